"""Batching: the identical compute segments of several devices as one task (``shoal.compile``'s default;
``batch=False`` turns it off).

Data parallelism on the virtual devices of one torch device runs the same segment once per device on
same-shaped shards: at 16 devices a small model's step is thousands of small kernels and 60-odd
firings contending for the GIL. ``batch_tasks`` merges the compute tasks of different devices that
are the same code on same-shaped Locals into one task per runtime worker (devices ``i``, ``i + w``,
``i + 2w``, ... of ``w`` workers, so the workers still run side by side; a group of fewer than
``MIN_GROUP`` segments is not merged). The merged task runs the segment once under ``torch.vmap`` over a leading
device dimension:

- an input every member reads as the same tensor, or the replicas of one value (a Broadcast value's
  shards, or the results of one all-reduce or all-gather: the same numbers on every device), is the
  first member's and not batched; another input is stacked, unless the members' inputs are the
  slices of one batched result of another merged task (taken as it is);
- each member's exports are views ``out[i]`` of the batched results;
- ``view`` runs as ``reshape`` (a view of a batched value need not exist; the segment writes nothing
  in place, so a copy is never seen).

vmap's batching rules compute some ops in another order than the per-device kernels (the weight
gradients of ``layer_norm``, a mean loss, a matmul folded over the devices): results agree with the
per-device loop to float32 rounding (about 1e-7 relative per step), not bit for bit. A group whose
ops write in place (the fused optimizer), or whose batched run fails (an op vmap cannot batch), runs
its members' own code one after the other in one firing.

A group that writes nothing in place and whose every input is replicated (the split of an
all-reduced gradient bucket) computes the same numbers on every member: it runs the first member's
code once and the others take its results (copied where something writes them), the bits the loop
would compute on each member in turn. (The optimizer of a data-parallel step writes each member's
replicas: copying the first member's new values into the others was slower than the loop.)
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch

from .. import comm
from ..runtime import _cores
from ..sbp import Broadcast
from ..world import world
from .ir import Graph, Ref
from .lower import LoweredPlan, Task

__all__ = ["batch_tasks", "Batched"]

# the fewest members a merged group has: a vmapped op costs a few plain calls of Python and dispatch,
# so batching 2 or 4 devices' segments was slower than running them in turn (bench/scaling.py at 4
# and 8 virtual devices on 2 workers), 8 faster
MIN_GROUP = 8
_VIEW = torch.ops.aten.view.default
_RESHAPE = torch.ops.aten.reshape.default


def batch_tasks(plan: LoweredPlan) -> None:
    """Merge groups of identical compute tasks of different devices in ``plan`` (its tasks' ids are
    positions again, its producer map follows)."""
    tasks, producer, g = plan.tasks, plan.producer, plan.graph
    w = world()
    devices = sorted({t.device for t in tasks if t.kind == "compute" and t.device is not None})
    workers = max(1, min(len(devices), _cores()))  # as the runtime shares its worker threads out
    groups: dict = {}
    for t in tasks:
        if t.kind == "compute" and t.device is not None:
            sig = _signature(t, g, w)
            if sig is not None:
                groups.setdefault((devices.index(t.device) % workers, sig), []).append(t)
    merged = [ms for ms in groups.values() if len(ms) >= MIN_GROUP]
    if not merged:
        return
    group_of = {m.id: i for i, ms in enumerate(merged) for m in ms}
    if _cyclic(tasks, group_of):
        return
    replicated = _replicated(g)
    bases = {g.locals[x].base for op in g.ops for x in op.writes}
    written = {lid for lid, loc in g.locals.items() if loc.base in bases}  # Locals whose storage some op writes
    new_id: dict = {}
    out: list = []
    for t in tasks:
        gi = group_of.get(t.id)
        if gi is None:
            new_id[t.id] = len(out)
            out.append(t)
        elif merged[gi][0] is t:
            for m in merged[gi]:
                new_id[m.id] = len(out)
            out.append(_merge(merged[gi], replicated, written))
    for i, t in enumerate(out):
        t.id = i
        t.deps = {(new_id[d], off) for d, off in t.deps} - {(i, 0), (i, 1)}
    _link([t.run for t in out if isinstance(t.run, Batched)])
    plan.tasks, plan.producer = out, {lid: new_id[tid] for lid, tid in producer.items()}


def _replicated(g: Graph) -> dict:
    """Local id -> what it is a replica of, where equal numbers on every device holding one are sure:
    a Broadcast value (its shards), an all-reduce or all-gather (its results on the group)."""
    out = {lid: ("value", vid) for vid, v in g.values.items() if all(isinstance(s, Broadcast) for s in v.spec.sbp)
           for lid in v.locals if lid is not None}
    for i, op in enumerate(g.ops):
        if op.kind == "comm" and op.fn in (comm.all_reduce, comm.all_gather):
            out.update((lid, ("comm", i)) for lid in op.out_ids)
    return out


def _link(runs: list) -> None:
    """Where every member of a merged task reads the same export of the same member of another
    merged task, it takes that task's batched result (``Batched.source``)."""
    made = {lid: (b, m, j) for b in runs for m, exports in enumerate(b.exports) for j, lid in enumerate(exports)}
    for b in runs:
        for i in range(b.k):
            hits = [made.get(imports[i]) for imports in b.imports]
            if any(h is None for h in hits):
                continue
            src, _, j = hits[0]
            if src.n == b.n and all(h == (src, m, j) for m, h in enumerate(hits)):
                b.source[i] = (src, j)


