"""nn functions on GlobalTensors equal plain torch: layer/batch/group norm, softmax, cross-entropy, embedding.

Outputs and gradients in sampled layouts on the oracle meshes; batch norm modules over two training
steps (running stats from the global batch) and in eval; no op left to the replicated fallback.
"""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shoal
from shoal import B, P, S
from shoal.testing import check, make_global

_G = torch.Generator().manual_seed(0)
MESHES = [(1,), (2,), (3,), (2, 2)]


def r(*shape):
    return torch.randn(shape, generator=_G)


def targets(n_classes, *shape, ignore=None, hits=2):
    t = torch.randint(0, n_classes, shape, generator=_G)
    if ignore is not None:
        t.view(-1)[torch.randperm(t.numel(), generator=_G)[:hits]] = ignore
    return t


def nd(mesh, *per_axis):
    """Layouts for one input: each entry is one SBP per mesh axis (a single SBP is used on every axis)."""
    out = []
    for s in per_axis:
        out.append(tuple(s) if isinstance(s, (tuple, list)) else (s,) * mesh.ndim)
    return out


# -- layer norm / softmax ------------------------------------------------------------------------


@pytest.mark.parametrize("shape", MESHES, ids=str)
def test_layer_norm_affine(meshes, shape):
    def layer_norm(x, w, b):
        return F.layer_norm(x, (7,), w, b)

    check(layer_norm, [r(5, 7), r(7), r(7)], meshes[shape], max_combos=12)


def test_layer_norm_two_normalized_dims(meshes):
    def layer_norm(x, w):
        return F.layer_norm(x, (5, 3), w)

    check(layer_norm, [r(7, 5, 3), r(5, 3)], meshes[(2, 2)], max_combos=10)


@pytest.mark.parametrize("shape", MESHES, ids=str)
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("fn", [F.softmax, F.log_softmax], ids=["softmax", "log_softmax"])
def test_softmax(meshes, shape, dim, fn):
    def softmax(x):
        return fn(x, dim)

    check(softmax, [r(5, 7)], meshes[shape], max_combos=8)


# -- cross entropy ----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", MESHES, ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_batch_and_class_split(meshes, shape, reduction):
    mesh = meshes[shape]
    weight = r(7).abs()

    def cross_entropy(logits, target):
        return F.cross_entropy(logits, target, ignore_index=-100, reduction=reduction)

    def weighted(logits, target):
        return F.cross_entropy(logits, target, weight=weight, ignore_index=3, reduction=reduction)

    inputs = [r(5, 7), targets(7, 5, ignore=-100)]
    # batch split: logits and targets S(0); vocabulary-parallel: logits S(1), targets B
    batch = [nd(mesh, S(0), B), nd(mesh, S(0), B)]
    classes = [nd(mesh, S(1)), nd(mesh, B)]
    check(cross_entropy, inputs, mesh, in_layouts=batch)
    check(cross_entropy, inputs, mesh, in_layouts=classes)
    check(weighted, [r(7, 7), targets(7, 7, ignore=3)], mesh, in_layouts=classes)
    if mesh.ndim == 2:  # batch on one axis, classes on the other
        check(cross_entropy, inputs, mesh, in_layouts=[nd(mesh, (S(0), S(1))), nd(mesh, (S(0), B))])


def test_cross_entropy_spatial_and_label_smoothing(meshes):
    mesh = meshes[(3,)]

    def spatial(logits, target):
        return F.cross_entropy(logits, target, ignore_index=0)

    def smoothed(logits, target):
        return F.cross_entropy(logits, target, label_smoothing=0.1)

    check(spatial, [r(2, 5, 7), targets(5, 2, 7, ignore=0, hits=3)], mesh, max_combos=12)
    check(smoothed, [r(5, 7), targets(7, 5)], mesh, in_layouts=[nd(mesh, S(0), S(1)), nd(mesh, S(0), B)])


def test_cross_entropy_all_ignored_is_nan(meshes):
    mesh = meshes[(2,)]

    def cross_entropy(logits, target):
        return F.cross_entropy(logits, target)

    check(cross_entropy, [r(3, 7), torch.full((3,), -100)], mesh, in_layouts=[nd(mesh, S(0), S(1)), nd(mesh, S(0), B)])


def test_mse_loss(meshes):
    mesh = meshes[(3,)]
    for reduction in ("mean", "sum", "none"):

        def mse(a, b, reduction=reduction):
            return F.mse_loss(a, b, reduction=reduction)

        check(mse, [r(5, 7), r(5, 7)], mesh, max_combos=8)


