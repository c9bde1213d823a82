"""Boxing: converting global tensors between (mesh, nd-SBP) pairs.

Sources are built shard by shard (``_shards_of``) so that Partial layouts are genuinely partial:
P(sum) pieces carry zero-sum noise, P(max)/P(min) pieces are off the value in random places. The
oracle ``_value_of`` rebuilds the global value from shards by the SBP definitions alone (and checks
that Broadcast copies agree), independently of the planner that ``full()`` uses.

World: 4 virtual CPU devices. Meshes are built inside the tests; parametrize with device lists.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shoal
from shoal import B, Mesh, P, Partial, S
from shoal.boxing import plan
from shoal.sbp import Broadcast, Split, normalize_sbp
from shoal.testing import value_of_shards

PMAX, PMIN = Partial("max"), Partial("min")
COLLECTIVES = {"all_gather", "all_reduce", "reduce_scatter", "all_to_all"}
M1, M2, M3, M22 = [0], [0, 1], [0, 1, 2], [[0, 1], [2, 3]]
M4 = [0, 1, 2, 3]


def _ids(val):
    """Readable parametrize ids: device lists as m01 / m01-23, SBPs as written."""
    if isinstance(val, list) and val and all(isinstance(d, int) for d in val):
        return "m" + "".join(map(str, val))
    if isinstance(val, list) and val and all(isinstance(r, list) for r in val):
        return "m" + "-".join("".join(map(str, r)) for r in val)
    if isinstance(val, (Split, Broadcast, Partial)):
        return repr(val)
    if isinstance(val, list) and all(isinstance(x, (Split, Broadcast, Partial)) for x in val):
        return "[" + ",".join(map(repr, val)) + "]"
    if isinstance(val, tuple) and all(isinstance(n, int) for n in val):
        return "x".join(map(str, val)) or "scalar"
    if isinstance(val, dict):
        return "+".join(f"{k}{n}" for k, n in val.items()) or "none"
    return None


@pytest.fixture(autouse=True)
def _world():
    shoal.init(devices=4)


# ---------------------------------------------------------------------------------------------
# helpers: genuinely partial sources and an independent oracle


def _chunk(t: torch.Tensor, dim: int, n: int, i: int) -> torch.Tensor:
    q, r = divmod(t.shape[dim], n)
    return t.narrow(dim, i * q + min(i, r), q + (1 if i < r else 0))


def _pieces(v: torch.Tensor, sbp, n: int, g: torch.Generator) -> list[torch.Tensor]:
    """``n`` tensors that are ``v`` laid out by ``sbp`` along one mesh axis."""
    if isinstance(sbp, Split):
        return [_chunk(v, sbp.dim, n, i).clone() for i in range(n)]
    if isinstance(sbp, Broadcast) or n == 1:
        return [v.clone() for _ in range(n)]
    if sbp.op == "sum":
        noise = torch.randint(-5, 6, (n - 1, *v.shape), generator=g).to(v.dtype)
        return [v - noise.sum(0), *noise]
    # max/min: each element's true value sits on a random piece, the others are off by 1..5
    owner = torch.randint(0, n, v.shape, generator=g)
    out = []
    for i in range(n):
        gap = torch.randint(1, 6, v.shape, generator=g).to(v.dtype)
        out.append(torch.where(owner == i, v, v - gap if sbp.op == "max" else v + gap))
    return out


def _shards_of(v: torch.Tensor, mesh: Mesh, sbp, g: torch.Generator) -> list[torch.Tensor]:
    """One shard per mesh position holding ``v`` laid out as ``sbp`` (axes outer to inner)."""
    sbp = normalize_sbp(sbp, mesh.ndim, v.ndim)
    at: dict = {}

    def rec(t, axis, coord):
        if axis == mesh.ndim:
            at[coord] = t
            return
        for i, piece in enumerate(_pieces(t, sbp[axis], mesh.shape[axis], g)):
            rec(piece, axis + 1, (*coord, i))

    rec(v, 0, ())
    return [at[c] for c in mesh.coords]


def _global(v: torch.Tensor, mesh: Mesh, sbp, seed: int = 0) -> shoal.GlobalTensor:
    g = torch.Generator().manual_seed(seed)
    shards = _shards_of(v, mesh, sbp, g)
    return shoal.from_local(dict(zip(mesh.devices, shards)), mesh, sbp, shape=tuple(v.shape))


def _value(shape, seed: int = 0, dtype=torch.float64) -> torch.Tensor:
    """Integer-valued, so sums of noisy pieces are exact."""
    g = torch.Generator().manual_seed(seed + 1000)
    return torch.randint(-50, 51, shape, generator=g).to(dtype)


def _check_layout(y: shoal.GlobalTensor, v: torch.Tensor) -> None:
    spec = y.spec
    assert len(y._shards) == y.mesh.size
    for p, s in enumerate(y._shards):
        assert not isinstance(s, shoal.GlobalTensor)
        assert tuple(s.shape) == spec.local_shape(p), f"position {p}: {tuple(s.shape)} vs {spec.local_shape(p)}"
        assert s.dtype == spec.dtype
    torch.testing.assert_close(value_of_shards(y._shards, y.mesh, y.sbp), v, rtol=0, atol=0)
    torch.testing.assert_close(y.full(), v, rtol=0, atol=0)


def test_helpers_make_genuinely_partial_shards():
    """The test's own helper: partial pieces differ from the value but reduce to it."""
    mesh = Mesh(M22)
    v = _value((4, 5))
    for sbp in ([P, B], [B, PMAX], [PMIN, S(1)], [P, PMAX]):
        shards = _shards_of(v, mesh, sbp, torch.Generator().manual_seed(0))
        torch.testing.assert_close(value_of_shards(shards, mesh, normalize_sbp(sbp, 2, 2)), v, rtol=0, atol=0)
        assert sum(not torch.equal(s, v) for s in shards) >= 2
    with pytest.raises(AssertionError):
        value_of_shards([v, v + 1, v, v], mesh, (B, B))


