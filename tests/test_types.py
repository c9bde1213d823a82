"""Types: Mesh, SBP normalization, TensorSpec layout math, from_local / to_local.

Every test runs in a world of 4 virtual CPU devices. Meshes are built inside the tests (after the
world exists); parametrize ids carry device lists and shapes only.
"""

from __future__ import annotations

import pytest
import torch

import shoal
from shoal import B, Mesh, P, Partial, S, TensorSpec
from shoal.spec import chunk_bounds


@pytest.fixture(autouse=True)
def _world():
    shoal.init(devices=4)


def _mesh(devices) -> Mesh:
    return Mesh(devices)


# ---------------------------------------------------------------------------------------------
# Mesh


def test_mesh_1d_defaults():
    m = Mesh([0, 1, 2, 3])
    assert m.devices == (0, 1, 2, 3)
    assert m.shape == (4,)
    assert m.axes == ("d0",)
    assert m.ndim == 1 and m.size == 4
    assert m.coords == ((0,), (1,), (2,), (3,))
    assert m.local_positions == (0, 1, 2, 3) and m.is_fully_local


def test_mesh_2d_named_axes():
    m = Mesh([[0, 1], [2, 3]], axes=("dp", "tp"))
    assert m.devices == (0, 1, 2, 3)
    assert m.shape == (2, 2)
    assert m.axes == ("dp", "tp")
    assert m.coords == ((0, 0), (0, 1), (1, 0), (1, 1))
    assert m.coord_of(2) == (1, 0)
    assert m.axis_index("tp") == 1 and m.axis_index(-2) == 0
    assert m.axis_size("dp") == 2


def test_mesh_row_major_device_order():
    m = Mesh([[3, 1], [0, 2]], axes=("a", "b"))
    assert m.devices == (3, 1, 0, 2)
    assert m.coord_of(0) == (1, 0)
    assert m.coord_of(1) == (0, 1)


def test_mesh_3d():
    m = Mesh([[[0, 1]], [[2, 3]]], axes=("x", "y", "z"))
    assert m.shape == (2, 1, 2)
    assert m.devices == (0, 1, 2, 3)
    assert m.coord_of(3) == (1, 0, 1)


def test_mesh_from_tensor_and_scalar():
    m = Mesh(torch.tensor([[0, 1], [2, 3]]))
    assert m.shape == (2, 2) and m.devices == (0, 1, 2, 3)
    one = Mesh(2)
    assert one.shape == (1,) and one.devices == (2,)


def test_mesh_axis_name_string_for_1d():
    assert Mesh([0, 1], axes="dp").axes == ("dp",)


def test_mesh_equality_and_hash():
    a = Mesh([[0, 1], [2, 3]], axes=("dp", "tp"))
    b = Mesh([[0, 1], [2, 3]], axes=("dp", "tp"))
    assert a == b and hash(a) == hash(b)
    assert a != Mesh([[0, 1], [2, 3]], axes=("x", "y"))
    assert a != Mesh([[0, 2], [1, 3]], axes=("dp", "tp"))
    assert a != Mesh([0, 1, 2, 3])
    assert len({a, b}) == 1


@pytest.mark.parametrize(
    "devices",
    [[[0, 1], [2]], [[0, 1], 2], [[[0, 1]], [[2, 3], [0, 1]]]],
    ids=["ragged-rows", "row-and-scalar", "ragged-3d"],
)
def test_mesh_ragged_is_an_error(devices):
    with pytest.raises(ValueError, match="ragged"):
        Mesh(devices)


def test_mesh_empty_is_an_error():
    with pytest.raises(ValueError, match="empty"):
        Mesh([])


@pytest.mark.parametrize("devices", [[0, 0], [[0, 1], [1, 2]]])
def test_mesh_duplicate_device_is_an_error(devices):
    with pytest.raises(ValueError, match="twice"):
        Mesh(devices)


@pytest.mark.parametrize("devices", [[0, 4], [-1, 0], [[0, 1], [2, 7]]])
def test_mesh_device_not_in_world_is_an_error(devices):
    with pytest.raises(ValueError, match="not in the world of 4 devices"):
        Mesh(devices)


