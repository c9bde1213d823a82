"""Embedding lookup and its dense backward.

Weight Broadcast with indices split: the output splits along the matching dim. Weight split on the
embedding dim: the output splits on its last dim. Weight split over the vocabulary: each shard looks up
the indices in its row range and zeroes the rest, giving Partial (the vocab offset comes from the
shard's spec). The backward mirrors these: split indices give a Partial gradient, a vocabulary-split
gradient is computed per shard with shifted indices and the local row count.
"""

from __future__ import annotations

import torch

from ..sbp import Broadcast, Partial, Split
from .empty import pad_empty
from .registry import Call, Rule, Sig, register

aten = torch.ops.aten
_B, _P = Broadcast(), Partial("sum")


def _embedding(call: Call) -> list[Sig]:
    idx = call.ins[1]
    sigs = [Sig((_B, Split(d)), (Split(d),)) for d in range(idx.ndim)]
    sigs += [Sig((Split(1), _B), (Split(idx.ndim),)), Sig((Split(0), _B), (_P,))]
    # a lookup picks elements: it passes any Partial of the weight
    return sigs + [Sig((p, _B), (p,)) for p in (_P, Partial("max"), Partial("min"))]


def _plain(func):
    return lambda ctx, *args, **kwargs: func(*args, **kwargs)


def _embedding_local(call: Call, ins, outs):
    func = call.func
    if Split(0) not in ins[0]:
        return _plain(func)

    def run(ctx, weight, indices, *args, **kwargs):
        lo, n = ctx.in_specs[0].local_offset(ctx.pos)[0], weight.shape[0]
        inside = (indices >= lo) & (indices < lo + n)
        out = func(weight, torch.where(inside, indices - lo, 0), *args, **kwargs)
        return torch.where(inside.unsqueeze(-1), out, 0)

    return pad_empty(run, with_shard=True)  # a shard without rows: one zero row, which gives zeros


# embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq)


def _backward(call: Call) -> list[Sig]:
    idx = call.ins[1]
    scale_by_freq = call.arg(4, "scale_grad_by_freq")
    # scale_grad_by_freq counts each index over all indices: a batch split would count per shard
    sigs = [] if scale_by_freq else [Sig((Split(d), Split(d)), (_P,)) for d in range(idx.ndim)]
    sigs += [Sig((Split(idx.ndim), _B), (Split(1),)), Sig((_B, _B), (Split(0),))]
    return sigs + [Sig((_P, _B), (_P,))]


def _backward_local(call: Call, ins, outs):
    func = call.func
    if Split(0) not in outs[0]:
        return _plain(func)

    def run(ctx, grad, indices, num_weights, padding_idx, scale_grad_by_freq):
        """Indices outside the shard's rows go to an extra dummy row, dropped after: with scale_grad_by_freq
        they must not count towards a real row."""
        spec = ctx.out_specs[0]
        lo, n = spec.local_offset(ctx.pos)[0], spec.local_shape(ctx.pos)[0]
        inside = (indices >= lo) & (indices < lo + n)
        pad = padding_idx - lo if lo <= padding_idx < lo + n else -1
        return func(grad, torch.where(inside, indices - lo, n), n + 1, pad, scale_grad_by_freq)[:n]

    return run


register(aten.embedding.default, Rule(_embedding, local=_embedding_local, local_ctx=True, name="embedding"))
register(
    aten.embedding_dense_backward.default,
    Rule(_backward, local=_backward_local, local_ctx=True, name="embedding_backward"),
)
