"""Normalization: layer norm, batch norm and group norm, forward and backward.

Layer norm is local on a split non-normalized dim (weight/bias Broadcast; their gradients Partial);
a split normalized dim decomposes into mean/rsqrt/mul with rules. Batch norm is local on a channel
split. In training a batch or spatial split decomposes, so the statistics and the running_mean/var
updates are over the global batch, as on one device (not per shard, as DDP would have them). Eval
is pointwise given the running stats: local for any split.
"""

from __future__ import annotations

import math

import torch

from ..sbp import Broadcast, Partial, Split
from .common import cast, compute_dtype, named_args, sig_of
from .empty import pad_empty, pad_empty_local
from .registry import Call, Rule, Sig, register

aten = torch.ops.aten
_B, _P = Broadcast(), Partial("sum")


def _outs(mask, sbps) -> tuple:
    return tuple(s for m, s in zip(mask, sbps) if m)


def _split_dims(spec) -> set[int]:
    return {s.dim for s in spec.sbp if isinstance(s, Split)}


# -- layer norm -------------------------------------------------------------------------------


def _ln_axis(x, normalized_shape) -> int:
    return x.ndim - len(normalized_shape)


def _layer_norm(call: Call) -> list[Sig]:
    x, shape, w, b, _ = named_args(call, 5)
    axis = _ln_axis(x, shape)
    return [Sig(sig_of((x, w, b), (Split(d), _B, _B)), (Split(d),) * 3) for d in range(axis)]


def _layer_norm_split_normalized(call: Call, specs) -> bool:
    x, shape = named_args(call, 2)
    axis = _ln_axis(x, shape)
    return math.prod(x.shape[axis:]) > 0 and any(d >= axis for d in _split_dims(specs[0]))


def _normalize(x, dims, eps):
    """(x - mean) * rstd over ``dims`` with the mean, biased variance and rstd, in ops that have rules:
    over a split dim the means are local sums (Partial) reduced by those ops' own rules."""
    xc = cast(x, compute_dtype(x.dtype))
    mean = aten.mean.dim(xc, dims, True)
    centered = aten.sub.Tensor(xc, mean)
    var = aten.mean.dim(aten.mul.Tensor(centered, centered), dims, True)
    rstd = aten.rsqrt.default(aten.add.Tensor(var, eps))
    return aten.mul.Tensor(centered, rstd), mean, var, rstd


def _layer_norm_decomposition(x, normalized_shape, weight, bias, eps):
    """Statistics over a split normalized dim: local sums, Partial, reduced by the ops' own rules."""
    dims = list(range(_ln_axis(x, normalized_shape), x.ndim))
    out, mean, var, rstd = _normalize(x, dims, eps)
    if weight is not None:
        out = aten.mul.Tensor(out, weight)
    if bias is not None:
        out = aten.add.Tensor(out, bias)
    return cast(out, x.dtype), cast(mean, x.dtype), cast(rstd, x.dtype)


def _layer_norm_backward(call: Call) -> list[Sig]:
    g, x, shape, mean, rstd, w, b, mask = named_args(call, 8)
    axis = _ln_axis(x, shape)
    vals = (g, x, mean, rstd, w, b)
    sigs = [Sig(sig_of(vals, (Split(d),) * 4 + (_B, _B)), _outs(mask, (Split(d), _P, _P))) for d in range(axis)]
    # linear in grad_out
    sigs.append(Sig(sig_of(vals, (_P,) + (_B,) * 5), _outs(mask, (_P,) * 3)))
    return sigs


def _layer_norm_backward_local(call: Call, ins, outs):
    """The CPU kernel reads mean/rstd as dense arrays: a shard of a split dim is a strided view of them."""
    func = call.func

    def run(g, x, normalized_shape, mean, rstd, *args):
        return func(g, x, normalized_shape, mean.contiguous(), rstd.contiguous(), *args)

    return run


