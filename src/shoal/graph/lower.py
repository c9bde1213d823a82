"""Lowering: the IR's ops become a ``LoweredPlan``: tasks, the thread each runs on, and what they pass.

Per device, compute segments: runs of that device's ops between communication points; each
collective is a task of its own; host work (``arange``, random draws, step counters) is host
segments. Each task names the runtime thread that runs it (``Thread``). Dependencies come from
data and from every in-place write (read-after-write, write-after-read, write-after-write on the
storage), within a piece and, for state, from one piece (micro-batch) to the next. Each segment is
compiled to straight-line Python that frees every temporary at its last use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..comm.dist import open_channels
from ..world import world
from .ir import Graph, Op, Ref, local_ids
from .trace import DEVICE

__all__ = ["Task", "Thread", "LoweredPlan", "lower"]


@dataclass(frozen=True, slots=True)
class Thread:
    """The runtime thread a task runs on: ``dev`` d computes for device d, ``comm`` d runs the
    collectives device d leads (None: this process owns no device of the group), ``host`` is the
    caller's host work."""

    kind: str  # "dev" | "comm" | "host"
    device: int | None = None
    lane: int | None = None  # a point-to-point transfer of a pipelined step across processes: its own thread

    @property
    def name(self) -> str:
        name = self.kind if self.device is None else f"{self.kind}{self.device}"
        return name if self.lane is None else f"{name}.{self.lane}"


@dataclass(eq=False)
class Task:
    id: int
    kind: str  # "compute" | "comm" | "host"
    device: int | None
    ops: list = field(default_factory=list)
    deps: set = field(default_factory=set)  # (task id, piece offset 0 or 1)
    imports: list = field(default_factory=list)  # Local ids read from outside
    exports: list = field(default_factory=list)  # Local ids others read
    run: object = None  # callable(list of imports) -> tuple of exports
    source: str = ""
    thread: Thread = Thread("host")
    phase: str = "F"  # a pipelined step's: "F", "B" or "W" (its ops')
    stage: int | None = None  # a pipelined step's model stage (its ops')
    channel: int | None = None  # a transfer across processes with a channel of its own (``comm.transfer``)

    @property
    def name(self) -> str:
        if self.kind == "comm":
            return self.ops[0].name()
        where = "host" if self.device is None else f"dev{self.device}"
        return f"{where} seg{self.id}"


@dataclass(eq=False)
class LoweredPlan:
    """What the actor runtime runs: the tasks, who makes each Local, and the state carried between
    pieces. (``shoal.Plan`` is another thing: how a user lays out a model.)"""

    graph: Graph
    tasks: list
    producer: dict  # Local id -> task id
    rebind: dict  # state Local read by piece k+1 -> the Local piece k left in that slot
    static: set  # Local ids bound before the run (inputs, state, constants)
    written: set  # storages (base Local ids) some op writes in place
    returned: set  # Local ids the caller gets back: outputs and the state left behind
    unread: set = field(default_factory=set)  # state Locals released before the run (Graph.unread_state)
    peak_bytes: dict = field(default_factory=dict)
    in_flight: dict = field(default_factory=dict)  # a pipelined step's: device -> micro-batches held at once

    def __str__(self) -> str:
        return describe(self)


