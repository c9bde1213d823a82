"""Eager dispatch: one ATen op on GlobalTensors.

rule -> cheapest signature (boxing cost of the actual inputs) -> boxing -> the ATen op on every
local shard -> outputs wrapped as GlobalTensors. Decisions are cached by (op, input specs and
strides, static args). Ops without a rule run replicated on Broadcast inputs, warn once, and are
listed by ``coverage()``.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections import Counter
from dataclasses import dataclass

import torch
from torch._decomp import decomposition_table
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten

from . import aliasing, boxing, debug
from .mesh import Mesh
from .ops.registry import Call, Rule, expand, lookup
from .sbp import Broadcast, sbp_str
from .spec import TensorSpec
from .world import world

__all__ = ["dispatch", "coverage", "Coverage"]

_B = Broadcast()
# Moving a mutated tensor to another layout is allowed (the global value is all that counts)
# but costs its aliases; prefer anything else.
_INPLACE_RELAYOUT_COST = 1e15


class _Slot:
    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


@dataclass(frozen=True, slots=True)
class _Decision:
    mesh: Mesh
    in_specs: tuple[TensorSpec, ...]  # target layout per tensor input
    out_specs: tuple[TensorSpec, ...]
    out_strides: tuple[tuple[int, ...], ...]
    out_template: object  # output structure with _Slot(i) per tensor output
    mutated: tuple[int, ...]  # tensor inputs the op writes to
    returns_input: tuple[int | None, ...]  # per tensor output: the input it aliases in place, if any
    size_arg: int | None
    local: object  # callable replacing func on shards, or None
    local_ctx: bool  # local takes a Shard context first (its position and the specs)
    kind: str  # "rule" | "value" (run once on Broadcast, by design) | "fallback" | "decompose" | "random"
    # | "random_fallback" (a random op without a rule: drawn once on the whole values)
    run_once: bool  # every shard computes the same thing: compute once and share (CPU)
    tensor_args: tuple[int, ...]  # positions of the tensor args (calls without kwargs or tensor lists)
    calls: list  # [func, number of calls]: coverage counts live in the decisions (cheap to bump)
    positions: tuple[int, ...]  # mesh positions this process owns
    single_out: bool  # exactly one tensor output, a fresh one (not an in-place result)
    device: torch.device  # the wrapper device of outputs
    replicated: bool  # kind is "value" or "fallback": Broadcast inputs, run once


@dataclass(frozen=True, slots=True)
class Shard:
    """What a context-taking local function learns about the shard it runs on."""

    pos: int  # mesh position
    in_specs: tuple[TensorSpec, ...]
    out_specs: tuple[TensorSpec, ...]


_CACHE: dict = {}
_GT: type = type(None)  # GlobalTensor, set by shoal.tensor (it imports this module)
_FALLBACK_WARNED: set = set()
_DECOMPOSING: set = set()  # ops being decomposed now: their parts must not decompose into them again


@dataclass
class Coverage:
    by_rule: Counter
    by_decomposition: Counter
    by_fallback: Counter

    def __repr__(self) -> str:
        lines = [
            f"shoal coverage: {len(self.by_rule)} op(s) by rule, {len(self.by_decomposition)} by decomposition, "
            f"{len(self.by_fallback)} by fallback"
        ]
        lines += [f"  fallback  {op}  x{n}" for op, n in self.by_fallback.most_common()]
        return "\n".join(lines)


_COUNTER_OF = {
    "rule": "by_rule",
    "value": "by_rule",
    "random": "by_rule",
    "fallback": "by_fallback",
    "random_fallback": "by_fallback",
    "decompose": "by_decomposition",
}
_DECISIONS: list = []  # every decision made, cached or not, for coverage()


def coverage(reset: bool = False) -> Coverage:
    """Ops served by rules, by decomposition into ruled ops, and by the replicated fallback since
    start (or the last reset; a reset also lets each fallback op warn once more)."""
    out = Coverage(Counter(), Counter(), Counter())
    if reset:
        _FALLBACK_WARNED.clear()
    for dec in _DECISIONS:
        func, n = dec.calls
        if n:
            getattr(out, _COUNTER_OF[dec.kind])[func] += n
        if reset:
            dec.calls[1] = 0
    return out


# ---------------------------------------------------------------------------------------------
# argument templating: tensors become slots; everything else is part of the cache key


class _Seq:
    """A list or tuple argument that holds tensors."""

    __slots__ = ("kind", "items")

    def __init__(self, kind, items) -> None:
        self.kind, self.items = kind, items


def _template(obj, tensors: list, key: list):
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        key.append(_Slot)  # not None: [None, t] and [t, None] (index's indices) must not share a decision
        return _Slot(len(tensors) - 1)
    if isinstance(obj, (list, tuple)):
        if any(isinstance(e, torch.Tensor) for e in obj):
            key.append(len(obj))
            return _Seq(type(obj), [_template(e, tensors, key) for e in obj])
        key.append(tuple(obj))
        return obj
    key.append(float if type(obj) is float else obj)
    return obj


def _fill(obj, values):
    t = type(obj)
    if t is _Slot:
        return values[obj.i]
    if t is _Seq:
        return obj.kind(_fill(e, values) for e in obj.items)
    return obj


def _fill_args(targs: tuple, values) -> tuple:
    return tuple(_fill(a, values) for a in targs)


# ---------------------------------------------------------------------------------------------


def dispatch(func, args: tuple, kwargs: dict):
    """Run ATen op ``func`` on GlobalTensors (and plain tensors, taken as Broadcast)."""
    view, written = aliasing.effects(func)
    if written:
        _check_overlap(func, written, args, kwargs)
        return _run(func, args, kwargs)
    out = _run(func, args, kwargs)
    if view:
        aliasing.link(func, args, kwargs, out, _GT)
    return out


def _check_overlap(func, written, args, kwargs) -> None:
    """Writes into a tensor whose group (views of one root) another input belongs to must not
    partly overlap it (torch's rule); only tensors in a group are looked at."""
    targets = []
    for i, name in written:
        v = args[i] if i < len(args) else kwargs.get(name)
        for t in v if isinstance(v, (list, tuple)) else (v,):
            if type(t) is _GT and (t._view is not None or t._members):
                targets.append(t)
    if targets:
        inputs = [t for t in tree_flatten((args, kwargs))[0] if type(t) is _GT]
        aliasing.check_overlap(func, targets, inputs)


def _run(func, args: tuple, kwargs: dict):
    if debug.ENABLED and world().processes > 1:
        debug.check_op(func, args, kwargs)
    # the cache key: the op, every static argument, and each tensor's spec and strides
    tensors: list = []
    key: list = [func]
    simple = not kwargs  # no kwargs and no tensor lists: shards are swapped in by position
    for a in args:
        ta = type(a)
        if ta is _GT:
            tensors.append(a)
            key.append(a._spec)
            key.append(a.stride())
        elif isinstance(a, torch.Tensor):
            tensors.append(a)
            key.append(_plain_key(a))
        elif ta is list or ta is tuple:
            if a and any(isinstance(e, torch.Tensor) for e in a):
                simple = False
                break
            key.append(tuple(a))
        elif ta is float:
            key.append(float)  # values change every step (lr, bias corrections): decisions never read them
        else:
            key.append(a)
    if simple:
        targs, tkwargs = args, None
    else:
        tensors, key = [], [func]
        targs = tuple(_template(a, tensors, key) for a in args)
        tkwargs = {k: _template(v, tensors, key) for k, v in kwargs.items()} if kwargs else {}
        key.append(tuple(kwargs))
        for t in tensors:
            if isinstance(t, _GT):
                key.append(t._spec)
                key.append(t.stride())
            else:
                key.append(_plain_key(t))
    try:
        dec = _CACHE.get(tuple(key)) if _FORCED is None else None
    except TypeError:  # an unhashable static argument: decide without caching
        key = None
        dec = None
    if dec is None:
        if func is _COPY and _across_meshes(args):
            return _copy_across_meshes(*args, **kwargs)
        if simple:  # decisions work on templates
            targs, tkwargs = _retemplate(args)
        dec = _decide(func, targs, tkwargs, tensors, _mesh_of(func, tensors))
        _DECISIONS.append(dec)
        if key is not None and _FORCED is None:
            _CACHE[tuple(key)] = dec
    dec.calls[1] += 1
    kind = dec.kind
    if kind == "rule":
        if simple:
            return _execute(func, dec, args, None, tensors)
        return _execute(func, dec, targs, tkwargs, tensors)
    if simple:
        targs, tkwargs = _retemplate(args)
    if kind == "decompose":
        rule = lookup(func)
        fn = rule.decomposition if rule is not None and rule.decomposition is not None else _decomposition(func)
        _DECOMPOSING.add(func)
        try:
            return fn(*args, **kwargs)
        finally:
            _DECOMPOSING.discard(func)
    if kind == "random" or kind == "random_fallback":
        with _math_bits():
            return _random(func, dec, targs, tkwargs, tensors)
    with _math_bits():  # a fallback's kernel may be any of torch's, e.g. one viewing its operands conjugated
        try:
            out = _execute(func, dec, targs, tkwargs, tensors)
        except Exception as e:
            # a traced step runs the fallback on meta shards: an op without a meta kernel, or whose
            # result needs its inputs' values (nonzero's shape, allclose's bool), stops the trace clearly
            if kind == "fallback" and _tracing(tensors) and not _refused(func, targs, tkwargs, tensors):
                why = f"torch cannot run it on meta tensors, without values ({_first_line(e)})"
                raise _untraceable(func, why) from e
            raise
    if kind == "fallback" and func not in _FALLBACK_WARNED:  # after the run: a user error is not news
        _warn_fallback(func, tensors)
    return out


# Inside __torch_dispatch__ torch excludes the dispatch keys above Python, the Conjugate and Negative
# keys among them: a kernel that makes a conjugated or negated view of a shard internally (pinv's
# ``mH``) would have the bit ignored by the ops it feeds. Shard kernels of the fallback run with
# them (and ZeroTensor, for autograd's zero tensors) back, as one device runs them.
_MATH_KEYS = (torch._C.DispatchKey.Conjugate, torch._C.DispatchKey.Negative, torch._C.DispatchKey.ZeroTensor)


@contextlib.contextmanager
def _math_bits():
    was = [k for k in _MATH_KEYS if torch._C._dispatch_tls_is_dispatch_key_excluded(k)]
    for k in was:
        torch._C._dispatch_tls_set_dispatch_key_excluded(k, False)
    try:
        yield
    finally:
        for k in was:
            torch._C._dispatch_tls_set_dispatch_key_excluded(k, True)


def _wrapper_device() -> torch.device:
    from .tensor import _wrapper_device as wd

    return wd()


@functools.cache  # asked on every run of a decomposed op
def _decomposition(func):
    """torch's decomposition of ``func``: the op's own CompositeImplicitAutograd kernel (such ops
    reach dispatch from inside decompositions, below autograd), else its table entry. The kernel
    first: it stays in ATen ops, which have rules, where the table's entry may be a reference
    implementation in prims (``where.ScalarOther``), which have none."""
    if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
        return func.decompose
    return decomposition_table.get(func)


@functools.cache
def _draws(func) -> bool:
    """``func`` draws random numbers itself (torch tags it ``nondeterministic_seeded``). A
    CompositeImplicitAutograd op does not: its parts draw, each through dispatch."""
    return torch.Tag.nondeterministic_seeded in func.tags and not torch._C._dispatch_has_kernel_for_dispatch_key(
        func.name(), "CompositeImplicitAutograd")


def _refused(func, targs, tkwargs, tensors) -> bool:
    """Whether torch's meta kernel refuses the call itself on the global shapes (a shape mismatch: the
    user's error, raised as it is), not for want of values or of a meta kernel."""
    metas = [_meta(t) for t in tensors]
    try:
        with _untraced():
            func(*_fill_args(targs, metas), **_meta_kwargs(tkwargs, metas))
    except NotImplementedError:
        return False
    except Exception as e:  # noqa: BLE001
        return "meta" not in str(e)
    return False


def _decomposition_agrees(func, targs, tkwargs, tensors) -> bool:
    """torch's decomposition may return outputs the real op does not (the CPU flash attention one
    returns the attention weights where the kernel returns the logsumexp its backward reads). Use a
    decomposition only if, on meta tensors, its outputs have the kernel's shapes and dtypes (or the
    kernel has no meta implementation to compare with)."""
    metas = [_meta(t) for t in tensors]
    margs, mkwargs = _fill_args(targs, metas), _meta_kwargs(tkwargs, metas)
    try:
        with _untraced():
            want = func(*margs, **mkwargs)
    except NotImplementedError:  # no meta kernel: nothing to compare with
        return True
    except Exception:  # noqa: BLE001 - the call is refused (a dtype torch does not take): the kernel must say so
        return False
    try:
        _DECOMPOSING.add(func)
        with _untraced():
            got = _decomposition(func)(*margs, **mkwargs)
    except Exception:  # noqa: BLE001 - the decomposition cannot even run on meta: don't trust it
        return False
    finally:
        _DECOMPOSING.discard(func)

    def sig(o):
        if isinstance(o, torch.Tensor):
            return (tuple(o.shape), o.dtype)
        if isinstance(o, (list, tuple)):
            return tuple(sig(e) for e in o)
        return type(o)

    return sig(want) == sig(got)


def _retemplate(args: tuple) -> tuple[tuple, dict]:
    found: list = []
    return tuple(_template(a, found, []) for a in args), {}


def _plain_key(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.dtype, t.stride(), t.device)


_COPY = torch.ops.aten.copy_.default


def _across_meshes(args) -> bool:
    dst, src = args[0], args[1]
    return type(dst) is _GT and type(src) is _GT and dst._spec.mesh != src._spec.mesh


def _copy_across_meshes(dst, src, non_blocking: bool = False):
    """``dst.copy_(src)`` with ``src`` on another mesh (a state dict saved under another plan): the
    value moves onto ``dst``'s mesh first."""
    from .tensor import onto_mesh_of

    return dispatch(_COPY, (dst, onto_mesh_of(src, dst), non_blocking), {})


def _mesh_of(func, tensors) -> Mesh:
    mesh = None
    for t in tensors:
        if isinstance(t, _GT):
            if mesh is None:
                mesh = t._spec.mesh
            elif t._spec.mesh != mesh:
                raise ValueError(
                    f"shoal: {func} got GlobalTensors on different meshes: {mesh} and {t._spec.mesh}. "
                    f"Move one with x.to_global(mesh, sbp) first."
                )
    return mesh


def _warn_fallback(func, tensors) -> None:
    from .tensor import GlobalTensor

    _FALLBACK_WARNED.add(func)
    specs = [sbp_str(t._spec.sbp) if isinstance(t, GlobalTensor) else "plain" for t in tensors]
    warnings.warn(
        f"shoal: no SBP rule for {func}; inputs {specs} are made Broadcast and the op runs replicated "
        f"(correct but slow). shoal.coverage() lists such ops.",
        stacklevel=4,
    )


def _spec_of(t, mesh: Mesh) -> TensorSpec:
    from .tensor import GlobalTensor

    if isinstance(t, GlobalTensor):
        return t._spec
    return TensorSpec(tuple(t.shape), t.dtype, mesh, (_B,) * mesh.ndim)


def _untraced():
    """Meta runs that decide layouts are no part of a traced step: graph mode's tracer (a dispatch
    mode) must not see them (a decomposition tried on meta made ops the verifier then rejected)."""
    return _disable_current_modes()


def _meta_kwargs(tkwargs: dict, metas: list) -> dict:
    """Keyword arguments for a run on meta tensors: a ``device`` argument names the meta device too
    (``randn_like(x, device="cpu")`` would run for real, and draw: the first call, which decides,
    then gave other numbers than torch)."""
    kw = {k: _fill(v, metas) for k, v in tkwargs.items()}
    if kw.get("device") is not None:
        kw["device"] = "meta"
    return kw


def _meta(t) -> torch.Tensor:
    with _untraced():
        return torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device="meta")


