"""BERT: a small transformer encoder trained by masked-language modelling, and its parallel plans.

Token + position embeddings and a LayerNorm, bidirectional blocks (post-LN as in BERT, or pre-LN),
and an MLM head (dense, GELU, LayerNorm, decoder to the vocabulary). Plain single-device torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..mesh import Mesh
from ..parallel import Plan
from .layers import Block, init_weights, megatron_plan

__all__ = ["BERTConfig", "BERT", "plans", "IGNORE"]

IGNORE = -100  # target of the positions that were not masked: no loss there


@dataclass(frozen=True)
class BERTConfig:
    vocab_size: int = 97  # characters + [MASK]
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    pre_ln: bool = False


class BERT(nn.Module):
    def __init__(self, cfg: BERTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.ln_emb = nn.LayerNorm(cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(
            Block(cfg.n_embd, cfg.n_head, cfg.dropout, causal=False, pre_ln=cfg.pre_ln) for _ in range(cfg.n_layer)
        )
        self.ln_f = nn.LayerNorm(cfg.n_embd) if cfg.pre_ln else nn.Identity()
        self.head = nn.Sequential(nn.Linear(cfg.n_embd, cfg.n_embd), nn.GELU(), nn.LayerNorm(cfg.n_embd))
        self.decoder = nn.Linear(cfg.n_embd, cfg.vocab_size)
        self.apply(init_weights)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Logits (B, T, vocab) for token ids (B, T); with ``targets`` (the original token at masked
        positions, ``IGNORE`` elsewhere) also the masked-LM cross entropy."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.ln_emb(self.tok_emb(idx) + self.pos_emb(pos)))
        for blk in self.blocks:
            x = blk(x)
        logits = self.decoder(self.head(self.ln_f(x)))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE)
        return logits, loss


def plans(mesh: Mesh, kind: str, sequence_parallel: bool = False) -> Plan:
    """How a BERT is laid out on ``mesh`` for plan ``kind`` (dp, tp, dp,tp or zero; see ``kinds``):
    batch split on the data-parallel axis; Megatron blocks, the token embedding split on the
    vocabulary and the decoder column-parallel (logits split on the vocabulary) on the tensor one.
    ``sequence_parallel``: the activations between the sub-blocks split on the sequence over tp
    (``layers.megatron_plan``)."""
    return megatron_plan(mesh, kind, ("tok_emb.weight", "decoder.*"), ("decoder",), sequence_parallel)
