"""Convolution, pooling, upsampling, attention and the optimizers' foreach path on GlobalTensors equal plain torch:
outputs and gradients for sampled input layouts, and parameters after optimizer steps."""

import itertools
import random
import unittest.mock
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import shoal
from shoal import B, P, S
from shoal.testing import assert_same_value, check, make_global

MESHES = [(1,), (2,), (3,), (2, 2)]
_G = torch.Generator().manual_seed(0)


def r(*shape):
    return torch.randn(shape, generator=_G)


def combos(mesh, *per_axis):
    """Per tensor: every nd-SBP whose axes take the given options."""
    return [list(itertools.product(opts, repeat=mesh.ndim)) for opts in per_axis]


# -- convolution and pooling ------------------------------------------------------------------


def conv(x, w, b):
    return F.conv2d(x, w, b, stride=2, padding=1)


def conv_block(x, w1, b1, w2):
    y = F.max_pool2d(torch.relu(F.conv2d(x, w1, b1, padding=1)), 2, ceil_mode=True)
    y = F.avg_pool2d(torch.tanh(F.conv2d(y, w2)), 2, stride=1, padding=1, count_include_pad=False)
    return F.adaptive_avg_pool2d(y, (2, 3))


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_conv2d(mesh_shape, meshes):
    inputs = [r(3, 5, 7, 7), r(7, 5, 3, 3), r(7)]
    assert check(conv, inputs, meshes[mesh_shape], max_combos=12, rtol=1e-4, atol=1e-4) > 0


def upsample(x):
    return (F.interpolate(x, scale_factor=2, mode="nearest").sum((2, 3))
            + F.interpolate(x, size=(5, 9), mode="bilinear", align_corners=True).mean((2, 3))
            + F.interpolate(x, scale_factor=1.5, mode="bicubic").amax((2, 3)))


def pools_3d(x):
    y = F.max_pool3d(x, 2).sum() + F.avg_pool3d(x, (1, 2, 2), padding=(0, 1, 1)).sum()
    return y + F.adaptive_max_pool3d(x, (2, 1, 2)).sum() + F.adaptive_max_pool2d(x[:, :, 0], 3).sum()


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_pools_3d_and_adaptive_max(mesh_shape, meshes):
    assert check(pools_3d, [r(5, 3, 4, 5, 5)], meshes[mesh_shape], max_combos=12, rtol=1e-4, atol=1e-4) > 0


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_upsample(mesh_shape, meshes):
    assert check(upsample, [r(5, 3, 4, 6)], meshes[mesh_shape], max_combos=12, rtol=1e-4, atol=1e-4) > 0


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_conv_pool_block(mesh_shape, meshes):
    inputs = [r(5, 3, 7, 7), r(7, 3, 3, 3), r(7), r(5, 7, 2, 2)]
    assert check(conv_block, inputs, meshes[mesh_shape], max_combos=8, rtol=1e-4, atol=1e-4) > 0


# -- attention --------------------------------------------------------------------------------