# -- embedding --------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", MESHES, ids=str)
def test_embedding_weight_layouts(meshes, shape):
    mesh = meshes[shape]

    def embedding(idx, weight):
        return F.embedding(idx, weight)

    def padded(idx, weight):
        return F.embedding(idx, weight, padding_idx=3, scale_grad_by_freq=True)

    idx = torch.tensor([[1, 10, 3, 3], [0, 5, 10, 7], [3, 2, 9, 1]])
    for w_layout in (B, S(0), S(1)):
        idx_layouts = nd(mesh, B, S(0), S(1)) if w_layout == B else nd(mesh, B)
        layouts = [idx_layouts, nd(mesh, w_layout)]
        check(embedding, [idx, r(11, 5)], mesh, in_layouts=layouts)
        check(padded, [idx, r(11, 5)], mesh, in_layouts=layouts)


# -- batch norm -------------------------------------------------------------------------------


def _globalize_module(mod, mesh, param_sbp, buffer_sbp):
    for name, p in list(mod.named_parameters(recurse=False)):
        setattr(mod, name, nn.Parameter(make_global(p.detach(), mesh, param_sbp)))
    for name, b in list(mod.named_buffers(recurse=False)):
        setattr(mod, name, make_global(b, mesh, buffer_sbp if b.ndim else (B,) * mesh.ndim))
    return mod


def _close(got, want, what):
    got = got.full() if isinstance(got, shoal.GlobalTensor) else got
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what}: {m}")


def _batch_norm_steps(make, mesh, x_shape, x_sbp, param_sbp=B, buffer_sbp=B, steps=2):
    """Train ``steps`` steps then one eval step, on plain torch and on shoal; compare everything."""
    ref = make()
    mod = _globalize_module(make(), mesh, param_sbp, buffer_sbp)
    for step in range(steps + 1):
        if step == steps:
            ref.eval()
            mod.eval()
        x, cot = r(*x_shape), r(*x_shape)
        xr = x.clone().requires_grad_(True)
        gx = make_global(x, mesh, x_sbp, requires_grad=True)
        out_r, out = ref(xr), mod(gx)
        (out_r * cot).sum().backward()
        (out * cot).sum().backward()
        what = f"step {step} on {mesh.shape} with x {x_sbp}"
        _close(out, out_r, what + ": output")
        _close(gx.grad, xr.grad, what + ": input grad")
        for (name, p), (_, pr) in zip(mod.named_parameters(), ref.named_parameters()):
            _close(p.grad, pr.grad, f"{what}: {name}.grad")
        for (name, b), (_, br) in zip(mod.named_buffers(), ref.named_buffers()):
            _close(b, br, f"{what}: {name}")


def _bn1d():
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(5, momentum=0.3)
    nn.init.normal_(bn.weight)
    nn.init.normal_(bn.bias)
    return bn


def _bn2d():
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(3)
    nn.init.normal_(bn.weight)
    nn.init.normal_(bn.bias)
    return bn


def _bn2d_cumulative():
    return nn.BatchNorm2d(3, momentum=None, affine=False)


def test_batch_norm_global_batch_statistics():
    mesh = shoal.Mesh([0, 1, 2, 3])
    _batch_norm_steps(_bn1d, mesh, (7, 5), S(0))
    _batch_norm_steps(_bn1d, mesh, (3, 5, 2), S(0))  # an empty shard
    _batch_norm_steps(_bn2d, mesh, (5, 3, 2, 3), S(0))
    _batch_norm_steps(_bn2d, mesh, (2, 3, 3, 5), S(3))  # spatial split
    _batch_norm_steps(_bn2d_cumulative, mesh, (5, 3, 2, 3), S(0))


@pytest.mark.parametrize(
    "x_sbp, param_sbp",
    [((S(0), S(0)), (B, B)), ((S(0), S(2)), (B, B)), ((S(0), S(1)), (B, S(0))), ((S(1), S(1)), (S(0), S(0)))],
    ids=str,
)
def test_batch_norm_2d_mesh(meshes, x_sbp, param_sbp):
    _batch_norm_steps(_bn2d, meshes[(2, 2)], (5, 3, 2, 3), x_sbp, param_sbp, param_sbp)


def test_batch_norm_channel_split_and_partial_stats(meshes):
    _batch_norm_steps(_bn1d, meshes[(3,)], (7, 5), S(1), S(0), S(0))
    _batch_norm_steps(_bn1d, meshes[(2,)], (7, 5), S(0), B, P)


@pytest.mark.parametrize("shape", [(2,), (3,)], ids=str)
def test_batch_norm_functional_no_running_stats(meshes, shape):
    def batch_norm(x, w, b):
        return F.batch_norm(x, None, None, w, b, training=True)

    check(batch_norm, [r(7, 3, 2), r(3), r(3)], meshes[shape], max_combos=16, rtol=1e-4)


