"""Plan an nd-SBP conversion as a sequence of 1-D steps, cheapest first by a bytes-moved cost model.

A step changes the SBP of one mesh axis. It is a plain collective over that axis's device groups
only when the inner axes commute with it (no inner split of a dim the step touches, no inner
Partial of another reduction), so the planner searches the small state space with Dijkstra.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from functools import lru_cache

from ..sbp import Broadcast, NdSBP, Partial, Split

__all__ = ["Step", "plan", "plan_cost", "step_bytes"]

_B = Broadcast()
# One collective launch costs as much as moving this many bytes (alpha-beta model); a local
# slice costs a little so that doing nothing beats slicing for free.
LAUNCH_BYTES = 4096.0
SLICE_COST = 1.0
RELABEL_COST = 1e-3


@dataclass(frozen=True, slots=True)
class Step:
    axis: int
    src: Split | Broadcast | Partial
    dst: Split | Broadcast | Partial

    @property
    def kind(self) -> str:
        s, d = self.src, self.dst
        if isinstance(s, Split) and isinstance(d, Broadcast):
            return "all_gather"
        if isinstance(s, Partial) and isinstance(d, Broadcast):
            return "all_reduce"
        if isinstance(s, Partial) and isinstance(d, Split):
            return "reduce_scatter"
        if isinstance(s, Split) and isinstance(d, Split):
            return "all_to_all"
        if isinstance(s, Broadcast) and isinstance(d, Split):
            return "slice"
        if isinstance(s, Broadcast) and isinstance(d, Partial):
            return "keep_one"
        return "relabel"


def _allowed(s, d) -> bool:
    if isinstance(s, Split):
        return isinstance(d, (Broadcast, Split))
    if isinstance(s, Partial):
        return isinstance(d, (Broadcast, Split))
    return isinstance(d, (Split, Partial))


def _commutes(state: NdSBP, mesh_shape: tuple[int, ...], axis: int, s, d) -> bool:
    dims = {x.dim for x in (s, d) if isinstance(x, Split)}
    pops = {x.op for x in (s, d) if isinstance(x, Partial)}
    for j in range(axis + 1, len(state)):
        if mesh_shape[j] == 1:
            continue
        inner = state[j]
        if isinstance(inner, Split) and inner.dim in dims:
            return False
        if isinstance(inner, Partial) and pops and inner.op not in pops:
            return False
    return True


def step_bytes(kind: str, nbytes: float, n: int) -> float:
    """Bytes each device moves for one step over a group of ``n`` devices on a tensor of ``nbytes``."""
    if kind == "all_gather" or kind == "reduce_scatter":
        return LAUNCH_BYTES + nbytes * (n - 1) / n
    if kind == "all_reduce":
        return LAUNCH_BYTES + 2 * nbytes * (n - 1) / n
    if kind == "all_to_all":
        return LAUNCH_BYTES + nbytes * (n - 1) / (n * n)
    if kind in ("slice", "keep_one"):
        return SLICE_COST
    return 0.0


def level_bytes(state: NdSBP, mesh_shape, axis: int, shape, itemsize: int) -> float:
    """Bytes of the tensor one group along ``axis`` works on: the global size cut by the other splits."""
    sizes = list(shape)
    for j, s in enumerate(state):
        if j != axis and isinstance(s, Split):
            sizes[s.dim] = sizes[s.dim] / mesh_shape[j]
    return math.prod(sizes) * itemsize


@lru_cache(maxsize=16384)
def _search(mesh_shape: tuple[int, ...], shape: tuple[int, ...], itemsize: int, src: NdSBP, dst: NdSBP):
    if src == dst:
        return 0.0, ()
    ndim = len(shape)
    pops = {x.op for x in src + dst if isinstance(x, Partial)}
    options = [_B, *(Split(i) for i in range(ndim)), *(Partial(o) for o in sorted(pops))]
    best = {src: 0.0}
    heap = [(0.0, 0, src, ())]
    tick = 0
    while heap:
        cost, _, state, path = heapq.heappop(heap)
        if state == dst:
            return cost, path
        if cost > best.get(state, math.inf):
            continue
        for axis, n in enumerate(mesh_shape):
            s = state[axis]
            for d in options:
                if d == s:
                    continue
                if n == 1:  # the same shards under another name: free, but not free-er than nothing
                    step_cost = RELABEL_COST
                elif not _allowed(s, d) or not _commutes(state, mesh_shape, axis, s, d):
                    continue
                else:
                    kind = Step(axis, s, d).kind
                    step_cost = step_bytes(kind, level_bytes(state, mesh_shape, axis, shape, itemsize), n)
                nxt = state[:axis] + (d,) + state[axis + 1 :]
                c = cost + step_cost
                if c < best.get(nxt, math.inf):
                    best[nxt] = c
                    tick += 1
                    heapq.heappush(heap, (c, tick, nxt, path + (Step(axis, s, d),)))
    raise AssertionError(f"no boxing path from {src} to {dst}")  # unreachable: B is always reachable


def plan(
    mesh_shape: tuple[int, ...], shape: tuple[int, ...], itemsize: int, src: NdSBP, dst: NdSBP
) -> tuple[Step, ...]:
    return _search(mesh_shape, shape, itemsize, src, dst)[1]


def plan_cost(mesh_shape: tuple[int, ...], shape: tuple[int, ...], itemsize: int, src: NdSBP, dst: NdSBP) -> float:
    return _search(mesh_shape, shape, itemsize, src, dst)[0]
