"""Eager dispatch: one ATen op on GlobalTensors, as key -> decide -> execute.

``key``: the cache key (op, static arguments, each tensor's layout and strides) and argument
templates. ``decide``: pure, the cheapest exact signature of the op's rule (boxing cost of the
actual inputs), or a decomposition, a replicated run, a random draw; cached by key, then bound to
what this process owns. ``execute``: one runner per kind of decision. Ops without a rule run
replicated on Broadcast inputs, warn once, and are listed by ``coverage()``. The module installs
``dispatch`` as GlobalTensor's handler of every ATen op.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

from .. import aliasing, debug
from ..mesh import Mesh
from ..tensor import GlobalTensor, _wrapper_device, install_dispatch, onto_mesh_of
from ..world import world
from .coverage import _DECISIONS, Coverage, coverage
from .decide import Decision, Input, _refused, decide, signatures
from .execute import run_decomposed, run_random, run_replicated, run_rule
from .key import _plain_key, _retemplate, _template

__all__ = ["dispatch", "coverage", "Coverage", "decide", "Decision", "Input", "signatures"]

_CACHE: dict = {}
_GT = GlobalTensor
_COPY = torch.ops.aten.copy_.default


def dispatch(func, args: tuple, kwargs: dict, forced=None):
    """Run ATen op ``func`` on GlobalTensors (and plain tensors, taken as Broadcast). ``forced``:
    the signature to run it with, (input SBPs, output SBPs) (the validator's; bypasses the cache)."""
    view, written = aliasing.effects(func)
    if written:
        _check_overlap(func, written, args, kwargs)
        return _run(func, args, kwargs, forced)
    out = _run(func, args, kwargs, forced)
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


def _run(func, args: tuple, kwargs: dict, forced=None):
    if debug.ENABLED and world().processes > 1:
        debug.check_op(func, args, kwargs, GlobalTensor)
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
        dec = _CACHE.get(tuple(key)) if forced is None else None
    except TypeError:  # an unhashable static argument: decide without caching
        key = None
        dec = None
    if dec is None:
        if func is _COPY and _across_meshes(args):
            return _copy_across_meshes(*args, **kwargs)
        if simple:  # decisions work on templates
            targs, tkwargs = _retemplate(args)
        mesh = _mesh_of(func, tensors)
        dec = decide(func, targs, tkwargs, [Input.of(t) for t in tensors], mesh, forced)
        dec = dec.bound(mesh.local_positions, _wrapper_device())  # what this process owns
        _DECISIONS.append(dec)
        if key is not None and forced is None:
            _CACHE[tuple(key)] = dec
    dec.calls[1] += 1
    kind = dec.kind
    if kind == "rule":
        if simple:
            return run_rule(func, dec, args, None, tensors)
        return run_rule(func, dec, targs, tkwargs, tensors)
    if simple:
        targs, tkwargs = _retemplate(args)
    if kind == "decompose":
        return run_decomposed(func, args, kwargs)
    if kind == "random" or kind == "random_fallback":
        return run_random(func, dec, targs, tkwargs, tensors)
    return run_replicated(func, dec, targs, tkwargs, tensors,
                          lambda: _refused(func, targs, tkwargs, [Input.of(t) for t in tensors]))


def _across_meshes(args) -> bool:
    dst, src = args[0], args[1]
    return type(dst) is _GT and type(src) is _GT and dst._spec.mesh != src._spec.mesh


def _copy_across_meshes(dst, src, non_blocking: bool = False):
    """``dst.copy_(src)`` with ``src`` on another mesh (a state dict saved under another plan): the
    value moves onto ``dst``'s mesh first."""
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


install_dispatch(dispatch)
