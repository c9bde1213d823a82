"""GPT: a nanoGPT-style decoder-only transformer, and its parallel plans as data.

``GPT(GPTConfig(...))`` is plain single-device torch; ``plans(mesh, kind)`` says how shoal lays it
out (data parallel, Megatron tensor parallel with a vocabulary-split embedding and head, or both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..mesh import Mesh
from ..parallel import Plan
from .layers import Block, init_weights, megatron_plan

__all__ = ["GPTConfig", "GPT", "plans"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 96
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    dropout: float = 0.0


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg.n_embd, cfg.n_head, cfg.dropout, causal=True) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)  # not tied: plans lay it out on its own
        self.apply(init_weights)
        for blk in self.blocks:  # GPT-2: scale the residual projections by depth
            for lin in (blk.attn.proj, blk.mlp.down):
                nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Logits (B, T, vocab) for token ids (B, T), and the next-token cross entropy if ``targets`` given."""
        t = idx.shape[1]
        if t > self.cfg.block_size:
            raise ValueError(f"GPT: sequence length {t} exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for blk in self.blocks:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, n: int, temperature: float = 1.0, generator=None) -> torch.Tensor:
        """Append ``n`` tokens to ``idx`` (B, T): greedy when ``temperature`` is 0, else sampled."""
        for _ in range(n):
            logits, _ = self(idx[:, -self.cfg.block_size :])
            logits = logits[:, -1]
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                nxt = torch.multinomial(F.softmax(logits / temperature, -1), 1, generator=generator)
            idx = torch.cat([idx, nxt], 1)
        return idx


def plans(mesh: Mesh, kind: str, sequence_parallel: bool = False) -> Plan:
    """How a GPT is laid out on ``mesh`` for plan ``kind`` (dp, tp, dp,tp or zero; see ``kinds``).

    Inputs (token ids and targets) are split on the batch dim along the data-parallel axis. Tensor
    parallel is Megatron's: whole heads and a quarter of the MLP per device (4-way), the token
    embedding split on the vocabulary, and the head's weight too, so the logits come out split on
    the vocabulary and the loss is a vocabulary-parallel cross entropy. ``sequence_parallel``: the
    activations between the sub-blocks split on the sequence over tp (``layers.megatron_plan``).
    """
    return megatron_plan(mesh, kind, ("tok_emb.weight", "lm_head.weight"), ("lm_head",), sequence_parallel)