def lower(g: Graph, backend: str | None = None, pipelined: bool = False) -> LoweredPlan:
    """``pipelined``: a pipelined step's body, whose transfers across processes each get a channel
    and a thread of their own (activations and gradients cross in both directions at once; on one
    shared thread a receive waiting for the peer could block the send the peer waits for)."""
    w = world()
    local_devices = set(w.local_devices)
    tasks: list[Task] = []
    producer: dict[int, int] = {}
    static = g.bound()
    written = {g.locals[x].base for op in g.ops for x in op.writes}
    for op in g.ops:  # a collective's results may share memory (with each other, or with an input that
        if op.kind == "comm":  # stays where it was, on CPU) unless someone writes them
            op.share_out = not any(g.locals[x].base in written for x in (*op.out_ids, *op.reads))

    last_host = [None]

    def new(kind, device):
        t = Task(len(tasks), kind, device)
        tasks.append(t)
        if kind == "host":  # host segments run in program order: random draws as in eager
            if last_host[0] is not None:
                t.deps.add((last_host[0], 0))
            last_host[0] = t.id
        return t

    cur: dict = {}  # executor (device or "host") -> current segment
    writer: dict = {}  # base -> task id
    readers: dict = {}  # base -> set of task ids since the last write
    base = {lid: loc.base for lid, loc in g.locals.items()}
    last_comm = None
    transfers: dict = {}  # pair of processes -> transfers between them so far
    consumed: set = set()  # host segments some device segment depends on
    closed: dict = {}  # device -> its compute segments in the order a collective ended them
    for op in g.ops:
        if op.kind == "comm":
            for k in [k for k in cur if k[0] in op.devices]:
                closed.setdefault(k[0], []).append(cur.pop(k).id)
            t = new("comm", None)
            if all(x in static for x in op.reads):
                # a collective of state alone (ZeRO-3's gathers) could run at the start, and every
                # gathered parameter would then be held at once: it starts once the segment before
                # the last of its devices is done, one segment ahead of its use
                t.deps |= {(closed[d][-2], 0) for d in op.devices if len(closed.get(d, ())) > 1}
            procs = tuple(sorted({w.process_of(x) for x in op.devices}))
            if pipelined and len(procs) > 1 and op.fn.p2p:
                # a channel of its own, numbered among the transfers of the same two processes, which
                # both trace in the same order (a process does not trace what devices it does not own do)
                t.channel = transfers[procs] = transfers.get(procs, -1) + 1
            elif len(procs) > 1:  # collectives across processes in the same order on every process
                if last_comm is not None:
                    t.deps.add((last_comm, 0))
                last_comm = t.id
        else:
            # a segment is one device's (or the host's) ops of one phase and stage of a pipelined step
            key = ("host",) if op.kind == "host" else (op.device, op.phase, op.stage)
            if key[0] != "host" and key[0] not in local_devices:
                continue
            t = cur.get(key)
            if t is None or (op.kind == "host" and t.id in consumed):
                # host work devices already wait for ends its segment: later host work runs alongside them
                t = cur[key] = new("host" if op.kind == "host" else "compute", None if op.kind == "host" else key[0])
        deps = _deps(op, base, writer, readers, producer)
        if op.kind != "host":
            consumed |= {d for d in deps if tasks[d].kind == "host"}
        if any(d > t.id for d in deps) and t.kind != "comm":  # keep the task graph acyclic: start a new segment
            t = cur[key] = new(t.kind, t.device)
        if not t.ops:
            t.phase, t.stage = op.phase, op.stage
        deps.discard(t.id)
        t.deps |= {(d, 0) for d in deps}
        t.ops.append(op)
        _commit(op, t.id, base, writer, readers)
        for lid in op.out_ids:
            producer[lid] = t.id

    if transfers:
        open_channels({pair: n + 1 for pair, n in transfers.items()})

    # state a piece leaves behind is what the next piece reads
    rebind = {}
    for s in g.slots:
        b, a = local_ids(s.before), local_ids(s.after)
        for bl, al in zip(b, a):
            if bl is not None and al is not None and bl != al:
                rebind[bl] = al
    _cross_piece_deps(g, tasks, base, writer, readers, rebind, static)

    # imports and exports
    needed_out = g.returned()
    exported: dict[int, set] = {}
    for t in tasks:
        made = set()
        imports = []
        for op in t.ops:
            for lid in op.reads:
                if lid not in made and lid not in imports:
                    imports.append(lid)
                    if lid in producer and producer[lid] != t.id:
                        exported.setdefault(producer[lid], set()).add(lid)
                    if lid in rebind:
                        src = rebind[lid]
                        exported.setdefault(producer.get(src, -1), set()).add(src)
            made |= set(op.out_ids)
        t.imports = imports
    for lid in needed_out:
        if lid in producer:
            exported.setdefault(producer[lid], set()).add(lid)
    for t in tasks:
        t.exports = sorted(exported.get(t.id, ()))
        t.run = _compile(t, g, backend)
        t.thread = _thread_of(t, w)
    plan = LoweredPlan(g, tasks, producer, rebind, static, written, needed_out, g.unread_state())
    plan.peak_bytes = _peak_bytes(g, tasks, plan.unread)
    return plan


def _deps(op: Op, base, writer, readers, producer) -> set:
    deps = set()
    for lid in op.reads:
        b = base[lid]
        if lid in producer:
            deps.add(producer[lid])
        if b in writer:
            deps.add(writer[b])
    for lid in op.writes:
        b = base[lid]
        if b in writer:
            deps.add(writer[b])
        deps |= readers.get(b, set())
    return deps