def _aliases(func, tensors_by_arg: list[tuple[int, ...]]):
    """(mutated tensor-input indices, per returned value: the tensor input it aliases as a write).
    ``tensors_by_arg``: per schema argument, the tensor inputs it holds (a list holds several)."""
    schema = func._schema
    write_sets: dict = {}
    mutated: set[int] = set()
    for a, ti in zip(schema.arguments, tensors_by_arg):
        ai = a.alias_info
        if ai is not None and ai.is_write and ti:
            mutated.update(ti)  # Tensor(a!) and Tensor(a!)[]: every element is written
            if len(ti) == 1:
                for s in ai.before_set:
                    write_sets[s] = ti[0]
    rets = []
    for r in schema.returns:
        ai = r.alias_info
        hit = None
        if ai is not None and ai.is_write:
            for s in ai.before_set:
                hit = write_sets.get(s, hit)
        rets.append(hit)
    return tuple(sorted(mutated)), rets


def _slots_in(v) -> tuple[int, ...]:
    if type(v) is _Slot:
        return (v.i,)
    if type(v) is _Seq:
        return tuple(e.i for e in v.items if type(e) is _Slot)
    return ()


@dataclass
class _Prepared:
    rule: Rule | None
    call: Call | None  # None: no rule, a value op, or no meta kernel -> run replicated
    mutated: tuple[int, ...]
    returns_input: list[int | None]
    out_template: object