# -- group norm -------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", MESHES, ids=str)
def test_group_norm(meshes, shape):
    """A batch split runs the kernel on each shard; a channel or spatial split decomposes (each
    group's statistics summed over the devices)."""

    def group_norm(x, w, b):
        return F.group_norm(x, 2, w, b)

    check(group_norm, [r(5, 6, 3), r(6), r(6)], meshes[shape], max_combos=16, rtol=1e-4)


# -- recurrent ----------------------------------------------------------------------------------


def _lstm_fn(mod):
    names = [n for n, _ in mod.named_parameters()]

    def lstm(x, h0, c0, *params):
        out, (h, c) = torch.func.functional_call(mod, dict(zip(names, params)), (x, (h0, c0)))
        return out, h, c

    return lstm


@pytest.mark.parametrize("shape", MESHES, ids=str)
def test_lstm(meshes, shape):
    """torch's CPU LSTM runs oneDNN's layer op: a batch split runs it on each shard (the backward
    rebuilds the shard's workspace); other layouts are boxed. Outputs, states and every gradient."""
    torch.manual_seed(0)
    mod = nn.LSTM(3, 4, num_layers=2, bidirectional=True, batch_first=True)
    inputs = [r(5, 6, 3), r(4, 5, 4), r(4, 5, 4), *(p.detach() for p in mod.parameters())]
    mesh = meshes[shape]
    split = [nd(mesh, S(0)), nd(mesh, S(1)), nd(mesh, S(1))] + [nd(mesh, B)] * (len(inputs) - 3)
    check(_lstm_fn(mod), inputs, mesh, in_layouts=split, rtol=1e-4, atol=1e-5)
    check(_lstm_fn(mod), inputs, mesh, max_combos=4, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", MESHES, ids=str)
@pytest.mark.parametrize("p", [1.0, 2.0, float("inf")])
def test_cdist(meshes, shape, p):
    """Rows of either operand or a batch dim split; distances and both gradients."""

    def cdist(x1, x2):
        return torch.cdist(x1, x2, p)

    check(cdist, [r(2, 5, 3), r(2, 7, 3)], meshes[shape], max_combos=24, rtol=1e-4)


# -- coverage ---------------------------------------------------------------------------------


def test_no_fallback_for_nn_functions(meshes):
    mesh = meshes[(2, 2)]

    def g(t, *sbp):
        return make_global(t, mesh, sbp, requires_grad=t.dtype.is_floating_point)

    shoal.coverage(reset=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback warns
        x = g(r(5, 7), S(0), S(1))
        losses = [
            F.layer_norm(x, (7,), g(r(7), B, B), g(r(7), B, B)).sum(),
            F.layer_norm(g(r(5, 7), S(0), B), (7,)).sum(),
            F.softmax(x, 1).sum() + F.log_softmax(x, 0).sum(),
            F.cross_entropy(x, g(targets(7, 5, ignore=-100), S(0), B)),
            F.cross_entropy(x, g(targets(7, 5), B, B), reduction="sum", label_smoothing=0.1),
            F.cross_entropy(g(r(2, 7, 3), S(2), S(1)), g(targets(7, 2, 3), S(1), B)),
            F.mse_loss(x, g(r(5, 7), S(0), B)),
            F.embedding(g(torch.tensor([[1, 10], [3, 0]]), B, B), g(r(11, 4), S(0), S(1))).sum(),
            F.embedding(g(torch.tensor([[1, 10], [3, 0]]), S(0), B), g(r(11, 4), B, B)).sum(),
        ]
        bn = _globalize_module(_bn2d(), mesh, (B, B), (B, B))
        losses.append(bn(g(r(5, 3, 2, 3), S(0), S(2))).sum())
        bn.eval()
        losses.append(bn(g(r(5, 3, 2, 3), S(0), S(1))).sum())
        losses.append(F.batch_norm(g(r(5, 3), S(1), S(1)), None, None, training=True).sum())
        losses.append(F.group_norm(g(r(5, 4, 3), S(0), S(0)), 2, g(r(4), B, B), g(r(4), B, B)).sum())
        losses.append(F.group_norm(g(r(5, 4, 3), S(0), S(2)), 4).sum())
        lstm = _globalize_module(nn.LSTM(4, 3, batch_first=True), mesh, (B, B), (B, B))
        losses.append(lstm(g(r(5, 2, 4), S(0), S(0)))[0].sum())
        losses.append(torch.cdist(g(r(5, 3), S(0), B), g(r(4, 3), B, S(0))).sum())
        sum(losses).backward()
    cov = shoal.coverage()
    assert not cov.by_fallback, str(cov)