def _signature(t, g: Graph, w) -> tuple | None:
    """What makes two segments the same code: every op's function and arguments, each Local named
    by its place in the segment (imports first) with its shape, dtype and strides. None: a
    constant that cannot be compared (the task is not merged)."""
    names: dict = {}

    def local(lid):
        if lid not in names:
            loc = g.locals[lid]
            names[lid] = (len(names), loc.shape, loc.dtype, loc.stride)
        return names[lid]

    def norm(a):
        if isinstance(a, Ref):
            return ("ref", local(a.id))
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(norm(e) for e in a))
        if isinstance(a, torch.Tensor):
            return ("tensor", id(a))
        return ("const", type(a).__name__, a)

    for lid in t.imports:
        local(lid)
    sig = (t.phase, t.stage, str(w.torch_device(t.device)),
           tuple((op.kind, op.fn, norm(op.args), tuple((k, norm(v)) for k, v in op.kwargs.items()), norm(op.outs),
                  bool(op.writes)) for op in t.ops),
           tuple(local(x) for x in t.exports))
    try:
        hash(sig)
    except TypeError:
        return None
    return sig


def _cyclic(tasks: list, group_of: dict) -> bool:
    """Whether merging the groups closes a cycle among same-piece dependencies."""
    node = {t.id: ("g", group_of[t.id]) if t.id in group_of else ("t", t.id) for t in tasks}
    edges: dict = {}
    for t in tasks:
        for d, off in t.deps:
            if off == 0 and node[d] != node[t.id]:
                edges.setdefault(node[d], set()).add(node[t.id])
    state: dict = {}  # 1: on the path, 2: done
    for start in set(node.values()):
        if start in state:
            continue
        state[start] = 1
        stack = [(start, iter(edges.get(start, ())))]
        while stack:
            n, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[n] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return True
            elif nxt not in state:
                state[nxt] = 1
                stack.append((nxt, iter(edges.get(nxt, ()))))
    return False


def _merge(members: list, replicated: dict, written: set):
    """One task for the group, on the first member's thread: the members' imports and exports one
    member after the other."""
    first = members[0]
    t = Task(first.id, "compute", first.device)
    t.ops = [op for m in members for op in m.ops]
    t.deps = set().union(*(m.deps for m in members))
    t.imports = [x for m in members for x in m.imports]
    t.exports = [x for m in members for x in m.exports]
    t.thread, t.phase, t.stage, t.source = first.thread, first.phase, first.stage, first.source
    t.run = Batched(members, replicated, written)
    return t


