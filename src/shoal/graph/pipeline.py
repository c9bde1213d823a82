"""Pipelined steps: a step's forward and backward per micro-batch, in a schedule's order per stage;
what touches gradients outside them (``zero_grad``, clipping, ``opt.step()``) once per call.

A step compiled with ``micro_batches=M`` is two graphs. The *body* is the step traced on one
micro-batch with the optimizer's calls deferred (recorded, not run) and its backward seeded with
``1/M`` (``loss="mean"``); it runs as M pieces on the actor runtime, its gradients accumulating into
accumulators laid out as backward makes them (Partial over the data-parallel axes: no reduction per
micro-batch). The *tail* installs the accumulated gradients (reduced once) and replays the deferred
calls. Each op of the body carries its phase (F, B, W) and model stage (``tag``); each device follows
its stage's order from ``runtime.schedules`` (``device_orders``).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from .. import seam
from ..parallel.memory import split_gradient
from ..sbp import Broadcast, Partial, Split, reduced
from ..tensor import GlobalTensor
from .ir import Graph, local_ids

__all__ = ["Calls", "cut", "deferring", "trainable", "data_axes", "accumulators", "tail_fn", "combine", "tag",
           "split_weight_grads", "device_orders", "plan_memory", "stages_of"]

LOSSES = ("mean", "sum")


# -- micro-batches ------------------------------------------------------------------------------


def cut(args: tuple, kwargs: dict, m: int, per_shard: bool = True) -> list:
    """The arguments of each of ``m`` micro-batches: every tensor cut along dim 0. A GlobalTensor is
    cut where its shards lie (micro-batch k is the k-th piece of every shard: no data moves, the
    layout stays the same), or with ``per_shard=False`` into contiguous rows of its global value."""

    def one(o, k):
        if isinstance(o, GlobalTensor) and per_shard:
            return _cut_global(o, k, m)
        if isinstance(o, torch.Tensor):
            n = o.shape[0] if o.ndim else 0
            if n % m:
                raise ValueError(f"shoal.compile: micro_batches={m} does not divide a batch of {n}; use a divisor "
                                 f"of {n}")
            b = n // m
            return o[k * b:(k + 1) * b]
        if isinstance(o, (list, tuple)):
            return type(o)(one(e, k) for e in o)
        if isinstance(o, dict):
            return {kk: one(e, k) for kk, e in o.items()}
        return o

    with torch.no_grad():
        return [(tuple(one(a, k) for a in args), {n: one(v, k) for n, v in kwargs.items()}) for k in range(m)]


def _cut_global(x: GlobalTensor, k: int, m: int) -> GlobalTensor:
    spec = x._spec
    if x.ndim == 0:
        raise ValueError(f"shoal.compile: a 0-dim argument {spec} cannot be cut into {m} micro-batches; pass it as "
                         "a Python number or a module attribute")
    n = spec.shape[0]
    small = type(spec)((n // m, *spec.shape[1:]), spec.dtype, spec.mesh, spec.sbp)
    shards = []
    for pos, s in enumerate(x._shards):
        if s is None:
            shards.append(None)
            continue
        rows = s.shape[0]
        if n % m or rows % m or small.local_shape(pos)[0] != rows // m:
            per = [spec.local_shape(q)[0] for q in range(spec.mesh.size)]
            raise ValueError(
                f"shoal.compile: micro_batches={m} does not cut the batch of {n} rows laid out {spec} evenly: its "
                f"shards hold {per} rows, and micro-batch k takes the k-th 1/{m} of every shard. Use a batch "
                f"of a multiple of {m * max(1, _split_ways(spec))} rows, or micro_batches dividing every shard")
        b = rows // m
        shards.append(s[k * b:(k + 1) * b])
    return GlobalTensor._make(small, tuple(shards), x.stride())


def _split_ways(spec) -> int:
    ways = 1
    for s, n in zip(spec.sbp, spec.mesh.shape):
        if isinstance(s, Split) and s.dim == 0:
            ways *= n
    return ways


def combine(outs: list, loss: str):
    """One result from the micro-batches' results: a 0-dim float tensor is their mean (their sum for
    ``loss="sum"``), another tensor the concatenation along dim 0 (0-dim ones stacked), anything
    else the last micro-batch's."""
    first = outs[0]
    if isinstance(first, torch.Tensor):
        if first.ndim == 0 and first.is_floating_point():
            total = outs[0]
            for o in outs[1:]:
                total = total + o
            return total / len(outs) if loss == "mean" else total
        return torch.stack(outs) if first.ndim == 0 else torch.cat(outs)
    if isinstance(first, (list, tuple)):
        return type(first)(combine([o[i] for o in outs], loss) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: combine([o[k] for o in outs], loss) for k in first}
    return outs[-1]


