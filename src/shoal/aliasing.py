"""Views of GlobalTensors and writes through them: torch's aliasing, kept across layouts.

A view op on a GlobalTensor runs on its shards like any op, but its shards alias the input's only
when the input needed no boxing: a slice across a split is computed from a relaid copy. So each
view remembers (``ViewOf``) its root (the tensor no view op made) and the view ops from the root
(``Step``s). A write to any member of a root's group then reaches all of them, as in torch: a view
that does not alias the root's memory is written back into the root (``slice_scatter`` and the like,
functionalization's inverses), and every member that holds a copy is refreshed from the root.
Writes never change a tensor's layout or memory (dispatch writes a result computed in another
layout back into the tensor's own shards), so a view that aliases stays aliased.
"""

from __future__ import annotations

import functools
import weakref
from typing import NamedTuple

import torch

from . import boxing, schema

__all__ = ["ViewOf", "Step", "effects", "link", "wrote", "check_overlap", "become_view", "assign", "write_shards",
           "replaced"]

aten = torch.ops.aten


class Step(NamedTuple):
    """One view op from a parent to its view: ``func(parent, *args, **kwargs)``."""

    func: torch._ops.OpOverload
    args: tuple
    kwargs: tuple  # (name, value) pairs

    def apply(self, x):
        return self.func(x, *self.args, **dict(self.kwargs))

    def bound(self) -> dict:
        """Every argument after ``self`` by schema name, defaults filled in."""
        return schema.bind(self.func, self.args, dict(self.kwargs), start=1)


class ViewOf(NamedTuple):
    root: object  # the GlobalTensor whose memory this view's values live in
    chain: tuple[Step, ...]  # view ops from the root
    aliased: bool  # this tensor's shards are the root's memory (a write needs no scatter)


# -- what an op does to memory, from its schema --------------------------------------------------


@functools.cache  # asked on every op
def effects(func) -> tuple[bool, tuple[tuple[int, str], ...]]:
    """(whether ``func`` returns views of its first argument, (position, name) of every argument it
    writes in place)."""
    sc = schema.of(func)
    return sc.view, sc.written


# -- making views ----------------------------------------------------------------------------------


# A root's members: {id: weak reference}, dead ones pruned as the table grows (a parameter is the
# root of every view each forward makes of it).


def _add(root, m) -> None:
    table = root._members
    if table is None:
        table = root._members = {}
    elif len(table) >= 64 and len(table) & (len(table) - 1) == 0:  # at 64, 128, 256, ...: drop the dead
        for k in [k for k, r in table.items() if r() is None]:
            del table[k]
    table[id(m)] = weakref.ref(m)


def _live(root) -> list:
    table = root._members
    if not table:
        return []
    return [m for r in list(table.values()) if (m := r()) is not None]


def _steps(func, args: tuple, kwargs: dict, outs: list) -> list[Step]:
    """The step to each output; the pieces of split/unbind become the slice/select they are."""
    rest, kw = tuple(args[1:]), tuple(kwargs.items())
    if func in _PIECES:
        bound = Step(func, rest, kw).bound()
        dim = bound["dim"] % args[0].dim()
        if func is aten.unbind.int:
            return [Step(aten.select.int, (dim, k), ()) for k in range(len(outs))]
        steps, start = [], 0
        for o in outs:
            n = o.shape[dim]
            steps.append(Step(aten.slice.Tensor, (dim, start, start + n, 1), ()))
            start += n
        return steps
    return [Step(func, rest, kw)] * len(outs)


def _same_memory(a, b) -> bool:
    if a is b:
        return True
    if a is None or b is None:
        return False
    base = a._base
    if base is not None and (base is b or base is b._base):
        return True
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata


def link(func, args: tuple, kwargs: dict, out, gt: type) -> None:
    """Record the outputs of view op ``func`` as views of its first argument."""
    x = args[0]
    if type(x) is not gt:
        return
    outs = [o for o in (out if isinstance(out, (list, tuple)) else (out,)) if type(o) is gt]
    if not outs:
        return
    parent = x._view
    root = x if parent is None else parent.root
    chain = () if parent is None else parent.chain
    up = True if parent is None else parent.aliased
    positions = x._spec.mesh.local_positions
    for o, step in zip(outs, _steps(func, args, kwargs, outs)):
        aliased = up and o._spec.mesh == x._spec.mesh and all(
            _same_memory(o._shards[p], x._shards[p]) for p in positions)
        o._view = ViewOf(root, (*chain, step), aliased)
        _add(root, o)