def causal_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def masked_attention(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def math_attention(q, k, v, mask):
    with sdpa_kernel([SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask > 0)


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_attention_causal(mesh_shape, meshes):
    """Batch 3 and heads 5 split (uneven, empty shards on 4 devices) or not, v Partial too."""
    mesh = meshes[mesh_shape]
    qkv = (B, S(0), S(1))
    lay = combos(mesh, qkv, qkv, (*qkv, P))
    q, k, v = r(3, 5, 6, 4), r(3, 5, 6, 4), r(3, 5, 6, 4)
    assert check(causal_attention, [q, k, v], mesh, in_layouts=lay, max_combos=10) > 0


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_attention_masked(mesh_shape, meshes):
    """A boolean mask per batch entry (broadcast over heads); queries may be split too. (A float mask
    that requires grad takes the math path: see test_attention_math_path.)"""
    mesh = meshes[mesh_shape]
    lay = combos(mesh, (B, S(0), S(1), S(2)), (B, S(0), S(1)), (B, S(0), S(1)), (B, S(0), S(2)))
    q, k, v, mask = r(3, 2, 5, 4), r(3, 2, 7, 4), r(3, 2, 7, 4), r(3, 1, 5, 7) > 0
    mask[..., 0] = True  # no query without keys
    assert check(masked_attention, [q, k, v, mask], mesh, in_layouts=lay, max_combos=10) > 0


@pytest.mark.parametrize("mesh_shape", [(3,), (2, 2)])
def test_attention_math_path(mesh_shape, meshes):
    mesh = meshes[mesh_shape]
    lay = combos(mesh, (B, S(0), S(1)), (B, S(0), S(1)), (B, S(0), S(1)), (B,))
    inputs = [r(3, 5, 4, 2), r(3, 5, 6, 2), r(3, 5, 6, 2), r(4, 6)]
    n = check(math_attention, inputs, mesh, in_layouts=lay, max_combos=6)
    assert n > 0


# -- foreach ops and optimizers ---------------------------------------------------------------


def _mixed(ts, mesh, seed, partial=True):
    """Each tensor in its own random layout (Partial ones with genuinely partial pieces)."""
    rng = random.Random(seed)
    out = []
    for i, t in enumerate(ts):
        opts = [B, *(S(d) for d in range(t.ndim)), *([P] if partial else [])]
        out.append(make_global(t, mesh, [rng.choice(opts) for _ in range(mesh.ndim)], seed=seed + i))
    return out


FOREACH = {
    "add_": lambda a, b, c: torch._foreach_add_(a, b, alpha=-0.5),
    "mul_scalar_": lambda a, b, c: torch._foreach_mul_(a, 0.9),
    "lerp_": lambda a, b, c: torch._foreach_lerp_(a, b, 0.1),
    "addcmul_": lambda a, b, c: torch._foreach_addcmul_(a, b, c, value=0.5),
    "addcdiv_": lambda a, b, c: torch._foreach_addcdiv_(a, b, [x.abs() + 1 for x in c], [0.1, -0.2, 0.3, 1.0]),
    "maximum_": lambda a, b, c: torch._foreach_maximum_(a, b),
    "add": lambda a, b, c: torch._foreach_add(a, b, alpha=2.0),
    "sqrt": lambda a, b, c: torch._foreach_sqrt([x.abs() for x in a]),
    "norm": lambda a, b, c: torch._foreach_norm(a),
    "norm_inf": lambda a, b, c: torch._foreach_norm(a, float("inf")),
    "norm_1": lambda a, b, c: torch._foreach_norm(a, 1),
    # the rest of the pointwise family, by the generic rule
    "clamp_min_": lambda a, b, c: torch._foreach_clamp_min_(a, b),
    "exp": lambda a, b, c: torch._foreach_exp(a),
}


@pytest.mark.parametrize("name", list(FOREACH))
@pytest.mark.parametrize("mesh_shape", [(3,), (2, 2)])
def test_foreach_mixed_layouts(name, mesh_shape, meshes):
    """Lists whose elements all have different layouts (Partial included, empty shards on (2,))."""
    mesh = meshes[mesh_shape]
    shapes = [(5, 3), (2,), (7,), ()]
    for seed in range(4):
        ref = [[r(*s) for s in shapes] for _ in range(3)]
        glob = [_mixed(lst, mesh, seed * 10 + j) for j, lst in enumerate(ref)]
        plain = [[t.clone() for t in lst] for lst in ref]
        what = f"{name} seed {seed}: layouts {[[str(t.sbp) for t in lst] for lst in glob]}"
        want = FOREACH[name](*plain)
        got = FOREACH[name](*glob)
        want_lists = plain if want is None else [want]
        got_lists = glob if got is None else [got]
        for w_list, g_list in zip(want_lists, got_lists):
            assert_same_value(g_list, w_list, what)


@pytest.mark.parametrize("mesh_shape", [(3,), (2, 2)])
def test_foreach_inplace_on_shared_shards(mesh_shape, meshes):
    """Broadcast shards made by to_global are one tensor for all devices (the list op runs per device:
    each element must be written once), and a Partial made from a full tensor keeps one copy beside
    zeros shared by the other devices (per-tensor ops unshare them)."""
    mesh = meshes[mesh_shape]
    a, b = [r(5, 3), r(7), r(4)], [r(5, 3), r(7), r(4)]
    ga = [shoal.to_global(t, mesh, [sbp] * mesh.ndim) for t, sbp in zip(a, (B, S(0), B))]
    gp = [shoal.to_global(r(4), mesh, [P] * mesh.ndim)]
    p = [gp[0].full()]
    gb, gq = _mixed(b, mesh, 3), _mixed([r(4)], mesh, 5)
    q = [gq[0].full()]
    shoal.coverage(reset=True)
    for lists in ((ga, gb), (a, b), (gp, gq), (p, q)):
        torch._foreach_add_(*lists, alpha=0.5)
        torch._foreach_mul_(lists[0], 3.0)
    assert_same_value(ga, a, "Broadcast and split elements")
    assert_same_value(gp, p, "a Partial element with shared zeros")
    cov = shoal.coverage()
    assert cov.by_rule[torch.ops.aten._foreach_add_.List] == 1
    assert cov.by_decomposition[torch.ops.aten._foreach_add_.List] == 1


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_foreach_generic_rule_writes_partial_elements_exactly(mesh_shape, meshes):
    """A pointwise foreach op without its own rule (clamp is not linear) writing Partial elements in
    place runs out of place and copies back, as the explicit rules do (clip_grad_value_ on the
    Partial gradients of a split batch)."""
    mesh = meshes[mesh_shape]
    ts = [r(5, 3), r(4)]
    glob = [make_global(t, mesh, [P] * mesh.ndim, seed=i) for i, t in enumerate(ts)]
    shoal.coverage(reset=True)
    torch._foreach_clamp_min_(glob, 0.1)
    torch._foreach_clamp_min_(ts, 0.1)
    assert_same_value(glob, ts, "clamp_min_ of Partial elements")
    assert shoal.coverage().by_decomposition[torch.ops.aten._foreach_clamp_min_.Scalar] == 1


def test_foreach_types_registered():
    from torch.optim.optimizer import _default_to_fused_or_foreach
    from torch.optim.optimizer import _foreach_supported_types as optim_types
    from torch.utils._foreach_utils import _foreach_supported_types as util_types

    assert shoal.GlobalTensor in optim_types and shoal.GlobalTensor in util_types
    p = shoal.to_global(r(4, 3), shoal.Mesh([0, 1]), S(0))
    # torch picks foreach by default on foreach-kernel devices (CUDA); CPU tensors, plain or not, take
    # the per-tensor path. On such a device GlobalTensors now qualify:
    with unittest.mock.patch("torch.optim.optimizer._get_foreach_kernels_supported_devices", lambda: ["cpu"]):
        assert _default_to_fused_or_foreach([p], False) == (False, True)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 7), torch.nn.ReLU(), torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)
    )