def _prepare(func, targs, tkwargs, tensors, specs: tuple = ()) -> _Prepared:
    # which tensor inputs each schema argument holds
    by_arg = [
        _slots_in(targs[i] if i < len(targs) else tkwargs.get(a.name)) for i, a in enumerate(func._schema.arguments)
    ]
    mutated, ret_alias = _aliases(func, by_arg)
    rule = lookup(func)
    if rule is None or rule.kind == "value":
        return _Prepared(rule, None, mutated, [], None)
    metas = [_meta(t) for t in tensors]
    margs, mkwargs = _fill_args(targs, metas), {k: _fill(v, metas) for k, v in tkwargs.items()}
    try:
        with _untraced():
            out_meta = func(*margs, **_meta_kwargs(tkwargs, metas))
    except Exception:  # no meta kernel or a data-dependent shape: decide on real values instead
        return _Prepared(rule, None, mutated, [], None)
    out_tensors: list = []
    out_template = _template(out_meta, out_tensors, [])
    call = Call(func, margs, mkwargs, tuple(metas), tuple(out_tensors), specs)
    return _Prepared(rule, call, mutated, _returned_inputs(out_meta, ret_alias, len(out_tensors)), out_template)


def _signatures(prep: _Prepared, mesh: Mesh):
    for ins, outs in expand(prep.call, prep.rule, mesh.shape):
        if any(i is not None and ins[i] != outs[k] for k, i in enumerate(prep.returns_input)):
            continue  # an in-place result has the layout its input is computed in
        yield ins, outs


