"""``shoal.compile``: a step function traced once per guard key, then run as a plan on actors."""

from __future__ import annotations

import functools
import time
import warnings
from dataclasses import replace

import torch

from .. import aliasing
from ..dispatch.execute import _region
from ..errors import DoesNotFit
from ..parallel.memory import byte_size
from ..parallel.precision import keeping_host_state, skipped_step
from ..tensor import GlobalTensor
from ..world import world
from . import pipeline
from .batch import batch_tasks
from .capture import capture, function_key, globals_key, guard_key, leaves
from .ir import Graph, Ref, Value, local_ids
from .lower import LoweredPlan, lower
from .passes import run_passes

__all__ = ["compile", "CompiledStep"]

_MANY_TRACES = 8


class CompiledStep:
    """A step function compiled per guard key (input shapes, dtypes, meshes, layouts, state).

    ``micro_batches`` M > 1 trains pipelined (``graph.pipeline``): every tensor argument is cut into
    M micro-batches along dim 0, forward and backward run per micro-batch in ``schedule``'s order
    per stage ("1f1b", "gpipe", "interleaved", "zb") with gradients accumulated, scaled for the
    loss's reduction (``loss="mean"`` or ``"sum"``), and ``zero_grad``, clipping and ``opt.step()``
    run once, so a call equals one step on the whole batch; random draws (dropout) are those of one
    device accumulating gradients over the micro-batches in turn, whatever the schedule's order. It
    returns what the step returns, a 0-dim float averaged over micro-batches (summed for ``"sum"``),
    other tensors concatenated.
    ``pieces`` P > 1 instead runs the whole step (optimizer included) on each of P pieces in turn,
    several in flight, state carried from piece to piece (random draws too), and returns the P results.
    ``batch`` (the default): a worker thread's devices whose compute segments are the same code
    (8 or more: many virtual devices on one CPU or GPU) run them as one batched task
    (``graph.batch``; results within float rounding of the per-device loop, not bit for bit);
    ``batch=False`` runs every device's segment itself. Not in pipelined steps.
    """

    def __init__(self, fn, backend: str | None = None, micro_batches: int = 1, registers: int = 2,
                 passes: bool = True, schedule: str = "1f1b", loss: str = "mean", pieces: int = 1,
                 batch: bool = True) -> None:
        if backend not in (None, "inductor"):
            raise ValueError(f"shoal.compile: unknown backend {backend!r}; use None or 'inductor'")
        if micro_batches < 1 or pieces < 1:
            raise ValueError(f"shoal.compile: micro_batches and pieces must be >= 1, got {micro_batches}, {pieces}")
        if micro_batches > 1 and pieces > 1:
            raise ValueError("shoal.compile: give micro_batches (one step over the whole batch) or pieces (one step "
                             "per piece), not both")
        if loss not in pipeline.LOSSES:
            raise ValueError(f"shoal.compile: loss={loss!r}; say how the step's loss reduces its batch: "
                             f"{pipeline.LOSSES}")
        from ..runtime import schedules

        schedules.schedule(schedule, 2, 2, 2 if schedule == "interleaved" else 1)  # an unknown name fails here
        self.fn, self.backend, self.micro_batches, self.pieces = fn, backend, micro_batches, pieces
        self.schedule, self.loss = schedule, loss
        self.registers, self.passes, self.batch = registers, passes, batch
        self._cache: dict = {}
        self._last = None
        self._pipes: dict = {}  # body graph id -> (Calls, params, tail function)
        self._warm: set = set()  # functions whose first, state-creating call ran eagerly
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
        """The last call's firings (a pipelined step's micro-batches, then its tail)."""
        if self._last is None:
            return []
        return self._last[2].timeline + (self._tail_timeline if self.micro_batches > 1 else [])

    def simulate(self, durations) -> list:
        """The last pipelined call's micro-batches replayed on a virtual clock (``Runtime.simulate``):
        ``durations`` a function of the task, or a dict phase ("F", "B", "W", "comm") -> seconds."""
        if self._last is None:
            raise RuntimeError("shoal.compile: call the step once first")
        return self._last[2].simulate(durations, max(self.micro_batches, 1))

    # -- calling --------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if self.micro_batches > 1:
            return self._pipelined(args, kwargs)
        if self.pieces == 1:
            return self._run([(args, kwargs)])[0][0]
        pieces = pipeline.cut(args, kwargs, self.pieces, per_shard=False)
        outs: list = []
        while len(outs) < len(pieces):  # a graph creating state runs one piece: the next reads that state
            outs += self._run(pieces[len(outs):])[0]
        return outs

    def _entry(self, key, args, kwargs, fn=None, pipe=None):
        """The compiled graph for guard key ``key`` whose baked-in globals still hold (else a new trace).
        ``pipe``: (Calls, Stages) to trace ``fn`` as a pipelined step's body."""
        fn = fn or self.fn
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
            if pipe is None:
                g = capture(fn, args, kwargs)
            else:
                calls, stages = pipe
                opts = [o for _, o in leaves(args, kwargs, fn) if isinstance(o, torch.optim.Optimizer)]
                with pipeline.deferring(opts, self.micro_batches, self.loss, calls):
                    g = capture(fn, args, kwargs, optimizers=False)
                if not calls.backwards:
                    raise ValueError("shoal.compile: micro_batches > 1 trains in micro-batches, but the step calls no "
                                     "backward(); for inference over pieces use pieces=")
            if self.passes:
                run_passes(g)
            orders, registers = None, self.registers
            if pipe is not None and stages is not None:
                pipeline.tag(g, stages)
                if self.schedule == "zb":
                    pipeline.split_weight_grads(g, stages)
            # a step that creates state (an optimizer's first step) runs once with this structure:
            # not worth an inductor compile, and not to be repeated for the next micro-batch
            creates = any(s.before is None and s.after is not None for s in g.slots)
            plan = lower(g, None if creates else self.backend, pipelined=pipe is not None)
            if self.batch and pipe is None and not creates:
                batch_tasks(plan)
            if pipe is not None and stages is not None:
                orders, registers = pipeline.device_orders(plan, stages, self.schedule, self.micro_batches)
                pipeline.plan_memory(plan, orders, stages)
            check_planned_peak(g, plan)
            entry = (g, plan, Runtime(plan, registers, orders=orders), creates, globals_key(g.globals_read))
            entries.append(entry)
            self.compile_seconds = time.perf_counter() - t0
            self.compile_seconds_total += self.compile_seconds
            self.traces += 1
            g.notes.append(f"compiled in {self.compile_seconds:.2f} s; {len(plan.tasks)} tasks; planned peak "
                           f"bytes per device {plan.peak_bytes}")
        return entry

    def _run(self, pieces: list, fn=None, pipe=None, tag=()) -> list:
        """Run as many of ``pieces`` ((args, kwargs) each) as the first one's graph can take in flight;
        their results."""
        fn = fn or self.fn
        args, kwargs = pieces[0]
        objs = leaves(args, kwargs, fn, pipe is None)
        if _creates_optimizer_state(objs) and (fn not in self._warm or _skipped(objs)):
            # an optimizer's first step creates its state: run it eagerly, once, and trace the step
            # the next call, with the state in place (one trace instead of one per state structure);
            # again while float16's loss scaling skips that step (a traced step cannot skip creating state)
            self._warm.add(fn)
            return [fn(*args, **kwargs)], None
        key, places = guard_key(objs)
        entry = self._entry((tag, function_key(fn), key), args, kwargs, fn, pipe)
        self._last = entry
        g, plan, rt, creates, _ = entry
        if creates:
            pieces = pieces[:1]
        static = _bind(g, plan, objs, places)
        per_piece = ([_bind_inputs(g, plan, leaves(*p, fn, pipe is None), k) for k, p in enumerate(pieces)]
                     if len(pieces) > 1 else None)
        with keeping_host_state(o for _, o in objs if isinstance(o, torch.optim.Optimizer)):
            results, final = rt.run(static, len(pieces), per_piece)
            _write_state(g, static, final)
        return [_build(g.outputs, r, static) for r in results], entry

    def _pipelined(self, args, kwargs):
        """One step over the whole batch in micro-batches: the body per micro-batch, then the tail."""
        m = self.micro_batches
        objs = leaves(args, kwargs, self.fn)
        stages = pipeline.stages_of(objs)
        params = pipeline.trainable(objs)
        axes = pipeline.data_axes(objs, None if stages is None else stages.axis)
        accs = pipeline.accumulators(params, axes, None if stages is None else stages.axis)
        saved = [p.grad for p in params]
        pieces = pipeline.cut(args, kwargs, m)
        key = ("body", self.schedule, m)
        calls = self._pipes.get(key) or pipeline.Calls()
        for p, acc in zip(params, accs):
            p.grad = acc
        try:
            outs, body = self._run_body(pieces, calls, stages, key)
        finally:
            accs = [p.grad for p in params]
            for p, g in zip(params, saved):
                p.grad = g
        self._pipes[key] = calls
        owners = [o for _, o in objs if isinstance(o, (torch.nn.Module, torch.optim.Optimizer))]
        tail = self._pipes.setdefault(("tail", id(calls)), pipeline.tail_fn(params, calls))
        _, tail_entry = self._run([((owners, accs), {})], tail, None, ("tail", key))
        self._tail_timeline = [] if tail_entry is None else [replace(f, phase="opt" if f.phase != "comm" else f.phase)
                                                             for f in tail_entry[2].timeline]
        self._last = body
        return pipeline.combine(outs, self.loss)

    def _run_body(self, pieces, calls, stages, key):
        from ..runtime import Runtime  # noqa: F401 - the entry makes one

        gate = {}
        for reducer in _reducers(leaves(*pieces[0], self.fn)):
            gate[reducer] = reducer.paused
            reducer.paused = True  # the accumulators are reduced once, by the tail
        try:
            outs, entry = self._run(pieces, None, (calls, stages), key)
        finally:
            for reducer, was in gate.items():
                reducer.paused = was
        return outs, entry


