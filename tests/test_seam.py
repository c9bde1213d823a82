"""The seam between eager execution and graph mode (shoal.seam): nothing in shoal is replaced while a
step is traced, and anything that goes through the seam is recorded, including a collective shoal
has never heard of."""

from __future__ import annotations

import sys
import threading

import torch

import shoal
from shoal import seam
from shoal.sbp import Broadcast, Partial, Split
from shoal.tensor import GlobalTensor
from shoal.testing import assert_same_value, make_global


def _shoal_attributes() -> dict:
    """Every attribute, public and private, of every loaded module of shoal: (module, name) -> object."""
    out = {}
    for name, mod in list(sys.modules.items()):
        if mod is not None and (name == "shoal" or name.startswith("shoal.")):
            for attr, obj in list(vars(mod).items()):
                out[(name, attr)] = obj
    return out


def test_tracing_replaces_nothing_in_any_module(meshes):
    mesh = meshes[(2, 2)]
    x = make_global(torch.randn(6, 4), mesh, [Split(0), Split(1)])
    w = make_global(torch.randn(4, 3), mesh, [Broadcast(), Split(0)])
    before = _shoal_attributes()
    inside: list = []

    @shoal.compile
    def step(x, w):
        y = (x @ w).relu()  # boxing (Partial -> ...), collectives, placements of the plain 2.0
        inside.append(_shoal_attributes())
        return y.sum(0) * 2.0

    out = step(x, w)
    assert inside and seam.current().tracing is False
    swapped = [k for k, obj in inside[0].items() if k in before and before[k] is not obj]
    assert not swapped, f"attributes replaced while tracing: {swapped}"
    assert_same_value(out, (x.full() @ w.full()).relu().sum(0) * 2.0)


def test_the_runtime_threads_see_eager_while_a_step_is_traced(meshes):
    """The execution in force belongs to the thread that set it."""
    seen = []

    @shoal.compile
    def step(x):
        t = threading.Thread(target=lambda: seen.append(seam.current()))
        t.start()
        t.join()
        seen.append(seam.current())
        return x + 1

    step(make_global(torch.randn(4), meshes[(2,)], [Split(0)]))
    other, tracing = seen
    assert type(other) is seam.Eager and tracing.tracing


_RUNS: list = []


@seam.collective
def _sum_then_double(devices, shards):
    """A collective only this test knows: every device gets twice the sum of the group's shards."""
    _RUNS.append(tuple(None if s is None else s.device.type for s in shards))
    total = sum(s for s in shards if s is not None) * 2
    return [None if s is None else total for s in shards]


def test_a_collective_added_through_the_seam_is_traced_and_run(meshes):
    mesh = meshes[(2,)]
    v = torch.randn(3, 5)
    x = make_global(v, mesh, [Partial("sum")])

    def step(x):
        ys = _sum_then_double(list(mesh.devices), list(x._shards))
        return GlobalTensor._make(x._spec.with_sbp((Broadcast(),)), tuple(ys))

    eager = step(x)
    assert_same_value(eager, v * 2)
    _RUNS.clear()
    compiled = shoal.compile(step)
    out = compiled(x)
    assert _RUNS[0] == ("meta", "meta")  # traced: run on the meta shards, for their shapes
    assert ("cpu", "cpu") in _RUNS[1:]  # then run by the runtime on the real shards
    assert [op.fn for op in compiled.graph.ops if op.kind == "comm"] == [_sum_then_double]
    assert_same_value(out, v * 2)
    x2 = make_global(v + 1, mesh, [Partial("sum")])
    assert_same_value(compiled(x2), (v + 1) * 2)  # the plan runs it again: it was not baked in