def test_mesh_non_int_device_is_an_error():
    """Regression (was a bug): a float device id dies in _flatten with "TypeError: 'float' object is not iterable".

    World.check has a branch with a helpful message for non-int ids, but _flatten (mesh.py:21) calls
    list() on every non-int leaf before the check is reached.
    """
    with pytest.raises(ValueError, match="not in the world"):
        Mesh([0.0, 1.0])


def test_mesh_axis_errors():
    with pytest.raises(ValueError, match="axis name"):
        Mesh([[0, 1], [2, 3]], axes=("dp",))
    with pytest.raises(ValueError, match="unique"):
        Mesh([[0, 1], [2, 3]], axes=("dp", "dp"))
    m = Mesh([[0, 1], [2, 3]], axes=("dp", "tp"))
    with pytest.raises(ValueError, match="no axis 'pp'"):
        m.axis_index("pp")
    with pytest.raises(ValueError, match="out of range"):
        m.axis_index(2)


def test_mesh_submesh_2d():
    m = Mesh([[0, 1], [2, 3]], axes=("dp", "tp"))
    assert m.submesh(dp=0) == Mesh([0, 1], axes=("tp",))
    assert m.submesh(dp=1) == Mesh([2, 3], axes=("tp",))
    assert m.submesh(tp=1) == Mesh([1, 3], axes=("dp",))


def test_mesh_submesh_3d_keeps_inner_shape():
    m = Mesh([[[0, 1]], [[2, 3]]], axes=("x", "y", "z"))
    sub = m.submesh(x=1)
    assert sub == Mesh([[2, 3]], axes=("y", "z"))
    assert sub.shape == (1, 2)
    assert m.submesh(z=0) == Mesh([[0], [2]], axes=("x", "y"))
    assert m.submesh(x=0, y=0) == Mesh([0, 1], axes=("z",))


def test_mesh_submesh_errors():
    m = Mesh([[0, 1], [2, 3]], axes=("dp", "tp"))
    with pytest.raises(ValueError, match="out of range"):
        m.submesh(dp=2)
    with pytest.raises(ValueError, match="no axis"):
        m.submesh(pp=0)
    with pytest.raises(ValueError, match="keep at least one axis"):
        m.submesh(dp=0, tp=1)


def test_mesh_groups():
    m = Mesh([[0, 1], [2, 3]], axes=("dp", "tp"))
    assert m.groups(0) == ((0, 2), (1, 3))
    assert m.groups(1) == ((0, 1), (2, 3))
    assert Mesh([0, 1, 2, 3]).groups(0) == ((0, 1, 2, 3),)
    assert Mesh([0, 1, 2]).groups(0) == ((0, 1, 2),)


def test_mesh_groups_3d():
    m = Mesh([[[0, 1]], [[2, 3]]], axes=("x", "y", "z"))
    assert m.groups(0) == ((0, 2), (1, 3))
    assert m.groups(1) == ((0,), (1,), (2,), (3,))
    assert m.groups(2) == ((0, 1), (2, 3))


def test_mesh_groups_every_position_once():
    m = Mesh([[[0, 1]], [[2, 3]]])
    for axis in range(m.ndim):
        flat = sorted(p for g in m.groups(axis) for p in g)
        assert flat == list(range(m.size))
        for g in m.groups(axis):
            coords = [m.coords[p] for p in g]
            assert [c[axis] for c in coords] == list(range(m.shape[axis]))
            assert len({c[:axis] + c[axis + 1 :] for c in coords}) == 1


def test_mesh_groups_negative_axis():
    """Regression (was a bug): Mesh.groups does not normalize a negative axis (every other Mesh method does).

    groups(-1) on a (2, 2) mesh returns ((0, 1), (1, 2), (2, 3), (3, 4)): position 4 does not
    exist, and the bad result is cached in _GROUP_CACHE under (shape, -1).
    """
    m = Mesh([[0, 1], [2, 3]], axes=("dp", "tp"))
    assert m.groups(-1) == m.groups(1)
    assert m.groups(-2) == m.groups(0)


# ---------------------------------------------------------------------------------------------
# SBP types and normalization


