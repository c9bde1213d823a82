"""Convolution, pooling and upsampling: ``convolution`` (conv1d/2d/3d, transposed too) and its
backward, ``max_pool2d_with_indices``, ``avg_pool2d``, ``_adaptive_avg_pool2d``, the ``upsample_*``
interpolations and their backwards.

Batch and channel splits are local: batch S(0) with weight B; output channels (weight S(0), bias
S(0)) -> S(1); input channels (input S(1), weight S(1), bias Partial) -> Partial. Channel splits need
``groups == 1``. Convolution is linear in input and in weight, so Partial passes through either.
Spatial splits would need halos and are never offered. Empty shards run padded (``empty.pad_empty``).
"""

from __future__ import annotations

import torch

from ..sbp import Broadcast, Partial, Split
from .empty import pad_empty, pad_empty_local
from .registry import Call, Rule, Sig, register

aten = torch.ops.aten
_B, _P = Broadcast(), Partial("sum")
S = Split


def _weight_dims(transposed: bool) -> tuple[int, int]:
    """(weight dim of output channels, weight dim of input channels); activations are (N, C, ...)."""
    return (1, 0) if transposed else (0, 1)


def _convolution(call: Call) -> list[Sig]:
    has_bias = len(call.ins) == 3
    transposed, groups = bool(call.arg(6, "transposed")), call.arg(8, "groups")
    wo, wi = _weight_dims(transposed)

    def sig(xs, ws, bs, out):
        return Sig((xs, ws, bs) if has_bias else (xs, ws), (out,))

    sigs = [sig(_P, _B, _P, _P), sig(_B, _P, _P, _P)]  # linear in input, and in weight
    sigs.append(sig(S(0), _B, _B, S(0)))
    if groups == 1:
        sigs.append(sig(_B, S(wo), S(0), S(1)))
        sigs.append(sig(S(1), S(wi), _P, _P))
    return sigs


register(aten.convolution.default, Rule(_convolution, local=pad_empty_local, local_ctx=True, name="convolution"))


def _convolution_backward(call: Call) -> list[Sig]:
    transposed, groups = bool(call.arg(7, "transposed")), call.arg(9, "groups")
    mask = list(call.arg(10, "output_mask"))
    wo, wi = _weight_dims(transposed)

    def sig(ins, gi, gw, gb):
        return Sig(ins, tuple(o for o, m in zip((gi, gw, gb), mask) if m))

    sigs = [
        sig((_P, _B, _B), _P, _P, _P),  # linear in grad_output
        sig((_B, _P, _B), _B, _P, _B),  # grad_weight is linear in input; the others do not read it
        sig((_B, _B, _P), _P, _B, _B),  # grad_input is linear in weight
    ]
    sigs.append(sig((S(0), S(0), _B), S(0), _P, _P))
    if groups == 1:
        sigs.append(sig((S(1), _B, S(wo)), _P, S(wo), S(0)))
        sigs.append(sig((_B, S(1), S(wi)), S(1), S(wi), _B))
    return sigs


def _conv_backward_local(call: Call, ins, outs):
    """Each shard's grad_bias has its shard's channel count: bias_sizes follows grad_output's shard."""

    def run(go, x, w, bias_sizes, *rest):
        if bias_sizes is not None:
            bias_sizes = [go.shape[1]]
        return aten.convolution_backward.default(go, x, w, bias_sizes, *rest)

    return pad_empty(run)


register(
    aten.convolution_backward.default,
    Rule(_convolution_backward, local=_conv_backward_local, local_ctx=True, name="convolution_backward"),
)


# -- pooling: every dim but the pooled (last two) is independent -------------------------------


def _pool_dims(call: Call, x: torch.Tensor) -> range:
    """The batch and channel dims (the ones before the 2 or 3 pooled dims)."""
    return range(x.ndim - (3 if "3d" in str(call.func) else 2))


def _pool(call: Call) -> list[Sig]:
    x = call.ins[0]
    nout = len(call.outs)
    sigs = [Sig((S(d),), (S(d),) * nout) for d in _pool_dims(call, x)]
    if call.func in _AVERAGES:  # averages are linear (maxima and their indices are not)
        sigs.append(Sig((_P,), (_P,)))
    return sigs


def _pool_backward(call: Call) -> list[Sig]:
    """grad_output, input (and indices) split alike; linear in grad_output."""
    n = len(call.ins)
    x = call.ins[1]
    sigs = [Sig((S(d),) * n, (S(d),)) for d in _pool_dims(call, x)]
    sigs.append(Sig((_P,) + (_B,) * (n - 1), (_P,)))
    return sigs