# -- deferring what runs once per call ------------------------------------------------------------


class Calls:
    """What the step does besides forward and backward, as found while tracing its body:
    ``zero_first`` (it zeroes gradients before its backward) and ``after`` (calls to run once, after
    the micro-batches, in order: ``opt.step()``, clipping, a ``zero_grad()`` after backward)."""

    def __init__(self) -> None:
        self.zero_first = False
        self.after: list = []
        self.backwards = 0


_CLIP_NAMES = ("clip_grad_norm_", "clip_grad_value_")


@contextlib.contextmanager
def deferring(opts: list, m: int, loss: str, calls: Calls):
    """While the body is traced: optimizers' ``step``/``zero_grad`` and gradient clipping are recorded
    in ``calls`` instead of run; ``backward`` of a 0-dim loss is seeded with ``1/m`` (``loss="mean"``)
    and marks the ops that follow as backward (``Op.phase``)."""
    import torch.nn.utils as nnu
    import torch.nn.utils.clip_grad as clip_mod

    real_backward = torch.autograd.backward

    def backward(tensors, grad_tensors=None, *a, **kw):
        ex = seam.current()
        ex.phase = "B"
        calls.backwards += 1
        if grad_tensors is None and loss == "mean" and m > 1 and isinstance(tensors, torch.Tensor) \
                and tensors.ndim == 0:
            grad_tensors = torch.full_like(tensors, 1.0 / m)
        return real_backward(tensors, grad_tensors, *a, **kw)

    def later(fn, what):
        def record(*a, **kw):
            if what == "zero_grad" and not calls.backwards:
                calls.zero_first = True
            else:  # parameters given as a generator are read now: the call is replayed later
                a = tuple(list(x) if _is_iter(x) else x for x in a)
                calls.after.append((fn, a, kw))
        return record

    saved_clip = {}
    for mod in (nnu, clip_mod):
        for name in _CLIP_NAMES:
            if hasattr(mod, name):
                saved_clip[(mod, name)] = getattr(mod, name)
                setattr(mod, name, later(saved_clip[(mod, name)], name))
    saved_opt = [(o, {k: o.__dict__[k] for k in ("step", "zero_grad") if k in o.__dict__}) for o in opts]
    for o in opts:  # (an LR scheduler wraps ``step`` on the instance: that wrapper comes back after)
        o.step, o.zero_grad = later(o.step, "step"), later(o.zero_grad, "zero_grad")
    torch.autograd.backward = backward
    try:
        yield
    finally:
        torch.autograd.backward = real_backward
        for (mod, name), f in saved_clip.items():
            setattr(mod, name, f)
        for o, own in saved_opt:
            del o.step, o.zero_grad
            o.__dict__.update(own)


def _is_iter(x) -> bool:
    return hasattr(x, "__next__")


# -- gradient accumulation ------------------------------------------------------------------------


def trainable(objs: list) -> list:
    """The GlobalTensor parameters that require grad of the modules and optimizers among ``objs``."""
    out, seen = [], set()

    def add(p):
        if isinstance(p, GlobalTensor) and p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)

    for _, o in objs:
        if isinstance(o, nn.Module):
            for p in o.parameters():
                add(p)
        elif isinstance(o, torch.optim.Optimizer):
            for g in o.param_groups:
                for p in g["params"]:
                    add(p)
    return out