def test_sbp_reprs_and_aliases():
    assert repr(S(1)) == "S(1)" and repr(B) == "B" and repr(P) == "P"
    assert repr(Partial("max")) == "P(max)"
    assert Partial("sum") == P and Partial() == P
    assert S(0) == shoal.Split(0) and shoal.Broadcast() == B
    assert len({S(0), S(0), B, P, Partial("min")}) == 4


def test_sbp_constructor_errors():
    with pytest.raises(TypeError, match="int dim"):
        S(1.0)
    with pytest.raises(ValueError, match="sum, max or min|one of"):
        Partial("mean")


@pytest.mark.parametrize(
    "mesh_devices, sbp, want",
    [
        ([0, 1], S(-1), (S(2),)),
        ([0, 1], S(-3), (S(0),)),
        ([0, 1], [S(-2)], (S(1),)),
        ([[0, 1], [2, 3]], [S(-1), S(-3)], (S(2), S(0))),
        ([[0, 1], [2, 3]], [B, S(-2)], (B, S(1))),
    ],
)
def test_negative_split_dim_is_normalized(mesh_devices, sbp, want):
    t = torch.arange(60.0).reshape(3, 4, 5)
    mesh = _mesh(mesh_devices)
    x = shoal.to_global(t, mesh, sbp)
    assert x.sbp == want
    torch.testing.assert_close(x.full(), t)
    # the same layout given with non-negative dims is the same spec
    assert x.spec == shoal.to_global(t, mesh, list(want)).spec


@pytest.mark.parametrize(
    "mesh_devices, sbp",
    [
        ([[0, 1], [2, 3]], [S(0)]),
        ([[0, 1], [2, 3]], S(0)),
        ([[0, 1], [2, 3]], [S(0), B, B]),
        ([0, 1], [B, B]),
        ([0, 1], []),
    ],
)
def test_sbp_count_must_match_mesh_rank(mesh_devices, sbp):
    mesh = _mesh(mesh_devices)
    with pytest.raises(ValueError, match="one SBP per mesh axis"):
        shoal.to_global(torch.zeros(4, 4), mesh, sbp)


def test_sbp_count_error_on_redistribute():
    x = shoal.to_global(torch.zeros(4, 4), Mesh([0, 1]), S(0))
    with pytest.raises(ValueError, match="one SBP per mesh axis"):
        x.to_global(Mesh([[0, 1], [2, 3]]), [B])


@pytest.mark.parametrize("dim", [2, 5, -3, -4])
def test_split_dim_out_of_range(dim):
    with pytest.raises(ValueError, match=f"split dim {dim} is out of range"):
        shoal.to_global(torch.zeros(4, 4), Mesh([0, 1]), S(dim))


def test_split_dim_out_of_range_on_scalar_and_inner_axis():
    with pytest.raises(ValueError, match="out of range"):
        shoal.to_global(torch.tensor(1.0), Mesh([0, 1]), S(0))
    with pytest.raises(ValueError, match="out of range"):
        shoal.to_global(torch.zeros(4), Mesh([[0, 1], [2, 3]]), [B, S(1)])


def test_not_an_sbp_is_a_type_error():
    with pytest.raises(TypeError, match="not an SBP"):
        shoal.to_global(torch.zeros(4), Mesh([0, 1]), ["B"])


def test_to_global_argument_type_errors():
    with pytest.raises(TypeError, match="torch.Tensor"):
        shoal.to_global([1.0, 2.0], Mesh([0, 1]), B)
    with pytest.raises(TypeError, match="shoal.Mesh"):
        shoal.to_global(torch.zeros(2), [0, 1], B)


# ---------------------------------------------------------------------------------------------
# TensorSpec: local shapes and offsets


def _spec(shape, mesh, sbp) -> TensorSpec:
    return shoal.to_global(torch.zeros(shape), mesh, sbp).spec


@pytest.mark.parametrize(
    "size, n, sizes",
    [(10, 4, [3, 3, 2, 2]), (2, 3, [1, 1, 0]), (0, 2, [0, 0]), (7, 1, [7]), (8, 4, [2, 2, 2, 2]), (1, 4, [1, 0, 0, 0])],
)
def test_chunk_bounds(size, n, sizes):
    bounds = [chunk_bounds(size, n, i) for i in range(n)]
    assert [b - a for a, b in bounds] == sizes
    assert bounds[0][0] == 0 and bounds[-1][1] == size
    assert all(bounds[i][1] == bounds[i + 1][0] for i in range(n - 1))