def _layer_norm_backward_split_normalized(call: Call, specs) -> bool:
    _, x, shape = named_args(call, 3)
    axis = _ln_axis(x, shape)
    return math.prod(x.shape[axis:]) > 0 and any(d >= axis for sp in specs[:2] for d in _split_dims(sp))


def _layer_norm_backward_decomposition(g, x, normalized_shape, mean, rstd, weight, bias, mask):
    axis = _ln_axis(x, normalized_shape)
    dims, batch_dims = list(range(axis, x.ndim)), list(range(axis))
    dt = compute_dtype(x.dtype)
    g, xc = cast(g, dt), cast(x, dt)
    xhat = aten.mul.Tensor(aten.sub.Tensor(xc, mean), rstd)
    gi = gw = gb = None
    if mask[0]:
        gx = aten.mul.Tensor(g, weight) if weight is not None else g
        a = aten.mean.dim(gx, dims, True)
        c = aten.mean.dim(aten.mul.Tensor(gx, xhat), dims, True)
        inner = aten.sub.Tensor(aten.sub.Tensor(gx, a), aten.mul.Tensor(xhat, c))
        gi = cast(aten.mul.Tensor(inner, rstd), x.dtype)
    if mask[1]:
        gxh = aten.mul.Tensor(g, xhat)
        gw = aten.sum.dim_IntList(gxh, batch_dims) if batch_dims else gxh
        gw = cast(gw, weight.dtype)
    if mask[2]:
        gb = aten.sum.dim_IntList(g, batch_dims) if batch_dims else aten.clone.default(g)
        gb = cast(gb, bias.dtype if bias is not None else x.dtype)
    return gi, gw, gb


register(
    aten.native_layer_norm.default,
    Rule(
        _layer_norm,
        decompose=_layer_norm_split_normalized,
        decomposition=_layer_norm_decomposition,
        name="layer_norm",
    ),
)
register(
    aten.native_layer_norm_backward.default,
    Rule(
        _layer_norm_backward,
        local=_layer_norm_backward_local,
        decompose=_layer_norm_backward_split_normalized,
        decomposition=_layer_norm_backward_decomposition,
        name="layer_norm_backward",
    ),
)


# -- batch norm -------------------------------------------------------------------------------
# Arguments are (input, weight, bias, running_mean, running_var, ...); per-channel tensors split as S(0)
# where the input splits its channel dim 1. Saved statistics are (C,) in training, (0,) in eval on CPU.


def _per_channel(t, c: int):
    """The SBP a per-channel tensor takes under a channel split (an empty (0,) placeholder stays B)."""
    return Split(0) if t is not None and t.ndim == 1 and t.shape[0] == c and c > 0 else _B


def _bn_channel_split(call: Call) -> list[Sig]:
    """Training (no running stats) with the channel dim split: every statistic is per channel."""
    x, w, b = named_args(call, 3)
    if x.shape[1] <= 1:
        return []
    return [Sig(sig_of((x, w, b), (Split(1), Split(0), Split(0))), (Split(1), Split(0), Split(0)))]


def _non_channel_split(spec) -> bool:
    return any(d != 1 for d in _split_dims(spec))


def _bn_shape(x) -> list[int]:
    return [1, x.shape[1]] + [1] * (x.ndim - 2)


def _bn_dims(x) -> list[int]:
    return [0, *range(2, x.ndim)]