# ---------------------------------------------------------------------------------------------
# (a) property: any layout to any layout on the same mesh keeps the value


_SBP_KINDS = st.sampled_from(["B", "P", "Pmax", "Pmin", "S"])


@st.composite
def _layouts(draw, mesh_ndim: int, rank: int):
    out = []
    for _ in range(mesh_ndim):
        kind = draw(_SBP_KINDS)
        if kind == "S":
            out.append(S(draw(st.integers(-rank, rank - 1))))
        else:
            out.append({"B": B, "P": P, "Pmax": PMAX, "Pmin": PMIN}[kind])
    return out


@st.composite
def _same_mesh_cases(draw):
    devices = draw(st.sampled_from([M1, M2, M3, M22]))
    mesh_ndim = 2 if isinstance(devices[0], list) else 1
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=rank, max_size=rank)))
    src = draw(_layouts(mesh_ndim, rank))
    dst = draw(_layouts(mesh_ndim, rank))
    seed = draw(st.integers(0, 2**16))
    return devices, shape, src, dst, seed


# Mixed Partial kinds across axes, e.g. (P, P(max)), are generated too: the value is
# op_outer over the outer axis of op_inner over the inner one, which the planner must respect.
@given(_same_mesh_cases())
@settings(max_examples=1500, deadline=None, derandomize=True, database=None)
def test_boxing_keeps_value_property(case):
    devices, shape, src, dst, seed = case
    mesh = Mesh(devices)
    v = _value(shape, seed)
    x = _global(v, mesh, src, seed)
    before = [s.clone() for s in x._shards]
    with shoal.CommCounter() as cc:
        y = x.to_global(mesh, dst)
    assert y.mesh == mesh
    assert y.sbp == normalize_sbp(dst, mesh.ndim, len(shape))
    _check_layout(y, v)
    assert set(cc.counts) <= COLLECTIVES, cc
    if y.sbp == x.sbp:
        assert y is x and cc.total == 0
    if all(isinstance(s, Broadcast) for s in x.sbp):
        assert cc.total == 0, f"from Broadcast every layout is local, got {cc}"
    for a, b in zip(before, x._shards):  # boxing never writes into its input
        torch.testing.assert_close(b, a, rtol=0, atol=0)


_ALL_1D = [B, P, PMAX, PMIN, S(0), S(1)]


@pytest.mark.parametrize(
    "devices, shape",
    [
        (M2, (3, 5)),
        (M3, (4, 7)),
        (M3, (2, 1)),
        (M4, (5, 6)),
        (M4, (7, 3)),
        (M22, (3, 5)),
        (M22, (7, 2)),
        (M3, ()),
        (M22, ()),
    ],
    ids=_ids,
)
def test_boxing_every_pair_of_layouts(devices, shape):
    """Every (src, dst) pair of nd-SBPs over B, P, P(max), P(min), S(0), S(1) on one mesh and shape,
    with uneven and empty chunks (and scalars, which have no split): the property test's sweep,
    made exhaustive for a few shapes."""
    mesh = Mesh(devices)
    opts = [s for s in _ALL_1D if not isinstance(s, Split) or s.dim < len(shape)]
    layouts = [[a] for a in opts] if mesh.ndim == 1 else [[a, b] for a in opts for b in opts]
    for k, src in enumerate(layouts):
        v = _value(shape, seed=k, dtype=torch.float64)
        for dst in layouts:
            x = _global(v, mesh, src, seed=k)
            y = x.to_global(mesh, dst)
            assert y.sbp == tuple(dst)
            _check_layout(y, v)


