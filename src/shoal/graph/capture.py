"""Capture: find a step's state, swap it for meta stand-ins, trace, put everything back.

State is what the step reads and leaves behind besides its arguments' values: parameters,
gradients and buffers of the modules it is given, the state of the optimizers it is given. The
guard key says when a captured graph no longer fits the call (shapes, dtypes, meshes, layouts,
which state exists, optimizer settings).
"""

from __future__ import annotations

import contextlib
import sys
import time
import traceback

import torch
from torch import nn
from torch.utils._pytree import tree_map

from .. import seam
from ..sbp import Partial
from ..tensor import GlobalTensor
from .ir import Graph, Ref, Slot, Value
from .trace import TraceError, Tracer, library_file, user_line

__all__ = ["capture", "function_key", "globals_key", "guard_key", "state_slots"]

_SKIP_GROUP_KEYS = ("params", "capturable", "foreach", "fused")


def _lr_is_input(opt, grp: dict) -> bool:
    """Optimizers whose traced path takes a tensor learning rate (capturable ones, and SGD's foreach
    path under a compiler) read it as a graph input: a schedule changing it needs no retrace."""
    return isinstance(grp.get("lr"), float) and ("capturable" in grp or isinstance(opt, torch.optim.SGD))


def _group_key(opt, grp: dict) -> tuple:
    """A param group's settings, but a learning rate that is a graph input."""
    skip = _SKIP_GROUP_KEYS + (("lr",) if _lr_is_input(opt, grp) else ())
    return tuple((k, v) for k, v in grp.items() if k not in skip)


def _walk(obj, path: str, out: list) -> None:
    if isinstance(obj, (list, tuple)):
        for i, e in enumerate(obj):
            _walk(e, f"{path}[{i}]", out)
    elif isinstance(obj, dict):
        for k, e in obj.items():
            _walk(e, f"{path}[{k!r}]", out)
    else:
        out.append((path, obj))


def leaves(args: tuple, kwargs: dict, fn=None, optimizers: bool = True) -> list:
    """(path, object) of every leaf of a step's arguments, then of what ``fn`` reads without taking
    it as an argument (``implicit``); without the optimizers unless ``optimizers`` (a pipelined
    step's body, which defers them, neither reads nor depends on their state)."""
    out: list = []
    _walk(list(args), "args", out)
    _walk(kwargs, "kwargs", out)
    if fn is not None:
        out += implicit(fn)
    if not optimizers:
        out = [(path, o) for path, o in out if not isinstance(o, torch.optim.Optimizer)]
    return out


def implicit(fn) -> list:
    """The modules, optimizers and GlobalTensors a step function names without taking them as
    arguments: globals its code names and variables it closes over (a step written as
    ``def step(x, y): loss = model(x, y); ...``). They are traced as if passed."""
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    out = []
    glb = getattr(fn, "__globals__", {})
    for name in code.co_names:
        v = glb.get(name)
        if isinstance(v, (nn.Module, torch.optim.Optimizer, GlobalTensor)):
            out.append((f"global {name}", v))
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            v = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(v, (nn.Module, torch.optim.Optimizer, GlobalTensor)):
            out.append((f"closure {name}", v))
    return out


def _tensor_key(t):
    if isinstance(t, GlobalTensor):
        return ("G", t._spec, t.stride(), t.requires_grad)
    return ("T", tuple(t.shape), t.dtype, t.stride(), t.device)


def _module_tree(m: nn.Module, seen: set, out: list) -> list:
    """``m`` and its submodules not in ``seen`` (ids), pre-order (named_modules without the names:
    this runs at every call)."""
    if id(m) not in seen:
        seen.add(id(m))
        out.append(m)
        for c in m._modules.values():
            if c is not None:
                _module_tree(c, seen, out)
    return out


def _param_places(p, seen: set, out: list) -> None:
    if isinstance(p, GlobalTensor) and id(p) not in seen:
        seen.add(id(p))
        out.append((p, None, p))
        out.append((p, "grad", p.grad))


