"""Deciding how one op runs on GlobalTensors: pure, from what the cache key holds (the op, its
static arguments, each tensor input's layout, shape, strides and dtype), never from values or
shards. The validator and a search ask ``decide`` and ``signatures`` directly."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
from torch._decomp import decomposition_table
from torch.utils._python_dispatch import _disable_current_modes

from .. import boxing, schema
from ..mesh import Mesh
from ..ops.registry import Call, Rule, expand, lookup
from ..sbp import Broadcast, sbp_str
from ..spec import TensorSpec
from ..tensor import GlobalTensor
from .coverage import _new_calls
from .key import _fill, _fill_args, _Slot, _slots_in, _template, _tensor_args

__all__ = ["Decision", "Input", "decide", "signatures"]

_B = Broadcast()
# Moving a mutated tensor to another layout is allowed (the global value is all that counts)
# but costs its aliases; prefer anything else.
_INPLACE_RELAYOUT_COST = 1e15
_DECOMPOSING: set = set()  # ops being decomposed now: their parts must not decompose into them again


@dataclass(frozen=True, slots=True)
class Decision:
    """How one call runs: for every process alike (what a process owns, ``positions`` and the
    wrapper ``device``, is bound after deciding)."""

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
    positions: tuple[int, ...] | None  # mesh positions this process owns (bound after deciding)
    single_out: bool  # exactly one tensor output, a fresh one (not an in-place result)
    device: torch.device | None  # the wrapper device of outputs (bound after deciding)
    replicated: bool  # kind is "value" or "fallback": Broadcast inputs, run once
    needs_values: bool = False  # the outputs' shapes need the inputs' values (nonzero): no meta run decides

    def bound(self, positions: tuple[int, ...], device) -> Decision:
        """This decision for a process owning mesh ``positions``, outputs wrapped on ``device``."""
        return dataclasses.replace(self, positions=positions, device=device)


class Input:
    """What deciding knows of a tensor input: shape, strides, dtype and, for a GlobalTensor, its
    layout (a plain tensor is Broadcast); no values, no shards."""

    __slots__ = ("shape", "dtype", "_stride", "spec", "is_global")

    def __init__(self, shape, dtype, stride, spec=None) -> None:
        self.shape, self.dtype, self._stride, self.spec, self.is_global = shape, dtype, stride, spec, spec is not None

    @staticmethod
    def of(t) -> Input:
        spec = t._spec if isinstance(t, GlobalTensor) else None
        return Input(tuple(t.shape), t.dtype, tuple(t.stride()), spec)

    def stride(self) -> tuple:
        return self._stride


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


def _spec_of(t, mesh: Mesh) -> TensorSpec:
    if t.is_global:
        return t.spec
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


@dataclass
class _Prepared:
    rule: Rule | None
    call: Call | None  # None: no rule, a value op, or no meta kernel -> run replicated
    mutated: tuple[int, ...]
    returns_input: list[int | None]
    out_template: object


def _prepare(func, targs, tkwargs, tensors, specs: tuple = ()) -> _Prepared:
    # which tensor inputs each schema argument holds
    by_arg = [_slots_in(targs[i] if i < len(targs) else tkwargs.get(name))
              for i, name in enumerate(schema.of(func).names)]
    mutated, ret_alias = schema.mutated(func, by_arg)
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


def decide(func, targs, tkwargs, inputs: list[Input], mesh: Mesh, forced=None) -> Decision:
    """The decision for ``func`` called with argument templates ``targs``/``tkwargs`` on ``inputs``
    (per tensor slot) on ``mesh``: the cheapest exact signature of its rule (boxing cost of the
    inputs' layouts), or a decomposition, a replicated run, a random draw. ``forced``: (input SBPs,
    output SBPs), the signature to take (the validator's). Pure: no tensor values, no process."""
    tensors = inputs
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
        return _other_decision(func, mesh, in_specs0, prep.mutated, "fallback",
                               needs_values=torch.Tag.dynamic_output_shape in func.tags)
    can_decompose = rule.decomposition is not None or decomposable
    wants = rule.decompose is not None and can_decompose and func not in _DECOMPOSING and forced is None
    if wants and rule.decompose(prep.call, tuple(in_specs0)):
        return _other_decision(func, mesh, in_specs0, prep.mutated, "decompose")
    best = None
    for ins, outs in _signatures(prep, mesh):
        if forced is not None:
            if (ins, outs) == forced:
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
        raise AssertionError(f"{func}: the forced signature {forced} is not among the rule's signatures")
    _, ins, outs = best
    call, rule = prep.call, prep.rule
    local = rule.local(call, ins, outs) if rule.local is not None else None
    in_specs = tuple(s if s.sbp == sbp else s.with_sbp(sbp) for s, sbp in zip(in_specs0, ins))
    out_specs = tuple(TensorSpec(tuple(o.shape), o.dtype, mesh, sbp) for o, sbp in zip(call.outs, outs))
    return Decision(
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
        positions=None,
        single_out=type(prep.out_template) is _Slot and prep.returns_input[0] is None,
        device=None,
        replicated=False,
    )


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
        if t.is_global and tuple(metas[i].shape) != tuple(t.shape):
            raise NotImplementedError(
                f"shoal: {func} changes the shape of its input in place ({list(t.shape)} -> {list(metas[i].shape)}, "
                f"laid out as {sbp_str(t.spec.sbp)}): a GlobalTensor's shape is fixed, except through in-place "
                f"view ops (unsqueeze_, transpose_...). Make a new tensor instead: x.new_empty(shape), or "
                f"x.reshape(shape) for as many elements."
            )


def _all_b(specs) -> bool:
    return all(all(type(s) is Broadcast for s in sp.sbp) for sp in specs)


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


def _other_decision(func, mesh, in_specs0, mutated, kind: str, needs_values: bool = False) -> Decision:
    """Replicated runs (inputs made Broadcast) and decompositions (the op re-dispatched in parts)."""
    rep = (_B,) * mesh.ndim
    return Decision(
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
        positions=None,
        single_out=False,
        device=None,
        replicated=kind in ("value", "fallback", "random_fallback"),
        needs_values=needs_values,
    )


def signatures(func, args: tuple, kwargs: dict, mesh: Mesh) -> list:
    """Every exact n-D signature the registry offers for this call on ``mesh`` (plain tensor args)."""
    tensors: list = []
    targs = tuple(_template(a, tensors, []) for a in args)
    tkwargs = {k: _template(v, tensors, []) for k, v in kwargs.items()}
    prep = _prepare(func, targs, tkwargs, [Input.of(t) for t in tensors])
    return [] if prep.call is None else list(_signatures(prep, mesh))