_CROSS_MESHES = [[0], [3], [0, 1], [2, 3], [1, 0], [0, 1, 2], [1, 2, 3], [[0, 1], [2, 3]], [[3, 2], [1, 0]], M4]


@st.composite
def _cross_mesh_cases(draw):
    src_devices = draw(st.sampled_from(_CROSS_MESHES))
    dst_devices = draw(st.sampled_from(_CROSS_MESHES))
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=rank, max_size=rank)))
    src = draw(_layouts(2 if isinstance(src_devices[0], list) else 1, rank))
    dst = draw(_layouts(2 if isinstance(dst_devices[0], list) else 1, rank))
    seed = draw(st.integers(0, 2**16))
    return src_devices, dst_devices, shape, src, dst, seed


@given(_cross_mesh_cases())
@settings(max_examples=600, deadline=None, derandomize=True, database=None)
def test_cross_mesh_boxing_keeps_value_property(case):
    src_devices, dst_devices, shape, src, dst, seed = case
    src_mesh, dst_mesh = Mesh(src_devices), Mesh(dst_devices)
    v = _value(shape, seed)
    x = _global(v, src_mesh, src, seed)
    y = x.to_global(dst_mesh, dst)
    assert y.mesh == dst_mesh
    _check_layout(y, v)


# ---------------------------------------------------------------------------------------------
# (b) every 1-D primitive: exact collective kinds, counts and bytes

_PRIMITIVES = [
    (S(0), B, "all_gather"),
    (S(1), B, "all_gather"),
    (P, B, "all_reduce"),
    (PMAX, B, "all_reduce"),
    (PMIN, B, "all_reduce"),
    (P, S(0), "reduce_scatter"),
    (PMAX, S(1), "reduce_scatter"),
    (PMIN, S(0), "reduce_scatter"),
    (S(0), S(1), "all_to_all"),
    (S(1), S(0), "all_to_all"),
    (B, S(0), None),
    (B, S(1), None),
    (B, P, None),
    (B, PMAX, None),
    (B, PMIN, None),
]
_SHAPE = (7, 6, 4)  # dim 0 uneven over 4 and over 2; dim 2 is the "other axis" split below
_FULL_BYTES = 7 * 6 * 4 * 4  # float32


@pytest.mark.parametrize("src, dst, kind", _PRIMITIVES, ids=_ids)
def test_primitive_on_1d_mesh(src, dst, kind):
    mesh = Mesh(M4)
    v = _value(_SHAPE, dtype=torch.float32)
    x = _global(v, mesh, [src])
    with shoal.CommCounter() as cc:
        y = x.to_global(mesh, [dst])
    _check_layout(y, v)
    if kind is None:
        assert cc.total == 0, cc
        assert dict(cc.bytes) == {}
    else:
        assert dict(cc.counts) == {kind: 1}
        assert dict(cc.bytes) == {kind: _FULL_BYTES}


@pytest.mark.parametrize("axis", [0, 1], ids=["axis0", "axis1"])
@pytest.mark.parametrize("other", [B, S(2)], ids=["other-B", "other-S2"])
@pytest.mark.parametrize("src, dst, kind", _PRIMITIVES, ids=_ids)
def test_primitive_on_2d_mesh(src, dst, kind, axis, other):
    """A 1-D step along one axis of a (2, 2) mesh: one collective per group, two groups."""
    mesh = Mesh(M22, axes=("dp", "tp"))
    v = _value(_SHAPE, dtype=torch.float32)
    src_nd = [src, other] if axis == 0 else [other, src]
    dst_nd = [dst, other] if axis == 0 else [other, dst]
    x = _global(v, mesh, src_nd)
    with shoal.CommCounter() as cc:
        y = x.to_global(mesh, dst_nd)
    _check_layout(y, v)
    steps = plan(mesh.shape, _SHAPE, 4, x.sbp, y.sbp)
    if kind is None:
        assert cc.total == 0, cc
    else:
        level = _FULL_BYTES // 2 if other == S(2) else _FULL_BYTES  # the other axis cut dim 2 in half
        assert dict(cc.counts) == {kind: 2}
        assert dict(cc.bytes) == {kind: 2 * level}
        assert [(st.axis, st.kind) for st in steps] == [(axis, kind)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64, torch.int64, torch.bool])
