"""The boxing planner (``shoal.boxing.planner``), apart from the code that runs its plans.

Values: for every (src, dst) pair of nd-SBPs over B, P, P(max), S(0), S(1) on 1-D and 2-D meshes
(size-1 axes included) and shapes that do not divide evenly, the plan's steps, each run on plain
torch tensors by its definition (``run_step``: no ``shoal.comm``, no ``shoal.boxing``), turn
genuinely partial source shards into shards of dst's local shapes that make up the same global
value. Costs: known plans are the collectives they should be and cost what the alpha-beta model
says; a plan is never dearer than going through any other layout (it is a shortest path).
"""

import itertools

import pytest
import torch

import shoal
from shoal import B, P, Partial, S
from shoal.boxing.planner import LAUNCH_BYTES, RELABEL_COST, SLICE_COST, Step, plan, plan_cost
from shoal.sbp import normalize_sbp
from shoal.spec import TensorSpec
from shoal.testing import make_global, value_of_shards

PMAX = Partial("max")
ONE_AXIS = [B, P, PMAX, S(0), S(1)]
REDUCE = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}
MESHES = {(2,): [0, 1], (3,): [0, 1, 2], (4,): [0, 1, 2, 3], (2, 2): [[0, 1], [2, 3]],
          (1, 3): [[0, 1, 2]], (3, 1): [[0], [1], [2]]}


def reduce(xs, op):
    acc = xs[0]
    for x in xs[1:]:
        acc = REDUCE[op](acc, x)
    return acc


def run_step(shards: list, mesh: shoal.Mesh, st: Step) -> list:
    """One 1-D step by its definition, on every group along ``st.axis``."""
    out = list(shards)
    for group in mesh.groups(st.axis):
        xs, n, kind = [shards[p] for p in group], len(group), st.kind
        if kind == "all_gather":
            ys = [torch.cat(xs, st.src.dim)] * n
        elif kind == "all_reduce":
            ys = [reduce(xs, st.src.op)] * n
        elif kind == "reduce_scatter":
            ys = torch.tensor_split(reduce(xs, st.src.op), n, st.dst.dim)
        elif kind == "all_to_all":
            ys = torch.tensor_split(torch.cat(xs, st.src.dim), n, st.dst.dim)
        elif kind == "slice":
            ys = [torch.tensor_split(x, n, st.dst.dim)[i] for i, x in enumerate(xs)]
        elif kind == "keep_one":
            ys = [x if i == 0 or st.dst.op != "sum" else torch.zeros_like(x) for i, x in enumerate(xs)]
        else:
            assert kind == "relabel" and n == 1, st  # only a size-1 axis changes names for free
            ys = xs
        for p, y in zip(group, ys):
            out[p] = y
    return out