# parameter layouts: weights and biases of three linear layers, Broadcast, row- and column-split
LAYOUTS = {
    (4,): ([S(0), S(0), S(1), B, B, S(0)], S(0)),
    (2, 2): ([[B, S(0)], [S(0), B], [S(1), S(0)], [B, B], [S(0), S(1)], [B, S(0)]], [S(0), B]),
}
def _laid_out(mesh_shape):
    """A plain model, the same laid out per LAYOUTS, an input and the input laid out."""
    mesh = shoal.Mesh([0, 1, 2, 3]) if mesh_shape == (4,) else shoal.Mesh([[0, 1], [2, 3]])
    layouts, x_layout = LAYOUTS[mesh_shape]
    ref, m = _model(), _model()
    for (name, p), sbp in zip(list(m.named_parameters()), layouts):
        mod, attr = name.rsplit(".", 1)
        setattr(m.get_submodule(mod), attr, torch.nn.Parameter(shoal.to_global(p.detach(), mesh, sbp)))
    x = r(5, 6)
    return ref, m, x, shoal.to_global(x, mesh, x_layout)


OPTIMIZERS = {
    "sgd": lambda ps, fe: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=fe),
    "adam": lambda ps, fe: torch.optim.Adam(ps, lr=0.01, weight_decay=0.1, foreach=fe),
    "adamw": lambda ps, fe: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, foreach=fe),
}