def test_all_gather_bytes_follow_dtype(dtype):
    mesh = Mesh(M4)
    v = _value((5, 3), dtype=dtype)
    x = _global(v, mesh, S(0))
    with shoal.CommCounter() as cc:
        y = x.to_global(mesh, B)
    assert y.dtype == dtype
    _check_layout(y, v)
    assert dict(cc.counts) == {"all_gather": 1}
    assert dict(cc.bytes) == {"all_gather": 15 * v.element_size()}


@pytest.mark.parametrize("devices", [M2, M3], ids=_ids)
@pytest.mark.parametrize("src, dst, kind", _PRIMITIVES, ids=_ids)
def test_primitive_uneven_and_empty_chunks(devices, src, dst, kind):
    """Shapes smaller than the mesh: some chunks are empty."""
    mesh = Mesh(devices)
    v = _value((1, 2, 1))
    x = _global(v, mesh, [src])
    with shoal.CommCounter() as cc:
        y = x.to_global(mesh, [dst])
    _check_layout(y, v)
    assert dict(cc.counts) == ({} if kind is None else {kind: 1})


def test_one_device_mesh_needs_no_collective():
    mesh = Mesh(M1)
    v = _value((3, 2))
    for src, dst in [(S(0), B), (P, B), (P, S(1)), (S(0), S(1)), (PMAX, S(0))]:
        x = _global(v, mesh, src)
        with shoal.CommCounter() as cc:
            y = x.to_global(mesh, dst)
        _check_layout(y, v)
        assert cc.total == 0, (src, dst, cc)


def test_comm_counter_nesting():
    mesh = Mesh(M4)
    x = _global(_value((8,), dtype=torch.float32), mesh, S(0))
    with shoal.CommCounter() as outer:
        x.to_global(mesh, B)
        with shoal.CommCounter() as inner:
            x.to_global(mesh, B)
    x.to_global(mesh, B)  # counted by nobody
    assert dict(inner.counts) == {"all_gather": 1} and dict(inner.bytes) == {"all_gather": 32}
    assert dict(outer.counts) == {"all_gather": 2} and outer.total == 2


# ---------------------------------------------------------------------------------------------
# (c) nd conversions that need an order


@pytest.mark.parametrize(
    "devices, shape, src, dst, counts, nbytes, first_axis",
    [
        # the inner split must be gathered before the outer one
        (M22, (11, 3), [S(0), S(0)], [B, B], {"all_gather": 4}, {"all_gather": 132 + 264}, 1),
        (M22, (11, 6), [S(0), S(0)], [S(1), S(1)], {"all_gather": 2, "all_to_all": 2}, None, 1),
        (M22, (11, 6), [S(0), S(0)], [S(0), S(1)], {"all_to_all": 2}, {"all_to_all": 132 * 2}, 1),
        (M22, (5, 7), [B, S(0)], [S(0), B], {"all_gather": 2}, {"all_gather": 2 * 140}, 1),
        (M22, (5, 7), [S(0), B], [B, S(0)], {"all_gather": 2}, {"all_gather": 2 * 140}, 0),
        (M22, (5, 7), [S(0), S(1)], [B, B], {"all_gather": 4}, {"all_gather": 140 + 2 * 140}, 0),
        (M22, (11, 3), [P, P], [B, B], {"all_reduce": 4}, {"all_reduce": 4 * 132}, None),
        (M22, (11, 3), [P, P], [S(0), S(0)], {"reduce_scatter": 4}, None, None),
        (M22, (6, 5), [P, S(0)], [S(0), S(0)], {"all_gather": 2, "reduce_scatter": 2}, None, 1),
        # mixed Partial kinds: the inner reduction must run first
        (M22, (5, 3), [PMAX, P], [B, B], {"all_reduce": 4}, None, 1),
        (M22, (5, 3), [P, PMIN], [B, B], {"all_reduce": 4}, None, 1),
        (M22, (5, 3), [PMAX, P], [S(0), B], {"all_reduce": 2, "reduce_scatter": 2}, None, 1),
        # from Broadcast everything is local
        (M22, (5, 3), [B, B], [S(0), S(0)], {}, None, None),
        (M22, (5, 3), [B, B], [P, PMAX], {}, None, None),
        (M22, (5, 3), [B, B], [S(1), P], {}, None, None),
        # size-1 mesh axes
        ([[0, 1, 2, 3]], (5, 3), [S(0), S(0)], [B, B], {"all_gather": 1}, {"all_gather": 60}, None),
        ([[0], [1], [2], [3]], (5, 3), [S(0), S(0)], [B, B], {"all_gather": 1}, {"all_gather": 60}, None),
        ([[0], [1], [2], [3]], (5, 3), [P, S(1)], [S(1), P], {"reduce_scatter": 1}, None, None),
    ],
    ids=_ids,
)
def test_nd_conversion(devices, shape, src, dst, counts, nbytes, first_axis):
    mesh = Mesh(devices)
    v = _value(shape, dtype=torch.float32)
    x = _global(v, mesh, src)
    with shoal.CommCounter() as cc:
        y = x.to_global(mesh, dst)
    _check_layout(y, v)
    assert dict(cc.counts) == counts
    if nbytes is not None:
        assert dict(cc.bytes) == nbytes
    if first_axis is not None:
        steps = [s for s in plan(mesh.shape, shape, 4, x.sbp, y.sbp) if s.kind != "relabel"]
        assert steps[0].axis == first_axis, steps