def _places(o, seen: set, out: list, key: list) -> None:
    """Append to ``out`` where the state of module or optimizer ``o`` lives, (owner, key, value) per
    place, with ``owner[key]`` or ``owner.key`` holding a tensor (or a gradient not made yet); key
    None: the GlobalTensor ``owner`` itself, written in place. Places already walked (``seen``) are
    skipped. Appends to ``key`` what else a graph depends on: training flags, optimizer settings and
    which state each parameter has."""
    add = key.append
    if id(o) in seen:
        add(("again", id(o)))
    elif isinstance(o, nn.Module):
        mods = _module_tree(o, seen, [])
        add(tuple(m.training for m in mods))
        for m in mods:
            for p in m._parameters.values():
                _param_places(p, seen, out)
            bufs = m._buffers
            for k, b in bufs.items():
                if isinstance(b, GlobalTensor):
                    out.append((bufs, k, b))
    else:  # an optimizer
        seen.add(id(o))
        state = o.state
        for g in o.param_groups:
            add(_hashable(_group_key(o, g)))
            for p in g["params"]:
                _param_places(p, seen, out)
                st = state.get(p)
                if not st:
                    add(None)
                    continue
                add(tuple((k, type(v)) for k, v in st.items()))  # a Python number in the state: by type
                for k, v in st.items():
                    if isinstance(v, torch.Tensor):
                        out.append((st, k, v))


def state_slots(objs) -> list[Slot]:
    """The state of the modules and optimizers among ``objs``, one Slot per place it lives."""
    places: list = []
    seen: set = set()
    for _, o in objs:
        if isinstance(o, (nn.Module, torch.optim.Optimizer)):
            _places(o, seen, places, [])
    labels = _labels(objs)
    return [Slot(owner, k, labels.get((id(owner), k), "state"), None) for owner, k, _ in places]


def _labels(objs) -> dict:
    """(id(owner), key) -> a name for the listing: the parameter's name in its module, or the
    optimizer's parameter number."""
    out: dict = {}
    for _, o in objs:
        if isinstance(o, nn.Module):
            for name, p in o.named_parameters():
                out.setdefault((id(p), None), name)
                out.setdefault((id(p), "grad"), f"{name}.grad")
            for mname, m in o.named_modules():
                for b in m._buffers:
                    out.setdefault((id(m._buffers), b), f"{mname}.{b}" if mname else b)
        elif isinstance(o, torch.optim.Optimizer):
            params = [p for g in o.param_groups for p in g["params"]]
            for i, p in enumerate(params):
                out.setdefault((id(p), None), f"param{i}")
                out.setdefault((id(p), "grad"), f"param{i}.grad")
                for k in o.state.get(p, {}):
                    out.setdefault((id(o.state[p]), k), f"opt[{out[(id(p), None)]}].{k}")
    return out


def guard_key(objs: list) -> tuple[tuple, list]:
    """What a captured graph depends on besides the values of its tensors, for the arguments'
    leaves ``objs``: their shapes, dtypes, strides (an argument's shards' too), meshes and layouts,
    which modules and optimizers it was given and where their state lives (the very objects: a graph
    reads and writes them), the state's layouts, optimizer settings; and the places (as
    ``state_slots`` orders them, with their values).
    (Called every step: kept cheap.)"""
    key: list = []
    add = key.append
    seen: set = set()
    places: list = []
    for path, o in objs:
        if isinstance(o, torch.Tensor):
            add(_tensor_key(o))
            if isinstance(o, GlobalTensor):  # and its shards' strides: the graph's ops on them were traced on these
                add(tuple(None if s is None else s.stride() for s in o._shards))
        elif isinstance(o, (nn.Module, torch.optim.Optimizer)):
            add(id(o))
            _places(o, seen, places, key)
        else:
            add((path, _hashable(o)))
    for owner, k, v in places:
        add(id(owner))
        add(k)
        add(None if v is None else _tensor_key(v))
    return tuple(key), places


_SIMPLE = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device)


def function_key(fn) -> tuple:
    """What the step function reads besides its arguments: the globals its code names and the
    variables it closes over (a number by value, anything else by identity). (The globals of the
    other functions of the user's on the stack of a traced op are ``Graph.globals_read``.)"""
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return (id(fn),)
    glb = getattr(fn, "__globals__", {})
    key = []
    for name in code.co_names:
        if name in glb:
            key.append((name, _by_value(glb[name])))
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            key.append((name, _by_value(cell.cell_contents)))
        except ValueError:  # an empty cell
            key.append((name, None))
    return tuple(key)


def _user_globals(codes: dict) -> tuple:
    """(globals dict, names) per module of the user's code among ``codes`` (code object -> its
    globals): the globals its functions name. Not the user's: the standard library, torch, shoal,
    installed packages, generated code (``<string>``, named tuples) and modules' top level."""
    names: dict = {}
    for code, glb in codes.items():
        f = code.co_filename
        if f.startswith("<") or code.co_name == "<module>" or library_file(f):
            continue
        mine = names.setdefault(id(glb), (glb, set()))[1]
        mine.update(n for n in code.co_names if n in glb)
    return tuple((glb, tuple(sorted(ns))) for glb, ns in names.values() if ns)


