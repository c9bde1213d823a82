"""Factories that take a tensor for its metadata (``*_like``, ``new_*``) and value ops (``.item()``).

``zeros_like``/``empty_like`` keep any layout; ``ones_like``/``full_like`` keep any but Partial(sum)
(a constant summed over devices would grow). ``new_*`` (``new_empty_strided`` too) ignore the
input's layout and are Broadcast.
Random factories are not here: they need the RNG semantics of a later issue.
"""

from __future__ import annotations

import torch

from ..sbp import Broadcast, Partial, Split
from .registry import Call, Rule, Sig, all_sbps, register

aten = torch.ops.aten
_B = Broadcast()


def _like(call: Call) -> list[Sig]:
    keep_sum = call.func in (aten.zeros_like.default, aten.empty_like.default)
    sigs = [Sig((Split(d),), (Split(d),)) for d in range(call.ins[0].ndim)]
    sigs += [Sig((Partial(o),), (Partial(o),)) for o in ("max", "min")]
    sigs.append(Sig((Partial("sum"),), (Partial("sum") if keep_sum else _B,)))
    return sigs


def _new(call: Call) -> list[Sig]:
    return [Sig((s,), (_B,)) for s in all_sbps(call.ins[0].ndim)]


register(
    [aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default],
    Rule(_like, name="like"),
)
# new_empty_strided's strides are the global ones: a Broadcast shard has the global shape, so they hold
# (autograd's AccumulateGrad makes a gradient with the parameter's strides this way)
register(
    [aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default,
     aten.new_empty_strided.default],
    Rule(_new, size_arg=1, name="new"),
)
register([aten._local_scalar_dense.default, aten.equal.default], Rule(kind="value", name="value"))