def test_nd_swap_of_splits():
    """[S(0), S(1)] -> [S(1), S(0)]: a reordering that no single all_to_all can do."""
    mesh = Mesh(M22)
    v = _value((6, 10), dtype=torch.float32)
    x = _global(v, mesh, [S(0), S(1)])
    with shoal.CommCounter() as cc:
        y = x.to_global(mesh, [S(1), S(0)])
    _check_layout(y, v)
    assert set(cc.counts) <= {"all_gather", "all_to_all"}, cc
    assert 2 <= cc.total <= 4, cc
    # never more traffic than gathering everything everywhere and slicing
    assert sum(cc.bytes.values()) <= 2 * 6 * 5 * 4 + 2 * 6 * 10 * 4


def test_nd_round_trip_keeps_value():
    mesh = Mesh(M22)
    v = _value((7, 5, 3))
    x = _global(v, mesh, [P, S(2)], seed=3)
    for sbp in ([S(0), S(0)], [S(1), S(0)], [PMAX, B], [B, S(2)], [S(2), P], [S(0), S(1)], [P, S(2)]):
        x = x.to_global(mesh, sbp)
        _check_layout(x, v)


# ---------------------------------------------------------------------------------------------
# (d) across meshes

_XSHAPE = (6, 5)
_XBYTES = 6 * 5 * 4


@pytest.mark.parametrize(
    "src_devices, src, dst_devices, dst, counts, nbytes",
    [
        # same mesh shape, other devices: shards move position by position
        ([0, 1], S(0), [2, 3], S(0), {"send_recv": 2}, {"send_recv": _XBYTES}),
        ([0, 1], S(1), [2, 3], S(1), {"send_recv": 2}, {"send_recv": _XBYTES}),
        # replicated: scattered to cross (each device sends half), all-gathered on arrival
        ([0, 1], B, [2, 3], B, {"send_recv": 2, "all_gather": 1}, {"send_recv": _XBYTES, "all_gather": _XBYTES}),
        ([0, 1], P, [2, 3], P, {"send_recv": 2}, {"send_recv": 2 * _XBYTES}),
        ([0, 1], PMAX, [2, 3], PMAX, {"send_recv": 2}, {"send_recv": 2 * _XBYTES}),
        (
            [0, 1],
            P,
            [2, 3],
            S(0),
            {"reduce_scatter": 1, "send_recv": 2},
            {"reduce_scatter": _XBYTES, "send_recv": _XBYTES},
        ),
        ([0, 1], PMIN, [2, 3], B, {"reduce_scatter": 1, "send_recv": 2, "all_gather": 1}, None),
        ([0, 1], B, [1, 2], B, {"send_recv": 2}, {"send_recv": 2 * _XBYTES}),  # meshes that overlap: sent whole
        ([0, 1], S(0), [2, 3], P, {"all_gather": 1, "send_recv": 2}, None),
        ([0, 1], S(0), [1, 0], S(0), {"send_recv": 2}, {"send_recv": _XBYTES}),
        ([[0, 1], [2, 3]], [S(0), S(1)], [[3, 2], [1, 0]], [S(0), S(1)], {"send_recv": 4}, {"send_recv": _XBYTES}),
        ([[0, 1], [2, 3]], [P, S(0)], [[3, 2], [1, 0]], [P, S(0)], {"send_recv": 4}, {"send_recv": 2 * _XBYTES}),
        # other mesh shapes: only device 3 is new, it receives its piece once
        ([0, 1, 2], S(0), [[0, 1], [2, 3]], [S(0), S(1)], {"all_gather": 1, "send_recv": 1}, None),
        (
            [0, 1, 2],
            P,
            [[0, 1], [2, 3]],
            [B, S(0)],
            {"all_reduce": 1, "send_recv": 1},
            {"all_reduce": _XBYTES, "send_recv": 60},
        ),
        ([0, 1, 2], PMAX, [[0, 1], [2, 3]], [S(1), B], {"all_reduce": 1, "send_recv": 1}, None),
        ([0, 1, 2], S(1), [[0, 1], [2, 3]], [P, PMAX], {"all_gather": 1, "send_recv": 1}, None),
        ([0, 1, 2], B, [[0, 1], [2, 3]], [PMIN, P], {"send_recv": 1}, {"send_recv": _XBYTES}),
        ([[0, 1], [2, 3]], [S(0), S(1)], [0, 1, 2], S(0), {"all_gather": 4}, None),
        ([[0, 1], [2, 3]], [P, PMAX], [0, 1, 2], P, {"all_reduce": 4}, None),
        ([0, 1, 2, 3], S(0), [[0, 1], [2, 3]], [S(0), S(1)], {"all_gather": 1}, None),
    ],
    ids=_ids,
)
def test_cross_mesh(src_devices, src, dst_devices, dst, counts, nbytes):
    src_mesh, dst_mesh = Mesh(src_devices), Mesh(dst_devices)
    v = _value(_XSHAPE, dtype=torch.float32)
    x = _global(v, src_mesh, src)
    with shoal.CommCounter() as cc:
        y = x.to_global(dst_mesh, dst)
    assert y.mesh == dst_mesh
    _check_layout(y, v)
    assert dict(cc.counts) == counts
    if nbytes is not None:
        assert dict(cc.bytes) == nbytes