def globals_key(reads: tuple) -> tuple:
    """The values of ``Graph.globals_read`` now (a number by value, anything else by identity)."""
    return tuple(_by_value(glb.get(n)) for glb, names in reads for n in names)


def _by_value(v):
    if isinstance(v, _SIMPLE) or (isinstance(v, tuple) and all(isinstance(e, _SIMPLE) for e in v)):
        return v
    return ("id", id(v))


def _hashable(o):
    try:
        hash(o)
        return o
    except TypeError:
        if isinstance(o, (list, tuple)):
            return tuple(_hashable(e) for e in o)
        if isinstance(o, dict):
            return tuple((k, _hashable(v)) for k, v in o.items())
        return ("id", id(o))


def _fusable(opt, grp: dict) -> bool:
    """Adam(W) can take its fused kernel (one op for every parameter) where each parameter's state is
    laid out as the parameter (not under ZeRO, which splits the state only)."""
    if type(opt) not in (torch.optim.Adam, torch.optim.AdamW) or "fused" not in grp or grp.get("differentiable"):
        return False
    meshes = set()
    for p in grp["params"]:
        if not isinstance(p, GlobalTensor) or not p.dtype.is_floating_point or p.is_complex():
            return False
        meshes.add(p._spec.mesh)
        if len(meshes) > 1:  # pipeline stages: one kernel cannot span them
            return False
        for v in opt.state.get(p, {}).values():
            if isinstance(v, GlobalTensor) and (v._spec.mesh != p._spec.mesh or v._spec.sbp != p._spec.sbp):
                return False
    return True


@contextlib.contextmanager
def _optimizers_traceable(opts, tr: Tracer, g: Graph):
    """Optimizers take a path without Python floats read from tensors while traced: Adam(W)'s fused
    kernel, else the capturable foreach path (step counters and bias corrections as tensor ops,
    re-run every step). Where that path takes a tensor learning rate, the rate is an input of the
    graph (a schedule changing it every step does not retrace), read from the param group at every
    call."""
    saved = []
    for o in opts:
        for grp in o.param_groups:
            saved.append((grp, {k: grp[k] for k in ("capturable", "foreach", "fused", "lr") if k in grp}))
            fused = _fusable(o, grp)
            if "capturable" in grp:
                grp["capturable"] = True
            if _lr_is_input(o, grp):
                lr = torch.tensor(grp["lr"], dtype=torch.float64)
                g.scalars.append((grp, "lr", tr.host_input(lr), lr.dtype))
                grp["lr"] = lr
            if fused:
                grp["fused"], grp["foreach"], grp["capturable"] = True, False, False
            elif "foreach" in grp:
                grp["foreach"] = True
    prev = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = prev
        for grp, kv in saved:
            grp.update(kv)


def _same_random_state():
    """The random generators as they were before, afterwards."""
    from ..world import world

    w = world()
    cuda = [w.torch_device(d).index for d in w.local_devices] if w.device_type == "cuda" else []
    return torch.random.fork_rng(devices=cuda)


