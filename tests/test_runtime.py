"""The actor runtime: tasks fire in dependency order, registers bound the pieces in flight, state
carries from piece to piece, errors name their task and never hang, collectives overlap compute,
and the threads use their share of the cores.

Most plans here are built by hand (tasks whose ``run`` is a Python function on numbers), so that
each test says exactly which dependencies and threads the runtime sees; the rest compile a step.
"""

import threading
import time
import types

import pytest
import torch

import shoal
from shoal import runtime
from shoal.graph.lower import LoweredPlan, Task, Thread
from shoal.testing import assert_same_value

DEV0, DEV1, COMM0, HOST = Thread("dev", 0), Thread("dev", 1), Thread("comm", 0), Thread("host")


def make_plan(specs, returned, rebind=None) -> LoweredPlan:
    """``specs``: per task (thread, imports, exports, fn, extra deps); ``fn`` takes the imports'
    values and returns the exports'. Data dependencies come from who exports what, as lowering's."""
    producer = {lid: i for i, (_, _, exports, _, _) in enumerate(specs) for lid in exports}
    tasks = []
    for i, (thread, imports, exports, fn, extra) in enumerate(specs):
        kind = {"dev": "compute", "comm": "comm", "host": "host"}[thread.kind]
        t = Task(i, kind, thread.device if kind == "compute" else None, imports=list(imports),
                 exports=list(exports), thread=thread)
        if kind == "comm":  # its name comes from its op
            t.ops = [types.SimpleNamespace(name=lambda i=i: f"comm.fake{i}", devices=(0, 1))]
        t.deps = {(producer[lid], 0) for lid in imports if lid in producer and lid not in (rebind or {})}
        t.deps |= set(extra)
        t.run = lambda ins, fn=fn: tuple(fn(*ins))
        tasks.append(t)
    static = {lid for _, imports, _, _, _ in specs for lid in imports if lid not in producer}
    return LoweredPlan(None, tasks, producer, dict(rebind or {}), static, set(), set(returned))


def slow(fn, seconds=0.002):
    def run(*xs):
        time.sleep(seconds)  # releases the GIL: the threads interleave
        return fn(*xs)

    return run


def diamond() -> LoweredPlan:
    """x -> a = x + 1 (dev0), b = 2x (dev1) -> c = a + b (comm0) -> d = 10c (dev0) -> e = d - 1 (host)."""
    return make_plan([
        (DEV0, [0], [1], slow(lambda x: [x + 1]), ()),
        (DEV1, [0], [2], slow(lambda x: [2 * x]), ()),
        (COMM0, [1, 2], [3], slow(lambda a, b: [a + b]), ()),
        (DEV0, [3], [4], slow(lambda c: [10 * c]), ()),
        (HOST, [4], [5], slow(lambda d: [d - 1]), ()),
    ], returned={5})


def firings(rt) -> dict:
    return {(f.task, f.piece): f for f in rt.timeline}


@pytest.mark.parametrize("registers", [1, 2])
def test_tasks_fire_in_dependency_order(registers):
    plan = diamond()
    rt = runtime.Runtime(plan, registers)
    xs = [3, 5, 7, 11]
    for _ in range(3):  # the same runtime runs again and again
        results, final = rt.run({0: 0}, len(xs), [{0: x} for x in xs])
        assert [r[5] for r in results] == [10 * (3 * x + 1) - 1 for x in xs]
        assert final == {5: results[-1][5]}
        fired = firings(rt)
        assert len(rt.timeline) == len(plan.tasks) * len(xs)  # every task once per piece
        for t in plan.tasks:
            for k in range(len(xs)):
                f = fired[t.name, k]
                assert f.thread == t.thread.name
                for d, _ in t.deps:
                    assert fired[plan.tasks[d].name, k].end <= f.start, (t.name, k, plan.tasks[d].name)
    # a register holds one piece until its readers are done with it: with one register, a task
    # fires for piece k + 1 only after its readers finished piece k
    if registers == 1:
        for t in plan.tasks:
            readers = [r for r in plan.tasks if (t.id, 0) in r.deps]
            for r in readers:
                for k in range(len(xs) - 1):
                    assert fired[r.name, k].end <= fired[t.name, k + 1].start, (t.name, r.name, k)


