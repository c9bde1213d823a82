"""Conjugate and negative bits: ``_conj`` and ``_neg_view`` materialized on every shard.

torch's ``x.conj()`` is a view that only sets a bit, and the Conjugate (Negative) dispatch key
resolves that bit before a kernel runs. Shard ops run inside ``__torch_dispatch__``, below those
keys: a shard carrying the bit would be read as if it had none (``conj(z) * z`` gave ``z * z``).
So a GlobalTensor never holds bits: ``_conj`` and ``_neg_view`` compute ``conj_physical`` and
``neg`` on each shard. The value is torch's; the result is a copy, which the aliasing module keeps
in step with its base like any view whose shards are a copy (writes go back through the inverse,
``conj_physical`` / ``neg``). ``resolve_conj`` and ``resolve_neg`` have nothing to resolve and
return their input's value in its layout. Both are linear over the reals: Partial(sum) passes.
"""

from __future__ import annotations

import torch

from ..sbp import Partial, Split
from .registry import Call, Rule, Sig, register

aten = torch.ops.aten
_P = Partial("sum")


def _elementwise(call: Call) -> list[Sig]:
    return [Sig((Split(d),), (Split(d),)) for d in range(call.ins[0].ndim)] + [Sig((_P,), (_P,))]


def _conj_local(call: Call, ins, outs):
    return lambda x: aten.conj_physical.default(x)


def _neg_local(call: Call, ins, outs):
    return lambda x: aten.neg.default(x)


register(aten._conj.default, Rule(_elementwise, local=_conj_local, name="conj"))
register(aten._neg_view.default, Rule(_elementwise, local=_neg_local, name="neg_view"))
# on shards they return the shard itself (shards hold no bits)
register([aten.resolve_conj.default, aten.resolve_neg.default], Rule(_elementwise, name="resolve_bits"))