def _decide(func, targs, tkwargs, tensors, mesh: Mesh) -> _Decision:
    in_specs0 = [_spec_of(t, mesh) for t in tensors]
    prep = _prepare(func, targs, tkwargs, tensors, tuple(in_specs0))
    rule = prep.rule
    decomposable = _decomposition(func) is not None and func not in _DECOMPOSING
    if prep.call is None:
        if rule is not None and rule.kind == "value":
            return _other_decision(func, mesh, in_specs0, prep.mutated, "value")
        if prep.mutated:
            _check_shapes_kept(func, targs, tkwargs, tensors, prep.mutated)
        if _draws(func):  # neither decomposed (other draws) nor run per device (one draw per device)
            return _other_decision(func, mesh, in_specs0, prep.mutated, "random_fallback")
        if decomposable and _decomposition_agrees(func, targs, tkwargs, tensors):
            return _other_decision(func, mesh, in_specs0, prep.mutated, "decompose")
        return _other_decision(func, mesh, in_specs0, prep.mutated, "fallback")
    can_decompose = rule.decomposition is not None or decomposable
    wants = rule.decompose is not None and can_decompose and func not in _DECOMPOSING and _FORCED is None
    if wants and rule.decompose(prep.call, tuple(in_specs0)):
        return _other_decision(func, mesh, in_specs0, prep.mutated, "decompose")
    best = None
    for ins, outs in _signatures(prep, mesh):
        if _FORCED is not None:
            if (ins, outs) == _FORCED:
                best = (0.0, ins, outs)
                break
            continue
        cost = 0.0
        for i, (spec, sbp) in enumerate(zip(in_specs0, ins)):
            if spec.sbp != sbp:
                cost += boxing.cost(spec, sbp) + (_INPLACE_RELAYOUT_COST if i in prep.mutated else 0.0)
        if best is None or cost < best[0]:
            best = (cost, ins, outs)
    if best is None:
        raise AssertionError(f"{func}: the forced signature {_FORCED} is not among the rule's signatures")
    _, ins, outs = best
    call, rule = prep.call, prep.rule
    local = rule.local(call, ins, outs) if rule.local is not None else None
    in_specs = tuple(s if s.sbp == sbp else s.with_sbp(sbp) for s, sbp in zip(in_specs0, ins))
    out_specs = tuple(TensorSpec(tuple(o.shape), o.dtype, mesh, sbp) for o, sbp in zip(call.outs, outs))
    return _Decision(
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        out_strides=tuple(o.stride() for o in call.outs),
        out_template=prep.out_template,
        mutated=prep.mutated,
        returns_input=tuple(prep.returns_input),
        size_arg=rule.size_arg,
        local=local,
        local_ctx=rule.local_ctx and local is not None,
        kind=rule.kind,
        run_once=_all_b(out_specs) and _all_b(in_specs) and rule.kind == "rule",
        tensor_args=_tensor_args(targs),
        calls=_new_calls(func),
        positions=mesh.local_positions,
        single_out=type(prep.out_template) is _Slot and prep.returns_input[0] is None,
        device=_wrapper_device(),
        replicated=False,
    )