def _commit(op: Op, tid: int, base, writer, readers) -> None:
    for lid in op.reads:
        readers.setdefault(base[lid], set()).add(tid)
    for lid in op.writes:
        writer[base[lid]] = tid
        readers[base[lid]] = set()
    for lid in op.out_ids:
        if base[lid] == lid:
            writer[lid] = tid
            readers[lid] = set()


def _cross_piece_deps(g, tasks, base, writer, readers, rebind, static) -> None:
    """Piece k+1 touches state after piece k is done with it: replay the accesses once more, starting
    from where piece k left each persistent storage; dependencies found on piece-k tasks get offset 1."""
    persistent = {base[lid] for lid in static}
    w1 = {b: t for b, t in writer.items() if b in persistent}
    r1 = {b: set(r) for b, r in readers.items() if b in persistent}
    for b_lid, a_lid in rebind.items():
        bb, ab = base[b_lid], base[a_lid]
        if ab in writer:
            w1[bb] = writer[ab]
        r1[bb] = set(readers.get(ab, ()))
    w2: dict = {}
    task_of = {id(op): t.id for t in tasks for op in t.ops}
    for op in g.ops:
        tid = task_of.get(id(op))
        if tid is None:
            continue
        t = tasks[tid]
        for lid in op.reads:
            b = base[lid]
            if b in w1 and b not in w2:
                t.deps.add((w1[b], 1))
        for lid in op.writes:
            b = base[lid]
            if b in w2:
                continue
            if b in w1:
                t.deps.add((w1[b], 1))
            for r in r1.get(b, ()):
                t.deps.add((r, 1))
        for lid in op.writes:
            w2[base[lid]] = tid
    for t in tasks:  # an actor fires its pieces in order anyway
        t.deps.discard((t.id, 1))
        t.deps.discard((t.id, 0))


def _thread_of(t: Task, w) -> Thread:
    """Compute on its device's thread; a collective on the communication thread of the first device
    of its group this process owns (collectives of disjoint groups run side by side); host work on
    the caller's."""
    if t.kind == "compute":
        return Thread("dev", t.device)
    if t.kind == "comm":
        mine = [d for d in t.ops[0].devices if w.owns(d)]
        return Thread("comm", min(mine) if mine else None, t.channel)
    return Thread("host")


# -- code generation ------------------------------------------------------------------------------


def _fast(fn):
    """The C++ op itself (skips OpOverload.__call__)."""
    return getattr(fn, "_op", fn)


def _compile(t: Task, g: Graph, backend: str | None):
    if t.kind == "comm":
        return _comm_runner(t, g)
    if backend == "inductor" and t.kind == "compute":
        from .inductor import compile_segment

        fn = compile_segment(t, g)
        if fn is not None:
            return fn
    return _codegen(t, g)


def _comm_runner(t: Task, g: Graph):
    op = t.ops[0]
    devs, in_refs, *rest = op.args
    pos = {lid: i for i, lid in enumerate(t.imports)}
    idx = [None if r is None else pos[r.id] for r in in_refs]
    out_ids = [None if r is None else r.id for r in op.outs]
    order = [out_ids.index(lid) for lid in t.exports]
    fn, p2p, share = op.fn.run, op.fn.p2p, op.share_out  # the collective's eager function: run, not traced
    channel = {} if t.channel is None else {"channel": t.channel}

    def run(ins):
        xs = [None if i is None else ins[i] for i in idx]
        res = [fn(devs[0], devs[1], xs[0], *rest, **channel)] if p2p else fn(devs, xs, *rest)
        if not share:
            seen = {id(x) for x in xs if x is not None}
            res = list(res)
            for i, r in enumerate(res):
                if r is not None:
                    if id(r) in seen:
                        res[i] = r.clone()
                    seen.add(id(r))
        return tuple(res[i] for i in order)

    return run


def _place(t, dev):
    return t if t.device == dev else t.to(dev)


def _place_copy(t, dev):
    return t.to(dev, memory_format=torch.contiguous_format, copy=True)  # as eager's _scatter_full