@pytest.mark.parametrize("registers", [1, 2])
def test_state_carries_from_piece_to_piece(registers):
    """``acc`` reads the state s and leaves s + x; piece k + 1 reads what piece k left (a Carried
    import); the scaling task reads each piece's new state in the same piece. Asked for one
    register, the runtime keeps two: with one, ``acc`` would wait for its own last state."""
    plan = make_plan([
        (DEV1, [10, 0], [11], slow(lambda s, x: [s + x]), ()),
        (DEV0, [11], [12], slow(lambda s: [100 * s]), ()),
    ], returned={11, 12}, rebind={10: 11})
    rt = runtime.Runtime(plan, registers, timeout=60)
    xs = [1, 2, 3, 4, 5]
    results, final = rt.run({10: 1000, 0: 0}, len(xs), [{0: x} for x in xs])
    sums = [1000 + sum(xs[:k + 1]) for k in range(len(xs))]
    assert [r[11] for r in results] == sums
    assert [r[12] for r in results] == [100 * s for s in sums]
    assert final == {11: sums[-1], 12: 100 * sums[-1]}
    assert isinstance(rt._actors[1].sources[0], runtime.FromTask)
    assert [type(s) for s in rt._actors[0].sources] == [runtime.Carried, runtime.Bound]


@pytest.mark.parametrize("where", [1, 2, 3, 4], ids=["dev1", "comm0", "dev0-caller", "host"])
def test_a_failing_task_surfaces_with_its_name_and_no_hang(where):
    """The task fails on piece 1 while others are in flight on every thread: the caller gets the
    error naming the task and piece, at once, after every running firing has ended; the plan runs
    again afterwards."""
    plan = diamond()
    run = plan.tasks[where].run
    bad = {1: -1, 2: 0, 3: -2, 4: -20}[where]  # what the task reads first on the piece whose x is -1

    def fails(ins):
        if ins[0] == bad:
            raise ValueError("boom")
        return run(ins)

    plan.tasks[where].run = fails
    rt = runtime.Runtime(plan, registers=2, timeout=60)
    t0 = time.monotonic()
    name = plan.tasks[where].name
    with pytest.raises(RuntimeError, match=rf"shoal runtime: {name} failed on piece 1: ValueError\('boom'\)") as err:
        rt.run({0: 0}, 3, [{0: 3}, {0: -1}, {0: 7}])
    assert time.monotonic() - t0 < 30  # not the timeout
    assert isinstance(err.value.__cause__, ValueError)
    assert rt._running == 0  # nothing of the failed run is still running
    pieces = [{0: 3}, {0: 5}, {0: 7}]
    results, _ = rt.run({0: 0}, len(pieces), pieces)
    assert [r[5] for r in results] == [10 * (3 * p[0] + 1) - 1 for p in pieces]


def test_a_stuck_task_times_out_naming_the_actors_not_finished():
    release = threading.Event()
    plan = make_plan([
        (DEV1, [0], [1], lambda x: [release.wait(30) and x], ()),
        (DEV0, [1], [2], lambda a: [a + 1], ()),
    ], returned={2})
    rt = runtime.Runtime(plan, timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"no progress in 0 s; actors not finished:\n  dev1 seg0: done 0/1, deps "
                                           r"\[\]\n  dev0 seg1: done 0/1, deps \[\('dev1 seg0', 0\)\]"):
        rt.run({0: 1})
    assert time.monotonic() - t0 < 10
    release.set()
    results, _ = rt.run({0: 1})  # the stuck firing, when it ends, is dropped: it belonged to the last run
    assert results == [{2: 2}]


