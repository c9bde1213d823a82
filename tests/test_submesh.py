"""Sub-meshes: moving values between a mesh and ``mesh.submesh(...)`` (pipeline stages).

Boxing restricts a value to a sub-mesh (exactly, moving no data when it is Broadcast on the fixed
axes and already laid out on the others) and extends one from a sub-mesh to the whole mesh. Ops
mixing a stage's sub-mesh with the whole mesh's batch (Broadcast over the stage axis) run on the
sub-mesh; other mixes of meshes are clear errors. Values are checked against plain torch.

World: 8 virtual CPU devices (a 2x2x2 mesh), back to 4 afterwards.
"""

from __future__ import annotations

import pytest
import torch

import shoal
from shoal import B, Mesh, P, S
from shoal.boxing import box
from shoal.spec import TensorSpec
from shoal.testing import assert_same_value, make_global, value_of_shards


@pytest.fixture(autouse=True)
def _world():
    shoal.init(devices=8)
    yield
    shoal.init(devices=4)


def _pp_dp() -> Mesh:
    return Mesh([[0, 1], [2, 3]], axes=("pp", "dp"))


def _boxed(x, mesh, sbp):
    """x's shards boxed straight onto (mesh, sbp), with the spec they claim."""
    dst = TensorSpec(x.spec.shape, x.dtype, mesh, tuple(sbp))
    return box(x._shards, x.spec, dst), dst


def _value(shards, spec):
    return value_of_shards(shards, spec.mesh, spec.sbp)


# -- Mesh.fixed_in ------------------------------------------------------------------------------


def test_fixed_in_names_the_fixed_axes_and_coordinates():
    m = _pp_dp()
    assert m.submesh(pp=1).fixed_in(m) == {0: 1}
    assert m.submesh(dp=0).fixed_in(m) == {1: 0}
    assert m.fixed_in(m) == {}
    assert m.fixed_in(m.submesh(pp=0)) is None  # the reverse
    assert Mesh([0, 2]).fixed_in(m) == {1: 0}  # names are not compared
    assert Mesh([1, 0]).fixed_in(m) is None  # order matters
    assert Mesh([0, 3]).fixed_in(m) is None  # a diagonal is no sub-mesh
    assert Mesh([4, 5]).fixed_in(m) is None
    cube = Mesh([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], axes=("a", "b", "c"))
    assert cube.submesh(a=1).fixed_in(cube) == {0: 1}
    assert cube.submesh(a=1, c=0).fixed_in(cube) == {0: 1, 2: 0}
    assert cube.submesh(b=1).fixed_in(cube) == {1: 1}


# -- restriction ---------------------------------------------------------------------------------


def test_restriction_of_a_broadcast_over_pp_moves_no_data():
    m = _pp_dp()
    v = torch.randn(6, 3)
    x = make_global(v, m, [B, S(0)])
    with shoal.CommCounter() as cc:
        out, dst = _boxed(x, m.submesh(pp=1), [S(0)])
        y = x.to_global(m.submesh(pp=1), S(0))
    assert cc.total == 0, cc
    assert out == (x._shards[2], x._shards[3])  # the very shards of devices 2 and 3
    assert all(a is b for a, b in zip(out, x._shards[2:]))
    torch.testing.assert_close(_value(out, dst), v)
    assert_same_value(y, v)


def test_restriction_slices_locally():
    m = _pp_dp()
    v = torch.randn(6, 3)
    x = make_global(v, m, [B, B])
    with shoal.CommCounter() as cc:
        out, dst = _boxed(x, m.submesh(pp=0), [S(0)])
    assert cc.total == 0, cc
    torch.testing.assert_close(_value(out, dst), v)