def check_planned_peak(g: Graph, plan: LoweredPlan) -> None:
    """Refuse (``DoesNotFit``) a plan whose planned peak on some device exceeds
    ``shoal.init(memory_per_device=...)``, naming the largest states there and what the rest is."""
    budget = world().memory_per_device
    if budget is None or not plan.peak_bytes or max(plan.peak_bytes.values()) <= budget:
        return
    worst = max(plan.peak_bytes, key=plan.peak_bytes.get)
    states = []
    for s in g.slots:
        b = sum(g.locals[x].nbytes for x in local_ids(s.before) if g.locals[x].device == worst)
        if b:
            states.append((b, s.label))
    held = sum(b for b, _ in states)
    top = ", ".join(f"{label} {byte_size(b)}" for b, label in sorted(states, reverse=True)[:5])
    raise DoesNotFit(
        f"shoal.compile: the step's planned peak on device {worst} is {byte_size(plan.peak_bytes[worst])}, over its "
        f"budget of {byte_size(budget)} (shoal.init(memory_per_device=...)) by "
        f"{byte_size(plan.peak_bytes[worst] - budget)}: states {byte_size(held)} (largest: {top}), activations and "
        f"other temporaries at the peak {byte_size(plan.peak_bytes[worst] - held)}. Plan(zero=...) shrinks the "
        f"states, Plan(checkpoint=[...]) the activations, more micro-batches the activations of a pipeline.")


