"""Random ops: the global value is drawn as single-device torch would draw it, then sharded.

Every process draws the whole tensor with the same op and RNG state and keeps its shards, so with
the same seed shoal's values equal single-device torch's on CPU, for every layout (dropout masks
included). The price is generating the full tensor on each process; the memory is freed at once.
``native_dropout`` (the fused kernel CUDA uses) is drawn with ``bernoulli_`` instead: same
distribution, not torch's CUDA values.

A random op without a rule here (``multinomial``, ``normal`` with tensor arguments, ``bernoulli``
with a tensor of probabilities, ``rrelu_with_noise``...) is never run per device (one draw each)
nor decomposed (its parts may draw other numbers): dispatch's random fallback gathers its inputs'
values and draws once, as one device would, and lays the results out Broadcast.
"""

from __future__ import annotations

import torch

from ..sbp import Broadcast, Partial, Split
from .registry import Call, Rule, Sig, register

aten = torch.ops.aten
_B = Broadcast()


def _inplace(call: Call) -> list[Sig]:
    return [Sig((Split(d),), (Split(d),)) for d in range(call.ins[0].ndim)]


def _like(call: Call) -> list[Sig]:
    sigs = _inplace(call)
    return sigs + [Sig((Partial(o),), (_B,)) for o in ("sum", "max", "min")]


register(
    [
        aten.bernoulli_.float,
        aten.uniform_.default,
        aten.normal_.default,
        aten.exponential_.default,
        aten.cauchy_.default,
        aten.geometric_.default,
        aten.log_normal_.default,
        aten.random_.default,
        getattr(aten.random_, "from"),
        aten.random_.to,
    ],
    Rule(_inplace, kind="random", name="random_"),
)
register(
    [aten.rand_like.default, aten.randn_like.default, aten.randint_like.default, aten.randint_like.low_dtype],
    Rule(_like, kind="random", name="random_like"),
)


def _native_dropout(x, p: float, train: bool | None):
    if not train or p == 0:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    keep = torch.empty_like(x).bernoulli_(1 - p)
    return x * keep * (1.0 / (1 - p)), keep.to(torch.bool)


register(
    aten.native_dropout.default,
    # always decomposed: run per device, even replicated, each device would draw its own mask
    Rule(decompose=lambda call, specs: True, decomposition=_native_dropout, check_nd=lambda *a: False,
         name="native_dropout"),
)