def _tracing(tensors) -> bool:
    """Graph mode's trace: GlobalTensors whose shards are meta tensors."""
    for t in tensors:
        if isinstance(t, _GT):
            return any(s is not None and s.device.type == "meta" for s in t._shards)
    return False


def _untraceable(func, why: str) -> Exception:
    from .graph.trace import TraceError, user_line

    return TraceError(
        f"shoal.compile: {func} cannot be traced: {why}, at\n  {user_line()}\nA compiled step runs on "
        f"shapes alone while it is traced: run this op outside the compiled function (eagerly)."
    )


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _check_shapes_kept(func, targs, tkwargs, tensors, mutated) -> None:
    """A GlobalTensor's shape is fixed (its wrapper's sizes; in-place view ops have rules of their
    own): an op that gives its input another shape (``resize_``, ``set_``) is refused, clearly."""
    metas = [_meta(t) for t in tensors]
    try:
        with _untraced():
            func(*_fill_args(targs, metas), **_meta_kwargs(tkwargs, metas))
    except Exception:  # noqa: BLE001 - no meta kernel: nothing known, the run will tell
        return
    for i in mutated:
        t = tensors[i]
        if isinstance(t, _GT) and tuple(metas[i].shape) != tuple(t.shape):
            raise NotImplementedError(
                f"shoal: {func} changes the shape of its input in place ({list(t.shape)} -> {list(metas[i].shape)}, "
                f"laid out as {sbp_str(t._spec.sbp)}): a GlobalTensor's shape is fixed, except through in-place "
                f"view ops (unsqueeze_, transpose_...). Make a new tensor instead: x.new_empty(shape), or "
                f"x.reshape(shape) for as many elements."
            )


