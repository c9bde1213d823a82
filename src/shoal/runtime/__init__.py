"""The actor runtime: runs a lowered plan, several pieces (micro-batches) in flight.

One ``Actor`` per task, with ``registers`` output registers: it fires for piece k when every task
it depends on has finished its piece (k, or k-1 for state handed from piece to piece) and its
register for k is free; its consumers return the register when they are done with it. No
scheduler decides the order: firings are messages between actors, run by one thread per device for
compute and one per device for the collectives it leads (threads of the process, shared by every
plan), so communication overlaps compute. The calling thread does the host work and its first
device's compute while it waits. Every firing is kept in a timeline exportable as a
Chrome/Perfetto trace.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

__all__ = ["Actor", "Runtime", "Firing"]

_SWITCH = 2e-4  # seconds: Python's default 5 ms lets one thread running many small ops starve the others


@dataclass(slots=True)
class Firing:
    task: str
    piece: int
    thread: str
    start: float
    end: float


@dataclass(eq=False)
class Actor:
    task: object  # lower.Task
    thread: str
    sources: list = field(default_factory=list)  # per import: ("static", lid) | ("task", actor, offset, index)
    deps: list = field(default_factory=list)  # (actor id, offset)
    dependents: set = field(default_factory=set)  # actor ids to re-check when this one finishes a piece
    holders: list = field(default_factory=list)  # (actor id, offset): who reads my registers
    outputs: list = field(default_factory=list)  # (index in exports, Local id) the caller wants back
    next: int = 0  # next piece to fire
    done: int = 0  # pieces finished
    freed: int = 0  # registers returned, in piece order
    regs: dict = field(default_factory=dict)  # piece -> [exports, readers left]
    busy: bool = False


class Runtime:
    def __init__(self, plan, registers: int = 2, timeout: float | None = None) -> None:
        self.plan = plan
        self.registers = max(1, registers)
        self.timeout = timeout or float(os.environ.get("SHOAL_TIMEOUT", "600"))
        self.timeline: list[Firing] = []
        self._lock = threading.Lock()
        self._actors = [Actor(t, _thread_of(t)) for t in plan.tasks]
        # The caller runs the host work and its first device's compute while it waits: a process
        # with one device computes on one thread, with no hand-offs (a second thread with its own
        # OpenMP team makes libgomp stop spinning between parallel regions, and every kernel then
        # pays a wake-up, eager torch in the same process included).
        devs = {a.thread for a in self._actors if a.thread.startswith("dev")}
        first = min(devs, key=lambda t: int(t[3:]), default=None)
        self._devices = len(devs)
        self._mine: queue.SimpleQueue = queue.SimpleQueue()
        self._queues = {a.thread: self._mine if a.thread in (first, "host") else _queue(a.thread)
                        for a in self._actors}
        self._run_id = 0  # firings queued for an earlier (failed) run are dropped
        self._running = 0  # firings being run now
        self._error = None
        self._wire()

    # -- wiring ---------------------------------------------------------------------------------
    def _wire(self) -> None:
        plan = self.plan
        index = {t.id: {lid: i for i, lid in enumerate(t.exports)} for t in plan.tasks}
        holders: dict[int, list] = {a.task.id: [] for a in self._actors}
        for a in self._actors:
            t = a.task
            for lid in t.imports:
                src = plan.producer.get(lid)
                if lid in plan.rebind:
                    after = plan.rebind[lid]
                    p = plan.producer.get(after)
                    a.sources.append(("rebind", lid, p, index[p][after] if p is not None else after))
                    if p is not None:
                        holders[p].append((t.id, 1))
                elif src is not None and src != t.id:
                    a.sources.append(("task", src, 0, index[src][lid]))
                    holders[src].append((t.id, 0))
                else:
                    a.sources.append(("static", lid))
            a.deps = sorted(t.deps)
            for d, _ in a.deps:
                self._actors[d].dependents.add(t.id)
        for a in self._actors:
            a.holders = holders[a.task.id]
        for a in self._actors:
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
        self._t0 = time.perf_counter()
        switch = sys.getswitchinterval()
        sys.setswitchinterval(_SWITCH)  # hand the GIL between actor threads often, so that they overlap
        threads = torch.get_num_threads()
        if self._devices > 1:  # the caller computes for one device: on its share of the cores, as workers do
            torch.set_num_threads(_share(threads, self._devices))
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
        final = {}
        for r in self._results:
            final.update(r)
        return self._results, final

    def _run_all(self) -> None:
        with self._lock:
            for a in self._actors:
                a.next = a.done = a.freed = 0
                a.regs = {}
                a.busy = False
            self._left = len(self._actors) * self._pieces
            for a in self._actors:
                self._try(a)
        last, since = self._left, time.monotonic()
        while self._left and self._error is None:  # fire my device's tasks; others wake me when they finish
            try:
                item = self._mine.get(timeout=self.timeout)
            except queue.Empty:
                item = None
            if item is not None:
                self._fire(*item[1:])
            if self._left != last:
                last, since = self._left, time.monotonic()
            elif time.monotonic() - since > self.timeout:
                with self._lock:
                    self._error = TimeoutError(self._stuck())

    def _stuck(self) -> str:
        lines = [f"shoal runtime: no progress in {self.timeout:.0f} s; actors not finished:"]
        for a in self._actors:
            if a.done < self._pieces:
                lines.append(f"  {a.task.name}: done {a.done}/{self._pieces}, deps "
                             f"{[(self._actors[d].task.name, o) for d, o in a.deps]}")
        return "\n".join(lines)

    def _ready(self, a: Actor) -> bool:
        k = a.next
        if a.busy or k >= self._pieces:
            return False
        for d, off in a.deps:
            if k - off >= 0 and self._actors[d].done <= k - off:
                return False
        # a free register: not every one holds a piece someone still reads
        return not (a.holders and k - self.registers >= a.freed)

    def _try(self, a: Actor) -> None:
        if self._ready(a):
            a.busy = True
            self._queues[a.thread].put((self, self._run_id, a, a.next))

    def _inputs(self, a: Actor, k: int) -> list:
        out = []
        pp = self._per_piece[k] if self._per_piece else None
        for src in a.sources:
            kind = src[0]
            if kind == "task":
                out.append(self._actors[src[1]].regs[k - src[2]][0][src[3]])
            elif kind == "rebind" and k > 0 and src[2] is not None:
                out.append(self._actors[src[2]].regs[k - 1][0][src[3]])
            else:
                lid = src[1]
                if pp is not None and lid in pp:
                    out.append(pp[lid])
                elif kind == "rebind" and k > 0:  # handed on through the static table
                    out.append(self._results[k - 1].get(src[3], self._static[lid]))
                else:
                    out.append(self._static[lid])
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
            self.timeline.append(Firing(a.task.name, k, a.thread, t0 - self._t0, t1 - self._t0))
            self._finish(a, k, ins, outs)

    def _finish(self, a: Actor, k: int, ins, outs) -> None:
        a.busy = False
        a.next = k + 1
        a.done = k + 1
        for i, lid in a.outputs:
            self._results[k][lid] = outs[i]
        readers = sum(1 for _, off in a.holders if k + off < self._pieces)
        if readers:
            a.regs[k] = [outs, readers]
        else:
            a.regs[k] = [outs, 0]
            self._free(a, k)
        # return the registers this firing read
        for src in a.sources:
            if src[0] == "task":
                self._release(self._actors[src[1]], k - src[2])
            elif src[0] == "rebind" and k > 0 and src[2] is not None:
                self._release(self._actors[src[2]], k - 1)
        self._left -= 1
        self._try(a)
        for d in a.dependents:
            self._try(self._actors[d])

    def _release(self, p: Actor, k: int) -> None:
        reg = p.regs.get(k)
        if reg is None:
            return
        reg[1] -= 1
        if reg[1] <= 0:
            self._free(p, k)
            self._try(p)

    def _free(self, p: Actor, k: int) -> None:
        """Registers come back in piece order (a piece's readers fire in piece order too)."""
        while p.freed < p.done:
            reg = p.regs.get(p.freed)
            if reg is not None and reg[1] > 0:
                return
            p.regs.pop(p.freed, None)
            p.freed += 1

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


def _queue(name: str) -> queue.SimpleQueue:
    with _QUEUES_LOCK:
        q = _QUEUES.get(name)
        if q is None:
            from ..world import world

            # CPU kernels on a worker use a share of the caller's intra-op threads (collectives and
            # host work one): more OpenMP threads than cores make every team stop spinning
            n = torch.get_num_threads()
            share = _share(n, len(world().local_devices)) if name.startswith("dev") else 1
            q = _QUEUES[name] = queue.SimpleQueue()
            ready = threading.Event()
            threading.Thread(target=_serve, args=(q, share, ready), name=f"shoal-{name}", daemon=True).start()
            ready.wait()
            torch.set_num_threads(n)  # the process-wide default is the caller's again
        return q


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


def _thread_of(t) -> str:
    """Compute on its device's thread; a collective on the communication thread of the first device
    of its group this process owns (collectives of disjoint groups run side by side); host work
    ("host") on the caller's."""
    if t.kind == "compute":
        return f"dev{t.device}"
    if t.kind == "comm":
        from ..world import world

        mine = [d for d in t.ops[0].devices if world().owns(d)]
        return f"comm{min(mine)}" if mine else "comm"
    return t.kind