def _codegen(t: Task, g: Graph):
    """Straight-line Python for a segment: locals are v<id>, constants are k<n> globals; every
    temporary is deleted right after its last use (the memory plan)."""
    w = world()
    dev = None if t.device is None else w.torch_device(t.device)
    glb: dict = {"_place": _place, "_place_copy": _place_copy}
    consts: dict = {}

    def const(x):
        k = f"k{len(consts)}"
        consts[k] = x
        glb[k] = x
        return k

    def emit(a) -> str:
        if isinstance(a, Ref):
            return f"v{a.id}"
        if a == DEVICE if isinstance(a, str) else False:
            return const(dev)
        if isinstance(a, list):
            return "[" + ", ".join(emit(e) for e in a) + "]"
        if isinstance(a, tuple):
            return "(" + "".join(emit(e) + ", " for e in a) + ")"
        if a is None or isinstance(a, (bool, int)):
            return repr(a)
        return const(a)

    keep = set(t.exports)
    last: dict = {}
    for i, op in enumerate(t.ops):
        for lid in op.reads:
            last[lid] = i
        for lid in op.out_ids:
            last.setdefault(lid, i)
    imported = set(t.imports)
    lines = [f"def seg({', '.join(f'v{i}' for i in t.imports)}):"]
    for i, op in enumerate(t.ops):
        if op.kind == "place":
            lines.append(f"    v{op.outs.id} = {'_place_copy' if op.fn else '_place'}(v{op.args[0].id}, {const(dev)})")
        else:
            f = const(_fast(op.fn))
            args = ", ".join(emit(a) for a in op.args)
            kw = ", ".join(f"{k}={emit(v)}" for k, v in op.kwargs.items())
            call = f"{f}({args}{', ' if args and kw else ''}{kw})"
            lines += _assign(op.outs, call)
        dead = [lid for lid in set(op.reads) | set(op.out_ids) if last.get(lid) == i and lid not in keep
                and lid not in imported]
        if dead:
            lines.append("    del " + ", ".join(f"v{lid}" for lid in sorted(dead)))
    lines.append("    return (" + "".join(f"v{lid}, " for lid in t.exports) + ")")
    t.source = "\n".join(lines)
    exec(compile(t.source, f"<shoal {t.name}>", "exec"), glb)  # noqa: S102 - our own generated code
    seg = glb["seg"]

    def run(ins):
        return seg(*ins)

    run.seg = seg  # the batched form is made from it (``batch``)
    return run


def _assign(outs, call: str) -> list[str]:
    if isinstance(outs, Ref):
        return [f"    v{outs.id} = {call}"]
    refs = _paths(outs, ())
    if not refs:
        return [f"    {call}"]
    lines = [f"    _r = {call}"]
    for path, r in refs:
        lines.append(f"    v{r.id} = _r" + "".join(f"[{i}]" for i in path))
    return lines


def _paths(o, path):
    if isinstance(o, Ref):
        return [(path, o)]
    if isinstance(o, (list, tuple)):
        out = []
        for i, e in enumerate(o):
            out += _paths(e, (*path, i))
        return out
    return []


def _peak_bytes(g: Graph, tasks, unread: set) -> dict:
    """Planned peak per device: state and inputs (but the ``unread`` state, released before the
    run), plus the temporaries alive at once when each device's segments run in order and free at
    last use."""
    order = [op for t in tasks for op in t.ops]
    last_use: dict = {}
    for i, op in enumerate(order):
        for lid in (*op.reads, *op.out_ids):
            last_use[g.locals[lid].base] = i
    live: dict = {}
    kept = {g.locals[x].base for x in (g.bound() - unread) | g.returned()}
    for lid in kept:
        loc = g.locals[lid]
        if loc.device is not None:
            live[loc.device] = live.get(loc.device, 0) + loc.nbytes
    peak = dict(live)
    for i, op in enumerate(order):
        for lid in op.out_ids:
            loc = g.locals[lid]
            if loc.base == lid and lid not in kept and loc.device is not None:
                live[loc.device] = live.get(loc.device, 0) + loc.nbytes
                peak[loc.device] = max(peak.get(loc.device, 0), live[loc.device])
        for lid in {g.locals[x].base for x in (*op.reads, *op.out_ids)}:
            loc = g.locals[lid]
            if last_use.get(lid) == i and lid not in kept and loc.device is not None:
                live[loc.device] -= loc.nbytes
    return peak


def describe(plan: LoweredPlan) -> str:
    """The tasks, their dependencies (``@-1``: on the previous piece) and what they pass on."""
    lines = [f"plan: {len(plan.tasks)} tasks"]
    for t in plan.tasks:
        deps = ", ".join(f"{d}{'@-1' if o else ''}" for d, o in sorted(t.deps))
        lines.append(f"  task {t.id} {t.name}: {len(t.ops)} ops, deps [{deps}], in {len(t.imports)}, "
                     f"out {len(t.exports)}")
    return "\n".join(lines)

