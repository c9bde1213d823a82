"""Transformer parts shared by GPT and BERT: self-attention, MLP, and a pre- or post-LN block.

q, k and v are separate Linear layers (not one fused projection), so that splitting their output
features over devices hands each device whole heads (Megatron column parallel).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..mesh import Mesh
from ..parallel import Plan
from ..sbp import S
from . import kinds

__all__ = ["Core", "SelfAttention", "MLP", "Block"]


class Core(nn.Module):
    """Attention's core: softmax(q k^T / sqrt(d)) v over heads, with dropout on the weights. A module
    of its own, without parameters, so that a plan can recompute it alone in backward
    (``Plan(checkpoint=["blocks.*.attn.core"])``: Megatron-LM's selective recomputation, which keeps
    the projections' activations and drops the seq x seq scores)."""

    def __init__(self, dropout: float = 0.0, causal: bool = True):
        super().__init__()
        self.dropout, self.causal = dropout, causal

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal)


class SelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0, causal: bool = True, bias: bool = True):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd {n_embd} is not a multiple of n_head {n_head}")
        self.n_head = n_head
        self.q = nn.Linear(n_embd, n_embd, bias=bias)
        # no key bias: it shifts every score of a query by the same amount, which softmax ignores, so its
        # gradient is zero and an optimizer that normalizes gradients (Adam) would only chase rounding noise
        self.k = nn.Linear(n_embd, n_embd, bias=False)
        self.v = nn.Linear(n_embd, n_embd, bias=bias)
        self.core = Core(dropout, causal)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (lin(x).view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = self.core(q, k, v)
        return self.drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        self.up = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.down = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down(F.gelu(self.up(x))))


class Block(nn.Module):
    """Attention then MLP, each with a residual; LayerNorm before each (pre-LN, GPT-2) or after (post-LN, BERT)."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0, causal: bool = True, pre_ln: bool = True):
        super().__init__()
        self.pre_ln = pre_ln
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = SelfAttention(n_embd, n_head, dropout, causal)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_ln:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.mlp(x))


def megatron_plan(mesh: Mesh, kind: str, vocab: tuple[str, ...], heads: tuple[str, ...],
                  sequence_parallel: bool = False) -> Plan:
    """A transformer of ``Block``s (``blocks.*``, after a token embedding ``tok_emb``) laid out on
    ``mesh`` for plan ``kind`` (see ``kinds``): the batch split on the data-parallel axis; on the
    tensor-parallel one, Megatron-LM's layout.

    Parameters: q, k, v and the MLP's up projection column-parallel (out features split, so each
    device holds whole heads), the attention output and the MLP's down projection row-parallel (in
    features split, the output a partial sum; their bias stays Broadcast), and the ``vocab``
    parameters (the embedding's and the output layers') split on the vocabulary.

    Activations: each attention's and MLP's output (a row-parallel partial sum) and the embedding's
    are all-reduced into Broadcast on tp. Left to itself, dispatch reduce-scatters each partial sum
    (half an all-reduce) and then moves weights around the batch-split activations at every matmul:
    at GPT-3's width on tp=8, 18x the collective time per layer (``auto.census``).

    ``sequence_parallel`` (Korthikanti et al. 2022) reduce-scatters those outputs onto the sequence
    dim instead, so the layer norms, residual adds and dropout between the sub-blocks run on 1/tp of
    the tokens and keep 1/tp of their activations; each attention's, MLP's and ``heads``' (the
    column-parallel layers after the blocks) input is all-gathered whole. The same bytes cross the
    links as with the all-reduces. Those inputs are kept split for backward and gathered again there
    (``Plan.regather``), as Megatron-LM keeps them: 1/tp of their memory for one more all-gather each."""
    ax = kinds.axes(mesh, kind)
    whole = ax.layout(dp=S(0))
    if sequence_parallel and ax.tp is None:
        raise ValueError(f"plans(mesh, {kind!r}, sequence_parallel=True): sequence parallelism splits on the "
                         f"tensor-parallel axis; plan {kind!r} has none (use 'tp' or 'dp,tp')")
    params, inputs, outputs, regather = {}, {"": whole}, {}, ()
    if ax.tp is not None:
        col, row = ax.layout(tp=S(0)), ax.layout(tp=S(1))
        params = {"blocks.*.attn.[qkv].*": col, "blocks.*.mlp.up.*": col, "blocks.*.attn.proj.weight": row,
                  "blocks.*.mlp.down.weight": row, **{name: col for name in vocab}}
        subs = ("blocks.*.attn", "blocks.*.mlp")
        between = ax.layout(dp=S(0), tp=S(1)) if sequence_parallel else whole  # the sub-blocks' outputs
        outputs = {name: between for name in (*subs, "tok_emb")}
        if sequence_parallel:
            regather = (*subs, *heads)
            inputs.update({name: whole for name in regather})
    return Plan(params=params, inputs=inputs, outputs=outputs, zero=kinds.ZERO.get(kind, 0), regather=regather)


def init_weights(m: nn.Module) -> None:
    """GPT-2 style: normal(0.02) weights for Linear and Embedding, zero biases."""
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)