def become_view(t, out) -> None:
    """``t`` (an in-place view op's input) takes the place of ``out``, a view of it: its old self
    becomes the root of its group (a hidden tensor on its old memory), so that ``t`` and every other
    member stay views of that memory."""
    if t._view is None:
        old = type(t)._make(t._spec, t._shards, t.stride())
        for m in _live(t):
            if m is not out and m is not t:
                m._view = ViewOf(old, m._view.chain, m._view.aliased)
                _add(old, m)
        t._members = None
        v = out._view
        t._view = ViewOf(old, v.chain, v.aliased)
        _add(old, t)
    else:
        t._view = out._view
        _add(t._view.root, t)
    t._set_shards(out._shards, out._spec)


def replaced(t) -> None:
    """``t``'s shards were swapped for new memory (a compiled step wrote its state back): it leaves
    its group and becomes a root, and the views it is the root of become copies, refreshed now."""
    v = t._view
    if v is not None:
        t._view = None
        (v.root._members or {}).pop(id(t), None)
    for m in _live(t):
        mv = m._view
        if mv.aliased:
            m._view = ViewOf(t, mv.chain, False)
        assign(m, _replay(t, mv.chain))


# -- writing through views -------------------------------------------------------------------------


def write_shards(dst, shards: tuple, spec) -> None:
    """Write the value whose shards in layout ``spec`` are ``shards`` into ``dst``'s own shards, in
    ``dst``'s layout (nothing else is told: the caller keeps the group consistent)."""
    own = dst._shards
    dst._set_shards(own)  # written in place below
    if shards is own:
        return
    if spec.sbp != dst._spec.sbp or spec.mesh != dst._spec.mesh:
        shards = boxing.box(shards, spec, dst._spec)
    positions = dst._spec.mesh.local_positions
    first: dict = {}
    for p in positions:
        q = first.setdefault(id(own[p]), p)
        if q != p and shards[p] is not shards[q] and dst._spec.has_partial:
            return _unshare(dst, shards)
    done = set()
    for p in positions:
        d, s = own[p], shards[p]
        if id(d) in done:
            continue
        done.add(id(d))  # memory several devices share holds copies of one value: written once
        if s is not d:
            d.copy_(s)


def _unshare(t, shards: tuple) -> None:
    """Devices that shared memory (a Partial's zeros) now hold different pieces: ``t`` gets memory
    of its own, and the views of its group that aliased memory become copies (refreshed on writes)."""
    t._set_shards(None if s is None else s.clone() for s in shards)
    root = t if t._view is None else t._view.root
    for m in (t, *_live(root)):
        if m._view is not None and m._view.aliased:
            m._view = m._view._replace(aliased=False)


def assign(dst, src) -> None:
    """Write ``src``'s value (a GlobalTensor on ``dst``'s mesh) into ``dst``'s own shards."""
    write_shards(dst, src._shards_as(dst._spec), dst._spec)


def wrote(t) -> None:
    """``t`` was written in place (its own shards hold the new value): make its root and every
    member of the group hold what torch's aliases would."""
    v = t._view
    if v is None:
        root = t
    else:
        root = v.root
        if not v.aliased:
            assign(root, _scatter(root, v.chain, t))
    table = root._members
    if not table:
        return
    root._set_shards(root._shards)
    live = {}
    for k, r in table.items():
        if (m := r()) is not None:
            live[k] = r
    root._members = live
    for r in list(live.values()):
        m = r()
        if m is None:
            continue
        m._set_shards(m._shards)
        mv = m._view
        if m is not t and not mv.aliased:
            r = _replay(root, mv.chain)
            if _repeats_elements(m):  # an expanded copy takes no writes: it holds the new expansion
                m._set_shards(r._shards_as(m._spec))
            else:
                assign(m, r)


def _repeats_elements(t) -> bool:
    return any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride()))


def _replay(root, chain):
    x = root
    for step in chain:
        x = step.apply(x)
    return x


def _scatter(root, chain, value):
    """The root's value after ``value`` was written into the view ``chain`` makes of it."""
    bases = [root]
    for step in chain[:-1]:
        bases.append(step.apply(bases[-1]))
    for step, base in zip(reversed(chain), reversed(bases)):
        inverse = _INVERSE.get(step.func)
        if inverse is None:
            raise NotImplementedError(
                f"shoal: a write through a view made by {step.func} whose shards are a copy (the view was "
                f"computed in another layout than its base's {base._spec}) cannot be written back; lay the "
                f"base out so that the view needs no boxing (e.g. Broadcast), or write the base directly"
            )
        value = inverse(base, value, step.bound())
    return value


