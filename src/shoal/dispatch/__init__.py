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
from torch.utils._pytree import tree_flatten, tree_map_only

from .. import aliasing, debug
from ..mesh import Mesh
from ..ops.foreach import by_mesh, spans_meshes
from ..sbp import Broadcast, sbp_str
from ..spec import TensorSpec
from ..tensor import GlobalTensor, _wrapper_device, install_dispatch, onto_mesh_of
from ..world import on_change, world
from .coverage import _DECISIONS, Coverage, coverage
from .decide import Decision, Input, _refused, decide, signatures
from .execute import run_decomposed, run_random, run_replicated, run_rule
from .key import _plain_key, _retemplate, _template

__all__ = ["dispatch", "coverage", "Coverage", "decide", "Decision", "Input", "signatures"]

_CACHE: dict = {}  # decisions bound to what this process owns: for one world
on_change(_CACHE.clear)
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
        if _across_meshes_any(tensors):  # a stage on a sub-mesh meets the whole mesh's batch
            if spans_meshes(func, args):  # an optimizer's foreach op over every stage: one call per mesh
                return by_mesh(func, args, kwargs, lambda f, a, k: _run(f, a, k, forced))
            args, kwargs = _onto_smallest_mesh(func, args, kwargs, tensors)
            return _run(func, args, kwargs, forced)
        if simple:  # decisions work on templates
            targs, tkwargs = _retemplate(args)
        mesh = _mesh_of(tensors)
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


def _mesh_of(tensors) -> Mesh:
    """The one mesh of the op's GlobalTensors (``_onto_smallest_mesh`` put them there)."""
    return next((t._spec.mesh for t in tensors if type(t) is _GT), None)


def _across_meshes_any(tensors) -> bool:
    mesh = None
    for t in tensors:
        if type(t) is _GT:
            if mesh is None:
                mesh = t._spec.mesh
            elif t._spec.mesh != mesh:
                return True
    return False


def _onto_smallest_mesh(func, args: tuple, kwargs: dict, tensors) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with every GlobalTensor on the op's smallest mesh.

    A pipeline stage runs on a sub-mesh (``mesh.submesh(pp=i)``) while the batch lives on the whole
    mesh, Broadcast over the stage axis: restricted to the sub-mesh, it keeps its own shards there
    (exact, no data moved). Anything else raises: an implicit move would cost collectives. This runs
    below autograd: the op's own backward takes gradients to the original tensors.
    """
    gts = [t for t in tensors if type(t) is _GT]
    sub = min((t._spec.mesh for t in gts), key=lambda m: m.size)
    pinned = _pinned(func, args, kwargs)
    big = next((t._spec.mesh for t in gts if id(t) in pinned and t._spec.mesh != sub), None)
    if big is not None and not torch.is_grad_enabled():
        return _onto_written_mesh(func, args, kwargs, gts, big)
    moved = {}
    for t in gts:
        spec = t._spec
        if spec.mesh == sub:
            continue
        fixed = sub.fixed_in(spec.mesh)
        if fixed is None and spec.mesh.shape == sub.shape and not torch.is_grad_enabled():
            # another stage's sub-mesh, under no_grad (clipping's norms of every stage, an optimizer's
            # step): sent over; with autograd on it stays an error (the gradient would land on this mesh)
            dst = TensorSpec(spec.shape, spec.dtype, sub, spec.sbp)
            moved[id(t)] = t._as(dst)
            continue
        if not fixed or not all(isinstance(spec.sbp[a], Broadcast) for a in fixed):
            raise ValueError(_meshes_error(func, gts, sub, spec, fixed))
        if id(t) in pinned:
            raise ValueError(
                f"shoal: {func} writes into (or returns a view of) a GlobalTensor on {spec.mesh}, but its other "
                f"inputs are on the sub-mesh {sub}; it cannot run on the sub-mesh in place of that tensor. "
                f"Move the other inputs with x.to_global({spec.mesh}, sbp) first.")
        kept = tuple(s for a, s in enumerate(spec.sbp) if a not in fixed)
        dst = TensorSpec(spec.shape, spec.dtype, sub, kept or (Broadcast(),) * sub.ndim)  # one device: any layout
        moved[id(t)] = t._as(dst)
    return tree_map_only(_GT, lambda t: moved.get(id(t), t), (args, kwargs))


def _onto_written_mesh(func, args: tuple, kwargs: dict, gts, mesh: Mesh) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with every GlobalTensor on ``mesh``, the mesh of a tensor the op writes, under
    no_grad (clipping scales the gradient of a parameter tied across pipeline stages, on the union of
    their sub-meshes, by a norm on one stage's): a tensor on a sub-mesh of ``mesh`` is sent to the
    devices of the fixed axes (Broadcast there, its layout on the others)."""
    moved = {}
    for t in gts:
        spec = t._spec
        if spec.mesh == mesh:
            continue
        fixed = spec.mesh.fixed_in(mesh)
        if fixed is None:
            raise ValueError(_meshes_error(func, gts, mesh, spec, fixed))
        kept = iter(spec.sbp if len(fixed) < mesh.ndim else ())
        sbp = tuple(Broadcast() if a in fixed else next(kept) for a in range(mesh.ndim))
        dst = TensorSpec(spec.shape, spec.dtype, mesh, sbp)
        moved[id(t)] = t._as(dst)
    return tree_map_only(_GT, lambda t: moved.get(id(t), t), (args, kwargs))


def _pinned(func, args: tuple, kwargs: dict) -> set[int]:
    """ids of the tensors ``func`` writes or returns views of: they cannot be swapped for a copy."""
    view, written = aliasing.effects(func)
    out = {id(args[0])} if view and args else set()
    for i, name in written:
        v = args[i] if i < len(args) else kwargs.get(name)
        out.update(id(t) for t in (v if isinstance(v, (list, tuple)) else (v,)))
    return out


def _meshes_error(func, gts, sub: Mesh, spec, fixed) -> str:
    """What went wrong with ``spec``'s mesh, which layouts would have run, and the fix."""
    meshes = ", ".join(dict.fromkeys(f"{t._spec.mesh} {sbp_str(t._spec.sbp)}" for t in gts))
    if fixed:
        names = [spec.mesh.axes[a] for a in fixed]
        why = (f"a tensor on {spec.mesh} moves onto its sub-mesh {sub} only when Broadcast on the fixed "
               f"axes {names}, this one is {sbp_str(spec.sbp)}")
    else:
        why = (f"{spec.mesh} is neither the smallest mesh {sub} nor a mesh that {sub} is a sub-mesh of "
               f"(mesh.submesh(...)) with the tensor Broadcast on the fixed axes")
    return (f"shoal: {func} got GlobalTensors on different meshes: {meshes}; {why}. "
            f"Move one with x.to_global(mesh, sbp) first.")


install_dispatch(dispatch)
