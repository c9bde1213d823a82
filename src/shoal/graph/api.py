"""``shoal.compile``: a step function traced once per guard key, then run as a plan on actors."""

from __future__ import annotations

import functools
import time
import warnings

import torch

from .. import aliasing
from ..dispatch.execute import _region
from ..tensor import GlobalTensor
from .capture import capture, function_key, globals_key, guard_key, leaves
from .ir import Graph, Ref, Value
from .lower import LoweredPlan, lower
from .passes import run_passes

__all__ = ["compile", "CompiledStep"]

_MANY_TRACES = 8


class CompiledStep:
    """A step function compiled per guard key (input shapes, dtypes, meshes, layouts, state).

    ``micro_batches`` M > 1 splits every tensor argument along dim 0 into M pieces and runs the
    step on each in turn, several in flight (the result is the list of M results); state carries
    from piece to piece exactly as if the step were called M times.
    """

    def __init__(self, fn, backend: str | None = None, micro_batches: int = 1, registers: int = 2,
                 passes: bool = True) -> None:
        if backend not in (None, "inductor"):
            raise ValueError(f"shoal.compile: unknown backend {backend!r}; use None or 'inductor'")
        if micro_batches < 1:
            raise ValueError(f"shoal.compile: micro_batches must be >= 1, got {micro_batches}")
        self.fn, self.backend, self.micro_batches = fn, backend, micro_batches
        self.registers, self.passes = registers, passes
        self._cache: dict = {}
        self._last = None
        self.compile_seconds = 0.0  # the last trace and compile
        self.compile_seconds_total = 0.0  # every one so far
        self.traces = 0
        functools.update_wrapper(self, fn)

    # -- what was compiled ----------------------------------------------------------------------
    @property
    def graph(self) -> Graph:
        if self._last is None:
            raise RuntimeError("shoal.compile: call the step once first; it is traced on its first call")
        return self._last[0]

    @property
    def plan(self) -> LoweredPlan:
        """The lowered plan of the last call (``print`` it for its tasks and dependencies)."""
        self.graph  # noqa: B018 - raises if nothing was compiled yet
        return self._last[1]

    def trace(self, path: str) -> None:
        """Write the runtime's last step as a Chrome/Perfetto trace (open in ui.perfetto.dev)."""
        if self._last is None:
            raise RuntimeError("shoal.compile: no step has run yet")
        self._last[2].chrome_trace(path)

    @property
    def timeline(self) -> list:
        return [] if self._last is None else self._last[2].timeline

    # -- calling --------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if self.micro_batches == 1:
            return self._run([(args, kwargs)])[0]
        pieces = _split(args, kwargs, self.micro_batches)
        outs: list = []
        while len(outs) < len(pieces):  # a graph creating state runs one piece: the next reads that state
            outs += self._run(pieces[len(outs):])
        return outs

    def _entry(self, key, args, kwargs):
        """The compiled graph for guard key ``key`` whose baked-in globals still hold (else a new trace)."""
        entries = self._cache.setdefault(key, [])
        entry = next((e for e in entries if globals_key(e[0].globals_read) == e[4]), None)
        if entry is None:
            from ..runtime import Runtime

            if self.traces == _MANY_TRACES:
                warnings.warn(f"shoal.compile: {getattr(self.fn, '__qualname__', self.fn)} is traced for the "
                              f"{_MANY_TRACES + 1}th time: something it depends on changes from call to call (input "
                              "shapes or layouts, a number in a global or closure it reads); pass a changing "
                              "number as a tensor argument", stacklevel=4)

            t0 = time.perf_counter()
            g = capture(self.fn, args, kwargs)
            if self.passes:
                run_passes(g)
            # a step that creates state (an optimizer's first step) runs once with this structure:
            # not worth an inductor compile, and not to be repeated for the next micro-batch
            creates = any(s.before is None and s.after is not None for s in g.slots)
            plan = lower(g, None if creates else self.backend)
            entry = (g, plan, Runtime(plan, self.registers), creates, globals_key(g.globals_read))
            entries.append(entry)
            self.compile_seconds = time.perf_counter() - t0
            self.compile_seconds_total += self.compile_seconds
            self.traces += 1
            g.notes.append(f"compiled in {self.compile_seconds:.2f} s; {len(plan.tasks)} tasks; planned peak "
                           f"bytes per device {plan.peak_bytes}")
        return entry

    def _run(self, pieces: list) -> list:
        """Run as many of ``pieces`` ((args, kwargs) each) as the first one's graph can take in flight;
        their results."""
        args, kwargs = pieces[0]
        objs = leaves(args, kwargs, self.fn)
        key, places = guard_key(objs)
        entry = self._entry((function_key(self.fn), key), args, kwargs)
        self._last = entry
        g, plan, rt, creates, _ = entry
        if creates:
            pieces = pieces[:1]
        static = _bind(g, plan, objs, places)
        per_piece = ([_bind_inputs(g, plan, leaves(*p, self.fn), k) for k, p in enumerate(pieces)] if len(pieces) > 1
                     else None)
        results, final = rt.run(static, len(pieces), per_piece)
        _write_state(g, static, final)
        return [_build(g.outputs, r, static) for r in results]


