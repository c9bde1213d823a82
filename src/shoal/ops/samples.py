"""Validator samples of the rule families (``validate`` runs each op on them): op -> a function giving
(args, kwargs) pairs, with uneven sizes (5 and 7 over 2, 3 and 4 devices) and sizes smaller than the mesh.
Each family draws from a generator of its own, so that its samples do not change with another's.
"""

from __future__ import annotations

import math

import torch

from .convolution import UPSAMPLE
from .foreach import FOREACH_OPS, FUSED_OPTIMIZER_OPS, base_name
from .loss import MEAN, NONE, SUM

__all__ = ["SAMPLES"]

aten = torch.ops.aten


class _Draws:
    """Sample tensors from a generator of their own, seeded 0."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.g = torch.Generator().manual_seed(0)
        self.dtype = dtype

    def r(self, *shape, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.randn(shape, generator=self.g, dtype=dtype or self.dtype)

    def i(self, high: int, *shape) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=self.g)


# -- convolution, pooling, upsampling --------------------------------------------------------------

_cv = _Draws(torch.float64)  # long sums over noisy Partial pieces: float32 rounding would show


def _conv_samples():
    x, w, b = _cv.r(5, 7, 7, 7), _cv.r(5, 7, 3, 3), _cv.r(5)
    return [
        ((x, w, b, [1, 1], [1, 1], [1, 1], False, [0, 0], 1), {}),
        ((_cv.r(3, 5, 7, 7), _cv.r(7, 5, 3, 3), None, [2, 2], [0, 1], [1, 1], False, [0, 0], 1), {}),
        ((_cv.r(3, 6, 7, 7), _cv.r(6, 2, 3, 3), _cv.r(6), [1, 1], [1, 1], [2, 2], False, [0, 0], 3), {}),  # grouped
        ((_cv.r(3, 5, 7), _cv.r(7, 5, 3), _cv.r(7), [1], [1], [1], False, [0], 1), {}),  # conv1d
        ((_cv.r(3, 5, 4, 4), _cv.r(5, 7, 3, 3), _cv.r(7), [2, 2], [1, 1], [1, 1], True, [1, 1], 1), {}),  # transposed
        # empty shards
        ((_cv.r(2, 2, 5, 5), _cv.r(2, 2, 3, 3), _cv.r(2), [1, 1], [0, 0], [1, 1], False, [0, 0], 1), {}),
    ]


def _conv_backward_samples():
    out = []
    for (x, w, b, stride, pad, dil, tr, opad, groups), _ in _conv_samples():
        y = aten.convolution.default(x, w, b, stride, pad, dil, tr, opad, groups)
        bias_sizes = None if b is None else list(b.shape)
        masks = [[True, True, b is not None]] + ([[False, True, False], [True, False, False]] if not out else [])
        for mask in masks:
            out.append(((_cv.r(*y.shape), x, w, bias_sizes, stride, pad, dil, tr, opad, groups, mask), {}))
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
    x4, x3, small = _cv.r(5, 7, 7, 7), _cv.r(7, 7, 7), _cv.r(2, 2, 5, 5)  # small: empty shards on 3 or 4 devices
    x5, small5 = _cv.r(5, 3, 4, 5, 5), _cv.r(2, 2, 3, 4, 4)
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
            out.append(((_cv.r(*y.shape), *args, idx), {}))
        elif op.startswith("adaptive_max"):
            y, idx = y
            out.append(((_cv.r(*y.shape), args[0], idx), {}))
        elif op.startswith("avg"):
            out.append(((_cv.r(*y.shape), *args), {}))
        else:
            out.append(((_cv.r(*y.shape), args[0]), {}))
    return out


def _upsample_samples(name: str, backward: bool):
    """Uneven batch and channel counts, a non-integer scale, and a small input (empty shards)."""
    k = int(name.removesuffix("_aa")[-2])
    linear = "nearest" not in name
    out = []
    for shape in ((5, 3, *(4,) * k), (2, 2, *(3,) * k)):
        size = [7] * k
        for corners in (False, True) if linear else (None,):
            x = _cv.r(*shape)
            extra = [] if corners is None else [corners]
            if not backward:
                out.append(((x, size, *extra), {}))
            else:
                y = getattr(aten, name).default(x, size, *extra)
                out.append(((_cv.r(*y.shape), size, list(shape), *extra), {}))
    return out


_CONVOLUTION = {
    **{getattr(aten, f).default: (lambda f=f: _upsample_samples(f, False)) for f in UPSAMPLE},
    **{getattr(aten, f"{f}_backward").default: (lambda f=f: _upsample_samples(f, True)) for f in UPSAMPLE},
    aten.convolution.default: _conv_samples,
    aten.convolution_backward.default: _conv_backward_samples,
    **{fwd.default: (lambda k=k: _pool_samples(k)) for k, (fwd, _) in _POOL_OPS.items()},
    **{bwd.default: (lambda k=k: _pool_backward_samples(k)) for k, (_, bwd) in _POOL_OPS.items()},
}


# -- attention -------------------------------------------------------------------------------------

_at = _Draws(torch.float64)
_FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _flash_samples():
    """(args, kwargs) with batch 3 or 5, heads 7 or 2, query length 5, key length 7."""
    q, k, v = _at.r(3, 7, 5, 4), _at.r(3, 7, 7, 4), _at.r(3, 7, 7, 4)
    q2, k2, v2 = _at.r(5, 2, 5, 4), _at.r(5, 2, 5, 4), _at.r(5, 2, 5, 4)
    return [
        ((q, k, v), {}),
        ((q2, k2, v2, 0.0, True), {}),
        ((q, k, v), {"attn_mask": _at.r(5, 7), "scale": 0.3}),
        ((q2, k2, v2), {"attn_mask": _at.r(5, 1, 5, 5)}),
        ((q, k, v), {"attn_mask": _at.r(3, 7, 5, 7)}),
    ]


def _flash_backward_samples():
    out = []
    for args, kw in _flash_samples():
        q, k, v = args[:3]
        causal = len(args) > 4 and args[4]
        o, lse = _FLASH(*args, **kw)
        out.append(((_at.r(*o.shape), q, k, v, o, lse, 0.0, causal), kw))
    return out


_ATTENTION = {_FLASH: _flash_samples, _FLASH_BACKWARD: _flash_backward_samples}


# -- normalization ---------------------------------------------------------------------------------

_nm = _Draws()


def _var(n):
    return torch.rand(n, generator=_nm.g) + 0.5


def _ln_bwd(shape, normalized, affine=True, bias=True, mask=(True, True, True)):
    x = _nm.r(*shape)
    w = _nm.r(*normalized) if affine else None
    b = _nm.r(*normalized) if affine and bias else None
    _, mean, rstd = aten.native_layer_norm.default(x, normalized, w, b, 1e-5)
    return (_nm.r(*shape), x, normalized, mean, rstd, w, b, list(mask)), {}


def _bn_bwd(shape, train, affine=True, stats=True, mask=(True, True, True)):
    x, c = _nm.r(*shape), shape[1]
    w = _nm.r(c) if affine else None
    rm, rv = (_nm.r(c), _var(c)) if stats else (None, None)
    _, sm, si = aten.native_batch_norm.default(
        x, w, None, None if rm is None else rm.clone(), None if rv is None else rv.clone(), train, 0.1, 1e-5
    )
    return (_nm.r(*shape), x, w, rm, rv, sm, si, train, 1e-5, list(mask)), {}


# Few tensor inputs of few dims: the validator samples layouts of decomposing ops from their full product.
# Eval forward is always decomposed, and not sampled here: the registry's all-Broadcast signature would run the
# kernel, whose placeholder outputs are (0,) on CPU where its meta kernel says (C,). tests/test_nn_rules.py has it.
def _gn_bwd(shape, group, affine=True, mask=(True, True, True)):
    x, c = _nm.r(*shape), shape[1]
    w = _nm.r(c) if affine else None
    hxw = math.prod(shape[2:])
    _, mean, rstd = aten.native_group_norm.default(x, w, None, shape[0], c, hxw, group, 1e-5)
    return (_nm.r(*shape), x, mean, rstd, w, shape[0], c, hxw, group, list(mask)), {}


_NORMALIZATION = {
    aten.native_group_norm.default: lambda: [
        ((_nm.r(5, 6, 3), _nm.r(6), _nm.r(6), 5, 6, 3, 2, 1e-5), {}),
        ((_nm.r(3, 4, 2, 3), None, None, 3, 4, 6, 4, 1e-5), {}),
        ((_nm.r(7, 4), _nm.r(4), None, 7, 4, 1, 1, 1e-5), {}),
    ],
    aten.native_group_norm_backward.default: lambda: [
        _gn_bwd((5, 6, 3), 2),
        _gn_bwd((3, 4, 2, 3), 4, affine=False, mask=(True, False, False)),
        _gn_bwd((7, 4), 1, mask=(True, False, True)),
    ],
    aten.native_layer_norm.default: lambda: [
        ((_nm.r(5, 7), [7], _nm.r(7), _nm.r(7), 1e-5), {}),
        ((_nm.r(3, 5, 6), [5, 6], _nm.r(5, 6), None, 1e-5), {}),
        ((_nm.r(2, 7), [7], None, None, 1e-5), {}),
        ((_nm.r(3, 5), [3, 5], _nm.r(3, 5), _nm.r(3, 5), 1e-5), {}),
    ],
    aten.native_layer_norm_backward.default: lambda: [
        _ln_bwd((5, 7), [7], bias=False, mask=(True, True, False)),
        _ln_bwd((3, 5, 6), [6], affine=False, mask=(True, False, False)),
        _ln_bwd((2, 7), [7], affine=False, mask=(True, False, False)),
        _ln_bwd((3, 5), [3, 5], affine=False, mask=(True, False, False)),
    ],
    aten.native_batch_norm.default: lambda: [
        ((_nm.r(5, 3, 4), _nm.r(3), _nm.r(3), _nm.r(3), _var(3), True, 0.1, 1e-5), {}),
        ((_nm.r(7, 5), None, None, _nm.r(5), _var(5), True, 0.3, 1e-5), {}),
        ((_nm.r(5, 3, 2, 3), _nm.r(3), None, None, None, True, 0.1, 1e-5), {}),
    ],
    aten._native_batch_norm_legit.default: lambda: [
        ((_nm.r(5, 3, 4), _nm.r(3), _nm.r(3), _nm.r(3), _var(3), True, 0.1, 1e-5), {}),
        ((_nm.r(7, 2), None, None, _nm.r(2), _var(2), True, 0.1, 1e-5), {}),
    ],
    aten._native_batch_norm_legit.no_stats: lambda: [
        ((_nm.r(5, 3, 4), _nm.r(3), _nm.r(3), True, 0.1, 1e-5), {}),
        ((_nm.r(7, 5), None, None, True, 0.1, 1e-5), {}),
    ],
    aten.native_batch_norm_backward.default: lambda: [
        _bn_bwd((7, 5), True, stats=False),
        _bn_bwd((5, 3, 4), True, affine=False, stats=False, mask=(True, False, False)),
        _bn_bwd((7, 3), False, affine=False, mask=(True, False, False)),
        _bn_bwd((2, 5), False, affine=False, mask=(True, False, False)),
    ],
}


# -- recurrent -------------------------------------------------------------------------------------

_rn = _Draws()


def _lstm_args(n: int, reverse: bool, batch_first: bool, t: int = 4, c: int = 3, h: int = 2):
    """(input, 4 weights, hx, cx, reverse, batch_sizes, mode=LSTM, hidden, layers, biases, bidirectional,
    batch_first, train)"""
    return (_rn.r(t, n, c), _rn.r(4 * h, c), _rn.r(4 * h, h), _rn.r(4 * h), _rn.r(4 * h), _rn.r(n, h), _rn.r(n, h),
            reverse, [], 2, h, 1, True, False, batch_first, True)


def _lstm_samples():
    # the workspace (output 3) is oneDNN's: the backward's samples check it through the gradients
    return [(_lstm_args(n, rev, bf), {"opaque": (3,)}) for n, rev, bf in ((5, False, False), (5, True, True),
                                                                           (2, False, True))]


def _lstm_backward_samples():
    out = []
    for n, rev, with_state_grads in ((5, False, True), (2, True, False), (7, False, False)):
        a = _lstm_args(n, rev, True)
        o, hy, cy, ws = aten.mkldnn_rnn_layer.default(*a)
        grads = ((_rn.r(*o.shape), _rn.r(*hy.shape), _rn.r(*cy.shape)) if with_state_grads
                 else (_rn.r(*o.shape), None, None))
        out.append(((*a[:7], o, hy, cy, *grads, rev, 2, 2, 1, True, True, False, [], True, ws), {}))
    return out


_RECURRENT = {
    aten.mkldnn_rnn_layer.default: _lstm_samples,
    aten.mkldnn_rnn_layer_backward.default: _lstm_backward_samples,
}


# -- embedding -------------------------------------------------------------------------------------

_em = _Draws()
_EMBEDDING = {
    aten.embedding.default: lambda: [
        ((_em.r(11, 4), _em.i(11, 5)), {}),
        ((_em.r(11, 5), _em.i(11, 3, 7)), {}),
        ((_em.r(7, 3), _em.i(7, 2, 3), 2), {}),
        ((_em.r(2, 3), _em.i(2, 5)), {}),
    ],
    aten.embedding_dense_backward.default: lambda: [
        ((_em.r(5, 4), _em.i(11, 5), 11, -1, False), {}),
        ((_em.r(3, 7, 5), _em.i(11, 3, 7), 11, 4, False), {}),
        ((_em.r(7, 3), torch.tensor([0, 3, 3, 6, 3, 0, 1]), 7, -1, True), {}),
        ((_em.r(2, 3, 3), _em.i(7, 2, 3), 7, 3, True), {}),
        ((_em.r(5, 3), _em.i(2, 5), 2, 0, False), {}),
    ],
}


# -- softmax ---------------------------------------------------------------------------------------

_sm = _Draws()


def _softmax_bwd(op, shape, dim):
    y = op(_sm.r(*shape), dim, False)
    return (_sm.r(*shape), y, dim, torch.float32), {}


_SOFTMAX = {
    aten._safe_softmax.default: lambda: [
        ((torch.tensor([[0.0, -float("inf")], [-float("inf"), -float("inf")], [1.0, 2.0]]), 1), {}),
        ((_sm.r(5, 7), 0), {}),
    ],
    aten._softmax.default: lambda: [
        ((_sm.r(5, 7), 1, False), {}),
        ((_sm.r(5, 7), 0, False), {}),
        ((_sm.r(3, 2, 7), -1, False), {}),
    ],
    aten._log_softmax.default: lambda: [
        ((_sm.r(5, 7), 1, False), {}),
        ((_sm.r(7, 3), 0, False), {}),
        ((_sm.r(2, 5, 3), 1, False), {}),
    ],
    aten._softmax_backward_data.default: lambda: [
        _softmax_bwd(aten._softmax.default, (5, 7), 1),
        _softmax_bwd(aten._softmax.default, (5, 7), 0),
        _softmax_bwd(aten._softmax.default, (3, 2, 7), -1),
    ],
    aten._log_softmax_backward_data.default: lambda: [
        _softmax_bwd(aten._log_softmax.default, (5, 7), 1),
        _softmax_bwd(aten._log_softmax.default, (7, 3), 0),
        _softmax_bwd(aten._log_softmax.default, (2, 5, 3), 1),
    ],
}


# -- loss ------------------------------------------------------------------------------------------

_ls = _Draws()


def _t(n: int, *shape, ignore: int | None = None, hits: int = 2):
    t = torch.randint(0, n, shape, generator=_ls.g)
    if ignore is not None:
        flat = t.view(-1)
        flat[torch.randperm(flat.numel(), generator=_ls.g)[:hits]] = ignore
    return t


def _nll_fwd_samples():
    out = []
    for red in (NONE, MEAN, SUM):
        out += [
            ((_ls.r(5, 7), _t(7, 5, ignore=-100), None, red, -100), {}),
            ((_ls.r(7, 3), _t(3, 7, ignore=1), _ls.r(3).abs(), red, 1), {}),
            ((_ls.r(7), _t(7), _ls.r(7).abs(), red, -100), {}),
        ]
    out.append(((_ls.r(2, 5), _t(5, 2, ignore=-100, hits=2), None, MEAN, -100), {}))  # everything ignored: nan
    return out


def _nll_bwd_samples(fwd, x_shape, t_shape, classes):
    out = []
    for red in (NONE, MEAN, SUM):
        for weight, ignore in ((None, -100), (_ls.r(classes).abs(), 2)):
            x, t = _ls.r(*x_shape), _t(classes, *t_shape, ignore=ignore)
            loss, total = fwd(x, t, weight, red, ignore)
            out.append(((_ls.r(*loss.shape), x, t, weight, red, ignore, total), {}))
    return out


_LOSS = {
    aten.nll_loss_forward.default: _nll_fwd_samples,
    aten.nll_loss_backward.default: lambda: [
        *_nll_bwd_samples(aten.nll_loss_forward.default, (5, 7), (5,), 7),
        *_nll_bwd_samples(aten.nll_loss_forward.default, (7,), (), 7)[:2],
    ],
    aten.nll_loss2d_forward.default: lambda: (
        [((_ls.r(3, 5, 2, 3), _t(5, 3, 2, 3, ignore=-100, hits=3), None, red, -100), {}) for red in (NONE, MEAN, SUM)]
        + [((_ls.r(2, 3, 3, 1), _t(3, 2, 3, 1, ignore=0), _ls.r(3).abs(), MEAN, 0), {})]
    ),
    aten.nll_loss2d_backward.default: lambda: _nll_bwd_samples(
        aten.nll_loss2d_forward.default, (3, 5, 2, 3), (3, 2, 3), 5
    ),
    aten.mse_loss.default: lambda: (
        [((_ls.r(5, 7), _ls.r(5, 7), red), {}) for red in (NONE, MEAN, SUM)] + [((_ls.r(2, 3), _ls.r(2, 3)), {})]
    ),
    aten.mse_loss_backward.default: lambda: (
        [((_ls.r(5, 7), _ls.r(5, 7), _ls.r(5, 7), NONE), {})]
        + [((_ls.r(), _ls.r(7, 5), _ls.r(7, 5), red), {}) for red in (MEAN, SUM)]
    ),
}


# -- foreach, norms --------------------------------------------------------------------------------

_fe = _Draws(torch.float64)


def _pos(*shape):
    return _fe.r(*shape).abs() + 0.5


def _foreach_sample(base: str, overload: str, inplace: bool):
    """Lists of two (small: the validator tries layouts of every element); (2,) leaves empty shards."""
    a, b = [_fe.r(5, 3), _fe.r(2)], [_fe.r(5, 3), _fe.r(2)]
    s, t = [_fe.r(7), _fe.r()], [_pos(7), _pos()]  # ternary ops: fewer layouts per element
    if base in ("neg", "sqrt", "abs", "sign", "reciprocal", "zero_"):
        return [(([_pos(5, 3), _pos(2), _pos(7)],), {})]
    if base == "copy_":
        return [((a, b), {})]
    if base in ("addcmul", "addcdiv"):
        return [(([_fe.r(7), _fe.r()], s, t, 0.3 if overload == "Scalar" else [0.3, -2.0]), {})]
    if base == "lerp":
        return [(([_fe.r(7), _fe.r()], s, 0.3 if overload == "Scalar" else [_pos(7) / 3, _pos() / 3]), {})]
    if overload == "List":
        kw = {"alpha": -0.5} if base in ("add", "sub") else {}
        other = [_pos(5, 3), _pos(2)] if base == "div" else b
        return [((a, other), kw), ((a, [_fe.r(3), _fe.r(2)]), {})] if base in ("add", "mul") else [((a, other), kw)]
    if overload == "Scalar":
        return [((a, 1.5), {})]
    if overload == "ScalarList":
        return [((a, [1.5, -3.0]), {})]
    return [((a, _pos()), {"alpha": 2.0} if base == "add" else {})]  # Tensor: one 0-dim tensor for all


def _adam_sample(tensor_lr: bool):
    lr = torch.tensor(0.01, dtype=torch.float64) if tensor_lr else 0.01
    kw = {"lr": lr, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.1, "eps": 1e-8, "amsgrad": False,
          "maximize": False}
    lists = ([_fe.r(5, 3), _fe.r(2)], [_fe.r(5, 3), _fe.r(2)], [_fe.r(5, 3), _fe.r(2)], [_pos(5, 3), _pos(2)], [],
             [torch.tensor(3.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64)])
    return [(lists, kw)]


_FOREACH = {op: (lambda op=op: _foreach_sample(*base_name(op))) for op in FOREACH_OPS}
for _op in FUSED_OPTIMIZER_OPS:
    _FOREACH[_op] = lambda op=_op: _adam_sample(op._overloadname == "tensor_lr")
_FOREACH[aten._foreach_norm.Scalar] = lambda: [
    (([_fe.r(5, 3), _fe.r(2), _fe.r(7)],), {}),
    (([_fe.r(5, 3), _fe.r(2)], 1), {}),
    (([_fe.r(5, 3), _fe.r(2)], math.inf), {}),
    (([_fe.r(7).float(), _fe.r(2).float()], 3.0, torch.float64), {}),
]
_FOREACH[aten.linalg_vector_norm.default] = lambda: [
    ((_fe.r(5, 7),), {}),
    ((_fe.r(5, 7), 1, [1]), {}),
    ((_fe.r(5, 7), math.inf, [0], True), {}),
    ((_fe.r(5, 7), 0), {}),
    ((_fe.r(2, 7), 3.0, [0]), {}),
    ((_fe.r(5, 7).float(), 2, [1], False), {"dtype": torch.float64}),
    ((_fe.r(7, 2), -math.inf, [1]), {}),
]


# -- indexing --------------------------------------------------------------------------------------

_ix = _Draws()
_INDEXING = {
    aten.gather.default: lambda: [
        ((_ix.r(5, 7), 1, _ix.i(7, 5, 4)), {}),
        ((_ix.r(5, 7), 0, _ix.i(5, 3, 7)), {}),
        ((_ix.r(5, 7), 1, _ix.i(7, 5, 7)), {}),
        ((_ix.r(3, 5, 2), -1, _ix.i(2, 3, 5, 3)), {}),
        ((_ix.r(3, 5, 2), 2, _ix.i(2, 1, 0)), {}),  # an empty index of lower rank: torch takes it
        ((_ix.r(3, 0, 2), -1, _ix.i(1, 0)), {}),
    ],
    aten.scatter.src: lambda: [
        ((_ix.r(5, 7), 1, _ix.i(7, 5, 3), _ix.r(5, 3)), {}),
        ((_ix.r(5, 7), 0, _ix.i(5, 2, 7), _ix.r(2, 7)), {}),
    ],
    aten.scatter.value: lambda: [((_ix.r(5, 7), 1, _ix.i(7, 5, 3), 2.5), {})],
    aten.scatter_add.default: lambda: [
        ((_ix.r(5, 7), 1, _ix.i(7, 5, 9), _ix.r(5, 9)), {}),
        ((_ix.r(5, 7), 0, _ix.i(5, 6, 7), _ix.r(6, 7)), {}),
    ],
    aten.topk.default: lambda: [((_ix.r(5, 7), 3), {}), ((_ix.r(5, 7), 2, 0, False), {}), ((_ix.r(3, 5, 4), 4, 1), {})],
    aten.sort.default: lambda: [((_ix.r(5, 7),), {}), ((_ix.r(5, 7), 0, True), {})],
    aten.sort.stable: lambda: [((_ix.r(5, 7),), {"stable": True, "dim": 0}), ((_ix.r(3, 5, 4),), {"stable": True})],
    aten.median.dim: lambda: [((_ix.r(5, 7), 1), {}), ((_ix.r(5, 7), 0, True), {})],
    aten.nanmedian.dim: lambda: [((torch.where(_ix.r(5, 7) > 1, float("nan"), _ix.r(5, 7)), 1), {})],
    aten.mode.default: lambda: [((torch.randint(0, 3, (5, 7), generator=_ix.g).float(), 1), {}),
                                ((torch.randint(0, 3, (3, 5, 4), generator=_ix.g).float(), 0, True), {})],
    aten.kthvalue.default: lambda: [((_ix.r(5, 7), 2), {}), ((_ix.r(5, 7), 3, 0, True), {})],
    aten.index.Tensor: lambda: [
        ((_ix.r(5, 7), [_ix.i(5, 6)]), {}),
        ((_ix.r(5, 7, 3), [None, _ix.i(7, 4, 2)]), {}),
        ((_ix.r(5, 7, 3), [_ix.i(5, 4), None, _ix.i(3, 4)]), {}),  # not adjacent: the index dims come first
        ((_ix.r(5, 7, 3), [None, _ix.i(7, 5), _ix.i(3, 1)]), {}),  # broadcast indices
    ],
    aten.index_put.default: lambda: [
        ((_ix.r(5, 7), [_ix.i(5, 6)], _ix.r(6, 7), True), {}),
        ((_ix.r(5, 7), [torch.randperm(5, generator=_ix.g)[:3]], _ix.r(3, 7)), {}),
        ((_ix.r(5, 7, 3), [None, _ix.i(7, 4)], _ix.r(5, 4, 3), True), {}),
        ((_ix.r(5, 7, 3), [None, _ix.i(7, 4)], _ix.r(3), True), {}),  # values broadcast
    ],
}


# -- random: checked for equal values under the same seed (the global generator, as torch draws) ---

_RANDOM = {
    aten.bernoulli_.float: lambda: [((torch.randn(5, 7), 0.3), {})],
    aten.uniform_.default: lambda: [((torch.randn(5, 7), -1.0, 2.0), {})],
    aten.normal_.default: lambda: [((torch.randn(7, 3),), {})],
    aten.exponential_.default: lambda: [((torch.randn(5, 3),), {})],
    aten.cauchy_.default: lambda: [((torch.randn(5, 3),), {}), ((torch.randn(7, 2), 1.0, 2.0), {})],
    aten.geometric_.default: lambda: [((torch.randn(5, 3), 0.3), {})],
    aten.log_normal_.default: lambda: [((torch.randn(5, 3),), {}), ((torch.randn(3, 7), 0.5, 0.25), {})],
    aten.random_.default: lambda: [((torch.randn(5, 3),), {})],
    getattr(aten.random_, "from"): lambda: [((torch.randn(5, 3), 2, 9), {})],
    aten.random_.to: lambda: [((torch.randn(5, 3), 9), {})],
    aten.rand_like.default: lambda: [((torch.randn(5, 7),), {})],
    aten.randn_like.default: lambda: [((torch.randn(5, 7),), {})],
    aten.randint_like.default: lambda: [((torch.randn(5, 7), 10), {})],
    aten.randint_like.low_dtype: lambda: [((torch.randn(5, 7), -3, 10), {})],
    aten.native_dropout.default: lambda: [((torch.randn(5, 7), 0.4, True), {}), ((torch.randn(5, 7), 0.4, False), {})],
}


# -- conjugate and negative bits -------------------------------------------------------------------


def _z(*shape):
    return torch.randn(shape, dtype=torch.complex64)


_CONJUGATE = {
    aten._conj.default: lambda: [((_z(5, 7),), {}), ((_z(3),), {})],
    aten._neg_view.default: lambda: [((_z(5, 7),), {}), ((torch.randn(7, 2),), {})],
    aten.resolve_conj.default: lambda: [((_z(5, 7),), {})],
    aten.resolve_neg.default: lambda: [((torch.randn(5, 7),), {})],
}


def _merged(*families: dict) -> dict:
    """One table of the families' samples (an op's samples are given once)."""
    out: dict = {}
    for family in families:
        for op, make in family.items():
            if op in out:
                raise ValueError(f"validator samples for {op} are given twice")
            out[op] = make
    return out


SAMPLES = _merged(_CONVOLUTION, _ATTENTION, _NORMALIZATION, _RECURRENT, _EMBEDDING, _SOFTMAX, _LOSS, _FOREACH,
                  _INDEXING, _RANDOM, _CONJUGATE)
