"""The actor runtime: runs a lowered plan, several pieces (micro-batches) in flight.

One ``Actor`` per task, with ``registers`` output registers: it fires for piece k when every task
it depends on has finished its piece (k, or k-1 for state handed from piece to piece) and its
register for k is free; its consumers return the register when they are done with it. No
scheduler decides the order: firings are messages between actors, run by one thread per device for
compute and one per device for the collectives it leads (threads of the process, shared by every
plan), so communication overlaps compute. The calling thread does the host work and its first
device's compute while it waits. Every firing is kept in a timeline exportable as a
Chrome/Perfetto trace. Types: ``Actor`` (one per task), ``Register`` (a piece's exports), an
import's source (``FromTask``, ``Carried``, ``Bound``), ``Dep``, ``Firing`` (a timeline entry).
"""

from __future__ import annotations

import heapq
import json
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

from ..graph.lower import LoweredPlan, Task
from ..world import world

__all__ = ["Actor", "Runtime", "Firing", "Order", "Register", "FromTask", "Carried", "Bound", "Dep", "bubble"]

_IDLE = 1.0  # seconds the caller waits for a firing before it looks for a deadlock
_SWITCH = 2e-4  # seconds: Python's default 5 ms lets one thread running many small ops starve the others


@dataclass(slots=True)
class Firing:
    task: str
    piece: int  # the micro-batch
    thread: str
    start: float
    end: float
    phase: str = ""  # "F", "B", "W" (a pipelined step's), "opt" (its tail), "comm", "host"
    stage: int | None = None  # a pipelined step's model stage


@dataclass(eq=False, slots=True)
class Order:
    """The (actor, piece) firings one device makes, in this order (a pipeline schedule's)."""

    items: list
    pos: int = 0


@dataclass(slots=True)
class Register:
    """What a task's firing for one piece exported, and how many readers have yet to return it."""

    outs: tuple
    readers: int


@dataclass(frozen=True, slots=True)
class FromTask:
    """An import made by another task in the same piece: its export number ``index``."""

    actor: Actor
    index: int


@dataclass(frozen=True, slots=True)
class Carried:
    """State handed from piece to piece: piece 0 reads the bound ``lid``, piece k > 0 what piece k-1
    of ``actor`` left there (its export number ``index``)."""

    lid: int
    actor: Actor
    index: int


@dataclass(frozen=True, slots=True)
class Bound:
    """An import bound before the run (input, state, constant), or per piece for micro-batch inputs."""

    lid: int


@dataclass(frozen=True, slots=True)
class Dep:
    """Piece k fires after ``actor`` has finished piece k - ``offset`` (0: the same piece, 1: the previous)."""

    actor: Actor
    offset: int


@dataclass(eq=False, slots=True)
class Actor:
    task: Task
    thread: str  # the thread's name, as the timeline shows it
    sources: list = field(default_factory=list)  # per import: FromTask | Carried | Bound
    deps: list = field(default_factory=list)  # Dep
    dependents: list = field(default_factory=list)  # actors to re-check when this one finishes a piece
    reads_same: int = 0  # imports of other actors that read my piece k in their piece k
    reads_next: int = 0  # ... in their piece k + 1 (state carried)
    outputs: list = field(default_factory=list)  # (index in exports, Local id) the caller wants back
    inbox: queue.SimpleQueue | None = None  # my thread's queue: where my firings go
    next: int = 0  # next piece to fire
    done: int = 0  # pieces finished
    freed: int = 0  # registers returned, in piece order
    regs: dict = field(default_factory=dict)  # piece -> Register
    busy: bool = False
    order: Order | None = None  # the device order this actor's firings follow, if any
    phase: str = ""  # as the timeline shows it
    draws: bool = False  # host work that draws random numbers (or sets the generator's state)