@pytest.mark.parametrize("shape", [(5, 3), (2, 7), (1, 1)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mesh_shape", list(MESHES), ids=lambda s: "m" + "x".join(map(str, s)))
def test_every_plan_keeps_the_value(mesh_shape, shape):
    mesh = shoal.Mesh(MESHES[mesh_shape])
    layouts = list(itertools.product(ONE_AXIS, repeat=mesh.ndim))
    v = torch.randint(-50, 51, shape, generator=torch.Generator().manual_seed(len(shape)))  # int64: exact sums
    for k, src in enumerate(layouts):
        x = make_global(v, mesh, src, seed=k)
        assert torch.equal(value_of_shards(list(x._shards), mesh, src), v)
        for dst in layouts:
            steps = plan(mesh.shape, shape, 8, src, dst)
            shards = list(x._shards)
            state = src
            for st in steps:
                assert st.src == state[st.axis], (src, dst, steps)
                shards = run_step(shards, mesh, st)
                state = state[:st.axis] + (st.dst,) + state[st.axis + 1:]
            assert state == dst, (src, dst, steps)
            spec = TensorSpec(shape, v.dtype, mesh, dst)
            for p, s in enumerate(shards):
                assert tuple(s.shape) == spec.local_shape(p), (src, dst, p, steps)
            got = value_of_shards(shards, mesh, dst)
            assert torch.equal(got, v), f"{src} -> {dst} by {steps}"


F = 8 * 6 * 4  # bytes of a float32 [8, 6]


def ag(level, n):  # all_gather / reduce_scatter
    return LAUNCH_BYTES + level * (n - 1) / n


@pytest.mark.parametrize("src, dst, steps, cost", [
    (S(0), B, [(0, "all_gather")], ag(F, 4)),
    (S(1), B, [(0, "all_gather")], ag(F, 4)),
    (P, S(0), [(0, "reduce_scatter")], ag(F, 4)),
    (PMAX, S(1), [(0, "reduce_scatter")], ag(F, 4)),
    (P, B, [(0, "all_reduce")], LAUNCH_BYTES + 2 * F * 3 / 4),  # not reduce_scatter + all_gather: one launch less
    (S(0), S(1), [(0, "all_to_all")], LAUNCH_BYTES + F * 3 / 16),
    (B, S(0), [(0, "slice")], SLICE_COST),
    (B, P, [(0, "keep_one")], SLICE_COST),
    (S(0), P, [(0, "all_gather"), (0, "keep_one")], ag(F, 4) + SLICE_COST),  # no split becomes partial directly
    (P, PMAX, [(0, "all_reduce"), (0, "keep_one")], LAUNCH_BYTES + 2 * F * 3 / 4 + SLICE_COST),
    (S(0), S(0), [], 0.0),
])
def test_known_plans_on_a_1d_mesh(src, dst, steps, cost):
    src, dst = (src,), (dst,)
    got = plan((4,), (8, 6), 4, src, dst)
    assert [(st.axis, st.kind) for st in got] == steps
    assert plan_cost((4,), (8, 6), 4, src, dst) == pytest.approx(cost)


@pytest.mark.parametrize("src, dst, steps, cost", [
    # the inner split first (an outer gather would interleave rows), each on what the other axis leaves
    ([S(0), S(0)], [B, B], [(1, "all_gather"), (0, "all_gather")], ag(F / 2, 2) + ag(F, 2)),
    ([P, P], [B, B], [(0, "all_reduce"), (1, "all_reduce")], 2 * (LAUNCH_BYTES + 2 * F / 2)),
    # slicing first would leave an inner split of the dim the other axis gathers: gather, then slice
    ([S(0), B], [B, S(0)], [(0, "all_gather"), (1, "slice")], ag(F, 2) + SLICE_COST),
    ([B, S(1)], [S(1), B], [(1, "all_gather"), (0, "slice")], ag(F, 2) + SLICE_COST),
    ([P, S(1)], [S(0), S(1)], [(0, "reduce_scatter")], ag(F / 2, 2)),
])
def test_known_plans_on_a_2d_mesh(src, dst, steps, cost):
    src, dst = tuple(src), tuple(dst)
    got = plan((2, 2), (8, 6), 4, src, dst)
    assert [(st.axis, st.kind) for st in got] == steps
    assert plan_cost((2, 2), (8, 6), 4, src, dst) == pytest.approx(cost)


def test_size_one_axes_cost_a_relabel():
    """A size-1 axis holds the whole group's value under any name: renaming it is (nearly) free."""
    src, dst = (S(0), S(0)), (B, B)
    got = plan((1, 4), (8, 6), 4, src, dst)
    assert sorted((st.axis, st.src, st.dst) for st in got) == [(0, S(0), B), (1, S(0), B)]
    assert plan_cost((1, 4), (8, 6), 4, src, dst) == pytest.approx(RELABEL_COST + ag(F, 4))


def test_cost_follows_the_element_size():
    for itemsize in (2, 4, 8):
        got = plan_cost((4,), (8, 6), itemsize, (S(0),), (B,))
        assert got == pytest.approx(ag(48 * itemsize, 4))


@pytest.mark.parametrize("mesh_shape", [(3,), (2, 2)], ids=["m3", "m2x2"])
def test_plans_are_shortest_paths(mesh_shape):
    """Going straight is never dearer than going through any third layout, and only staying put is free."""
    layouts = [normalize_sbp(s, len(mesh_shape), 2) for s in itertools.product(ONE_AXIS, repeat=len(mesh_shape))]
    cost = {(a, b): plan_cost(mesh_shape, (5, 7), 4, a, b) for a in layouts for b in layouts}
    for (a, b), c in cost.items():
        assert (c == 0) == (a == b), (a, b, c)
        for m in layouts:
            assert c <= cost[a, m] + cost[m, b] + 1e-9, (a, m, b)