def _permuted_back(base, v, a):
    dims = [d % base.dim() for d in a["dims"]]
    inv = [0] * len(dims)
    for i, d in enumerate(dims):
        inv[d] = i
    return aten.permute.default(v, inv)


def _same(base, v, a):
    return v


def _reshaped(base, v, a):
    return aten.reshape.default(v, list(base.shape))


def _expanded(base, v, a):
    """An expand that only adds size-1 dims is a reshape; one that repeats elements takes no writes."""
    off = v.dim() - base.dim()
    repeats = any(n != 1 for n in v.shape[:off]) or any(
        b == 1 and n != 1 for b, n in zip(base.shape, v.shape[off:]))
    if repeats:
        raise RuntimeError(
            "unsupported operation: more than one element of the written-to tensor refers to a single memory "
            "location. Please clone() the tensor before performing the operation."
        )
    return aten.reshape.default(v, list(base.shape))


_PIECES = (aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int)

# view op -> (base, written view value, the view op's arguments) -> the base's new value
_INVERSE = {
    aten.slice.Tensor: lambda b, v, a: aten.slice_scatter.default(b, v, a["dim"], a["start"], a["end"], a["step"]),
    aten.select.int: lambda b, v, a: aten.select_scatter.default(b, v, a["dim"], a["index"]),
    aten.diagonal.default: lambda b, v, a: aten.diagonal_scatter.default(b, v, a["offset"], a["dim1"], a["dim2"]),
    aten.as_strided.default: lambda b, v, a: aten.as_strided_scatter.default(b, v, a["size"], a["stride"],
                                                                            a["storage_offset"]),
    aten.transpose.int: lambda b, v, a: aten.transpose.int(v, a["dim0"], a["dim1"]),
    aten.t.default: lambda b, v, a: aten.t.default(v),
    aten.permute.default: _permuted_back,
    aten.view.default: _reshaped,
    aten._reshape_alias.default: _reshaped,
    aten.unsqueeze.default: _reshaped,
    aten.squeeze.default: _reshaped,
    aten.squeeze.dim: _reshaped,
    aten.squeeze.dims: _reshaped,
    aten.expand.default: _expanded,
    aten.alias.default: _same,
    aten.detach.default: _same,
    aten.lift_fresh.default: _same,
    aten._conj.default: lambda b, v, a: aten.conj_physical.default(v),
    aten._neg_view.default: lambda b, v, a: aten.neg.default(v),
    aten.view_as_real.default: lambda b, v, a: aten.view_as_complex.default(aten.clone.default(
        v, memory_format=torch.contiguous_format)),
    aten.view_as_complex.default: lambda b, v, a: aten.view_as_real.default(v),
    aten.view.dtype: lambda b, v, a: aten.view.dtype(aten.clone.default(v, memory_format=torch.contiguous_format),
                                                     b.dtype),
}


# -- overlapping operands --------------------------------------------------------------------------


def _meta_view(t):
    """``t`` as a meta tensor on its root's memory (exact sizes, strides and storage offset)."""
    v = t._view
    root = t if v is None else v.root
    base = torch.empty_strided(tuple(root.shape), root.stride(), dtype=root.dtype, device="meta")
    x = base
    for step in () if v is None else v.chain:
        x = step.apply(x)
    return x


def _non_overlapping_and_dense(m) -> bool:
    return torch._prims_common.is_non_overlapping_and_dense_or_false(m)


def _root(t):
    return t if t._view is None else t._view.root


def check_overlap(func, written: list, inputs: list) -> None:
    """torch refuses an in-place op whose output partly overlaps an input's memory (``x.add_(x.t())``);
    so does shoal, from the views' places in their roots' memory."""
    by_root: dict = {}
    for x in inputs:
        by_root.setdefault(id(_root(x)), []).append(x)
    for w in written:
        others = [x for x in by_root.get(id(_root(w)), ()) if x is not w]
        if not others:
            continue
        a = _meta_view(w)
        for x in others:
            b = _meta_view(x)
            if a.numel() == 0 or b.numel() == 0:
                continue
            if not (_non_overlapping_and_dense(a) and _non_overlapping_and_dense(b)):
                continue
            size = a.element_size()
            a0, b0 = a.storage_offset() * size, b.storage_offset() * size
            a1, b1 = a0 + a.numel() * size, b0 + b.numel() * size
            full = a0 == b0 and a1 == b1 and a.stride() == b.stride()
            if not full and a0 < b1 and b0 < a1:
                raise RuntimeError(
                    f"unsupported operation: some elements of the input tensor and the written-to tensor refer to "
                    f"a single memory location. Please clone() the tensor before performing the operation. "
                    f"(shoal: {func})"
                )