def data_axes(args_objs: list, stage_axis: str | None) -> set:
    """Names of the mesh axes the batch is split over (some GlobalTensor argument is Split(0) there)."""
    out = set()
    for _, o in args_objs:
        if isinstance(o, GlobalTensor):
            for name, s in zip(o._spec.mesh.axes, o._spec.sbp):
                if isinstance(s, Split) and s.dim == 0 and name != stage_axis:
                    out.add(name)
    return out


def accumulators(params: list, axes: set, stage_axis: str | None = None) -> list:
    """Zero gradient accumulators, one per parameter, laid out as its gradient comes out of backward:
    Partial(sum) over the data axes where the parameter is Broadcast, and over the stage axis where a
    parameter tied across stages spans it; as the parameter elsewhere."""
    out = []
    for p in params:
        spec = p._spec
        sbp = tuple(Partial("sum") if isinstance(s, Broadcast) and (name in axes or name == stage_axis and n > 1) else s
                    for name, s, n in zip(spec.mesh.axes, spec.sbp, spec.mesh.shape))
        acc_spec = spec.with_sbp(sbp)
        shards = tuple(None if s is None else torch.zeros(acc_spec.local_shape(pos), dtype=s.dtype, device=s.device)
                       for pos, s in enumerate(p._shards))
        out.append(GlobalTensor._make(acc_spec, shards))
    return out


def tail_fn(params: list, calls: Calls):
    """The tail: the accumulated gradients (``accs``) reduced (reduce-scattered under ZeRO-2/3) and
    installed (replacing the gradients when the step zeroes them before backward or there are none,
    else added to them), then the deferred calls in order. Its arguments are the modules and
    optimizers (their state) and the accumulators."""

    def tail(owners, accs):
        with torch.no_grad():
            for p, acc in zip(params, accs):
                g = split_gradient(p, acc)  # ZeRO-2/3: reduce-scattered over the ZeRO axis, once a step
                if g is None:
                    grad_sbp = reduced(acc.sbp)
                    g = acc.to_global(acc.mesh, grad_sbp) if grad_sbp != acc.sbp else acc
                if calls.zero_first or p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)
        for fn, a, kw in calls.after:
            fn(*a, **kw)

    return tail


# -- phases and stages ------------------------------------------------------------------------------


def stages_of(objs: list):
    """The ``Stages`` of the first staged module among ``objs`` (``Plan(stages=...)``), else None."""
    for _, o in objs:
        st = getattr(o, "_shoal_stages", None)
        if st is not None:
            return st
    return None


def _slot_stage(s) -> int | None:
    owner, key = s.owner, s.key
    if key is None or (key == "grad" and isinstance(owner, torch.Tensor)):
        return getattr(owner, "_shoal_stage", None)
    if isinstance(owner, dict):
        return getattr(owner.get(key), "_shoal_stage", None)
    return None


def tag(g: Graph, stages) -> None:
    """Give every op of a body its model stage (``Op.stage``): forward ops the latest stage among
    what they read, backward ops the earliest (parameters and buffers know theirs), moved to a
    stage their device holds (the first at or after it going forward, the last at or before it going
    backward); ops reading nothing staged take the stage their device was last at (or its first, or
    its last going backward), which what they make does not inherit."""
    p = stages.p
    rank = {d: r for r, m in enumerate(stages.meshes) for d in m.devices}
    held = {d: [r + c * p for c in range(stages.v)] for d, r in rank.items()}
    of: dict[int, int] = {}
    last: dict = {}  # (device, phase) -> the stage of its last op known
    for s in g.slots:
        st = _slot_stage(s)
        for lid in local_ids(s.before) if st is not None else ():
            if lid is not None and isinstance(st, tuple):  # tied: on each device its stage there, if only one
                here = [x for x in st if x in held.get(g.locals[lid].device, ())]
                if len(here) == 1:
                    of[lid] = here[0]
            elif lid is not None:
                of[lid] = st
    for op in g.ops:
        known = [of[lid] for lid in (*op.reads, *op.writes) if lid in of]
        fwd = op.phase == "F"
        st = (max(known) if fwd else min(known)) if known else None
        devs = [op.device] if op.device is not None else list(op.devices)
        mine = held.get(devs[0]) if devs and op.kind != "comm" else None
        if mine is not None and st is None:
            # the stage its device was last at in this phase (what another process sent it, a
            # micro-batch's labels), else its device's first (last going backward); what it makes
            # does not inherit a guess (a label sliced in forward pulled backward to the first stage)
            op.stage = last.get((devs[0], op.phase), mine[0] if fwd else mine[-1])
            continue
        if mine is not None and st not in mine:
            later = [x for x in mine if x >= st] if fwd else [x for x in mine if x <= st][::-1]
            st = later[0] if later else (mine[-1] if fwd else mine[0])
        if mine is not None:
            last[devs[0], op.phase] = st
        op.stage = st
        if st is not None:
            for lid in (*op.out_ids, *op.writes):
                of.setdefault(lid, st)