def test_to_global_defaults():
    a, b = Mesh([0, 1]), Mesh([2, 3])
    v = _value((4, 3))
    x = _global(v, a, S(0))
    y = x.to_global(b)  # same rank: the sbp stays
    assert y.mesh == b and y.sbp == (S(0),)
    _check_layout(y, v)
    z = x.to_global(sbp=B)  # no mesh: the mesh stays
    assert z.mesh == a and z.sbp == (B,)
    _check_layout(z, v)
    assert x.to_global() is x and x.to_global(a, [S(-2)]) is x
    with pytest.raises(ValueError, match="give sbp"):
        x.to_global(Mesh(M22))


def test_cross_mesh_renamed_axes_moves_nothing():
    a, b = Mesh(M22, axes=("dp", "tp")), Mesh(M22, axes=("x", "y"))
    v = _value((3, 4), dtype=torch.float32)
    x = _global(v, a, [S(0), S(1)])
    with shoal.CommCounter() as cc:
        y = x.to_global(b, [S(0), S(1)])
    assert y.mesh == b and cc.total == 0
    _check_layout(y, v)
    with shoal.CommCounter() as cc:
        y = x.to_global(b, [B, B])
    _check_layout(y, v)
    assert dict(cc.counts) == {"all_gather": 4}


def test_cross_mesh_back_and_forth():
    a, b = Mesh([0, 1, 2]), Mesh([[0, 1], [2, 3]])
    v = _value((5, 4, 3))
    x = _global(v, a, P, seed=5)
    for mesh, sbp in [(b, [S(0), P]), (a, S(2)), (Mesh([3]), PMAX), (b, [B, S(1)]), (a, PMIN), (Mesh([2, 3]), S(0))]:
        x = x.to_global(mesh, sbp)
        _check_layout(x, v)


# ---------------------------------------------------------------------------------------------
# (e) gradient of to_global