@pytest.mark.parametrize("size", range(0, 13))
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_chunk_bounds_agree_with_tensor_split(size, n):
    """Boxing slices with chunk_bounds and scatters with torch.tensor_split: they must agree."""
    parts = torch.tensor_split(torch.arange(size), n)
    for i, part in enumerate(parts):
        a, b = chunk_bounds(size, n, i)
        assert part.tolist() == list(range(a, b))


@pytest.mark.parametrize(
    "shape, devices, sbp, shapes, offsets",
    [
        ((10,), [0, 1, 2, 3], S(0), [(3,), (3,), (2,), (2,)], [(0,), (3,), (6,), (8,)]),
        ((2,), [0, 1, 2], S(0), [(1,), (1,), (0,)], [(0,), (1,), (2,)]),
        ((0, 3), [0, 1], S(0), [(0, 3), (0, 3)], [(0, 0), (0, 0)]),
        ((4, 5), [0, 1, 2], S(1), [(4, 2), (4, 2), (4, 1)], [(0, 0), (0, 2), (0, 4)]),
        ((4, 5), [0, 1, 2], B, [(4, 5)] * 3, [(0, 0)] * 3),
        ((4, 5), [0, 1, 2], P, [(4, 5)] * 3, [(0, 0)] * 3),
        (
            (11,),
            [[0, 1], [2, 3]],
            [S(0), S(0)],
            [(3,), (3,), (3,), (2,)],
            [(0,), (3,), (6,), (9,)],
        ),
        (
            (5, 3),
            [[0, 1], [2, 3]],
            [S(0), S(1)],
            [(3, 2), (3, 1), (2, 2), (2, 1)],
            [(0, 0), (0, 2), (3, 0), (3, 2)],
        ),
        (
            (5, 3),
            [[0, 1], [2, 3]],
            [S(1), S(0)],
            [(3, 2), (2, 2), (3, 1), (2, 1)],
            [(0, 0), (3, 0), (0, 2), (3, 2)],
        ),
        (
            (3, 7),
            [[0, 1], [2, 3]],
            [B, S(1)],
            [(3, 4), (3, 3), (3, 4), (3, 3)],
            [(0, 0), (0, 4), (0, 0), (0, 4)],
        ),
        (
            (3, 7),
            [[0, 1], [2, 3]],
            [Partial("max"), S(0)],
            [(2, 7), (1, 7), (2, 7), (1, 7)],
            [(0, 0), (2, 0), (0, 0), (2, 0)],
        ),
        ((1,), [[0, 1], [2, 3]], [S(0), S(0)], [(1,), (0,), (0,), (0,)], [(0,), (1,), (1,), (1,)]),
    ],
    ids=[
        "10/4",
        "2/3-empty",
        "0/2",
        "S1-5/3",
        "B",
        "P",
        "S0S0-11",
        "S0S1",
        "S1S0",
        "BS1",
        "PmaxS0",
        "S0S0-1",
    ],
)
def test_spec_local_shapes_and_offsets(shape, devices, sbp, shapes, offsets):
    mesh = _mesh(devices)
    spec = _spec(shape, mesh, sbp)
    assert [spec.local_shape(p) for p in range(mesh.size)] == shapes
    assert [spec.local_offset(p) for p in range(mesh.size)] == offsets
    for p in range(mesh.size):
        region = spec.local_region(p)
        assert tuple(r.stop - r.start for r in region) == shapes[p]
        assert tuple(r.start for r in region) == offsets[p]