def _new_calls(func) -> list:
    return [func, 0]


def _tensor_args(targs) -> tuple[int, ...]:
    return tuple(i for i, a in enumerate(targs) if type(a) is _Slot)


def _all_b(specs) -> bool:
    return all(all(type(s) is Broadcast for s in sp.sbp) for sp in specs)


# -- for the validator: list a call's signatures, and force one -------------------------------

_FORCED = None


def signatures(func, args: tuple, kwargs: dict, mesh: Mesh) -> list:
    """Every exact n-D signature the registry offers for this call on ``mesh`` (plain tensor args)."""
    tensors: list = []
    targs = tuple(_template(a, tensors, []) for a in args)
    tkwargs = {k: _template(v, tensors, []) for k, v in kwargs.items()}
    prep = _prepare(func, targs, tkwargs, tensors)
    return [] if prep.call is None else list(_signatures(prep, mesh))


@contextlib.contextmanager
def force(ins, outs):
    """Run ops inside with exactly this signature (bypassing the cache); for the validator."""
    global _FORCED
    prev, _FORCED = _FORCED, (ins, outs)
    try:
        yield
    finally:
        _FORCED = prev


def _returned_inputs(out_meta, ret_alias, n: int) -> list[int | None]:
    """Per tensor output: the mutated tensor input it is (in-place and out= ops), else None."""
    out: list[int | None] = [None] * n
    if any(r is not None for r in ret_alias):
        flat = out_meta if isinstance(out_meta, (tuple, list)) else (out_meta,)
        k = 0
        for r, alias in zip(flat, ret_alias):
            if isinstance(r, torch.Tensor):
                out[k] = alias
                k += 1
    return out


def _other_decision(func, mesh, in_specs0, mutated, kind: str) -> _Decision:
    """Replicated runs (inputs made Broadcast) and decompositions (the op re-dispatched in parts)."""
    rep = (_B,) * mesh.ndim
    return _Decision(
        mesh=mesh,
        in_specs=tuple(s.with_sbp(rep) for s in in_specs0),
        out_specs=(),
        out_strides=(),
        out_template=None,
        mutated=mutated,
        returns_input=(),
        size_arg=None,
        local=None,
        local_ctx=False,
        kind=kind,
        run_once=True,
        tensor_args=(),
        calls=_new_calls(func),
        positions=mesh.local_positions,
        single_out=False,
        device=_wrapper_device(),
        replicated=kind in ("value", "fallback", "random_fallback"),
    )


# ---------------------------------------------------------------------------------------------


def _execute(func, dec: _Decision, targs, tkwargs, tensors):
    """Box the inputs, run on every local shard, wrap the outputs. ``tkwargs`` None: ``targs`` are
    the call's own args and tensors are swapped in at ``dec.tensor_args``."""
    mesh = dec.mesh
    positions = dec.positions
    shards_in = []
    for t, spec in zip(tensors, dec.in_specs):
        if type(t) is _GT or isinstance(t, _GT):
            src = t._spec
            shards_in.append(t._shards if src is spec or src.sbp == spec.sbp else t._shards_as(spec))
        else:
            shards = _plain_shards(t, mesh)
            rep = spec.with_sbp((_B,) * mesh.ndim)
            shards_in.append(shards if spec == rep else boxing.box(shards, rep, spec))
    if dec.replicated:  # the op sees each whole value with the strides torch would give it (view checks them)
        shards_in = [_with_strides(s, t.stride()) if type(t) is _GT else s for s, t in zip(shards_in, tensors)]
    once = dec.run_once and all(_same_everywhere(s, positions) for s in shards_in)
    fn = dec.local or func._op  # the C++ op itself: skips OpOverload.__call__
    results: list = [None] * mesh.size
    run_at = positions[:1] if once else positions
    same_as: dict = {}
    if dec.mutated and not once and len(positions) > 1:
        run_at, same_as = _plan_writes(dec.mutated, shards_in, positions)
    simple = tkwargs is None
    for p in run_at:
        if simple:
            a = list(targs)
            for i, j in enumerate(dec.tensor_args):
                a[j] = shards_in[i][p]
            kw = {}
        else:
            vals = [s[p] for s in shards_in]
            a = [_fill(x, vals) for x in targs]
            kw = {k: _fill(v, vals) for k, v in tkwargs.items()} if tkwargs else {}
        if dec.size_arg is not None:
            a[dec.size_arg] = list(dec.out_specs[0].local_shape(p))
        if dec.local_ctx:
            results[p] = fn(Shard(p, dec.in_specs, dec.out_specs), *a, **kw)
        else:
            results[p] = fn(*a, **kw)
    if once:
        r0 = results[positions[0]]
        for p in positions[1:]:
            results[p] = r0
    for q, p in same_as.items():
        results[q] = results[p]
    # a written tensor keeps its layout and memory (its views alias it): a result computed in another
    # layout, or on a copy, is written back into its own shards; then its group is told
    for i in dec.mutated:
        t = tensors[i]
        if isinstance(t, _GT):
            aliasing.write_shards(t, shards_in[i], dec.in_specs[i])
            aliasing.wrote(t)
    if dec.replicated:
        return _wrap_replicated(results, positions, mesh, tensors, dec, shards_in)
    if dec.single_out:  # one tensor out, not an input written in place
        return _GT._make(dec.out_specs[0], tuple(results), dec.out_strides[0], device=dec.device)
    if not positions:  # another process's devices: the outputs are known from the decision alone
        return _fill(dec.out_template, [
            tensors[dec.returns_input[k]] if dec.returns_input[k] is not None
            else _GT._make(spec, (None,) * mesh.size, dec.out_strides[k], device=dec.device)
            for k, spec in enumerate(dec.out_specs)
        ])
    first = results[positions[0]]
    outs_local = []
    _collect(first, outs_local)
    per_out = [[None] * mesh.size for _ in outs_local]
    for p in positions:
        flat: list = []
        _collect(results[p], flat)
        for k, v in enumerate(flat):
            per_out[k][p] = v
    wrapped = []
    for k, spec in enumerate(dec.out_specs):
        alias = dec.returns_input[k]
        if alias is not None and isinstance(tensors[alias], _GT):
            wrapped.append(tensors[alias])
        else:
            wrapped.append(_GT._make(spec, tuple(per_out[k]), dec.out_strides[k]))
    return _fill(dec.out_template, wrapped)