@pytest.mark.parametrize(
    "src_devices, src, dst_devices, dst",
    [
        (M4, S(0), M4, B),
        (M4, P, M4, S(0)),
        (M4, S(0), M4, P),
        (M3, PMIN, M3, B),
        (M3, PMAX, M3, S(1)),
        (M22, [S(0), S(1)], M22, [B, S(0)]),
        (M22, [P, S(0)], M22, [S(1), B]),
        (M22, [PMAX, B], M22, [S(0), P]),
        (M22, [P, PMAX], M22, [S(1), S(0)]),
        (M22, [B, B], M22, [P, P]),
        (M2, S(0), [2, 3], P),
        (M3, P, M22, [S(0), B]),
        (M22, [S(1), P], M3, S(0)),
        (M2, [P], M3, PMIN),
    ],
    ids=_ids,
)
def test_to_global_gradient(src_devices, src, dst_devices, dst):
    src_mesh, dst_mesh = Mesh(src_devices), Mesh(dst_devices)
    shape = (5, 3)
    x = _global(_value(shape), src_mesh, src, seed=7)
    x.requires_grad_(True)
    assert x.is_leaf
    w = torch.randn(shape, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    y = x.to_global(dst_mesh, dst)
    assert y.requires_grad
    (y.full() * w).sum().backward()
    g = x.grad
    assert isinstance(g, shoal.GlobalTensor)
    assert g.mesh == src_mesh
    assert g.sbp == tuple(B if isinstance(s, Partial) else s for s in x.sbp)
    _check_layout(g, w)
    torch.testing.assert_close(g.full(), w)


@pytest.mark.parametrize("src, dst", [(P, S(1)), (B, S(0)), (S(0), P)], ids=_ids)
def test_to_global_gradient_on_one_device_mesh(src, dst):
    """Regression (was a bug): on a mesh whose axes all have size 1 the gradient comes back as S(0), not B.

    The gradient leaves _Redistribute.backward as [B]; AccumulateGrad then runs aten.detach on it,
    and dispatch._decide picks the first signature among equal costs: every relabel on a size-1
    axis costs 0 (planner._search, ``n == 1``), and the first signature the pointwise rule offers
    is S(0). Any op on a size-1 axis relabels it this way (``(x + x).sbp`` is S(0) for B or P x).
    """
    shape = (5, 3)
    x = _global(_value(shape), Mesh(M1), src, seed=7)
    x.requires_grad_(True)
    w = torch.randn(shape, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    (x.to_global(Mesh([3]), dst).full() * w).sum().backward()
    _check_layout(x.grad, w)
    assert x.grad.sbp == tuple(B if isinstance(s, Partial) else s for s in x.sbp)


def test_to_global_gradient_accumulates():
    mesh = Mesh(M22)
    x = _global(_value((4, 3)), mesh, [S(0), P])
    x.requires_grad_(True)
    w = torch.arange(12.0, dtype=torch.float64).reshape(4, 3)
    for dst in ([B, S(1)], [P, S(0)]):
        (x.to_global(mesh, dst).full() * w).sum().backward()
    assert x.grad.sbp == (S(0), B)
    torch.testing.assert_close(x.grad.full(), 2 * w)


# ---------------------------------------------------------------------------------------------
# (f) in-place safety: shards that share memory must be written once


@pytest.mark.parametrize(
    "devices, sbp",
    [(M4, B), (M3, B), (M22, [B, B]), (M22, [B, S(0)]), (M22, [S(1), B])],
    ids=_ids,
)
def test_inplace_add_on_broadcast_made_by_to_global(devices, sbp):
    """Replicated regions may be one tensor, or distinct ``narrow`` views of one tensor ([B, S(0)]:
    the B->S slice gives each position its own view): either way the add must land once."""
    mesh = Mesh(devices)
    t = _value((4, 6))
    x = shoal.to_global(t, mesh, sbp)
    x.add_(1)
    _check_layout(x, t + 1)
    torch.testing.assert_close(t, _value((4, 6)))  # the input is not touched


@pytest.mark.parametrize(
    "devices, src, dst",
    [
        (M4, P, B),
        (M4, PMAX, B),
        (M3, P, B),
        (M22, [P, P], [B, B]),
        (M22, [P, B], [B, B]),
        (M22, [B, P], [B, B]),
        (M22, [P, S(0)], [B, S(0)]),
        (M4, S(0), B),
        (M22, [S(0), S(1)], [B, B]),
    ],
    ids=_ids,
)
def test_inplace_add_after_reduction_or_gather(devices, src, dst):
    mesh = Mesh(devices)
    v = _value((5, 4))
    y = _global(v, mesh, src, seed=2).to_global(mesh, dst)
    y.add_(1)
    _check_layout(y, v + 1)
    y.mul_(3)
    _check_layout(y, 3 * (v + 1))


@pytest.mark.parametrize(
    "src_devices, src, dst_devices, dst",
    [
        (M2, B, [2, 3], B),
        (M2, S(0), [2, 3], S(0)),
        (M3, B, M22, [B, B]),
        (M3, S(0), M22, [S(0), B]),
        (M22, [B, B], M3, B),
    ],
    ids=_ids,
)
def test_inplace_add_after_cross_mesh(src_devices, src, dst_devices, dst):
    """Across mesh shapes every dst position gets ``full[sp][region]``, a fresh view of one shared
    replica: the dst shards alias each other without being the same object."""
    v = _value((4, 6))
    y = _global(v, Mesh(src_devices), src).to_global(Mesh(dst_devices), dst)
    y.add_(1)
    _check_layout(y, v + 1)


@pytest.mark.parametrize(
    "src_devices, src, dst_devices, dst",
    [
        (M4, S(0), M4, B),
        (M4, PMAX, M4, B),
        (M22, [S(0), S(1)], M22, [S(1), S(0)]),
        (M4, B, M4, S(0)),
        (M4, B, M4, P),
        (M22, [B, B], M22, [S(0), B]),
        (M2, B, [2, 3], B),
        (M3, B, M22, [B, S(1)]),
    ],
    ids=_ids,
)
def test_to_global_result_does_not_alias_input(src_devices, src, dst_devices, dst):
    """Regression (was a bug) for the conversions that need no collective (B->S slice, B->P keep-one, moves whose send
    is a no-op on CPU): the result's shards are views of the input's (boxing/__init__.py ``slice``
    branch of _run_step, _keep_one keeps ``xs[0]`` itself, comm.transfer returns ``t`` on CPU), so
    mutating the result mutates the input. Whether it does depends only on the layouts, which
    DESIGN.md rules out ("Layout is never visible in results"). ``to_global`` to the same spec
    returns ``self``, as ``Tensor.to`` does; that case is not tested here.
    """
    v = _value((4, 6))
    x = _global(v, Mesh(src_devices), src)
    y = x.to_global(Mesh(dst_devices), dst)
    assert y is not x
    y.mul_(2)
    _check_layout(y, 2 * v)
    _check_layout(x, v)


@pytest.mark.parametrize(
    "devices, src, dst",
    [
        (M4, P, B),
        (M4, P, S(0)),
        (M3, P, S(1)),
        (M22, [P, S(0)], [B, S(0)]),
        (M22, [S(0), P], [S(0), S(1)]),
        (M22, [P, P], [B, B]),
        (M4, PMIN, B),
    ],
    ids=_ids,
)
def test_mutating_a_reduced_result_leaves_the_partial_source_alone(devices, src, dst):
    """Regression (was a bug): GlobalTensor._shards_as memoizes the first conversion out of Partial(sum) in
    ``x._resolved`` and hands the very same shards to the result ``y``. Writing into ``y`` then
    silently changes ``x``'s value as ``full()`` and every later conversion see it, while ``x``'s own
    shards still hold the old value: ``x`` shows two values. Only ``y._resolved`` is reset by the
    write (dispatch._execute), never the memo of the tensor ``y`` was boxed from.
    """
    mesh = Mesh(devices)
    v = _value((4, 6))
    x = _global(v, mesh, src, seed=4)
    y = x.to_global(mesh, dst)
    y.add_(1)
    _check_layout(y, v + 1)
    _check_layout(x, v)
    torch.testing.assert_close(x.to_global(mesh, [S(1)] * mesh.ndim).full(), v, rtol=0, atol=0)


@pytest.mark.parametrize("devices, dst", [(M4, B), (M3, S(0)), (M22, [B, S(1)])], ids=_ids)
def test_two_conversions_of_a_partial_are_independent(devices, dst):
    """Regression (Partial memo): converting one Partial(sum) tensor twice to the same layout returns two
    GlobalTensors over the same memo shards, so writing one changes the other."""
    mesh = Mesh(devices)
    v = _value((4, 6))
    x = _global(v, mesh, [P] * mesh.ndim, seed=8)
    y1 = x.to_global(mesh, dst)
    y2 = x.to_global(mesh, dst)
    y1.add_(1)
    _check_layout(y1, v + 1)
    _check_layout(y2, v)


def test_partial_value_follows_writes_through_an_alias():
    """Regression (Partial memo): once ``x.full()`` has run, a write into ``x``'s shards through an alias
    (``x.detach()`` shares its storage, as in torch) changes what x's ops compute but not what
    ``x.full()`` returns, so the same tensor shows two values."""
    mesh = Mesh(M4)
    v = _value((3, 5))
    x = _global(v, mesh, P, seed=6)
    torch.testing.assert_close(x.full(), v, rtol=0, atol=0)
    x.detach().mul_(2)
    shards_value = value_of_shards(x._shards, mesh, x.sbp)
    torch.testing.assert_close((x * 1).full(), shards_value, rtol=0, atol=0)
    torch.testing.assert_close(x.full(), shards_value, rtol=0, atol=0)
