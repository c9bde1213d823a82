"""Pointwise ops: every op tagged ``torch.Tag.pointwise`` (in-place variants too), plus copy_/fill_/zero_.

Each output dim may be split if every input either splits the matching dim (same size) or
broadcasts along it. Partial passes through ops that are linear in it, per the tables below.
"""

from __future__ import annotations

import torch

from ..sbp import Broadcast, Partial, Split
from .registry import Call, Rule, Sig, register, register_generic

aten = torch.ops.aten
_B = Broadcast()
_P = Partial("sum")
_PMAX, _PMIN = Partial("max"), Partial("min")

# Partial(sum) passes through an op that is linear in a group of operands jointly while the
# other tensor operands are Broadcast. Every position of the group must hold a tensor: a Python
# scalar there (x + 2) would be added once per device.
_LINEAR: dict = {
    aten.add.Tensor: ((0, 1),),
    aten.add_.Tensor: ((0, 1),),
    aten.sub.Tensor: ((0, 1),),
    aten.sub_.Tensor: ((0, 1),),
    aten.copy_.default: ((0, 1),),
    aten.lerp.Scalar: ((0, 1),),
    aten.lerp_.Scalar: ((0, 1),),
    aten.mul.Tensor: ((0,), (1,)),
    aten.mul_.Tensor: ((0,), (1,)),
    aten.div.Tensor: ((0,),),
    aten.div_.Tensor: ((0,),),
    aten.mul.Scalar: ((0,),),
    aten.mul_.Scalar: ((0,),),
    aten.div.Scalar: ((0,),),
    aten.div_.Scalar: ((0,),),
    aten.neg.default: ((0,),),
    aten.neg_.default: ((0,),),
    aten.positive.default: ((0,),),
    aten.clone.default: ((0,),),
    aten.alias.default: ((0,),),
    aten.detach.default: ((0,),),
    aten.where.self: ((1, 2),),
}
# Order-preserving unary ops keep Partial(max)/Partial(min); neg swaps them.
_MONOTONE = {
    aten.clone.default,
    aten.alias.default,
    aten.detach.default,
    aten.relu.default,
    aten.exp.default,
    aten.sigmoid.default,
    aten.tanh.default,
    aten.positive.default,
}


def _tensor_positions(call: Call) -> list[int]:
    return [i for i, a in enumerate(call.args) if isinstance(a, torch.Tensor)]


def broadcast_splits(ins, out_shape) -> list[Sig]:
    """Signatures splitting one output dim, every input splitting its matching dim or broadcasting."""
    r = len(out_shape)
    sigs = []
    for d in range(r):
        sig_in = []
        for t in ins:
            td = d - (r - t.ndim)
            if td < 0 or (t.shape[td] == 1 and out_shape[d] != 1):
                sig_in.append(_B)
            else:
                sig_in.append(Split(td))
        sigs.append(sig_in)
    return sigs


def _pointwise(call: Call) -> list[Sig]:
    nout = len(call.outs)
    out_shape = call.outs[0].shape
    sigs = [Sig(tuple(si), (Split(d),) * nout) for d, si in enumerate(broadcast_splits(call.ins, out_shape))]
    f = call.func
    nin = len(call.ins)
    if call.outs[0].dtype != torch.bool:
        tpos = _tensor_positions(call)
        for group in _LINEAR.get(f, ()):
            if all(p in tpos for p in group):
                ins = tuple(_P if p in group else _B for p in tpos)
                sigs.append(Sig(ins, (_P,) * nout))
    if nin == 1 and f in _MONOTONE:
        sigs += [Sig((_PMAX,), (_PMAX,)), Sig((_PMIN,), (_PMIN,))]
    if f in (aten.neg.default, aten.neg_.default):
        sigs += [Sig((_PMAX,), (_PMIN,)), Sig((_PMIN,), (_PMAX,))]
    return sigs


def _is_pointwise(op) -> bool:
    return torch.Tag.pointwise in op.tags


POINTWISE = Rule(_pointwise, name="pointwise")
register_generic(_is_pointwise, POINTWISE)
register([aten.copy_.default, aten.detach.default, aten.alias.default], POINTWISE)


def _fill(call: Call) -> list[Sig]:
    """fill_/zero_ write the same value everywhere: any layout but Partial(sum) (zero_ takes that too)."""
    r = call.ins[0].ndim
    sigs = [Sig((Split(d),), (Split(d),)) for d in range(r)]
    sigs += [Sig((_PMAX,), (_PMAX,)), Sig((_PMIN,), (_PMIN,))]
    if call.func == aten.zero_.default:
        sigs.append(Sig((_P,), (_P,)))
    return sigs


register([aten.fill_.Scalar, aten.zero_.default], Rule(_fill, name="fill"))


def _fill_tensor(call: Call) -> list[Sig]:
    r = call.ins[0].ndim
    return [Sig((Split(d), _B), (Split(d),)) for d in range(r)]


register(aten.fill_.Tensor, Rule(_fill_tensor, name="fill"))


def _holds(dst: torch.dtype, src: torch.dtype) -> bool:
    """Every ``src`` value is a ``dst`` value (no rounding, no overflow)."""
    if dst == src:
        return True
    if not (src.is_floating_point and dst.is_floating_point):
        return False
    a, b = torch.finfo(src), torch.finfo(dst)
    return b.eps <= a.eps and b.max >= a.max and b.tiny <= a.tiny


def _to_copy(call: Call) -> list[Sig]:
    """Rounding to another float dtype is monotone (Partial max/min pass), but rounds each piece of a
    Partial(sum) on its own: only a cast that rounds nothing (same dtype, float32 -> float64) keeps it."""
    r = call.ins[0].ndim
    sigs = [Sig((Split(d),), (Split(d),)) for d in range(r)]
    src, dst = call.ins[0].dtype, call.outs[0].dtype
    if dst.is_floating_point and (src.is_floating_point or src == dst):
        sigs += [Sig((_PMAX,), (_PMAX,)), Sig((_PMIN,), (_PMIN,))]
    if _holds(dst, src) and (dst.is_floating_point or dst.is_complex):
        sigs.append(Sig((_P,), (_P,)))
    return sigs


def _to_copy_local(call: Call, ins, outs):
    """Shards live on their own devices: drop a device argument that names the wrapper's device."""
    if "device" not in call.kwargs:
        return None
    kw = {k: v for k, v in call.kwargs.items() if k != "device"}

    def run(x, **_):
        return aten._to_copy.default(x, **kw)

    return run


register(aten._to_copy.default, Rule(_to_copy, local=_to_copy_local, name="to_copy"))


def _triangle(call: Call) -> list[Sig]:
    """tril/triu: each matrix of the batch on its own (which entries are kept depends on the row and
    column, so those two dims stay whole)."""
    return [Sig((Split(d),), (Split(d),)) for d in range(call.ins[0].ndim - 2)]


register([aten.tril.default, aten.triu.default], Rule(_triangle, name="triangle"))