def test_a_deadlock_is_reported_at_once_not_after_the_timeout():
    """A device order no firing can follow (piece 1 of a task before its piece 0): nothing runs or
    waits, so the run stops within about a second, naming the actors, not after its 60 s timeout."""
    plan = make_plan([
        (DEV1, [0], [1], lambda x: [x + 1], ()),
        (DEV0, [1], [2], lambda a: [a + 1], ()),
    ], returned={2})
    rt = runtime.Runtime(plan, timeout=60, orders={"dev1": [(0, 1), (0, 0)]})
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"deadlock: no firing is running, queued or ready; actors not finished:"
                                           r"\n  dev1 seg0: done 0/2"):
        rt.run({}, 2, [{0: 1}, {0: 2}])
    assert time.monotonic() - t0 < 10


def test_comm_tasks_run_on_their_own_thread_and_overlap_compute():
    """A collective independent of a device's compute runs beside it: the comm thread is not the
    device's thread (nor the caller's)."""
    plan = make_plan([
        (DEV0, [0], [1], slow(lambda x: [x + 1], 0.2), ()),
        (COMM0, [0], [2], slow(lambda x: [x * 2], 0.2), ()),
        (HOST, [1, 2], [3], lambda a, b: [a + b], ()),
    ], returned={3})
    rt = runtime.Runtime(plan)
    for _ in range(3):
        results, _ = rt.run({0: 5})
        assert results == [{3: 16}]
        fired = firings(rt)
        a, b = fired["dev0 seg0", 0], fired["comm.fake1", 0]
        assert (a.thread, b.thread) == ("dev0", "comm0")
        if a.start < b.end and b.start < a.end:
            return
    raise AssertionError(f"the collective never overlapped the compute: {rt.timeline}")


def test_lowering_puts_each_task_on_its_thread():
    """Compute on its device's thread, a collective on the comm thread of the first device of its
    group, host work on the caller's. Devices' compute shares at most as many threads as there are
    cores: the i-th device computes on worker i % workers, the caller's queue being worker 0."""
    mesh = shoal.Mesh([1, 2, 3])
    f = shoal.compile(lambda t: (t * 2).sum().to_global(mesh, shoal.B) + torch.arange(3.0).sum())
    t = torch.randn(6, 3)
    assert_same_value(f(shoal.to_global(t, mesh, shoal.S(0))), (t * 2).sum() + 3)
    tasks = f.plan.tasks
    assert {t.kind for t in tasks} == {"compute", "comm", "host"}
    for task in tasks:
        want = {"compute": Thread("dev", task.device), "comm": Thread("comm", 1), "host": Thread("host")}[task.kind]
        assert task.thread == want, task.name
    rt = f._last[2]
    workers = min(3, runtime._cores())
    worker_of = {Thread("dev", d): i % workers for i, d in enumerate((1, 2, 3))}
    for a in rt._actors:
        th = a.task.thread
        if th.kind == "dev":
            w = worker_of[th]
            assert a.inbox is (rt._mine if w == 0 else runtime._QUEUES[f"dev{1 + w}"]), th
        else:
            assert (a.inbox is rt._mine) == (th.kind == "host"), th
            assert a.inbox is rt._mine or a.inbox is runtime._QUEUES[th.name]


def test_devices_beyond_the_cores_share_compute_threads(monkeypatch):
    """4 devices on 2 cores compute on 2 threads (the caller and one worker), not 4."""
    monkeypatch.setattr(runtime, "_cores", lambda: 2)
    mesh = shoal.Mesh(list(range(4)))
    f = shoal.compile(lambda t: (t * 2 + 1).relu())
    t = torch.randn(8, 3)
    assert_same_value(f(shoal.to_global(t, mesh, shoal.S(0))), (t * 2 + 1).relu())
    rt = f._last[2]
    inboxes = {id(a.inbox) for a in rt._actors if a.task.thread.kind == "dev"}
    assert len(inboxes) == 2 and id(rt._mine) in inboxes