_AVERAGES = {aten.avg_pool2d.default, aten.avg_pool3d.default, aten._adaptive_avg_pool2d.default,
             aten._adaptive_avg_pool3d.default}
_POOL = Rule(_pool, local=pad_empty_local, local_ctx=True, name="pool")
_POOL_BACKWARD = Rule(_pool_backward, local=pad_empty_local, local_ctx=True, name="pool_backward")
register([aten.max_pool2d_with_indices.default, aten.max_pool3d_with_indices.default, aten.adaptive_max_pool2d.default,
          aten.adaptive_max_pool3d.default, *_AVERAGES], _POOL)
register(
    [
        aten.max_pool2d_with_indices_backward.default,
        aten.max_pool3d_with_indices_backward.default,
        aten.adaptive_max_pool2d_backward.default,
        aten.adaptive_max_pool3d_backward.default,
        aten.avg_pool2d_backward.default,
        aten.avg_pool3d_backward.default,
        aten._adaptive_avg_pool2d_backward.default,
        aten._adaptive_avg_pool3d_backward.default,
    ],
    _POOL_BACKWARD,
)


# -- upsampling -----------------------------------------------------------------------------------
# Nearest and (bi/tri)linear/cubic interpolation, forward and backward: each sample and channel on
# its own (batch and channel splits local; the output size and scales are spatial), and linear in
# the input (Partial passes through).

