"""Reductions: sum, mean, amax, amin, max, min, var, std, var_mean, std_mean, prod (all elements
or over dims, keepdim); the scans cumsum, cumprod, logcumsumexp, cummax, cummin.

A split kept dim stays split; a split reduced dim gives Partial (sum for sum/mean, max/min for
amax/amin). mean over a split dim runs as a local sum divided by the global count. var and std
(alone or with the mean) over a split dim decompose into mean, the squared deviations and their
sum (a Partial sum).
A scan is local on the other dims (cumsum is linear: Partial(sum) stays Partial); a split scanned
dim is made whole.
"""

from __future__ import annotations

import math

import torch

from ..sbp import Partial, Split
from .empty import pad_empty_local
from .registry import Call, Rule, Sig, register

aten = torch.ops.aten

# op -> (the Partial a split reduced dim gives, whether it returns indices too)
_KIND = {
    aten.sum.default: "sum",
    aten.sum.dim_IntList: "sum",
    aten.mean.default: "sum",
    aten.mean.dim: "sum",
    aten.amax.default: "max",
    aten.amin.default: "min",
    aten.max.default: "max",
    aten.min.default: "min",
    aten.max.dim: None,
    aten.min.dim: None,
    aten.argmax.default: None,
    aten.argmin.default: None,
}
_ALL_DIMS = {aten.sum.default, aten.mean.default, aten.max.default, aten.min.default}


def reduced_dims(call: Call, dim_arg: int = 1) -> tuple[tuple[int, ...], bool]:
    """(reduced dims, keepdim) of a reduction whose ``dim`` is argument ``dim_arg`` and keepdim the next."""
    x = call.ins[0]
    if call.func in _ALL_DIMS:
        return tuple(range(x.ndim)), False
    dim = call.arg(dim_arg, "dim")
    keepdim = bool(call.arg(dim_arg + 1, "keepdim", False))
    if x.ndim == 0:  # dim 0 or -1 of a number: nothing is reduced
        return (), keepdim
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return tuple(range(x.ndim)), keepdim
    dims = [dim] if isinstance(dim, int) else list(dim)
    return tuple(sorted({d % max(x.ndim, 1) for d in dims})), keepdim


def _reduction(call: Call) -> list[Sig]:
    x = call.ins[0]
    dims, keepdim = reduced_dims(call)
    kind = _KIND[call.func]
    nout = len(call.outs)
    sigs = []
    for d in range(x.ndim):
        if d in dims:
            if kind is not None and x.shape[d] > 1:
                sigs.append(Sig((Split(d),), (Partial(kind),) * nout))
        else:
            od = d if keepdim else d - sum(1 for r in dims if r < d)
            sigs.append(Sig((Split(d),), (Split(od),) * nout))
    if kind is not None:
        p = Partial(kind)
        sigs.append(Sig((p,), (p,) * nout))
    return sigs


def _no_empty_max(call: Call, ins, outs, mesh_shape) -> bool:
    """max/min of an empty shard is an error in torch: every shard of a reduced split dim needs an element."""
    if _KIND[call.func] in ("sum", None):
        return True
    dims, _ = reduced_dims(call)
    x = call.ins[0]
    for d in dims:
        n = math.prod(m for m, s in zip(mesh_shape, ins[0]) if s == Split(d))
        if x.shape[d] < n:
            return False
    return True


def _mean_local(call: Call, ins, outs):
    """mean over a split dim: sum locally, divide by the global count (the result is Partial)."""
    if call.func not in (aten.mean.default, aten.mean.dim):
        return None
    dims, keepdim = reduced_dims(call)
    if not any(isinstance(s, Split) and s.dim in dims for s in ins[0]):
        return None
    count = math.prod(call.ins[0].shape[d] for d in dims)
    dtype = call.kwargs.get("dtype")

    def run(x, *args, **kwargs):
        return aten.sum.dim_IntList(x, list(dims), keepdim, dtype=dtype) / count

    return run


