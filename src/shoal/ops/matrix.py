"""Matrix products: mm, bmm, addmm, mv, dot (matmul and linear decompose into these); pairwise
distances (cdist) and their backward.

Row split of the left operand or column split of the right one stays split; a split contracted
dim gives Partial; Partial passes through either operand while the other is Broadcast. A distance
is no sum of per-feature pieces (p-norms), so cdist splits rows of either operand or batch dims
only; the backward's gradient for x1 sums over x2's rows (Partial when those are split).
"""

from __future__ import annotations

import torch

from ..sbp import Broadcast, Partial, Split
from .pointwise import broadcast_splits
from .registry import Call, Rule, Sig, register

aten = torch.ops.aten
_B, _P = Broadcast(), Partial("sum")


def _mm(call: Call) -> list[Sig]:
    S = Split
    return [
        Sig((S(0), _B), (S(0),)),
        Sig((_B, S(1)), (S(1),)),
        Sig((S(1), S(0)), (_P,)),
        Sig((_P, _B), (_P,)),
        Sig((_B, _P), (_P,)),
    ]


def _bmm(call: Call) -> list[Sig]:
    S = Split
    return [
        Sig((S(0), S(0)), (S(0),)),
        Sig((S(1), _B), (S(1),)),
        Sig((_B, S(2)), (S(2),)),
        Sig((S(2), S(1)), (_P,)),
        Sig((_P, _B), (_P,)),
        Sig((_B, _P), (_P,)),
    ]


def _addmm(call: Call) -> list[Sig]:
    """addmm(bias, a, b) = beta * bias + alpha * a @ b; bias broadcasts to the output."""
    bias = call.ins[0]
    per_dim = broadcast_splits([bias], call.outs[0].shape)
    sigs = [Sig((per_dim[0][0], *mm.ins), mm.outs) for mm in _mm(call)[:1]]
    sigs.append(Sig((per_dim[1][0], _B, Split(1)), (Split(1),)))
    sigs += [Sig((_P, *mm.ins), mm.outs) for mm in _mm(call)[2:]]
    return sigs


def _mv(call: Call) -> list[Sig]:
    S = Split
    return [Sig((S(0), _B), (S(0),)), Sig((S(1), S(0)), (_P,)), Sig((_P, _B), (_P,)), Sig((_B, _P), (_P,))]


def _dot(call: Call) -> list[Sig]:
    return [Sig((Split(0), Split(0)), (_P,)), Sig((_P, _B), (_P,)), Sig((_B, _P), (_P,))]


register(aten.mm.default, Rule(_mm, name="mm"))
register(aten.bmm.default, Rule(_bmm, name="bmm"))
register(aten.addmm.default, Rule(_addmm, name="addmm"))
register(aten.mv.default, Rule(_mv, name="mv"))
register(aten.dot.default, Rule(_dot, name="dot"))


# _cdist_forward(x1 (*batch, P, M), x2 (*batch, R, M), p, compute_mode) -> (*batch, P, R): the kernel
# picks its method (matmul-based or direct) from P and R, which shards only make smaller; torch.cdist
# takes the matmul route above this op when the global sizes call for it.


def _batch_splits(x1, x2, nin: int) -> list[Sig]:
    """Batch dims that both operands have, unbroadcast: every input split alike."""
    if x2.ndim != x1.ndim or x1.shape[:-2] != x2.shape[:-2]:
        return []
    return [Sig((Split(d),) * nin, (Split(d),)) for d in range(x1.ndim - 2)]


def _cdist(call: Call) -> list[Sig]:
    """Rows of x1 give rows of the result, rows of x2 its columns (each operand by its own dims: batch
    dims broadcast, so x1, x2 and the result may differ in rank)."""
    x1, x2 = call.ins
    r = call.outs[0].ndim
    return [Sig((Split(x1.ndim - 2), _B), (Split(r - 2),)), Sig((_B, Split(x2.ndim - 2)), (Split(r - 1),)),
            *_batch_splits(x1, x2, 2)]


def _cdist_backward(call: Call) -> list[Sig]:
    """(grad, x1, x2, p, cdist) -> grad_x1, of the broadcast batch shape (grad's rank)."""
    g, x1, x2, _ = call.ins
    r = g.ndim
    rows, cols = Split(r - 2), Split(r - 1)
    return [Sig((rows, Split(x1.ndim - 2), _B, rows), (Split(call.outs[0].ndim - 2),)),
            Sig((cols, _B, Split(x2.ndim - 2), cols), (_P,)), *_batch_splits(x1, x2, 4)]


register(aten._cdist_forward.default, Rule(_cdist, name="cdist"))


def _cdist_backward_local(call: Call, ins, outs):
    """torch's kernel returns ``zeros_like(x1)``, without the broadcast batch dims, when a size is zero:
    a shard without rows (of x1 or of x2) contributes nothing, zeros of its own shape. (Not
    ``empty.pad_empty``: the kernel takes empty shards; only its result's shape is off.)"""

    def run(shard, grad, x1, x2, p, cdist):
        out = aten._cdist_backward.default(grad, x1, x2, p, cdist)
        want = shard.out_specs[0].local_shape(shard.pos)
        return out if tuple(out.shape) == tuple(want) else out.new_zeros(want)

    return run


register(aten._cdist_backward.default,
         Rule(_cdist_backward, local=_cdist_backward_local, local_ctx=True, name="cdist_backward"))