@pytest.mark.parametrize("clip", [None, "norm", "value"])
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("mesh_shape", list(LAYOUTS))
def test_optimizer_steps_match_torch(mesh_shape, opt, clip):
    """Three steps on parameters with mixed layouts (gradients come out Partial where the batch is
    split) give the parameters plain torch gives, on the foreach path, clip_grad_norm_ and
    clip_grad_value_ included."""
    ref, m, x, gx = _laid_out(mesh_shape)
    shoal.coverage(reset=True)
    for model, inp, foreach in ((ref, x, False), (m, gx, True)):
        optimizer = OPTIMIZERS[opt](model.parameters(), foreach)
        for _ in range(3):
            optimizer.zero_grad()
            (model(inp) ** 2).mean().backward()
            if clip == "norm":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # foreach by default for GlobalTensors
            elif clip == "value":
                torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
            optimizer.step()
    for (name, got), want in zip(m.named_parameters(), ref.parameters()):
        assert_same_value(got, want.detach(), f"{name} after 3 steps", rtol=1e-4, atol=1e-5)
    cov = shoal.coverage()
    ran = {str(op) for op in (*cov.by_rule, *cov.by_decomposition)}
    assert "aten._foreach_add_.List" in ran or "aten._foreach_addcdiv_.ScalarList" in ran
    assert clip != "norm" or "aten._foreach_norm.Scalar" in ran
    assert clip != "value" or "aten._foreach_clamp_min_.Scalar" in ran
    assert not cov.by_fallback, cov


@pytest.mark.parametrize("opt", [torch.optim.Adam, torch.optim.AdamW])
@pytest.mark.parametrize("mesh_shape", list(LAYOUTS))
def test_fused_adam_matches_torch(mesh_shape, opt):
    """The fused kernel (one op for all parameters) on mixed layouts: column-split shards are strided
    views, which the kernel would walk as contiguous memory; the rule runs it on contiguous copies."""
    ref, m, x, gx = _laid_out(mesh_shape)
    shoal.coverage(reset=True)
    for model, inp in ((ref, x), (m, gx)):
        optimizer = opt(model.parameters(), lr=0.01, weight_decay=0.1, fused=True)
        for _ in range(3):
            optimizer.zero_grad()
            (model(inp) ** 2).mean().backward()
            optimizer.step()
    for (name, got), want in zip(m.named_parameters(), ref.parameters()):
        assert_same_value(got, want.detach(), f"{name} after 3 steps", rtol=1e-4, atol=1e-5)
    assert any("_fused_adam" in str(op) for op in shoal.coverage().by_rule)


# -- coverage ---------------------------------------------------------------------------------

def test_no_fallback(meshes):
    mesh = meshes[(2, 2)]
    shoal.coverage(reset=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback warns
        x = make_global(r(5, 3, 7, 7), mesh, [S(0), B], requires_grad=True)
        w1 = make_global(r(7, 3, 3, 3), mesh, [B, S(0)], requires_grad=True)
        b1 = make_global(r(7), mesh, [B, S(0)], requires_grad=True)
        w2 = make_global(r(5, 7, 2, 2), mesh, [B, S(1)], requires_grad=True)
        conv_block(x, w1, b1, w2).sum().backward()
        q, k, v = (make_global(r(3, 5, 6, 4), mesh, [S(0), S(1)], requires_grad=True) for _ in range(3))
        causal_attention(q, k, v).sum().backward()
        mask = make_global(r(3, 1, 6, 6), mesh, [S(0), B])
        masked_attention(q, k, v, mask).sum().backward()
        upsample(make_global(r(5, 3, 4, 6), mesh, [S(0), S(1)], requires_grad=True)).sum().backward()
        pools_3d(make_global(r(5, 3, 4, 5, 5), mesh, [S(0), S(1)], requires_grad=True)).backward()
    cov = shoal.coverage()
    assert not cov.by_fallback, cov
    ran = {str(op) for op in cov.by_rule}
    for op in ("convolution", "convolution_backward", "max_pool2d_with_indices", "avg_pool2d_backward",
               "upsample_nearest2d_backward", "upsample_bilinear2d", "upsample_bicubic2d_backward"):
        assert f"aten.{op}.default" in ran
    assert "aten._scaled_dot_product_flash_attention_for_cpu_backward.default" in ran


def test_math_attention_path_has_no_fallback(meshes):
    """sdpa's math path: torch's decomposition of _safe_softmax calls softmax.int, a composite op that
    dispatch decomposes by its own kernel (into _softmax, which has a rule), not by torch's table."""
    mesh = meshes[(2,)]
    q, k, v = (make_global(r(3, 5, 6, 4), mesh, S(1), requires_grad=True) for _ in range(3))
    shoal.coverage(reset=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback warns
        math_attention(q, k, v, make_global(r(6, 6), mesh, B)).sum().backward()
    assert not shoal.coverage().by_fallback