@pytest.mark.parametrize(
    "shape, devices, sbp",
    [
        ((10, 3), [0, 1, 2, 3], S(0)),
        ((2, 5), [0, 1, 2], S(0)),
        ((11, 2), [[0, 1], [2, 3]], [S(0), S(0)]),
        ((5, 7), [[0, 1], [2, 3]], [S(1), S(0)]),
        ((3, 5), [[0, 1], [2, 3]], [B, S(1)]),
        ((3, 1, 6), [[0, 1], [2, 3]], [S(2), S(2)]),
    ],
)
def test_to_global_shards_are_the_regions(shape, devices, sbp):
    """Scattering a full tensor puts exactly value[local_region(p)] at each position."""
    mesh = _mesh(devices)
    t = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    x = shoal.to_global(t, mesh, sbp)
    assert len(x._shards) == mesh.size
    for p in range(mesh.size):
        assert tuple(x._shards[p].shape) == x.spec.local_shape(p)
        torch.testing.assert_close(x._shards[p], t[x.spec.local_region(p)], rtol=0, atol=0)


def test_to_global_partial_from_full_has_one_copy():
    mesh = Mesh([0, 1, 2])
    t = torch.arange(6.0).reshape(2, 3)
    x = shoal.to_global(t, mesh, P)
    torch.testing.assert_close(sum(x._shards), t)
    torch.testing.assert_close(x.full(), t)
    x = shoal.to_global(t, mesh, Partial("max"))
    for s in x._shards:
        torch.testing.assert_close(s, t)


def test_spec_properties():
    mesh = Mesh([[0, 1], [2, 3]])
    spec = TensorSpec((6, 5), torch.float32, mesh, (S(0), S(0)))
    assert spec.ndim == 2 and spec.numel == 30 and spec.nbytes == 120
    assert spec.split_factor(0) == 4 and spec.split_factor(1) == 1
    assert not spec.has_partial and not spec.is_replicated
    assert spec.with_sbp((B, B)).is_replicated
    assert spec.with_sbp((B, Partial("min"))).has_partial
    assert TensorSpec((6, 5), torch.float16, mesh, (B, B)).nbytes == 60
    assert hash(spec) == hash(TensorSpec((6, 5), torch.float32, Mesh([[0, 1], [2, 3]]), (S(0), S(0))))
    with pytest.raises(AttributeError):
        spec.shape = (1,)


# ---------------------------------------------------------------------------------------------
# from_local / to_local


_LAYOUTS = [
    ((10, 3), [0, 1, 2, 3], S(0)),
    ((2, 4), [0, 1, 2], S(0)),
    ((4, 5), [0, 1, 2], S(1)),
    ((11,), [[0, 1], [2, 3]], [S(0), S(0)]),
    ((5, 3), [[0, 1], [2, 3]], [S(0), S(1)]),
    ((5, 3), [[0, 1], [2, 3]], [B, S(1)]),
    ((3, 7), [[0, 1], [2, 3]], [S(1), B]),
    ((3, 7), [[0, 1], [2, 3]], [P, S(1)]),
    ((0, 2), [0, 1], S(0)),
    ((4,), [0, 1], B),
]


@pytest.mark.parametrize("shape, devices, sbp", _LAYOUTS)
def test_from_local_round_trip_infers_shape(shape, devices, sbp):
    mesh = _mesh(devices)
    t = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    x = shoal.to_global(t, mesh, sbp)
    local = x.to_local()
    assert isinstance(local, dict) and list(local) == list(mesh.devices)
    y = shoal.from_local(local, mesh, sbp)
    assert y.shape == t.shape and y.spec == x.spec
    for p, d in enumerate(mesh.devices):
        assert y._shards[p] is local[d]  # no copies
    torch.testing.assert_close(y.full(), t)


@pytest.mark.parametrize("shape, devices, sbp", _LAYOUTS)
def test_from_local_with_explicit_shape(shape, devices, sbp):
    mesh = _mesh(devices)
    t = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    x = shoal.to_global(t, mesh, sbp)
    y = shoal.from_local(x.to_local(), mesh, sbp, shape=shape)
    assert y.spec == x.spec
    torch.testing.assert_close(y.full(), t)


def test_from_local_partial_sum_value():
    mesh = Mesh([[0, 1], [2, 3]])
    shards = {d: torch.full((2, 3), float(d + 1)) for d in mesh.devices}
    x = shoal.from_local(shards, mesh, [P, P])
    assert x.shape == (2, 3)
    torch.testing.assert_close(x.full(), torch.full((2, 3), 10.0))
    shards = {d: torch.full((2, 3), float(d + 1)) for d in mesh.devices}
    x = shoal.from_local(shards, mesh, [S(0), Partial("max")])
    assert x.shape == (4, 3)
    torch.testing.assert_close(x.full(), torch.tensor([[2.0] * 3] * 2 + [[4.0] * 3] * 2))