def batch_norm_train(x, weight, bias, running_mean, running_var, momentum, eps):
    """Training batch norm with statistics over the global batch, in ops that have rules: a split batch or
    spatial dim gives Partial sums, reduced by the ops' own rules; a channel split stays local.

    Running stats are written in place by one copy_ each. The kernel is not used with them: native_batch_norm's
    schema does not declare the writes (``_native_batch_norm_legit`` does, and could serve here)."""
    c, dims, shape = x.shape[1], _bn_dims(x), _bn_shape(x)
    out, mean, var, rstd = _normalize(x, dims, eps)
    if weight is not None:
        out = aten.mul.Tensor(out, aten.view.default(weight, shape))
    if bias is not None:
        out = aten.add.Tensor(out, aten.view.default(bias, shape))
    save_mean, save_rstd = aten.view.default(mean, [c]), aten.view.default(rstd, [c])
    if running_mean is not None:
        new = aten.add.Tensor(aten.mul.Tensor(save_mean, momentum), aten.mul.Tensor(running_mean, 1 - momentum))
        aten.copy_.default(running_mean, new)
    if running_var is not None:
        n = x.numel() // c
        unbiased = aten.mul.Tensor(aten.view.default(var, [c]), n / (n - 1) if n > 1 else math.inf)
        new = aten.add.Tensor(aten.mul.Tensor(unbiased, momentum), aten.mul.Tensor(running_var, 1 - momentum))
        aten.copy_.default(running_var, new)
    # ATen saves the statistics in the parameters' dtype (fp32 for a bf16 input with fp32 parameters)
    stats = next((t.dtype for t in (weight, bias, running_mean, running_var) if t is not None), x.dtype)
    return cast(out, x.dtype), cast(save_mean, stats), cast(save_rstd, stats)


def batch_norm_eval(x, weight, bias, running_mean, running_var, eps):
    """Eval batch norm: pointwise given the running stats, so local for a batch, spatial or channel split.
    The saved statistics are empty placeholders, as the CPU kernel returns them (its meta kernel says (C,),
    which is why eval is never run as a kernel under a rule)."""
    shape = _bn_shape(x)
    xc = cast(x, compute_dtype(x.dtype))
    scale = aten.rsqrt.default(aten.add.Tensor(running_var, eps))
    if weight is not None:
        scale = aten.mul.Tensor(scale, weight)
    out = aten.mul.Tensor(aten.sub.Tensor(xc, aten.view.default(running_mean, shape)), aten.view.default(scale, shape))
    if bias is not None:
        out = aten.add.Tensor(out, aten.view.default(bias, shape))
    return cast(out, x.dtype), aten.new_zeros.default(x, [0]), aten.new_zeros.default(x, [0])


def _has_stats(call: Call, training_arg: int) -> bool:
    return training_arg == 5 and (call.arg(3, "running_mean") is not None or call.arg(4, "running_var") is not None)


def _batch_norm(training_arg: int):
    """The kernel runs under a rule only in training without running stats; the rest is decomposed."""

    def candidates(call: Call) -> list[Sig]:
        if not call.arg(training_arg, "training") or _has_stats(call, training_arg):
            return []
        return _bn_channel_split(call)

    return candidates


def _batch_norm_decompose(training_arg: int):
    """Eval: always (pointwise ops, local in every split; the CPU kernel's placeholder outputs disagree with its
    meta kernel's shapes). Training with running stats: always (two in-place writes, see batch_norm_train).
    Training without: when a batch or spatial dim is split (global statistics)."""

    def pred(call: Call, specs) -> bool:
        if not call.arg(training_arg, "training"):
            return True
        return _has_stats(call, training_arg) or _non_channel_split(specs[0])

    return pred


def _batch_norm_decomposition(x, weight, bias, *args):
    if len(args) == 3:  # _native_batch_norm_legit.no_stats
        running_mean = running_var = None
        training, momentum, eps = args
    else:
        running_mean, running_var, training, momentum, eps = args
    if not training:
        return batch_norm_eval(x, weight, bias, running_mean, running_var, eps)
    return batch_norm_train(x, weight, bias, running_mean, running_var, momentum, eps)


for _op, _training_arg in (
    (aten.native_batch_norm.default, 5),
    (aten._native_batch_norm_legit.default, 5),
    (aten._native_batch_norm_legit.no_stats, 3),
):
    register(
        _op,
        Rule(
            _batch_norm(_training_arg),
            local=pad_empty_local,  # the CPU kernel rejects an empty shard (a chunk of an uneven split)
            local_ctx=True,
            decompose=_batch_norm_decompose(_training_arg),
            decomposition=_batch_norm_decomposition,
            name="batch_norm",
        ),
    )


