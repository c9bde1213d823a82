"""Softmax and log-softmax, forward and backward.

A split on any other dim is local. A split on the softmax dim decomposes: amax gives Partial(max) and
sum gives Partial(sum), so only per-row statistics are all-reduced (vocabulary-parallel softmax and
loss). The backward ops are linear in the incoming gradient, so a Partial gradient stays Partial.
"""

from __future__ import annotations

import torch

from ..sbp import Broadcast, Partial, Split
from .common import cast, compute_dtype
from .registry import Call, Rule, Sig, register

aten = torch.ops.aten
_B, _P = Broadcast(), Partial("sum")


def _dim(call: Call, i: int) -> int:
    nd = call.ins[0].ndim
    return call.arg(i, "dim") % nd if nd else 0


def _softmax(call: Call) -> list[Sig]:
    dim = _dim(call, 1)
    return [Sig((Split(d),), (Split(d),)) for d in range(call.ins[0].ndim) if d != dim]


def _backward(call: Call) -> list[Sig]:
    dim = _dim(call, 2)
    sigs = [Sig((Split(d), Split(d)), (Split(d),)) for d in range(call.ins[0].ndim) if d != dim]
    return [*sigs, Sig((_P, _B), (_P,))]


def _split_on_dim(i: int):
    """Decompose when a tensor input is split on the softmax dim (argument ``i`` holds the dim)."""

    def pred(call: Call, specs) -> bool:
        dim = _dim(call, i)
        x = call.ins[0]
        if x.ndim == 0 or x.shape[dim] == 0 or not x.is_floating_point():  # integers: the kernel refuses them
            return False
        return any(s == Split(dim) for sp in specs for s in sp.sbp)

    return pred


def _shifted(x, dim: int):
    x = cast(x, compute_dtype(x.dtype))
    return aten.sub.Tensor(x, aten.amax.default(x, [dim], True))


def _softmax_decomposition(x, dim: int, half_to_float: bool):
    e = aten.exp.default(_shifted(x, dim))
    out = aten.div.Tensor(e, aten.sum.dim_IntList(e, [dim], True))
    return cast(out, torch.float32 if half_to_float else x.dtype)


def _log_softmax_decomposition(x, dim: int, half_to_float: bool):
    s = _shifted(x, dim)
    lse = aten.log.default(aten.sum.dim_IntList(aten.exp.default(s), [dim], True))
    return cast(aten.sub.Tensor(s, lse), torch.float32 if half_to_float else x.dtype)


def _softmax_backward_decomposition(grad, out, dim: int, input_dtype: torch.dtype):
    dt = compute_dtype(grad.dtype)
    grad, out = cast(grad, dt), cast(out, dt)
    gy = aten.mul.Tensor(grad, out)
    gi = aten.sub.Tensor(gy, aten.mul.Tensor(out, aten.sum.dim_IntList(gy, [dim], True)))
    return cast(gi, input_dtype)


def _log_softmax_backward_decomposition(grad, out, dim: int, input_dtype: torch.dtype):
    dt = compute_dtype(grad.dtype)
    grad, out = cast(grad, dt), cast(out, dt)
    gi = aten.sub.Tensor(grad, aten.mul.Tensor(aten.exp.default(out), aten.sum.dim_IntList(grad, [dim], True)))
    return cast(gi, input_dtype)


# _safe_softmax (attention's math path): rows of -inf give 0; split dims other than ``dim`` are local
register(aten._safe_softmax.default, Rule(_softmax, name="safe_softmax"))
register(
    aten._softmax.default,
    Rule(_softmax, decompose=_split_on_dim(1), decomposition=_softmax_decomposition, name="softmax"),
)
register(
    aten._log_softmax.default,
    Rule(_softmax, decompose=_split_on_dim(1), decomposition=_log_softmax_decomposition, name="softmax"),
)
register(
    aten._softmax_backward_data.default,
    Rule(_backward, decompose=_split_on_dim(2), decomposition=_softmax_backward_decomposition, name="softmax_backward"),
)
register(
    aten._log_softmax_backward_data.default,
    Rule(
        _backward,
        decompose=_split_on_dim(2),
        decomposition=_log_softmax_backward_decomposition,
        name="softmax_backward",
    ),
)
