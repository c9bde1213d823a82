"""Indexing: gather, scatter, scatter_add, advanced indexing (index, index_put), topk, sort and
the order statistics (median, mode, kthvalue).

Index values address positions of the full tensor, so a dim the indices address is never split
with them; every other dim is local when the data and the indices are split on it alike (equal
sizes, so the pieces line up). Gather and indexing only select: a Partial input stays Partial
(sum, max or min); accumulating writes (scatter_add, index_put with accumulate) are linear, so
Partial(sum) data and values give Partial(sum). Integer indices with the data Broadcast may be
split anywhere (each piece selects its own rows of the result). Boolean masks give data-dependent
shapes and take no rule.
"""

from __future__ import annotations

import torch

from ..sbp import Broadcast, Partial, Split
from .registry import Call, Rule, Sig, register

aten = torch.ops.aten
_B = Broadcast()
_PARTIALS = tuple(Partial(o) for o in ("sum", "max", "min"))


def _dim(call: Call, i: int, default: int | None = None) -> int:
    nd = call.ins[0].ndim
    d = call.arg(i, "dim", default)
    return d % nd if nd else 0


def _alike(dim: int, *ts) -> list[int]:
    """Dims other than ``dim`` on which every tensor has the same size."""
    nd = ts[0].ndim
    if any(t.ndim != nd for t in ts):
        return []
    return [d for d in range(nd) if d != dim and len({t.shape[d] for t in ts}) == 1]


def _gather(call: Call) -> list[Sig]:
    x, index = call.ins
    dim = _dim(call, 1)
    sigs = [Sig((Split(d), Split(d)), (Split(d),)) for d in _alike(dim, x, index)]
    if dim < index.ndim:  # (an empty index may have any rank, even fewer dims than x)
        sigs.append(Sig((_B, Split(dim)), (Split(dim),)))  # rows of the index pick rows of the result
    return [*sigs, *(Sig((p, _B), (p,)) for p in _PARTIALS)]


def _scatter(call: Call) -> list[Sig]:
    """scatter (src or value) and scatter_add: out = self with src written (added) at the index."""
    dim = _dim(call, 1)
    sigs = [Sig((Split(d),) * len(call.ins), (Split(d),)) for d in _alike(dim, *call.ins)]
    if call.func is aten.scatter_add.default:
        p = Partial("sum")
        sigs.append(Sig((p, _B, p), (p,)))
    return sigs


# op -> the position of its ``dim`` in the schema (sort.stable's is keyword-only)
_SORT_DIM = {aten.topk.default: 2, aten.sort.default: 1, aten.sort.stable: 2}


def _sort(call: Call) -> list[Sig]:
    """topk and sort: (values, indices), each row along ``dim`` on its own."""
    dim = _dim(call, _SORT_DIM[call.func], -1)
    return [Sig((Split(d),), (Split(d), Split(d))) for d in range(call.ins[0].ndim) if d != dim]


class _Indexed:
    """Where ``x[indices]`` puts x's dims: the broadcast index shape replaces the indexed dims, in
    place when they are adjacent, else in front."""

    def __init__(self, x, indices) -> None:
        self.dims = [d for d, t in enumerate(indices) if t is not None]
        self.tensors = [t for t in indices if t is not None]
        self.shape = tuple(torch.broadcast_shapes(*(t.shape for t in self.tensors)))
        self.rest = [d for d in range(x.ndim) if d not in self.dims]
        self.adjacent = self.dims == list(range(self.dims[0], self.dims[-1] + 1))
        self.first = self.dims[0] if self.adjacent else 0

    def out_dim(self, d: int) -> int:
        """The result's dim holding x's dim ``d`` (not an indexed one)."""
        if not self.adjacent:
            return len(self.shape) + self.rest.index(d)
        return d if d < self.first else d - len(self.dims) + len(self.shape)


def _indexed(call: Call) -> _Indexed | None:
    indices = call.arg(1, "indices")
    if not any(t is not None for t in indices) or any(
        t is not None and t.dtype in (torch.bool, torch.uint8) for t in indices
    ):
        return None
    return _Indexed(call.ins[0], indices)


def _index(call: Call) -> list[Sig]:
    ix = _indexed(call)
    if ix is None:
        return []
    n = len(ix.tensors)
    sigs = [Sig((Split(d), *(_B,) * n), (Split(ix.out_dim(d)),)) for d in ix.rest]
    if all(tuple(t.shape) == ix.shape for t in ix.tensors):
        sigs += [Sig((_B, *(Split(e),) * n), (Split(ix.first + e),)) for e in range(len(ix.shape))]
    return [*sigs, *(Sig((p, *(_B,) * n), (p,)) for p in _PARTIALS)]


def _index_put(call: Call) -> list[Sig]:
    ix = _indexed(call)
    if ix is None:
        return []
    x, values = call.ins[0], call.ins[-1]
    n = len(ix.tensors)
    result_ndim = len(ix.shape) + len(ix.rest)  # x[indices], which values broadcast to
    sigs = []
    for d in ix.rest:
        vd = ix.out_dim(d) - (result_ndim - values.ndim)
        if vd >= 0 and values.shape[vd] == x.shape[d]:
            sigs.append(Sig((Split(d), *(_B,) * n, Split(vd)), (Split(d),)))
        elif vd < 0 or values.shape[vd] == 1:  # values broadcast along it: each piece writes them all
            sigs.append(Sig((Split(d), *(_B,) * n, _B), (Split(d),)))
    if call.arg(3, "accumulate", False):
        p = Partial("sum")
        sigs.append(Sig((p, *(_B,) * n, p), (p,)))
    return sigs


register(aten.gather.default, Rule(_gather, name="gather"))
register([aten.scatter.src, aten.scatter.value, aten.scatter_add.default], Rule(_scatter, name="scatter"))
register(list(_SORT_DIM), Rule(_sort, name="sort"))

_ORDER_STATS = {aten.median.dim: 1, aten.nanmedian.dim: 1, aten.mode.default: 1, aten.kthvalue.default: 2}


def _order_statistic(call: Call) -> list[Sig]:
    """median, mode, kthvalue along ``dim``: (values, indices), each row on its own."""
    x = call.ins[0]
    i = _ORDER_STATS[call.func]
    dim = _dim(call, i, -1)
    keepdim = call.arg(i + 1, "keepdim", False)
    return [Sig((Split(d),), (Split(d if keepdim else d - (d > dim)),) * 2) for d in range(x.ndim) if d != dim]


register(list(_ORDER_STATS), Rule(_order_statistic, name="order_statistic"))
register(aten.index.Tensor, Rule(_index, name="index"))
register(aten.index_put.default, Rule(_index_put, name="index_put"))