# native_batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean, save_invstd,
#                            train, eps, output_mask)


def _bn_backward(call: Call) -> list[Sig]:
    g, x, *rest, train, _, mask = named_args(call, 10)  # rest: weight, running and saved statistics
    c = x.shape[1]
    vals = (g, x, *rest)
    sigs = []
    if c > 1:
        per = tuple(_per_channel(t, c) for t in rest)
        sigs.append(Sig(sig_of(vals, (Split(1), Split(1), *per)), _outs(mask, (Split(1), Split(0), Split(0)))))
    if not train:
        for d in range(x.ndim):
            if d != 1:
                sigs.append(Sig(sig_of(vals, (Split(d), Split(d)) + (_B,) * 5), _outs(mask, (Split(d), _P, _P))))
    # linear in grad_out
    sigs.append(Sig(sig_of(vals, (_P,) + (_B,) * 6), _outs(mask, (_P,) * 3)))
    return sigs


def _bn_backward_decompose(call: Call, specs) -> bool:
    return bool(call.arg(7, "train")) and (_non_channel_split(specs[0]) or _non_channel_split(specs[1]))


def _bn_backward_decomposition(g, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps, mask):
    """Training backward with the per-channel sums over the global batch (Partial, reduced by the ops' rules)."""
    c, dims, shape = x.shape[1], _bn_dims(x), _bn_shape(x)
    n = x.numel() // c
    dt = compute_dtype(x.dtype)
    g, xc = cast(g, dt), cast(x, dt)
    invstd = aten.view.default(save_invstd, shape)
    xhat = aten.mul.Tensor(aten.sub.Tensor(xc, aten.view.default(save_mean, shape)), invstd)
    sum_g = aten.sum.dim_IntList(g, dims)
    sum_gx = aten.sum.dim_IntList(aten.mul.Tensor(g, xhat), dims)
    gi = None
    if mask[0]:
        mean_g = aten.div.Tensor(aten.view.default(sum_g, shape), n)
        proj = aten.mul.Tensor(xhat, aten.div.Tensor(aten.view.default(sum_gx, shape), n))
        scale = aten.mul.Tensor(invstd, aten.view.default(weight, shape)) if weight is not None else invstd
        gi = cast(aten.mul.Tensor(aten.sub.Tensor(aten.sub.Tensor(g, mean_g), proj), scale), x.dtype)
    wdt = weight.dtype if weight is not None else x.dtype
    return gi, cast(sum_gx, wdt) if mask[1] else None, cast(sum_g, wdt) if mask[2] else None


register(
    aten.native_batch_norm_backward.default,
    Rule(
        _bn_backward,
        local=pad_empty_local,
        local_ctx=True,
        decompose=_bn_backward_decompose,
        decomposition=_bn_backward_decomposition,
        name="batch_norm_backward",
    ),
)


# -- group norm -------------------------------------------------------------------------------
# native_group_norm(input, weight, bias, N, C, HxW, group, eps) -> (out, mean (N, group), rstd (N, group)).
# Each sample is normalized on its own: a batch split is local, with N the shard's; another split
# decomposes into ops that have rules (statistics of each group as Partial sums over the split dim).


def _group_norm(call: Call) -> list[Sig]:
    x, w, b = named_args(call, 3)
    return [Sig(sig_of((x, w, b), (Split(0), _B, _B)), (Split(0),) * 3)]


def _group_norm_local(call: Call, ins, outs):
    """The shard's own batch size for N (an empty shard runs padded)."""
    func = call.func

    def run(x, weight, bias, n, c, hxw, group, eps):
        return func(x, weight, bias, x.shape[0], c, hxw, group, eps)

    return pad_empty(run)