def test_from_local_uneven_inference():
    mesh = Mesh([0, 1, 2])
    x = shoal.from_local({0: torch.ones(3, 2), 1: torch.ones(2, 2), 2: torch.ones(2, 2)}, mesh, S(0))
    assert x.shape == (7, 2)
    x = shoal.from_local({0: torch.ones(1), 1: torch.ones(1), 2: torch.ones(0)}, mesh, S(-1))
    assert x.shape == (2,) and x.sbp == (S(0),)


@pytest.mark.parametrize(
    "sizes, kwargs",
    [
        ([1, 3], {}),  # infers 4, which needs 2, 2
        ([2, 3], {}),  # infers 5, which needs 3, 2
        ([2, 2], {"shape": (5, 2)}),  # 5 needs 3, 2
        ([3, 2], {"shape": (6, 2)}),
    ],
)
def test_from_local_shard_shape_mismatch(sizes, kwargs):
    mesh = Mesh([0, 1])
    shards = {d: torch.zeros(n, 2) for d, n in zip(mesh.devices, sizes)}
    with pytest.raises(ValueError, match="from_local: the shard of device"):
        shoal.from_local(shards, mesh, S(0), **kwargs)


def test_from_local_broadcast_shape_mismatch():
    mesh = Mesh([0, 1])
    with pytest.raises(ValueError, match="needs \\[2, 2\\]"):
        shoal.from_local({0: torch.zeros(2, 2), 1: torch.zeros(2, 3)}, mesh, B)


def test_from_local_dtype_mismatch():
    mesh = Mesh([0, 1])
    with pytest.raises(ValueError, match="float64"):
        shoal.from_local({0: torch.zeros(2), 1: torch.zeros(2, dtype=torch.float64)}, mesh, S(0))


def test_from_local_device_errors():
    mesh = Mesh([0, 1])
    with pytest.raises(ValueError, match="no shard given for local device"):
        shoal.from_local({0: torch.zeros(2)}, mesh, S(0))
    with pytest.raises(ValueError, match="device 2 is not in"):
        shoal.from_local({0: torch.zeros(2), 1: torch.zeros(2), 2: torch.zeros(2)}, mesh, S(0))
    with pytest.raises(ValueError, match="not in the world"):
        shoal.from_local({0: torch.zeros(2), 1: torch.zeros(2), 9: torch.zeros(2)}, mesh, S(0))
    with pytest.raises(TypeError, match="shoal.Mesh"):
        shoal.from_local({0: torch.zeros(2)}, [0, 1], S(0))
    with pytest.raises(ValueError, match="one SBP per mesh axis"):
        shoal.from_local({0: torch.zeros(2), 1: torch.zeros(2)}, mesh, [S(0), B])


def test_to_local():
    mesh = Mesh([[0, 1], [2, 3]])
    t = torch.arange(20.0).reshape(5, 4)
    x = shoal.to_global(t, mesh, [S(0), S(1)])
    local = x.to_local()
    assert set(local) == {0, 1, 2, 3}
    for p, d in enumerate(mesh.devices):
        assert local[d] is x._shards[p]
        assert x.to_local(d) is x._shards[p]
    torch.testing.assert_close(x.to_local(3), t[3:, 2:])
    with pytest.raises(ValueError, match="device 5 is not in"):
        x.to_local(5)


def test_to_local_is_a_dict_and_local_shard_the_one_shard():
    """to_local() is {device: shard} however many devices the process owns (torchrun --nproc-per-node N
    gives each one); local_shard() is the one shard of a process with one device of the mesh."""
    mesh = Mesh([2])
    t = torch.arange(6.0).reshape(2, 3)
    x = shoal.to_global(t, mesh, S(0))
    assert list(x.to_local()) == [2]
    local = x.local_shard()
    assert local is x.to_local()[2] and not isinstance(local, shoal.GlobalTensor)
    torch.testing.assert_close(local, t)
    with pytest.raises(ValueError, match=r"local_shard: process 0 owns 2 devices .* use to_local\(\)"):
        shoal.to_global(t, Mesh([0, 1]), S(0)).local_shard()
    y = shoal.from_local({2: local}, mesh, S(1))
    assert y.shape == (2, 3)
    torch.testing.assert_close(y.full(), t)