def split_weight_grads(g: Graph, stages) -> None:
    """Zero-bubble's split of backward: a backward op is "B" (input gradient) when what it makes
    reaches a transfer to another stage, else "W" (weight gradient: only gradients of parameters
    depend on it), which the schedule may defer."""
    rank = {d: r for r, m in enumerate(stages.meshes) for d in m.devices}
    needed: set = set()
    for op in reversed(g.ops):
        if op.phase == "F":
            break
        if op.kind == "comm":
            ranks = {rank.get(d) for d in op.devices}
            if len(ranks) > 1 or any(lid in needed for lid in op.out_ids):
                needed.update(op.reads)
            continue
        if any(lid in needed for lid in (*op.out_ids, *op.writes)):
            needed.update(op.reads)
        elif op.device is not None:
            op.phase = "W"


# -- the order each device follows ------------------------------------------------------------------


def device_orders(plan, stages, name: str, m: int) -> tuple[dict, int]:
    """Per device: the (task id, micro-batch) its compute tasks fire in, following schedule ``name``
    for its pipeline rank; and the registers the schedule needs (the most micro-batches a stage
    holds between forward and backward, plus one)."""
    from ..runtime import schedules

    p, v = stages.p, stages.v
    if name == "interleaved" and v == 1:
        raise ValueError("shoal.compile: schedule='interleaved' needs virtual stages: give Plan(stages=...) "
                         f"{2 * p} or more stages for the {p} devices of {stages.axis!r}")
    if name != "interleaved" and v > 1:
        raise ValueError(f"shoal.compile: {stages.count} stages on {p} devices are virtual stages; use "
                         "schedule='interleaved'")
    orders = schedules.schedule(name, p, m, v)
    rank = {d: r for r, mesh in enumerate(stages.meshes) for d in mesh.devices}
    groups: dict = {}
    for t in plan.tasks:
        if t.kind == "compute" and t.device in rank and t.stage is not None:
            groups.setdefault((t.device, t.phase, t.stage // p), []).append(t.id)
    out = {}
    for d, r in rank.items():
        out[d] = [(tid, item.micro_batch) for item in orders[r] for tid in groups.get((d, item.kind, item.chunk), ())]
    regs = max(schedules.peak_in_flight(o) for o in orders) + 1
    return out, max(2, regs)


def plan_memory(plan, orders: dict, stages) -> None:
    """Planned peak bytes per device under the schedule: the one-micro-batch peak, plus the
    activations its forward keeps for backward (what its forward tasks export on the device) for
    each further micro-batch the schedule holds between F and B there (``plan.in_flight``)."""
    plan.in_flight = {}
    for d, seq in orders.items():
        release = "W" if any(plan.tasks[tid].phase == "W" for tid, _ in seq) else "B"  # zero-bubble: W reads them
        live: set = set()
        peak = 0
        for tid, k in seq:
            t = plan.tasks[tid]
            if t.phase == "F":
                live.add((k, t.stage))
                peak = max(peak, len(live))
            elif t.phase == release:
                live.discard((k, t.stage))
        plan.in_flight[d] = peak
        saved = sum(plan.graph.locals[lid].nbytes for tid, k in seq if k == 0 and plan.tasks[tid].phase == "F"
                    for lid in plan.tasks[tid].exports if plan.graph.locals[lid].device == d)
        plan.peak_bytes[d] = plan.peak_bytes.get(d, 0) + max(0, peak - 1) * saved