_UPSAMPLE = ("upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
             "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
             "upsample_bicubic2d", "upsample_trilinear3d", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa")


def _upsample(call: Call) -> list[Sig]:
    n = len(call.ins)
    return [*(Sig((S(d),) * n, (S(d),)) for d in range(2) if call.ins[0].shape[d] > 0), Sig((_P,) * n, (_P,))]


def _upsample_backward_local(call: Call, ins, outs):
    """The shard's batch and channel counts in ``input_size`` (the result's size)."""
    func = call.func

    def run(g, output_size, input_size, *rest):
        return func(g, output_size, [*g.shape[:2], *input_size[2:]], *rest)

    return pad_empty(run)


register([getattr(aten, f).default for f in _UPSAMPLE],
         Rule(_upsample, local=pad_empty_local, local_ctx=True, name="upsample"))
register([getattr(aten, f"{f}_backward").default for f in _UPSAMPLE],
         Rule(_upsample, local=_upsample_backward_local, local_ctx=True, name="upsample_backward"))


# -- validator samples (shoal.ops.validate) ---------------------------------------------------

_G = torch.Generator().manual_seed(0)


def _r(*shape, dtype=torch.float64):  # long sums over noisy Partial pieces: float32 rounding would show
    return torch.randn(shape, generator=_G, dtype=dtype)


def _conv_samples():
    x, w, b = _r(5, 7, 7, 7), _r(5, 7, 3, 3), _r(5)
    return [
        ((x, w, b, [1, 1], [1, 1], [1, 1], False, [0, 0], 1), {}),
        ((_r(3, 5, 7, 7), _r(7, 5, 3, 3), None, [2, 2], [0, 1], [1, 1], False, [0, 0], 1), {}),
        ((_r(3, 6, 7, 7), _r(6, 2, 3, 3), _r(6), [1, 1], [1, 1], [2, 2], False, [0, 0], 3), {}),  # grouped
        ((_r(3, 5, 7), _r(7, 5, 3), _r(7), [1], [1], [1], False, [0], 1), {}),  # conv1d
        ((_r(3, 5, 4, 4), _r(5, 7, 3, 3), _r(7), [2, 2], [1, 1], [1, 1], True, [1, 1], 1), {}),  # transposed
        ((_r(2, 2, 5, 5), _r(2, 2, 3, 3), _r(2), [1, 1], [0, 0], [1, 1], False, [0, 0], 1), {}),  # empty shards
    ]


def _conv_backward_samples():
    out = []
    for (x, w, b, stride, pad, dil, tr, opad, groups), _ in _conv_samples():
        y = aten.convolution.default(x, w, b, stride, pad, dil, tr, opad, groups)
        bias_sizes = None if b is None else list(b.shape)
        masks = [[True, True, b is not None]] + ([[False, True, False], [True, False, False]] if not out else [])
        for mask in masks:
            out.append(((_r(*y.shape), x, w, bias_sizes, stride, pad, dil, tr, opad, groups, mask), {}))
    return out


_POOL_OPS = {  # sample kind -> (forward op, backward op)
    "max": (aten.max_pool2d_with_indices, aten.max_pool2d_with_indices_backward),
    "max3d": (aten.max_pool3d_with_indices, aten.max_pool3d_with_indices_backward),
    "avg": (aten.avg_pool2d, aten.avg_pool2d_backward),
    "avg3d": (aten.avg_pool3d, aten.avg_pool3d_backward),
    "adaptive": (aten._adaptive_avg_pool2d, aten._adaptive_avg_pool2d_backward),
    "adaptive3d": (aten._adaptive_avg_pool3d, aten._adaptive_avg_pool3d_backward),
    "adaptive_max": (aten.adaptive_max_pool2d, aten.adaptive_max_pool2d_backward),
    "adaptive_max3d": (aten.adaptive_max_pool3d, aten.adaptive_max_pool3d_backward),
}


def _pool_samples(op):
    """Full argument lists, so that the backward samples can reuse them."""
    x4, x3, small = _r(5, 7, 7, 7), _r(7, 7, 7), _r(2, 2, 5, 5)  # small: empty shards on 3 or 4 devices
    x5, small5 = _r(5, 3, 4, 5, 5), _r(2, 2, 3, 4, 4)
    if op == "max":  # (x, kernel, stride, padding, dilation, ceil_mode)
        cfgs = [(x4, [2, 2], [2, 2], [0, 0], [1, 1], False), (x4, [3, 3], [2, 2], [1, 1], [1, 1], True)]
        cfgs += [(x3, [2, 2], [1, 1], [0, 0], [2, 2], False), (small, [2, 2], [2, 2], [0, 0], [1, 1], False)]
    elif op == "max3d":
        cfgs = [(x5, [2, 2, 2], [2, 2, 2], [0, 0, 0], [1, 1, 1], False),
                (small5, [1, 3, 3], [1, 2, 2], [0, 1, 1], [1, 1, 1], True)]
    elif op == "avg":  # (x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)
        cfgs = [(x4, [2, 2], [2, 2], [0, 0], False, True, None), (x4, [3, 3], [2, 2], [1, 1], True, False, None)]
        cfgs += [(x3, [3, 3], [2, 2], [1, 1], False, True, 2), (small, [2, 2], [2, 2], [0, 0], False, True, None)]
    elif op == "avg3d":
        cfgs = [(x5, [2, 2, 2], [2, 2, 2], [0, 0, 0], False, True, None),
                (small5, [1, 3, 3], [1, 2, 2], [0, 1, 1], True, False, None)]
    elif op.endswith("3d"):  # (x, output_size)
        cfgs = [(x5, [2, 3, 2]), (small5, [1, 2, 2])]
    else:
        cfgs = [(x4, [2, 3]), (x3, [3, 3]), (small, [2, 2])]
    return [(cfg, {}) for cfg in cfgs]


def _pool_backward_samples(op):
    forward = _POOL_OPS[op][0].default
    out = []
    for args, _ in _pool_samples(op):
        y = forward(*args)
        if op.startswith("max"):
            y, idx = y
            out.append(((_r(*y.shape), *args, idx), {}))
        elif op.startswith("adaptive_max"):
            y, idx = y
            out.append(((_r(*y.shape), args[0], idx), {}))
        elif op.startswith("avg"):
            out.append(((_r(*y.shape), *args), {}))
        else:
            out.append(((_r(*y.shape), args[0]), {}))
    return out


def _upsample_samples(name: str, backward: bool):
    """Uneven batch and channel counts, a non-integer scale, and a small input (empty shards)."""
    k = int(name.removesuffix("_aa")[-2])
    linear = "nearest" not in name
    out = []
    for shape in ((5, 3, *(4,) * k), (2, 2, *(3,) * k)):
        size = [7] * k
        for corners in (False, True) if linear else (None,):
            x = _r(*shape)
            extra = [] if corners is None else [corners]
            if not backward:
                out.append(((x, size, *extra), {}))
            else:
                y = getattr(aten, name).default(x, size, *extra)
                out.append(((_r(*y.shape), size, list(shape), *extra), {}))
    return out


SAMPLES = {
    **{getattr(aten, f).default: (lambda f=f: _upsample_samples(f, False)) for f in _UPSAMPLE},
    **{getattr(aten, f"{f}_backward").default: (lambda f=f: _upsample_samples(f, True)) for f in _UPSAMPLE},
    aten.convolution.default: _conv_samples,
    aten.convolution_backward.default: _conv_backward_samples,
    **{fwd.default: (lambda k=k: _pool_samples(k)) for k, (fwd, _) in _POOL_OPS.items()},
    **{bwd.default: (lambda k=k: _pool_backward_samples(k)) for k, (_, bwd) in _POOL_OPS.items()},
}