def compile(fn=None, *, backend: str | None = None, micro_batches: int = 1, registers: int = 2,  # noqa: A001
            passes: bool = True):
    """Compile a step (forward, backward, optimizer) into a static graph run on the actor runtime.
    Use as ``@shoal.compile`` or ``shoal.compile(fn, backend="inductor", micro_batches=4)``."""
    if fn is None:
        return lambda f: CompiledStep(f, backend, micro_batches, registers, passes)
    return CompiledStep(fn, backend, micro_batches, registers, passes)


# -- binding ------------------------------------------------------------------------------------


def _shards_into(env: dict, v: Value, t: GlobalTensor, written: set, g: Graph) -> None:
    """Bind ``t``'s shards to ``v``'s Locals. Eager shares one piece of memory between devices
    holding the same values (Broadcast on CPU); where the plan writes it on any device, each device
    gets its own."""
    shards = t._shards
    if len(shards) == 1 or not any(lid is not None and g.locals[lid].base in written for lid in v.locals):
        for lid, s in zip(v.locals, shards):
            if lid is not None:
                env[lid] = s
        return
    seen = set()
    changed = False
    for p, lid in enumerate(v.locals):
        if lid is None:
            continue
        s = shards[p]
        region = _region(s)
        if region in seen:
            if not changed:
                shards, changed = list(shards), True
            s = shards[p] = s.clone()
            region = _region(s)
        seen.add(region)
        env[lid] = s
    if changed:
        t._set_shards(shards)
        aliasing.replaced(t)


def _bind_one(env: dict, v, o, plan: LoweredPlan) -> None:
    """Bind what the graph calls ``v`` (a Value, or a host Local id) to the tensor ``o``."""
    if isinstance(v, Value):
        _shards_into(env, v, o, plan.written, plan.graph)
    else:
        env[v] = o


def _bind(g: Graph, plan: LoweredPlan, objs: list, places: list) -> dict:
    """Local id -> tensor for everything a run reads before its first op: constants, the numbers read
    at every call, the arguments (``objs``: their leaves), the state (``places``: guard_key's, in the
    order of the graph's slots)."""
    env = dict(g.constants)
    for owner, key, lid, dtype in g.scalars:
        env[lid] = torch.tensor(owner[key], dtype=dtype)
    env.update(_bind_inputs(g, plan, objs, 0))
    for s, (_, _, o) in zip(g.slots, places):
        if s.before is not None:
            _bind_one(env, s.before, o, plan)
    return env


def _bind_inputs(g: Graph, plan: LoweredPlan, objs: list, k: int) -> dict:
    """The arguments of micro-batch ``k`` (``objs``: their leaves)."""
    env: dict = {}
    for i, path, v in g.inputs:
        o = objs[i][1]
        if isinstance(v, Value) and o._spec != v.spec:
            raise ValueError(f"shoal.compile: micro-batch {k} of {path} is laid out {o._spec}, micro-batch 0 "
                             f"{v.spec}; pick a batch size the micro-batches split evenly")
        _bind_one(env, v, o, plan)
    return env


def _get(lid, final: dict, static: dict):
    return final[lid] if lid in final else static[lid]


def _shards(v: Value, final: dict, static: dict) -> tuple:
    return tuple(None if lid is None else _get(lid, final, static) for lid in v.locals)


def _write_state(g: Graph, static: dict, final: dict) -> None:
    # kept slots need nothing when the run handed back the very shards it was given (updated in place)
    moved = any(lid in final and final[lid] is not static[lid] for lid in g.kept)
    for s in g.slots:
        a = s.after
        if a is None:
            if s.key is not None and s.get() is not None:
                s.set(None)
        elif s.kept and not moved:
            continue
        elif isinstance(a, Value):
            if s.same or s.key is None:
                t = s.get()
                t._set_shards(_shards(a, final, static), a.spec)
                aliasing.replaced(t)
            else:
                s.set(GlobalTensor._make(a.spec, _shards(a, final, static), a.stride))
        else:
            s.set(_get(a, final, static))


def _build(o, results: dict, static: dict):
    if isinstance(o, Value):
        return GlobalTensor._make(o.spec, _shards(o, results, static), o.stride)
    if isinstance(o, Ref):
        return _get(o.id, results, static)
    if isinstance(o, (list, tuple)):
        return type(o)(_build(e, results, static) for e in o)
    if isinstance(o, dict):
        return {k: _build(e, results, static) for k, e in o.items()}
    return o


def _split(args, kwargs, m: int) -> list:
    """The arguments of each micro-batch: every tensor cut into ``m`` equal parts along dim 0."""

    def cut(o, k):
        if isinstance(o, torch.Tensor):
            n = o.shape[0]
            if n % m:
                raise ValueError(f"shoal.compile: micro_batches={m} does not divide a batch of {n}")
            b = n // m
            return o[k * b:(k + 1) * b]
        if isinstance(o, (list, tuple)):
            return type(o)(cut(e, k) for e in o)
        if isinstance(o, dict):
            return {kk: cut(e, k) for kk, e in o.items()}
        return o

    with torch.no_grad():
        return [(tuple(cut(a, k) for a in args), {n: cut(v, k) for n, v in kwargs.items()}) for k in range(m)]
