"""The one reader of ATen op schemas: argument names and defaults, which arguments an op writes in
place, which outputs are those written inputs, and whether the op returns views of its input.
Dispatch, the tracer, the aliasing of views, the validator and the rules all ask here.
Imports nothing of shoal."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = ["Schema", "of", "bind", "mutated"]


@dataclass(frozen=True, slots=True)
class Schema:
    names: tuple[str, ...]  # every argument, in order
    defaults: tuple  # per argument: its default (None where it has none)
    written: tuple[tuple[int, str], ...]  # (position, name) of every argument written in place (Tensor(a!))
    write_sets: tuple[tuple[str, ...] | None, ...]  # per argument written: its alias sets (a list's: ()); else None
    returned_sets: tuple[tuple[str, ...], ...]  # per return: the alias sets of the written input it is
    view: bool  # returns views of its first argument (Tensor(a) self -> Tensor(a)), not composite
    mutable: bool
    fresh: bool  # writes nothing and returns no alias of an input: its outputs are new tensors


@functools.cache
def of(func) -> Schema:
    s = func._schema
    args = s.arguments
    write_sets = tuple(tuple(a.alias_info.before_set) if a.alias_info is not None and a.alias_info.is_write
                       else None for a in args)
    written = tuple((i, a.name) for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write)
    first = args[0].alias_info if args else None
    view = not written and bool(s.returns) and first is not None and not first.is_write
    # a composite "may alias" op (reshape, flatten, resolve_conj) is a view only where its parts are:
    # the view ops it decomposes into are views themselves
    composite = torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")
    return Schema(
        names=tuple(a.name for a in args),
        defaults=tuple(a.default_value if a.has_default_value() else None for a in args),
        written=written,
        write_sets=write_sets,
        returned_sets=tuple(tuple(r.alias_info.before_set) if r.alias_info is not None and r.alias_info.is_write
                            else () for r in s.returns),
        view=view and not composite,
        mutable=s.is_mutable,
        fresh=not s.is_mutable and not any(a.alias_info is not None for a in (*args, *s.returns)) and not composite,
    )


def bind(func, args, kwargs, start: int = 0) -> dict:
    """The call's arguments from position ``start`` on, by name (given by position or keyword, else
    the schema's default; ``args`` begin at ``start``)."""
    sc = of(func)
    out = {}
    for i, name in enumerate(sc.names[start:]):
        if i < len(args):
            out[name] = args[i]
        elif name in kwargs:
            out[name] = kwargs[name]
        else:
            out[name] = sc.defaults[start + i]
    return out


# The fused Adam kernels mark their gradients written (Tensor(b!)[] grads) but store them only when
# unscaling by a grad_scale (ATen's CPU and CUDA kernels alike): without one they read them, and a
# gradient bucket they read stays shareable between devices.
_UNSCALED_GRADS = {"aten::_fused_adam_", "aten::_fused_adamw_"}


def mutated(func, tensors_by_arg) -> tuple[tuple[int, ...], list]:
    """(the tensor inputs ``func`` writes, per return: the tensor input it is, or None).
    ``tensors_by_arg``: per schema argument, the indices of the tensor inputs it holds (a list holds
    several; each element of a written list is written)."""
    sc = of(func)
    read_only = None
    if func._schema.name in _UNSCALED_GRADS and not tensors_by_arg[sc.names.index("grad_scale")]:
        read_only = sc.names.index("grads")
    write_sets: dict = {}
    out: set[int] = set()
    for i, (sets, ti) in enumerate(zip(sc.write_sets, tensors_by_arg)):
        if sets is not None and ti and i != read_only:
            out.update(ti)  # Tensor(a!) and Tensor(a!)[]: every element is written
            if len(ti) == 1:
                for s in sets:
                    write_sets[s] = ti[0]
    rets = []
    for sets in sc.returned_sets:
        hit = None
        for s in sets:
            hit = write_sets.get(s, hit)
        rets.append(hit)
    return tuple(sorted(out)), rets