class Runtime:
    def __init__(self, plan: LoweredPlan, registers: int = 2, timeout: float | None = None,
                 orders: dict | None = None) -> None:
        """``orders``: device -> [(task id, piece)], the order that device's tasks fire in (a pipeline
        schedule's; tasks in no order fire as soon as they can)."""
        self.plan = plan
        self.registers = max(1, registers)
        self.timeout = timeout or float(os.environ.get("SHOAL_TIMEOUT", "600"))
        self.timeline: list[Firing] = []
        self._lock = threading.Lock()
        self._actors = [Actor(t, t.thread.name, phase="comm" if t.kind == "comm" else t.phase if t.kind == "compute"
                              else "host") for t in plan.tasks]
        self._orders = []
        for items in (orders or {}).values():
            o = Order([(self._actors[tid], k) for tid, k in items])
            self._orders.append(o)
            for a, _ in o.items:
                a.order = o
        # The caller runs the host work and its first device's compute while it waits: a process
        # with one device computes on one thread, with no hand-offs (a second thread with its own
        # OpenMP team makes libgomp stop spinning between parallel regions, and every kernel then
        # pays a wake-up, eager torch in the same process included).
        # Devices' compute shares at most as many threads as the machine has cores (a thread per
        # device beyond that only contends for the cores and the GIL): device i of the plan's computes
        # on worker i % workers, worker 0 being the caller. Each device's tasks still run in order,
        # and a compute task never waits on another, so sharing a thread cannot deadlock.
        devs = sorted({t.thread for t in plan.tasks if t.thread.kind == "dev"}, key=lambda th: th.device)
        self._devices = len(devs)
        self._workers = workers = max(1, min(len(devs), _cores()))
        self._mine: queue.SimpleQueue = queue.SimpleQueue()
        inbox = {th: self._mine if i % workers == 0 else _queue(devs[i % workers].name, True)
                 for i, th in enumerate(devs)}
        for a in self._actors:
            th = a.task.thread
            a.inbox = inbox[th] if th.kind == "dev" else self._mine if th.kind == "host" else _queue(th.name, False)
        for a in self._actors:
            a.draws = a.task.kind == "host" and any(op.random for op in a.task.ops)
        self._draw_from = None  # (actor, piece) -> the generators' states its firing draws from
        self._sim = None  # simulating: thread name -> firings ready to start
        self._run_id = 0  # firings queued for an earlier (failed) run are dropped
        self._running = 0  # firings being run now
        self._error = None
        self._wire()

    # -- wiring ---------------------------------------------------------------------------------
    def _wire(self) -> None:
        plan, actors = self.plan, self._actors
        index = {t.id: {lid: i for i, lid in enumerate(t.exports)} for t in plan.tasks}
        dependents: dict[int, set] = {a.task.id: set() for a in actors}
        for a in actors:
            t = a.task
            for lid in t.imports:
                src = plan.producer.get(lid)
                after = plan.rebind.get(lid)
                p = None if after is None else plan.producer.get(after)
                if p is not None:
                    a.sources.append(Carried(lid, actors[p], index[p][after]))
                    actors[p].reads_next += 1
                elif after is None and src is not None and src != t.id:
                    a.sources.append(FromTask(actors[src], index[src][lid]))
                    actors[src].reads_same += 1
                else:  # bound before the run or per piece; so is state no task leaves behind
                    a.sources.append(Bound(lid))
            a.deps = [Dep(actors[d], off) for d, off in sorted(t.deps)]
            for d, _ in t.deps:
                dependents[d].add(t.id)
        if any(a.reads_next for a in actors):
            # state carried to the next piece stays in its register while that piece is made: with
            # one register, a task reading its own (or a reader's) last state would wait for itself
            self.registers = max(2, self.registers)
        for a in actors:
            a.dependents = [actors[d] for d in sorted(dependents[a.task.id])]
            a.outputs = [(i, lid) for i, lid in enumerate(a.task.exports) if lid in plan.returned]

    # -- running --------------------------------------------------------------------------------
    def run(self, static: dict, pieces: int = 1, per_piece: list | None = None) -> tuple[list, dict]:
        """Run ``pieces`` pieces. ``static``: Local id -> tensor for inputs, state and constants;
        ``per_piece``: Local id -> tensor overrides per piece (micro-batch inputs). Returns (per piece:
        Local id -> tensor of the outputs, the last piece's state Locals)."""
        self._run_id += 1
        self._static, self._per_piece, self._pieces = static, per_piece, pieces
        self._results = [dict() for _ in range(pieces)]
        self._error = None
        self.timeline = []
        self._draw_from = None
        drawn = self._replay_draws() if pieces > 1 and any(a.draws for a in self._actors) else None
        self._t0 = time.perf_counter()
        switch = sys.getswitchinterval()
        sys.setswitchinterval(_SWITCH)  # hand the GIL between actor threads often, so that they overlap
        threads = torch.get_num_threads()
        if self._devices > 1:  # the caller computes as a worker: on its share of the cores
            torch.set_num_threads(_share(threads, self._workers))
        try:
            self._run_all()
        except BaseException as e:  # an interrupt in the caller: the run stops like a failed one
            with self._lock:
                if self._error is None:
                    self._error = e
        finally:
            sys.setswitchinterval(switch)
            if self._devices > 1:
                torch.set_num_threads(threads)
        if self._error is not None:
            if not isinstance(self._error, TimeoutError):  # a stuck run: its firings may never end
                self._drain()
            err, self._error = self._error, None
            raise err
        if drawn is not None:  # the generators end where the pieces drawn one after another leave them
            _set_states(drawn)
        final = {}
        for r in self._results:
            final.update(r)
        return self._results, final

    def _replay_draws(self) -> list:
        """Random numbers drawn by several pieces follow piece order, whatever order the schedule
        fires their host work in: each piece draws what it would draw if the pieces ran one after
        another (piece 0's forward and backward, then piece 1's: gradient accumulation on one
        device). The host work of every piece is replayed here in that order, before the run,
        keeping only the generators' states where each drawing firing starts (its draws are freed);
        the firing starts from that state. Returns the states the replay ended in."""
        per_piece, static = self._per_piece, self._static
        hosts = [a for a in self._actors if a.task.kind == "host"]
        host_ids = {id(a) for a in hosts}
        for a in hosts:
            for src in a.sources:
                if type(src) is not Bound and id(src.actor) not in host_ids:
                    raise RuntimeError(f"shoal runtime: host work {a.task.name} reads what {src.actor.task.name} "
                                       "makes on a device; its random draws cannot be replayed in piece order")
        copies: dict = {}  # bound tensors host work writes in place: the replay writes copies

        def bound(lid, k):
            t = per_piece[k][lid] if per_piece is not None and lid in per_piece[k] else static[lid]
            if self.plan.graph.locals[lid].base not in self.plan.written:
                return t
            if id(t) not in copies:
                copies[id(t)] = t.clone()
            return copies[id(t)]

        self._draw_from = {}
        last: dict = {}
        with torch.no_grad():
            for k in range(self._pieces):
                made: dict = {}
                for a in hosts:
                    ins = [made[id(src.actor)][src.index] if type(src) is FromTask
                           else last[id(src.actor)][src.index] if type(src) is Carried and k > 0
                           else bound(src.lid, k) for src in a.sources]
                    if a.draws:
                        self._draw_from[a, k] = _get_states()
                    made[id(a)] = a.task.run(ins)
                last = made
        return _get_states()

    def _run_all(self) -> None:
        with self._lock:
            self._reset()
            for a in self._actors:
                self._try(a)
        last, since = self._left, time.monotonic()
        while self._left and self._error is None:  # fire my device's tasks; others wake me when they finish
            try:
                item = self._mine.get(timeout=min(self.timeout, _IDLE))
            except queue.Empty:
                item = None
            if item is not None:
                self._fire(*item[1:])
            if self._left != last:
                last, since = self._left, time.monotonic()
            elif item is None:
                with self._lock:
                    if self._deadlocked():
                        self._error = RuntimeError(self._stuck("deadlock: no firing is running, queued or ready"))
                    elif time.monotonic() - since > self.timeout:
                        self._error = TimeoutError(self._stuck(f"no progress in {self.timeout:.0f} s"))

    def _deadlocked(self) -> bool:
        """Nothing runs or waits in a queue, so nothing will ever make another firing ready (only a
        firing's end does): the run cannot finish. A firing blocked in a collective with another
        process is running, not deadlocked."""
        return self._running == 0 and self._mine.empty() and not any(a.busy for a in self._actors)

    def _reset(self) -> None:
        for a in self._actors:
            a.next = a.done = a.freed = 0
            a.regs = {}
            a.busy = False
        for o in self._orders:
            o.pos = 0
            if len(o.items) != len(set((id(a), k) for a, k in o.items)) or any(k >= self._pieces for _, k in o.items):
                raise ValueError("shoal runtime: a device order names a firing twice or a piece not run")
        self._left = len(self._actors) * self._pieces

    def _stuck(self, why: str) -> str:
        lines = [f"shoal runtime: {why}; actors not finished:"]
        for a in self._actors:
            if a.done < self._pieces:
                lines.append(f"  {a.task.name}: done {a.done}/{self._pieces}, deps "
                             f"{[(d.actor.task.name, d.offset) for d in a.deps]}")
        return "\n".join(lines)

    def _ready(self, a: Actor) -> bool:
        k = a.next
        if a.busy or k >= self._pieces:
            return False
        for d in a.deps:
            j = k - d.offset
            if j >= 0 and d.actor.done <= j:
                return False
        o = a.order
        if o is not None and (o.pos >= len(o.items) or o.items[o.pos][0] is not a or o.items[o.pos][1] != k):
            return False  # not this device's next firing
        # a free register: not every one holds a piece someone still reads
        return not ((a.reads_same or a.reads_next) and k - self.registers >= a.freed)

    def _try(self, a: Actor) -> None:
        if self._ready(a):
            a.busy = True
            if self._sim is not None:
                self._sim.setdefault(a.thread, []).append((a, a.next))
            else:
                a.inbox.put((self, self._run_id, a, a.next))

    def _inputs(self, a: Actor, k: int) -> list:
        out = []
        pp = self._per_piece[k] if self._per_piece else None
        for src in a.sources:
            kind = type(src)
            if kind is FromTask:
                out.append(src.actor.regs[k].outs[src.index])
            elif kind is Carried and k > 0:
                out.append(src.actor.regs[k - 1].outs[src.index])
            else:
                lid = src.lid
                out.append(pp[lid] if pp is not None and lid in pp else self._static[lid])
        return out

    def _drain(self) -> None:
        """After a failure: wait for the firings already running (those still queued are dropped),
        so that none of this run touches memory after the caller has the error."""
        until = time.monotonic() + self.timeout
        while self._running and time.monotonic() < until:
            time.sleep(1e-3)

    def _fire(self, run_id: int, a: Actor, k: int) -> None:
        with self._lock:
            if run_id != self._run_id or self._error is not None:
                return  # left over from a run that failed
            self._running += 1
        try:
            self._fire_one(run_id, a, k)
        finally:
            with self._lock:
                self._running -= 1
            self._mine.put(None)  # wake the caller

    def _fire_one(self, run_id: int, a: Actor, k: int) -> None:
        t0 = time.perf_counter()
        try:
            ins = self._inputs(a, k)
            if a.draws and self._draw_from is not None:
                _set_states(self._draw_from[a, k])
            outs = a.task.run(ins)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            with self._lock:
                if self._error is None:
                    if isinstance(e, KeyboardInterrupt):  # the caller's own firing was interrupted
                        self._error = e
                    else:
                        self._error = RuntimeError(f"shoal runtime: {a.task.name} failed on piece {k}: {e!r}")
                        self._error.__cause__ = e
            return
        t1 = time.perf_counter()
        with self._lock:
            if run_id != self._run_id:
                return  # its run gave up waiting for it (a timeout) and another one started
            self.timeline.append(Firing(a.task.name, k, a.thread, t0 - self._t0, t1 - self._t0, a.phase, a.task.stage))
            self._finish(a, k, outs)

    def _finish(self, a: Actor, k: int, outs) -> None:
        a.busy = False
        a.next = k + 1
        a.done = k + 1
        if outs is not None:
            for i, lid in a.outputs:
                self._results[k][lid] = outs[i]
        readers = a.reads_same + (a.reads_next if k + 1 < self._pieces else 0)
        a.regs[k] = Register(outs, readers)
        if not readers:
            self._free(a)
        # return the registers this firing read
        for src in a.sources:
            kind = type(src)
            if kind is FromTask:
                self._release(src.actor, k)
            elif kind is Carried and k > 0:
                self._release(src.actor, k - 1)
        self._left -= 1
        self._try(a)
        for d in a.dependents:
            self._try(d)
        o = a.order
        if o is not None:
            o.pos += 1
            if o.pos < len(o.items):
                self._try(o.items[o.pos][0])

    def _release(self, p: Actor, k: int) -> None:
        reg = p.regs.get(k)
        if reg is None:
            return
        reg.readers -= 1
        if reg.readers <= 0:
            self._free(p)
            self._try(p)

    def _free(self, p: Actor) -> None:
        """Registers come back in piece order (a piece's readers fire in piece order too)."""
        while p.freed < p.done:
            reg = p.regs.get(p.freed)
            if reg is not None and reg.readers > 0:
                return
            p.regs.pop(p.freed, None)
            p.freed += 1

    # -- the virtual clock ----------------------------------------------------------------------
    def simulate(self, durations, pieces: int = 1) -> list[Firing]:
        """Replay the plan with the same actor rules (dependencies, registers, device orders) on a
        virtual clock, each device and communication thread its own, each firing lasting
        ``durations(task)`` seconds (a callable of the ``Task``, or a dict phase -> seconds with 0 for
        phases it does not name); nothing is computed. Returns the timeline."""
        if isinstance(durations, dict):
            table = durations

            def durations(t):
                return table.get("comm" if t.kind == "comm" else t.phase if t.kind == "compute" else "host", 0.0)

        with self._lock:
            self._pieces, self._sim, self._results = pieces, {}, None
            try:
                self._reset()
                for a in self._actors:
                    self._try(a)
                now, free, events, timeline, n = 0.0, {}, [], [], 0
                while True:
                    for th, ready in self._sim.items():  # start what is ready on every idle thread
                        if ready and free.get(th, 0.0) <= now and th not in {e[3].thread for e in events}:
                            a, k = ready.pop(0)
                            end = now + float(durations(a.task))
                            heapq.heappush(events, (end, n, now, a, k))
                            n += 1
                    if not events:
                        break
                    end, _, start, a, k = heapq.heappop(events)
                    now = free[a.thread] = end
                    timeline.append(Firing(a.task.name, k, a.thread, start, end, a.phase, a.task.stage))
                    self._finish(a, k, None)
                if self._left:
                    raise RuntimeError(self._stuck("the simulated run stalled"))
                return timeline
            finally:
                self._sim = None

    # -- timeline -------------------------------------------------------------------------------
    def chrome_trace(self, path: str) -> None:
        """The last run's firings as a Chrome/Perfetto trace (one row per thread)."""
        tids = {name: i for i, name in enumerate(sorted({f.thread for f in self.timeline}))}
        events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": n}} for n, i in tids.items()]
        for f in self.timeline:
            events.append({"name": f"{f.task} [mb {f.piece}]", "cat": f.task, "ph": "X", "pid": 0,
                           "tid": tids[f.thread], "ts": f.start * 1e6, "dur": max(0.0, f.end - f.start) * 1e6,
                           "args": {"piece": f.piece, "task": f.task}})
        with open(path, "w") as fh:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, fh)