def test_restriction_of_a_partial_over_pp_reduces_first():
    m = _pp_dp()
    v = torch.randn(6, 3)
    x = make_global(v, m, [P, S(0)], seed=3)
    with shoal.CommCounter() as cc:
        out, dst = _boxed(x, m.submesh(pp=1), [S(0)])
    assert set(cc.counts) == {"all_reduce"}, cc
    torch.testing.assert_close(_value(out, dst), v)


@pytest.mark.parametrize("src", [[S(0), B], [S(1), S(0)], [P, P], [B, P]], ids=str)
@pytest.mark.parametrize("dst", [[B], [S(0)], [S(1)], [P]], ids=str)
@pytest.mark.parametrize("fix", [{"pp": 0}, {"pp": 1}, {"dp": 1}], ids=str)
def test_restriction_of_any_layout_is_exact(src, dst, fix):
    m = _pp_dp()
    v = torch.randint(-9, 9, (5, 3))  # 5 rows over 2: uneven; integers: Partial pieces sum exactly
    x = make_global(v, m, src, seed=1)
    with shoal.CommCounter() as cc:
        out, spec = _boxed(x, m.submesh(**fix), dst)
    assert "send_recv" not in cc.counts, cc  # everything needed is on the sub-mesh already
    torch.testing.assert_close(_value(out, spec), v)


def test_restriction_uneven_rows():
    m = _pp_dp()
    v = torch.randn(5, 4)
    y = make_global(v, m, [B, S(0)]).to_global(m.submesh(pp=0), S(0))
    assert [tuple(s.shape) for s in y._shards] == [(3, 4), (2, 4)]
    assert_same_value(y, v)


def test_restriction_of_a_3d_mesh_on_its_first_axis():
    cube = Mesh([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], axes=("pp", "dp", "tp"))
    sub = cube.submesh(pp=1)
    v = torch.randn(5, 6)
    x = make_global(v, cube, [B, S(0), S(1)])
    with shoal.CommCounter() as cc:
        out, dst = _boxed(x, sub, [S(0), S(1)])
    assert cc.total == 0, cc
    assert all(a is b for a, b in zip(out, x._shards[4:]))
    torch.testing.assert_close(_value(out, dst), v)
    assert_same_value(x.to_global(sub, [S(1), B]), v)


# -- extension -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dst", [[B, S(0)], [B, B], [P, S(0)], [S(0), B], [B, P]], ids=str)
@pytest.mark.parametrize("src", [[S(0)], [B], [P]], ids=str)
def test_extension_onto_the_whole_mesh(src, dst):
    m = _pp_dp()
    v = torch.randint(-9, 9, (5, 3))
    x = make_global(v, m.submesh(pp=1), src, seed=2)
    out, spec = _boxed(x, m, dst)
    torch.testing.assert_close(_value(out, spec), v)
    y = x.to_global(m, dst)
    assert y.mesh == m
    assert_same_value(y, v)


def test_extension_of_a_broadcast_sends_each_shard_along_pp_only():
    m = _pp_dp()
    v = torch.randn(6, 3)
    x = make_global(v, m.submesh(pp=0), S(0))
    with shoal.CommCounter() as cc:
        out, spec = _boxed(x, m, [B, S(0)])
    assert dict(cc.counts) == {"send_recv": 2}, cc  # devices 0->2 and 1->3, a shard each
    assert cc.bytes["send_recv"] == v.numel() * v.element_size()
    assert out[0] is x._shards[0] and out[1] is x._shards[1]
    torch.testing.assert_close(_value(out, spec), v)


def test_extension_of_a_3d_submesh_and_back():
    cube = Mesh([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], axes=("pp", "dp", "tp"))
    v = torch.randn(5, 6)
    x = make_global(v, cube.submesh(pp=0), [S(0), S(1)])
    y = x.to_global(cube, [B, S(0), S(1)])
    assert_same_value(y, v)
    assert_same_value(y.to_global(cube.submesh(pp=1), [S(0), S(1)]), v)


# -- ops mixing a sub-mesh and the whole mesh -----------------------------------------------------