def test_to_global_copies_its_input():
    t = torch.arange(8.0)
    x = shoal.to_global(t, Mesh([0, 1]), B)
    assert all(s.data_ptr() != t.data_ptr() for s in x._shards)
    t.add_(1)
    torch.testing.assert_close(x.full(), torch.arange(8.0))


def test_global_tensor_metadata():
    mesh = Mesh([[0, 1], [2, 3]], axes=("dp", "tp"))
    x = shoal.to_global(torch.zeros(5, 3, dtype=torch.float64), mesh, [S(0), B])
    assert isinstance(x, shoal.GlobalTensor) and isinstance(x, torch.Tensor)
    assert x.shape == (5, 3) and x.dtype == torch.float64
    assert x.mesh == mesh and x.sbp == (S(0), B)
    assert "sbp=[S(0), B]" in repr(x)
    assert shoal.to_global(torch.zeros(2), Mesh([0, 1]), B, requires_grad=True).requires_grad


def test_devices_sharing_gpus_map_round_robin():
    """shoal.init(share_gpus=True): several virtual devices per GPU (no GPU needed to check the map)."""
    from shoal.world import World

    w = World(processes=1, devices_per_process=4, rank=0, device_type="cuda", gpus=2)
    assert [w.torch_device(d) for d in range(4)] == [torch.device("cuda", i) for i in (0, 1, 0, 1)]
    one_each = World(processes=2, devices_per_process=2, rank=1, device_type="cuda", local_rank=1)
    assert [one_each.torch_device(d) for d in (2, 3)] == [torch.device("cuda", 2), torch.device("cuda", 3)]


def test_a_meta_world_lays_out_more_than_this_machine_holds():
    """shoal.init(device_type="meta"): shards are meta tensors (no memory), host work stays on the
    CPU; a 16384-wide layer (1 GiB of weights) on 64 devices computes shapes and layouts as a real
    world would."""
    shoal.init(devices=64, device_type="meta")  # conftest puts the 4-device world back after the test
    mesh = Mesh(torch.arange(64).reshape(8, 8).tolist(), axes=("dp", "tp"))
    lin = shoal.distribute_module(torch.nn.Linear(1 << 14, 1 << 14, device="meta"), mesh,
                                  {"weight": (B, S(0)), "bias": (B, S(0))})  # 1 GiB of weights, never allocated
    x = shoal.to_global(torch.ones(64, 1 << 14), mesh, (S(0), B))
    assert x.device.type == "cpu" and all(s.device.type == "meta" for s in x.to_local().values())
    y = lin(x)
    assert y.shape == (64, 1 << 14) and y.sbp == (S(0), S(1))
    assert all(s.device.type == "meta" and s.shape == (8, 2048) for s in y.to_local().values())
    with pytest.raises(ValueError, match="'cpu', 'cuda' or 'meta'"):
        shoal.init(devices=2, device_type="tpu")


def test_decisions_made_in_a_meta_world_do_not_outlive_it():
    """dispatch caches each op's decision bound to the mesh devices this process owns; a meta world
    of absent processes (``meta_world(8, per_process=2)``) owns 2 of a 2 x 2 mesh's devices where the
    4-device world after it owns all 4, so the same op on the same layouts decides again there."""
    from shoal.world import meta_world

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(6, 5, generator=g), torch.randn(5, 7, generator=g)

    def matmul():
        mesh = Mesh([[0, 1], [2, 3]], axes=("dp", "tp"))
        return shoal.to_global(a, mesh, (S(0), B)) @ shoal.to_global(b, mesh, (B, S(1)))

    with meta_world(8, per_process=2):
        y = matmul()
        assert sorted(y.to_local()) == [0, 1] and all(s.device.type == "meta" for s in y.to_local().values())
    y = matmul()
    assert sorted(y.to_local()) == [0, 1, 2, 3]
    torch.testing.assert_close(y.full(), a @ b)