# The threads: one per name (dev<d>, comm<d>, host) in the process, shared by every plan, started
# on first use. A queued firing holds its runtime only until it runs.
_QUEUES: dict[str, queue.SimpleQueue] = {}
_QUEUES_LOCK = threading.Lock()


def _queue(name: str, compute: bool) -> queue.SimpleQueue:
    """The queue of thread ``name``, started on first use; a ``compute`` thread runs its kernels on a
    share of the caller's intra-op threads (collectives and host work on one)."""
    with _QUEUES_LOCK:
        q = _QUEUES.get(name)
        if q is None:
            # more OpenMP threads than cores make every team stop spinning
            n = torch.get_num_threads()
            share = _share(n, min(len(world().local_devices), _cores())) if compute else 1
            q = _QUEUES[name] = queue.SimpleQueue()
            ready = threading.Event()
            threading.Thread(target=_serve, args=(q, share, ready), name=f"shoal-{name}", daemon=True).start()
            ready.wait()
            torch.set_num_threads(n)  # the process-wide default is the caller's again
        return q


def _generators() -> list:
    """The generators host work draws from: the CPU's, and the GPU's of the device it draws on."""
    w = world()
    dev = w.torch_device(w.local_devices[0])
    out = [torch.random.default_generator]
    if dev.type == "cuda":
        out.append(torch.cuda.default_generators[dev.index or 0])
    return out