register(list(_KIND), Rule(_reduction, check_nd=_no_empty_max, local=_mean_local, name="reduction"))


# -- var, std -------------------------------------------------------------------------------------


def _kept_splits(call: Call) -> list[Sig]:
    """A split kept dim stays split (in every output); a split reduced dim has no local form."""
    dims, keepdim = reduced_dims(call)
    nout = len(call.outs)
    return [Sig((Split(d),), (Split(d if keepdim else d - sum(1 for r in dims if r < d)),) * nout)
            for d in range(call.ins[0].ndim) if d not in dims]


def _split_reduced(call: Call, specs) -> bool:
    """Decompose over a split dim, but not with no degrees of freedom left (a device's empty piece
    would give 0/0 where torch gives inf) nor for complex numbers."""
    x = call.ins[0]
    dims, _ = reduced_dims(call)
    correction = call.kwargs.get("correction")
    dof = math.prod(x.shape[d] for d in dims) - (1 if correction is None else correction)
    return dof > 0 and not x.is_complex() and any(s == Split(d) for s in specs[0].sbp for d in dims)


def _dims(x, dim) -> list[int]:
    """The dims a decomposition reduces: all for None or [], else ``dim`` normalized and sorted."""
    if x.ndim == 0:
        return []
    return list(range(x.ndim)) if dim is None or len(dim) == 0 else sorted({d % max(x.ndim, 1) for d in dim})


def _var_decomposition(x, dim=None, *, correction=None, keepdim=False):
    dims = _dims(x, dim)
    n = math.prod(x.shape[d] for d in dims)
    dev = aten.sub.Tensor(x, aten.mean.dim(x, dims, True))
    squares = aten.sum.dim_IntList(aten.mul.Tensor(dev, dev), dims, keepdim)
    return aten.div.Scalar(squares, max(n - (1 if correction is None else correction), 0))


def _std_decomposition(x, dim=None, *, correction=None, keepdim=False):
    return aten.sqrt.default(_var_decomposition(x, dim, correction=correction, keepdim=keepdim))


def _var_mean_decomposition(x, dim=None, *, correction=None, keepdim=False):
    return (_var_decomposition(x, dim, correction=correction, keepdim=keepdim),
            aten.mean.dim(x, _dims(x, dim), keepdim))


def _std_mean_decomposition(x, dim=None, *, correction=None, keepdim=False):
    var, mean = _var_mean_decomposition(x, dim, correction=correction, keepdim=keepdim)
    return aten.sqrt.default(var), mean


# an empty shard of a kept dim (an uneven split) runs padded: on no elements the kernel would warn that it
# has no degrees of freedom
_MOMENT = {"decompose": _split_reduced, "local": pad_empty_local, "local_ctx": True, "name": "var"}
register(aten.var.correction, Rule(_kept_splits, decomposition=_var_decomposition, **_MOMENT))
register(aten.std.correction, Rule(_kept_splits, decomposition=_std_decomposition, **_MOMENT))
register(aten.var_mean.correction, Rule(_kept_splits, decomposition=_var_mean_decomposition, **_MOMENT))
register(aten.std_mean.correction, Rule(_kept_splits, decomposition=_std_mean_decomposition, **_MOMENT))
register(aten.prod.dim_int, Rule(_kept_splits, name="prod"))


def _scan(call: Call) -> list[Sig]:
    """Local on the other dims; cumsum is linear (Partial(sum) stays Partial)."""
    x = call.ins[0]
    dim = call.arg(1, "dim") % max(x.ndim, 1)
    nout = len(call.outs)
    sigs = [Sig((Split(d),), (Split(d),) * nout) for d in range(x.ndim) if d != dim]
    if call.func is aten.cumsum.default:
        sigs.append(Sig((Partial("sum"),), (Partial("sum"),)))
    return sigs


register([aten.cumsum.default, aten.cumprod.default, aten.logcumsumexp.default, aten.cummax.default,
          aten.cummin.default], Rule(_scan, name="scan"))