class Batched:
    """A merged task's run: the batched segment, the first member's run once (every input
    replicated), or (``fn`` None) the members' own runs in turn. ``batched``, ``once`` and ``looped``
    count the firings each way."""

    def __init__(self, members: list, replicated: dict, written: set) -> None:
        first = members[0]
        self.members = [m.run for m in members]
        self.imports, self.exports = [m.imports for m in members], [m.exports for m in members]
        self.n, self.k = len(members), len(first.imports)
        self.source: list = [None] * self.k  # per input: (Batched, export) whose batched result it is
        # replicas of one value hold the same numbers: the first member's, not batched
        self.same = [replicated.get(first.imports[i]) is not None
                     and all(replicated.get(m.imports[i]) == replicated[first.imports[i]] for m in members)
                     for i in range(self.k)]
        # a result equal on every member (vmap expands it, or one run made it) is one storage:
        # copied where it is written
        self.copy = [any(m.exports[j] in written for m in members) for j in range(len(first.exports))]
        writes = any(op.writes for op in first.ops)
        self.fn = None if writes else _batched_fn(first)
        self.one = not writes  # where every input is replicated: the first member's run, once
        self.batched = self.once = self.looped = 0
        self._last: dict = {}  # export -> (the batched result, its slices), weakly: the last firing's

    def __call__(self, ins: list) -> tuple:
        k = self.k
        if self.one and all(self.same[i] or all(x is ins[i] for x in ins[i::k]) for i in range(k)):
            self.once += 1
            return self._once(ins)
        if self.fn is not None:
            try:
                out = self._batched(ins)
            except Exception:  # noqa: BLE001 - an op vmap cannot batch: the loop, from now on
                self.fn = None
            else:
                self.batched += 1
                return out
        self.looped += 1
        return tuple(x for i, run in enumerate(self.members) for x in run(ins[i * k:(i + 1) * k]))

    def _once(self, ins: list) -> tuple:
        k, n = self.k, self.n
        outs = self.members[0](ins[:k])
        return tuple(outs) + tuple(o.clone() if c else o for _ in range(1, n) for o, c in zip(outs, self.copy))

    def _batched(self, ins: list) -> tuple:
        k, n = self.k, self.n
        args, dims = [], []
        for i in range(k):
            xs = ins[i::k]
            if self.same[i] or all(x is xs[0] for x in xs):
                args.append(xs[0])
                dims.append(None)
            else:
                args.append(self._stacked(i, xs))
                dims.append(0)
        with _quiet():  # an op with no batching rule loops inside vmap, with a warning per call
            outs = torch.vmap(self.fn, in_dims=tuple(dims))(*args)
        self._last = {}
        per = []
        for j, o in enumerate(outs):
            if self.copy[j] and o.stride(0) == 0:
                o = o.contiguous()
            views = o.unbind(0)
            self._last[j] = (weakref.ref(o), [weakref.ref(v) for v in views])
            per.append(views)
        return tuple(per[j][i] for i in range(n) for j in range(len(per)))

    def _stacked(self, i: int, xs: list) -> torch.Tensor:
        """Input ``i`` of every member as one tensor: the batched result of the merged task that
        made it, while these are still its slices (it may have fired for the next piece), else a
        stacked copy."""
        src = self.source[i]
        hit = None if src is None else src[0]._last.get(src[1])
        if hit is not None:
            o = hit[0]()
            if o is not None and all(r() is x for r, x in zip(hit[1], xs)):
                return o
        return torch.stack(xs)


_QUIET = [0, threading.Lock()]  # batched runs under way (on several worker threads), its lock


@contextlib.contextmanager
def _quiet():
    """vmap's fallback warnings off while any batched run is under way (the switch is process-wide)."""
    with _QUIET[1]:
        _QUIET[0] += 1
        torch._C._functorch._set_vmap_fallback_warning_enabled(False)
    try:
        yield
    finally:
        with _QUIET[1]:
            _QUIET[0] -= 1
            if not _QUIET[0]:
                torch._C._functorch._set_vmap_fallback_warning_enabled(True)


def _batched_fn(t):
    """Member ``t``'s generated segment with ``view`` as ``reshape``; None if it has none (another
    backend compiled it)."""
    seg = getattr(t.run, "seg", None)
    if seg is None:
        return None
    glb = dict(seg.__globals__)
    for name, v in list(glb.items()):
        if v is _VIEW._op:
            glb[name] = _RESHAPE
    exec(compile(t.source, f"<shoal batched {t.name}>", "exec"), glb)  # noqa: S102 - our own generated code
    return glb["seg"]
