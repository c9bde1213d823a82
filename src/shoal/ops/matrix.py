"""Matrix products: mm, bmm, addmm, mv, dot (matmul and linear decompose into these).

Row split of the left operand or column split of the right one stays split; a split contracted
dim gives Partial; Partial passes through either operand while the other is Broadcast.
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
