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

UPSAMPLE = ("upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
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


register([getattr(aten, f).default for f in UPSAMPLE],
         Rule(_upsample, local=pad_empty_local, local_ctx=True, name="upsample"))
register([getattr(aten, f"{f}_backward").default for f in UPSAMPLE],
         Rule(_upsample, local=_upsample_backward_local, local_ctx=True, name="upsample_backward"))