def _get_states() -> list:
    return [g.get_state() for g in _generators()]


def _set_states(states: list) -> None:
    for g, s in zip(_generators(), states):
        g.set_state(s)


def _cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _share(threads: int, devices: int) -> int:
    """Intra-op threads of one device's compute thread when ``devices`` compute side by side."""
    return max(1, threads // devices)


def _serve(q: queue.SimpleQueue, threads: int, ready: threading.Event) -> None:
    torch.get_num_threads()  # ATen sets a thread's count from the process default on first use: now
    torch.set_num_threads(threads)
    ready.set()
    while True:
        rt, run_id, a, k = q.get()
        rt._fire(run_id, a, k)
        del rt, a  # hold no runtime between firings


def bubble(timeline: list[Firing]) -> dict[str, float]:
    """Per compute thread of a timeline: its idle fraction ``1 - busy / makespan`` over the
    forward and backward work (phases F, B, W), the makespan being theirs (first start to last end)."""
    work = [f for f in timeline if f.phase in ("F", "B", "W")]
    if not work:
        return {}
    span = max(f.end for f in work) - min(f.start for f in work)
    busy: dict[str, float] = {}
    for f in work:
        busy[f.thread] = busy.get(f.thread, 0.0) + f.end - f.start
    return {th: 1.0 - b / span for th, b in sorted(busy.items())}