def _with_strides(shards: tuple, stride: tuple) -> tuple:
    """Whole-value shards laid out under ``stride`` (a GlobalTensor's own) where they are not and
    those strides address each element once."""
    out, made = [], {}
    for s in shards:
        if s is None or s.stride() == stride or s.numel() <= 1:
            out.append(s)
            continue
        if id(s) not in made:
            dims = sorted((st, n) for n, st in zip(s.shape, stride) if n > 1)
            reach = 0  # the furthest element the smaller strides reach: each stride must pass it
            for st, n in dims:
                if st <= reach:
                    return shards
                reach += (n - 1) * st
            buf = s.new_empty((reach + 1,))
            made[id(s)] = buf.as_strided(tuple(s.shape), stride).copy_(s)
        out.append(made[id(s)])
    return tuple(out)


def _random(func, dec: _Decision, targs, tkwargs, tensors):
    """Draw the global value exactly as one device would (same op, same RNG calls, global shape),
    then keep each shard's part: with the same seed, results equal single-device torch."""
    from .tensor import GlobalTensor, _scatter_full

    if dec.replicated:
        return _random_replicated(func, dec, targs, tkwargs, tensors)
    w = world()
    dev = w.torch_device(w.local_devices[0])
    full_in = [torch.empty(t.shape, dtype=t.dtype, device=dev) if isinstance(t, GlobalTensor) else t for t in tensors]
    out = func(*_fill_args(targs, full_in), **{k: _fill(v, full_in) for k, v in tkwargs.items()})
    if debug.ENABLED and w.processes > 1:  # every process must draw the same numbers: seed alike
        for d in [full_in[i] for i in dec.mutated] or [out]:
            debug.check_same_value(str(func), d)
    for i in dec.mutated:
        t = tensors[i]
        drawn = _scatter_full(full_in[i], t._spec)
        aliasing.write_shards(t, drawn._shards, t._spec)
        aliasing.wrote(t)
    if dec.mutated:
        return tensors[dec.mutated[0]]
    return _scatter_full(out, dec.out_specs[0])


def _random_replicated(func, dec: _Decision, targs, tkwargs, tensors):
    """A random op without a rule: run once, on its inputs' whole values (every process gathers
    them and draws the same numbers), and lay the results out Broadcast. Running it per device
    would draw once per device, and a decomposition may draw other numbers than the op does."""
    from .tensor import GlobalTensor, _full_value, _scatter_full

    if _tracing(tensors):
        raise _untraceable(func, "it is a random op without a rule, drawn once on its inputs' gathered values")
    rep = (_B,) * dec.mesh.ndim
    full_in = [_full_value(t) if isinstance(t, GlobalTensor) else t for t in tensors]
    out = func(*_fill_args(targs, full_in), **{k: _fill(v, full_in) for k, v in tkwargs.items()})
    for i in dec.mutated:
        t = tensors[i]
        if isinstance(t, GlobalTensor):
            aliasing.write_shards(t, _scatter_full(full_in[i], t._spec)._shards, t._spec)
            aliasing.wrote(t)

    def wrap(o):
        if isinstance(o, torch.Tensor):
            for i in dec.mutated:  # an in-place result: the written input itself
                if o is full_in[i]:
                    return tensors[i]
            return _scatter_full(o, TensorSpec(tuple(o.shape), o.dtype, dec.mesh, rep))
        if isinstance(o, (list, tuple)):
            return type(o)(wrap(e) for e in o)
        return o

    res = wrap(out)
    if func not in _FALLBACK_WARNED:
        _warn_fallback(func, tensors)
    return res