def _creates_optimizer_state(objs) -> bool:
    """Whether an optimizer among ``objs`` has a trainable parameter without state yet."""
    for _, o in objs:
        if isinstance(o, torch.optim.Optimizer):
            for grp in o.param_groups:
                if any(p.requires_grad and not o.state.get(p) for p in grp["params"]):
                    return True
    return False


def _skipped(objs) -> bool:
    return any(skipped_step(o) for _, o in objs if isinstance(o, torch.optim.Optimizer))


def _reducers(objs) -> list:
    return [o._shoal_reducer for _, o in objs if isinstance(o, torch.nn.Module) and hasattr(o, "_shoal_reducer")]


def compile(fn=None, *, backend: str | None = None, micro_batches: int = 1, registers: int = 2,  # noqa: A001
            passes: bool = True, schedule: str = "1f1b", loss: str = "mean", pieces: int = 1,
            batch: bool = True):
    """Compile a step (forward, backward, optimizer) into a static graph run on the actor runtime.
    Use as ``@shoal.compile`` or ``shoal.compile(fn, micro_batches=8, schedule="1f1b")``
    (``CompiledStep`` says what the options mean)."""
    opts = dict(backend=backend, micro_batches=micro_batches, registers=registers, passes=passes,
                schedule=schedule, loss=loss, pieces=pieces, batch=batch)
    if fn is None:
        return lambda f: CompiledStep(f, **opts)
    return CompiledStep(fn, **opts)


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
        if s.before is None:
            continue
        mine = local_ids(s.before)  # none: the state lives on other processes' devices
        if mine and plan.unread.issuperset(mine):  # overwritten unread: let it go before the run
            if not isinstance(s.owner, dict) and s.key is not None:
                s.set(None)
            continue
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