def test_a_failing_task_names_itself_and_the_next_call_runs():
    """An error at run time (an index out of range, which tracing on meta tensors cannot see) names
    the task and micro-batch; the plan runs again afterwards. Plans share the runtime's threads."""
    mesh = shoal.Mesh([0, 1])
    w = torch.randn(5, 3)
    f = shoal.compile(lambda w, i: torch.nn.functional.embedding(i, w) * 2)
    gw = shoal.to_global(w, mesh, shoal.B)
    ok = torch.tensor([[0, 4], [1, 2]])
    assert_same_value(f(gw, shoal.to_global(ok, mesh, shoal.S(0))), w[ok] * 2)
    threads = threading.active_count()
    with pytest.raises(RuntimeError, match=r"shoal runtime: dev\d seg\d+ failed on piece 0: IndexError"):
        f(gw, shoal.to_global(torch.tensor([[0, 9], [1, 2]]), mesh, shoal.S(0)))
    assert_same_value(f(gw, shoal.to_global(ok, mesh, shoal.S(0))), w[ok] * 2)
    g = shoal.compile(lambda w: w.sum(0))
    for _ in range(3):
        assert_same_value(g(gw), w.sum(0))
    assert threading.active_count() == threads


def test_a_failed_run_returns_only_when_none_of_its_tasks_is_running():
    """Device 0 fails at once while device 1 is busy: the error reaches the caller after device 1's
    firing has finished, so nothing of the failed run touches memory after the caller has it."""
    mesh = shoal.Mesh([0, 1])
    w, big = torch.randn(5, 3), torch.randn(700, 700)
    f = shoal.compile(lambda w, i, big: torch.nn.functional.embedding(i, w).sum() + (big @ big @ big).sum())
    bad = torch.tensor([[0, 9], [1, 2]])  # out of range on device 0's rows only
    args = [shoal.to_global(t, mesh, sbp) for t, sbp in ((w, shoal.B), (bad, shoal.S(0)), (big, shoal.B))]
    for _ in range(3):
        with pytest.raises(RuntimeError, match="IndexError"):
            f(*args)
        assert f._last[2]._running == 0


def test_a_worker_thread_runs_kernels_on_its_share_of_the_intra_op_threads():
    """A worker thread computes with (caller's threads) // (compute threads: local devices, at most
    the cores) OpenMP threads, even after
    its first kernel (ATen sets a new thread's count from the process default on first use), and
    the process default stays the caller's."""
    seen, done = {}, threading.Event()

    class Probe:
        def _fire(self, run_id, a, k):
            (torch.randn(1 << 20) * 2).exp_()  # big enough to run in parallel
            seen["threads"] = torch.get_num_threads()
            done.set()

    prev = torch.get_num_threads()
    torch.set_num_threads(8)
    try:
        runtime._queue("dev-probe", compute=True).put((Probe(), 0, None, 0))
        assert done.wait(60)
        assert torch.get_num_threads() == 8
    finally:
        torch.set_num_threads(prev)
    assert seen["threads"] == 8 // min(len(shoal.world().local_devices), runtime._cores())


def test_the_caller_computes_on_its_share_of_the_intra_op_threads(monkeypatch):
    """While a plan over several local devices runs, the calling thread (which computes for the first
    of them) uses its share of the intra-op threads, as the workers do: n threads for each of the d
    devices would oversubscribe the cores. A one-device plan keeps them all; afterwards the caller's
    count is what it was."""
    seen = []
    run_all = runtime.Runtime._run_all
    monkeypatch.setattr(runtime.Runtime, "_run_all", lambda self: (seen.append(torch.get_num_threads()), run_all(self)))
    f = shoal.compile(lambda t: (t * 2).sum())
    prev = torch.get_num_threads()
    torch.set_num_threads(8)
    try:
        for devices in ([0, 1, 2, 3], [0]):
            t = torch.randn(8, 3)
            assert_same_value(f(shoal.to_global(t, shoal.Mesh(devices), shoal.S(0))), (t * 2).sum())
            assert torch.get_num_threads() == 8
    finally:
        torch.set_num_threads(prev)
    assert seen == [8 // min(4, runtime._cores()), 8]