def _collect(obj, out: list) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for e in obj:
            _collect(e, out)


def _same_everywhere(shards, positions) -> bool:
    if not positions:
        return False
    first = shards[positions[0]]
    return all(shards[p] is first for p in positions)


def _region(t) -> tuple:
    """The memory a shard covers: equal regions are the same piece of memory (by storage, so that
    meta shards, which all have address 0, are told apart when a step is traced)."""
    if isinstance(t, torch.Tensor):
        return (t.untyped_storage()._cdata, t.storage_offset(), t.shape, t.stride())
    return (id(t),)


def _plan_writes(mutated, shards_in: list, positions) -> tuple[list, dict]:
    """Shards of several devices may be one piece of memory (Broadcast shares it on CPU).

    A position that reads exactly what an earlier one reads shares its result (the write happens
    once). Otherwise every written piece another position already writes is copied first, so each
    device writes its own. Returns (positions to run at, {skipped position: the one it shares}).
    """
    run_at, same_as = [], {}
    seen_reads: dict = {}
    written: list[set] = [set() for _ in mutated]
    for p in positions:
        reads = tuple(_region(s[p]) for s in shards_in)
        if reads in seen_reads:
            same_as[p] = seen_reads[reads]
            continue
        seen_reads[reads] = p
        for k, i in enumerate(mutated):
            region = _region(shards_in[i][p])
            if region in written[k]:
                new = list(shards_in[i])
                new[p] = new[p].clone()
                shards_in[i] = tuple(new)
                region = _region(new[p])
            written[k].add(region)
        run_at.append(p)
    return run_at, same_as


def _plain_shards(t: torch.Tensor, mesh: Mesh) -> tuple:
    """A plain tensor meeting a GlobalTensor is taken as Broadcast on its mesh."""
    w = world()
    out = [None] * mesh.size
    for p in mesh.local_positions:
        dev = w.torch_device(mesh.devices[p])
        out[p] = t if t.device == dev else t.to(dev)
    return tuple(out)


def _wrap_replicated(results, positions, mesh, tensors, dec, shards_in):
    """Outputs of a replicated run: tensors become Broadcast GlobalTensors."""
    from .tensor import GlobalTensor

    first = results[positions[0]] if positions else None
    w = world()
    if w.processes > 1 and not _covers_all_processes(mesh):
        # processes without a device here learn the result (a value, or tensor shapes) from its owner
        first = _from_owner(first, w.process_of(mesh.devices[0]))
    rep = (_B,) * mesh.ndim

    def wrap(obj, path):
        if isinstance(obj, torch.Tensor):
            for i in dec.mutated:  # in-place result: the mutated input itself
                t = tensors[i]
                if isinstance(t, GlobalTensor) and shards_in[i][positions[0]] is obj:
                    return t
            shards = [None] * mesh.size
            for p in positions:
                shards[p] = _pick(results[p], path)
            spec = TensorSpec(tuple(obj.shape), obj.dtype, mesh, rep)
            return GlobalTensor._make(spec, tuple(shards), obj.stride())
        if isinstance(obj, (list, tuple)):
            return type(obj)(wrap(e, (*path, k)) for k, e in enumerate(obj))
        return obj

    return wrap(first, ())


def _covers_all_processes(mesh: Mesh) -> bool:
    w = world()
    return len({w.process_of(d) for d in mesh.devices}) == w.processes


def _from_owner(obj, src: int):
    """``obj`` as process ``src`` has it, on every process; tensors travel as meta tensors (shapes only)."""
    import torch.distributed as dist

    def meta(o):
        if isinstance(o, torch.Tensor):
            return torch.empty_strided(tuple(o.shape), o.stride(), dtype=o.dtype, device="meta")
        if isinstance(o, (list, tuple)):
            return type(o)(meta(e) for e in o)
        return o

    box = [meta(obj) if world().rank == src else None]
    dist.broadcast_object_list(box, src)
    return obj if world().rank == src else box[0]


def _pick(obj, path):
    for k in path:
        obj = obj[k]
    return obj