def _not_batch_split(*which: int):
    def pred(call: Call, specs) -> bool:
        return call.ins[which[0]].numel() > 0 and any(d != 0 for i in which for d in _split_dims(specs[i]))

    return pred


def _grouped(t, n: int, group: int):
    return aten.reshape.default(t, [n, group, -1])


def _channel_shape(x) -> list[int]:
    return [1, x.shape[1]] + [1] * (x.ndim - 2)


def _group_norm_decomposition(x, weight, bias, n, c, hxw, group, eps):
    out, mean, _, rstd = _normalize(_grouped(x, n, group), [2], eps)
    out = aten.reshape.default(out, list(x.shape))
    if weight is not None:
        out = aten.mul.Tensor(out, aten.view.default(weight, _channel_shape(x)))
    if bias is not None:
        out = aten.add.Tensor(out, aten.view.default(bias, _channel_shape(x)))
    return (cast(out, x.dtype), cast(aten.view.default(mean, [n, group]), x.dtype),
            cast(aten.view.default(rstd, [n, group]), x.dtype))


# native_group_norm_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask)


def _group_norm_backward(call: Call) -> list[Sig]:
    g, x, mean, rstd, w, *_, mask = named_args(call, 10)
    vals = (g, x, mean, rstd, w)
    return [
        Sig(sig_of(vals, (Split(0),) * 4 + (_B,)), _outs(mask, (Split(0), _P, _P))),
        Sig(sig_of(vals, (_P,) + (_B,) * 4), _outs(mask, (_P,) * 3)),  # linear in grad_out
    ]


def _group_norm_backward_local(call: Call, ins, outs):
    func = call.func

    def run(g, x, mean, rstd, weight, n, c, hxw, group, mask):
        return func(g, x, mean.contiguous(), rstd.contiguous(), weight, x.shape[0], c, hxw, group, mask)

    return pad_empty(run)


def _group_norm_backward_decomposition(g, x, mean, rstd, weight, n, c, hxw, group, mask):
    dt = compute_dtype(x.dtype)
    gc, xc = cast(g, dt), cast(x, dt)
    stat = [n, group, 1]
    xhat = aten.mul.Tensor(aten.sub.Tensor(_grouped(xc, n, group), aten.view.default(mean, stat)),
                           aten.view.default(rstd, stat))
    xhat = aten.reshape.default(xhat, list(x.shape))  # (N, C, ...)
    dims = [0, *range(2, x.ndim)]
    gi = gw = gb = None
    if mask[0]:
        gx = aten.mul.Tensor(gc, aten.view.default(weight, _channel_shape(x))) if weight is not None else gc
        gxg, xhg = _grouped(gx, n, group), _grouped(xhat, n, group)
        a = aten.mean.dim(gxg, [2], True)
        b = aten.mean.dim(aten.mul.Tensor(gxg, xhg), [2], True)
        inner = aten.sub.Tensor(aten.sub.Tensor(gxg, a), aten.mul.Tensor(xhg, b))
        gi = aten.reshape.default(aten.mul.Tensor(inner, aten.view.default(rstd, stat)), list(x.shape))
        gi = cast(gi, x.dtype)
    wdt = weight.dtype if weight is not None else x.dtype
    if mask[1]:
        gw = cast(aten.sum.dim_IntList(aten.mul.Tensor(gc, xhat), dims), wdt)
    if mask[2]:
        gb = cast(aten.sum.dim_IntList(gc, dims), wdt)
    return gi, gw, gb


register(
    aten.native_group_norm.default,
    Rule(_group_norm, local=_group_norm_local, local_ctx=True, decompose=_not_batch_split(0),
         decomposition=_group_norm_decomposition, name="group_norm"),
)
register(
    aten.native_group_norm_backward.default,
    Rule(_group_norm_backward, local=_group_norm_backward_local, local_ctx=True, decompose=_not_batch_split(0, 1),
         decomposition=_group_norm_backward_decomposition, name="group_norm_backward"),
)