def test_op_on_a_submesh_and_the_whole_mesh_runs_on_the_submesh():
    m = _pp_dp()
    a, b = torch.randn(6, 3), torch.randn(6, 3)
    x = make_global(a, m.submesh(pp=1), S(0))
    y = make_global(b, m, [B, S(0)])
    with shoal.CommCounter() as cc:
        z = x + y
        z2 = y * x
    assert cc.total == 0, cc
    assert z.mesh == m.submesh(pp=1) and z2.mesh == m.submesh(pp=1)
    assert_same_value(z, a + b)
    assert_same_value(z2, b * a)


def test_cross_entropy_of_stage_logits_and_whole_mesh_targets():
    m = _pp_dp()
    sub = m.submesh(pp=1)
    logits, target = torch.randn(5, 7), torch.randint(0, 7, (5,))
    ref_in = logits.clone().requires_grad_(True)
    ref = torch.nn.functional.cross_entropy(ref_in, target)
    ref.backward()
    x = make_global(logits, sub, S(0), requires_grad=True)
    y = make_global(target, m, [B, S(0)])
    loss = torch.nn.functional.cross_entropy(x, y)
    loss.backward()
    assert_same_value(loss, ref.detach())
    assert x.grad.mesh == sub
    assert_same_value(x.grad, ref_in.grad)


def test_gradient_reaches_a_whole_mesh_input():
    m = _pp_dp()
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    x = make_global(a, m.submesh(pp=0), S(0), requires_grad=True)
    w = make_global(b, m, [B, B], requires_grad=True)
    (x * w).sum().backward()
    assert_same_value(x.grad, b)
    assert_same_value(w.grad, a)  # the value; it is laid out on the sub-mesh the op ran on


def test_inplace_into_a_submesh_tensor_reads_the_whole_mesh():
    m = _pp_dp()
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    x = make_global(a, m.submesh(pp=1), S(0))
    y = make_global(b, m, [B, S(0)])
    x.add_(y)
    assert_same_value(x, a + b)
    assert_same_value(y, b)


def test_unrelated_meshes_are_a_clear_error():
    x = make_global(torch.randn(4, 3), Mesh([0, 1]), S(0))
    y = make_global(torch.randn(4, 3), Mesh([2, 3]), S(0))
    with pytest.raises(ValueError, match=r"aten.add.Tensor got GlobalTensors on different meshes.*neither.*to_global"):
        x + y


def test_whole_mesh_split_over_pp_is_a_clear_error():
    m = _pp_dp()
    x = make_global(torch.randn(4, 3), m.submesh(pp=0), S(0))
    y = make_global(torch.randn(4, 3), m, [S(0), B])
    with pytest.raises(ValueError, match=r"only when Broadcast on the fixed axes \['pp'\].*\[S\(0\), B\].*to_global"):
        x * y


def test_writing_into_the_whole_mesh_tensor_is_a_clear_error():
    m = _pp_dp()
    x = make_global(torch.randn(4, 3), m.submesh(pp=0), S(0))
    y = make_global(torch.randn(4, 3), m, [B, S(0)])
    with pytest.raises(ValueError, match=r"aten.add_.Tensor writes into .* on the sub-mesh"):
        y.add_(x)


def test_compiled_steps_restrict_and_extend_as_eager():
    m = _pp_dp()
    sub = m.submesh(pp=1)
    a, b = torch.randn(6, 3), torch.randn(6, 3)
    x = make_global(a, sub, S(0))
    y = make_global(b, m, [B, S(0)])
    f = shoal.compile(lambda x, y: (x * y + y.to_global(sub, B)).sum(0))
    g = shoal.compile(lambda x: x.to_global(m, [B, S(0)]) * 2)
    for _ in range(2):  # traced, then replayed
        assert_same_value(f(x, y), (a * b + b).sum(0))
        assert_same_value(g(x), a * 2)
