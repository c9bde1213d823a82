"""Losses: nll_loss (1-D/2-D and the spatial ``nll_loss2d``) and mse_loss, forward and backward.

nll_loss, batch or spatial split: reduction sum gives Partial loss and total_weight, none stays split.
Classes split with targets Broadcast (vocabulary-parallel loss): each shard picks the targets in its
class range (the others masked), giving Partial. Reduction mean decomposes into the sum and a division
by the all-reduced total_weight. The backward ops are local in both layouts, since total_weight comes
in global. cross_entropy (log_softmax + nll_loss) follows from these and the softmax rules.
"""

from __future__ import annotations

import math

import torch

from .. import schema
from ..sbp import Broadcast, Partial, Split
from .common import named_args, sig_of
from .registry import Call, Rule, Sig, register

aten = torch.ops.aten
_B, _P = Broadcast(), Partial("sum")
NONE, MEAN, SUM = 0, 1, 2
_MASKED = -1  # the local ignore_index for targets outside a shard's classes: never a local class


def _class_dim(x) -> int:
    return 1 if x.ndim >= 2 else 0


def _target_dim(d: int, cd: int) -> int:
    return d if d < cd else d - 1


# -- nll_loss ---------------------------------------------------------------------------------
# forward (self, target, weight, reduction, ignore_index) -> (output, total_weight)
# backward (grad_output, self, target, weight, reduction, ignore_index, total_weight) -> grad_input


def _nll(call: Call) -> list[Sig]:
    x, t, w, red, _ = named_args(call, 5)
    cd = _class_dim(x)
    vals = (x, t, w)
    # total_weight of reduction none (with a batch) is 0 on every device
    tw = _B if red == NONE and x.ndim > 1 else _P
    sigs = []
    if red != MEAN:
        for d in range(x.ndim):
            if d != cd:
                td = _target_dim(d, cd)
                out = Split(td) if red == NONE else _P
                sigs.append(Sig(sig_of(vals, (Split(d), Split(td), _B)), (out, tw)))
        sigs.append(Sig(sig_of(vals, (Split(cd), _B, Split(0))), (_P, tw)))
    # linear in self; total_weight depends on target and weight only
    sigs.append(Sig(sig_of(vals, (_P, _B, _B)), (_P, _B)))
    return sigs


def _nll_backward(call: Call) -> list[Sig]:
    g, x, t, w, red, _, tw = named_args(call, 7)
    cd = _class_dim(x)
    vals = (g, x, t, w, tw)
    sigs = []
    for d in range(x.ndim):
        if d != cd:
            td = _target_dim(d, cd)
            gs = Split(td) if red == NONE and x.ndim > 1 else _B
            sigs.append(Sig(sig_of(vals, (gs, Split(d), Split(td), _B, _B)), (Split(d),)))
    sigs.append(Sig(sig_of(vals, (_B, Split(cd), _B, Split(0), _B)), (Split(cd),)))
    sigs.append(Sig(sig_of(vals, (_P, _B, _B, _B, _B)), (_P,)))
    return sigs


def _local_targets(t, ignore_index: int, lo: int, n: int):
    """Targets in this shard's class range [lo, lo + n), shifted; the rest (and ignored ones) masked."""
    inside = (t >= lo) & (t < lo + n) & (t != ignore_index)
    return torch.where(inside, t - lo, _MASKED)


def _nll_local(self_pos: int):
    """Class split: shift the targets into the shard's class range, mask the others (``self_pos``: the
    tensor input holding self)."""

    def local(call: Call, ins, outs):
        func = call.func
        cd = _class_dim(call.ins[self_pos])
        if not any(s == Split(cd) for s in ins[self_pos]):
            return lambda ctx, *args, **kwargs: func(*args, **kwargs)

        def run(ctx, *args, **kwargs):
            args = [*args, *(kwargs[n] for n in schema.of(func).names[len(args):] if n in kwargs)]
            x = args[self_pos]
            lo = ctx.in_specs[self_pos].local_offset(ctx.pos)[cd]
            ti, ii = self_pos + 1, self_pos + 4  # target; ignore_index
            args[ti] = _local_targets(args[ti], args[ii], lo, x.shape[cd])
            args[ii] = _MASKED
            return func(*args)

        return run

    return local


def _nll_mean_splits(call: Call, specs) -> bool:
    return call.arg(3, "reduction") == MEAN and any(isinstance(s, Split) for sp in specs[:2] for s in sp.sbp)


def _nll_mean_decomposition(func):
    """Mean = sum / total_weight, with the global total_weight (a scalar all-reduce)."""

    def run(x, target, weight, reduction, ignore_index):
        loss, total = func(x, target, weight, SUM, ignore_index)
        return aten.div.Tensor(loss, total), total

    return run


for _fwd, _bwd in (
    (aten.nll_loss_forward.default, aten.nll_loss_backward.default),
    (aten.nll_loss2d_forward.default, aten.nll_loss2d_backward.default),
):
    register(
        _fwd,
        Rule(
            _nll,
            local=_nll_local(0),
            local_ctx=True,
            decompose=_nll_mean_splits,
            decomposition=_nll_mean_decomposition(_fwd),
            name="nll_loss",
        ),
    )
    register(_bwd, Rule(_nll_backward, local=_nll_local(1), local_ctx=True, name="nll_loss_backward"))


# -- mse_loss ---------------------------------------------------------------------------------


def _same_shape(call: Call) -> bool:
    return all(t.shape == call.ins[-1].shape for t in call.ins[-2:])


def _mse(call: Call) -> list[Sig]:
    if not _same_shape(call):
        return []
    red = call.arg(2, "reduction", MEAN)
    out = (lambda d: Split(d)) if red == NONE else (lambda d: _P)
    return [Sig((Split(d), Split(d)), (out(d),)) for d in range(call.ins[0].ndim)]


def _mse_backward(call: Call) -> list[Sig]:
    if not _same_shape(call):
        return []
    red = call.arg(3, "reduction")
    g = Split if red == NONE else (lambda d: _B)
    sigs = [Sig((g(d), Split(d), Split(d)), (Split(d),)) for d in range(call.ins[1].ndim)]
    return [*sigs, Sig((_P, _B, _B), (_P,))]


def _split(sbps) -> bool:
    return any(isinstance(s, Split) for s in sbps)


def _mse_local(call: Call, ins, outs):
    """mean over a split: the local sum over the global count (Partial)."""
    if call.arg(2, "reduction", MEAN) != MEAN or not _split(ins[0]):
        return None
    n = math.prod(call.ins[0].shape)
    return lambda x, t, *_, **__: aten.mse_loss.default(x, t, SUM) / n


def _mse_backward_local(call: Call, ins, outs):
    """mean: the gradient scale is 2 / (global count), not the shard's."""
    if call.arg(3, "reduction") != MEAN or not _split(ins[1]):
        return None
    n = math.prod(call.ins[1].shape)
    return lambda g, x, t, *_, **__: aten.mse_loss_backward.default(g, x, t, SUM) / n


register(aten.mse_loss.default, Rule(_mse, local=_mse_local, name="mse_loss"))
register(aten.mse_loss_backward.default, Rule(_mse_backward, local=_mse_backward_local, name="mse_loss_backward"))