def capture(fn, args: tuple, kwargs: dict, optimizers: bool = True) -> Graph:
    """Trace ``fn(*args, **kwargs)`` into a Graph; every tensor and state is as it was afterwards.
    ``optimizers``: whether the optimizers among its arguments are part of its state (``leaves``)."""
    t0 = time.perf_counter()
    tr = Tracer()
    g = tr.g
    objs = leaves(args, kwargs, fn, optimizers)
    slots = state_slots(objs)
    opts = [o for _, o in objs if isinstance(o, torch.optim.Optimizer)]
    saved_gt: dict[int, tuple] = {}  # id -> (tensor, shards, spec, resolved)
    saved_slots = [(s, s.get()) for s in slots]
    saved_opt = [(o, {p: dict(st) for p, st in o.state.items()}) for o in opts]

    def stand_in(t: GlobalTensor) -> None:
        if id(t) not in saved_gt:
            saved_gt[id(t)] = (t, t._shards, t._spec, t._resolved)
            t._set_shards(tr.meta_input(t._spec, t._shards, t.stride()))

    host_swapped = []
    traced_obj = {}  # slot -> the object the trace starts from
    try:
        for s, v in saved_slots:
            traced_obj[id(s)] = v
            if isinstance(v, GlobalTensor):
                stand_in(v)
                s.before = tr.value(v)
            elif isinstance(v, torch.Tensor):  # a plain state tensor (an optimizer's step count)
                c = traced_obj[id(s)] = v.clone()
                s.set(c)
                host_swapped.append((s, v))
                s.before = tr.host_input(c)
        copies: dict = {}  # id(plain tensor argument) -> the copy the trace reads and writes (host work runs)
        for i, (path, o) in enumerate(objs):
            if isinstance(o, GlobalTensor):
                stand_in(o)
                g.inputs.append((i, path, tr.value(o)))
            elif isinstance(o, torch.Tensor):
                if o.requires_grad:
                    raise TraceError(f"shoal.compile: {path} is a plain tensor that requires grad; "
                                     "pass GlobalTensors or tensors without grad")
                c = copies.setdefault(id(o), _replica(o))
                g.inputs.append((i, path, tr.host_input(c)))
        if copies:
            args, kwargs = tree_map(lambda t: copies.get(id(t), t), (args, kwargs))
        # the trace draws random numbers for real (host work runs): the step itself must draw the same
        tr.outer = sys._getframe()
        with _same_random_state(), seam.using(tr), _optimizers_traceable(opts, tr, g), tr, tr.recording_rng():
            out = fn(*args, **kwargs)
        g.globals_read = _user_globals(tr.code_seen)
        g.outputs = _out_refs(tr, out, g)
        # state after the step, including state it created (an optimizer's first step)
        for s, _ in saved_slots:
            now = s.get()
            s.after = _state_ref(tr, now)
            s.same = now is not None and now is traced_obj[id(s)]
            s.kept = (s.same and isinstance(s.before, Value) and isinstance(s.after, Value)
                      and s.after.locals == s.before.locals and s.after.spec == s.before.spec
                      and not any(isinstance(x, Partial) for x in s.after.spec.sbp))
        known = {(id(s.owner), s.key) for s in slots}
        for s in state_slots(objs):
            if (id(s.owner), s.key) not in known:
                s.after = _state_ref(tr, s.get())
                slots.append(s)
        g.slots = slots
        g.kept = tuple(lid for s in slots if s.kept for lid in s.after.locals if lid is not None)
    except BaseException as e:
        if isinstance(e, Exception) and not isinstance(e, TraceError):
            where = user_line(traceback.extract_tb(e.__traceback__)).split("\n")[0]
            e.add_note(f"shoal.compile: raised while tracing {getattr(fn, '__qualname__', fn)} on meta shards (the "
                       f"message may read differently from eager's), at\n  {where}")
        for o, st in saved_opt:
            o.state.clear()
            o.state.update(st)
        for s, v in saved_slots:
            s.set(v) if s.key is not None else None
        raise
    finally:
        tr.restore()
        for t, shards, spec, resolved in saved_gt.values():
            t._set_shards(shards, spec, resolved)
        for s, v in host_swapped:
            s.set(v)
    # ops whose device was never decided were only made to decide layouts
    dead = tr.unsettled()
    g.ops = [op for op in g.ops if id(op) not in dead]
    g.notes.append(f"traced in {time.perf_counter() - t0:.2f} s")
    return g


def _replica(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` laid out in memory as ``t`` is (offset and strides: the trace records views
    against them)."""
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    return out.set_(t.untyped_storage().clone(), t.storage_offset(), t.shape, t.stride())


def _state_ref(tr: Tracer, v):
    if isinstance(v, GlobalTensor):
        return tr.value(v)
    if isinstance(v, torch.Tensor):
        return tr.lid(v)
    return None


def _out_refs(tr: Tracer, out, g: Graph):
    if isinstance(out, GlobalTensor):
        v = tr.value(out)
        g.out_refs.append(v)
        return v
    if isinstance(out, torch.Tensor):
        lid = tr.lid(out)
        if lid is None or g.locals[lid].device is not None:
            raise TraceError("shoal.compile: the step returns a plain tensor made from a shard; return the "
                             "GlobalTensor instead")
        r = Ref(lid)
        g.out_refs.append(r)
        return r
    if isinstance(out, (list, tuple)):
        return type(out)(_out_refs(tr, e, g) for e in out)
    if isinstance(out, dict):
        return {k: _out_refs(tr, e, g) for k, e in out.items()}
    return out

