"""View and shape ops: view/reshape, permute/transpose/t, (un)squeeze, expand, slice, select,
cat, stack, split, unbind, diagonal and their backward ops, flip, constant padding; the in-place views
(transpose_, t_, (un)squeeze_).

A split dim keeps its split where the op moves it (its output dim is computed per op); dims the op
slices or concatenates along must be whole. Views that merge or split a split dim are checked for
exactness shard by shard, since uneven chunks rarely line up.
"""

from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import return_and_correct_aliasing

from .. import aliasing
from ..sbp import Broadcast, Partial, Split
from .registry import Call, Rule, Sig, register

aten = torch.ops.aten
_B = Broadcast()
_PARTIALS = (Partial("sum"), Partial("max"), Partial("min"))


def _moves(call: Call, dim_map, nin: int = 1, nout: int = 1, partial: bool = True) -> list[Sig]:
    """Signatures from ``dim_map(d) -> output dim or None`` (None: d cannot stay split)."""
    sigs = []
    for d in range(call.ins[0].ndim):
        e = dim_map(d)
        if e is not None:
            sigs.append(Sig((Split(d),) * nin, (Split(e),) * nout))
    if partial:
        sigs += [Sig((p,) * nin, (p,) * nout) for p in _PARTIALS]
    return sigs


def _norm(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0


# -- view / reshape ---------------------------------------------------------------------------


def _view_map(in_shape, out_shape):
    """Input dim -> output dim holding the same elements block for block (equal prefix products)."""
    prefix_out = {}
    acc = 1
    for e, n in enumerate(out_shape):
        if n > 1:
            prefix_out.setdefault(acc, e)
        acc *= n
    m = {}
    acc = 1
    for d, n in enumerate(in_shape):
        if n > 1 and acc in prefix_out and out_shape[prefix_out[acc]] > 1:
            m[d] = prefix_out[acc]
        acc *= n
    return m


def _view(call: Call) -> list[Sig]:
    m = _view_map(call.ins[0].shape, call.outs[0].shape)
    return _moves(call, m.get)


def _view_exact(call: Call, ins, outs, mesh_shape) -> bool:
    """Every shard's element range along the split dim must be the same before and after the view."""
    if not any(isinstance(s, Split) for s in ins[0]):
        return True
    in_shape, out_shape = tuple(call.ins[0].shape), tuple(call.outs[0].shape)
    m = _view_map(in_shape, out_shape)
    coords = _coords(mesh_shape)
    for s_in, s_out in zip(ins[0], outs[0]):
        if isinstance(s_in, Split):
            d, e = s_in.dim, s_out.dim
            r_in, r_out = math.prod(in_shape[d + 1 :]), math.prod(out_shape[e + 1 :])
            if m.get(d) != e:
                return False
            for c in coords:
                a_off, a_len = _region(in_shape, ins[0], mesh_shape, c, d)
                b_off, b_len = _region(out_shape, outs[0], mesh_shape, c, e)
                if a_off * r_in != b_off * r_out or a_len * r_in != b_len * r_out:
                    return False
    return True


def _coords(mesh_shape):
    import itertools

    return list(itertools.product(*(range(n) for n in mesh_shape)))


def _region(shape, sbp, mesh_shape, coord, dim) -> tuple[int, int]:
    from ..spec import chunk_bounds

    size, off = shape[dim], 0
    for axis, s in enumerate(sbp):
        if s == Split(dim):
            a, b = chunk_bounds(size, mesh_shape[axis], coord[axis])
            off += a
            size = b - a
    return off, size


def _view_local(call: Call, ins, outs):
    """A shard need not have its GlobalTensor's strides (a wrapper's are contiguous; a transposed
    shard, split or not, is not), so a view the global value allows may not view the shard: then it
    is copied, as reshape does."""
    def run(x, size, *rest):
        try:
            return call.func(x, size, *rest)
        except RuntimeError:  # a strided shard that the global view did not have: copy instead
            return aten.reshape.default(x, size)

    return run


VIEW = Rule(_view, size_arg=1, check_nd=_view_exact, local=_view_local, name="view")
register([aten.view.default, aten._unsafe_view.default], VIEW)


# -- permutations ----------------------------------------------------------------------------


def _permute(call: Call) -> list[Sig]:
    nd = call.ins[0].ndim
    dims = [_norm(d, nd) for d in call.arg(1, "dims")]
    return _moves(call, dims.index)


def _transpose(call: Call) -> list[Sig]:
    nd = call.ins[0].ndim
    if call.func == aten.t.default:
        a, b = (0, 1) if nd == 2 else (0, 0)
    else:
        a, b = _norm(call.arg(1, "dim0"), nd), _norm(call.arg(2, "dim1"), nd)
    return _moves(call, lambda d: b if d == a else a if d == b else d)


register(aten.permute.default, Rule(_permute, name="permute"))
register([aten.transpose.int, aten.t.default], Rule(_transpose, name="transpose"))


# -- (un)squeeze / expand --------------------------------------------------------------------


def _unsqueeze(call: Call) -> list[Sig]:
    dim = _norm(call.arg(1, "dim"), call.ins[0].ndim + 1)
    return _moves(call, lambda d: d if d < dim else d + 1)


def _squeezed(call: Call) -> list[int]:
    """The dims squeeze removes: those of global size 1 (a shard may be size 1 where the global is not)."""
    x = call.ins[0]
    if x.ndim == 0:  # a 0-dim tensor squeezes to itself (dims 0 and -1 name it)
        return []
    if call.func == aten.squeeze.default:
        return [d for d in range(x.ndim) if x.shape[d] == 1]
    dims = call.arg(1, "dim")
    dims = [dims] if isinstance(dims, int) else list(dims)
    return [_norm(d, x.ndim) for d in dims if x.shape[_norm(d, x.ndim)] == 1]


def _squeeze(call: Call) -> list[Sig]:
    dims = _squeezed(call)
    return _moves(call, lambda d: None if d in dims else d - sum(1 for r in dims if r < d))


def _squeeze_local(call: Call, ins, outs):
    dims = _squeezed(call)
    return lambda x, *_: aten.squeeze.dims(x, dims)


def _expand(call: Call) -> list[Sig]:
    x, out = call.ins[0], call.outs[0]
    off = out.ndim - x.ndim
    sigs = []
    for e in range(out.ndim):
        d = e - off
        if d >= 0 and x.shape[d] == out.shape[e]:
            if out.shape[e] > 1:
                sigs.append(Sig((Split(d),), (Split(e),)))
        elif out.shape[e] > 1:  # a new or size-1 dim: every shard expands to its own chunk
            sigs.append(Sig((_B,), (Split(e),)))
    return sigs + [Sig((p,), (p,)) for p in _PARTIALS]


register(aten.unsqueeze.default, Rule(_unsqueeze, name="unsqueeze"))
register(
    [aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims], Rule(_squeeze, local=_squeeze_local, name="squeeze")
)
register(aten.expand.default, Rule(_expand, size_arg=1, name="expand"))


# In-place views change the tensor's own shape: the out-of-place view (its rule above) gives the new
# layout and shards, the tensor takes them, and its wrapper's sizes and strides follow (torch's
# return_and_correct_aliasing runs the op on the wrapper's metadata alone).
def _inplace_view(op):
    view = getattr(aten, op._schema.name.split("::")[1].removesuffix("_"))

    def run(self, *args, **kwargs):
        out = view(self, *args, **kwargs)
        aliasing.become_view(self, out)
        return return_and_correct_aliasing(op, (self, *args), kwargs, self)

    return run


for _op in (aten.transpose_.default, aten.t_.default, aten.unsqueeze_.default, aten.squeeze_.default,
            aten.squeeze_.dim, aten.squeeze_.dims):
    # no per-shard signature (not even all-Broadcast): run on the shards, the wrapper would keep its shape
    register(_op, Rule(check_nd=lambda *a: False, decompose=lambda call, specs: True,
                       decomposition=_inplace_view(_op), name="inplace_view"))


# -- slicing / joining ----------------------------------------------------------------------


def _slice(call: Call) -> list[Sig]:
    dim = _norm(call.arg(1, "dim", 0), call.ins[0].ndim)
    return _moves(call, lambda d: None if d == dim else d)


def _select(call: Call) -> list[Sig]:
    dim = _norm(call.arg(1, "dim"), call.ins[0].ndim)
    return _moves(call, lambda d: None if d == dim else d - (d > dim))


def _slice_backward(call: Call) -> list[Sig]:
    dim = _norm(call.arg(2, "dim"), call.outs[0].ndim)
    return _moves(call, lambda d: None if d == dim else d, partial=False) + [Sig((Partial("sum"),), (Partial("sum"),))]


def _select_backward(call: Call) -> list[Sig]:
    dim = _norm(call.arg(2, "dim"), call.outs[0].ndim)
    return _moves(call, lambda d: d + (d >= dim), partial=False) + [Sig((Partial("sum"),), (Partial("sum"),))]


def _flip(call: Call) -> list[Sig]:
    dims = {_norm(d, call.ins[0].ndim) for d in call.arg(1, "dims")}
    return _moves(call, lambda d: None if d in dims else d)


def _pad(call: Call) -> list[Sig]:
    """constant_pad_nd: dims it pads (or crops) stay whole; the pad value makes it not linear."""
    nd, pad = call.ins[0].ndim, call.arg(1, "pad")
    padded = {nd - 1 - i // 2 for i, p in enumerate(pad) if p != 0}
    return _moves(call, lambda d: None if d in padded else d, partial=False)


def _off_diagonal(ndim: int, dim1: int, dim2: int) -> list[int]:
    """The dims diagonal keeps, in the order they come out (the diagonal itself goes last)."""
    pair = (_norm(dim1, ndim), _norm(dim2, ndim))
    return [d for d in range(ndim) if d not in pair]


def _diagonal(call: Call) -> list[Sig]:
    rest = _off_diagonal(call.ins[0].ndim, call.arg(2, "dim1", 0), call.arg(3, "dim2", 1))
    return _moves(call, lambda d: rest.index(d) if d in rest else None)


def _diagonal_backward(call: Call) -> list[Sig]:
    rest = _off_diagonal(call.outs[0].ndim, call.arg(3, "dim1"), call.arg(4, "dim2"))
    return _moves(call, lambda d: rest[d] if d < len(rest) else None, partial=False) + [
        Sig((Partial("sum"),), (Partial("sum"),))]


def _as_strided_local(call: Call, ins, outs):
    """as_strided addresses storage under the input's own strides (a GlobalTensor's storage offset is
    0). A full copy laid out under those strides (Broadcast memory, e.g. the buffer autograd's
    as_strided backward writes through) is viewed directly, aliasing it as in torch; any other copy
    is first laid out under them in a buffer (NaN where the input has no element), which the result
    views: then it does not alias the input."""
    strides = call.ins[0].stride()

    def run(full, size, stride, storage_offset=None):
        offset = storage_offset or 0
        if full.stride() == strides or full.numel() <= 1:
            return full.as_strided(size, stride, full.storage_offset() + offset)
        fill = float("nan") if full.is_floating_point() or full.is_complex() else 0
        buf, _ = _under_strides(full, strides, size, stride, offset, fill)
        return buf.as_strided(size, stride, offset)

    return run


def _under_strides(full, strides, size, stride, offset, fill):
    """(a buffer, ``full`` laid out in it under ``strides``): long enough for that and for
    ``as_strided(size, stride, offset)``; elements neither addresses hold ``fill``."""
    extent = 1 + sum((n - 1) * st for n, st in zip(full.shape, strides) if n > 0)
    need = 1 + offset + sum((n - 1) * st for n, st in zip(size, stride) if n > 0)
    buf = full.new_full((max(extent, need),), fill)
    return buf, buf.as_strided(full.shape, strides).copy_(full)


register(aten.slice.Tensor, Rule(_slice, name="slice"))
# replicated: only the all-Broadcast signature, run as above
register(aten.as_strided.default, Rule(local=_as_strided_local, name="as_strided"))
register(aten.diagonal.default, Rule(_diagonal, name="diagonal"))
register(aten.diagonal_backward.default, Rule(_diagonal_backward, size_arg=1, name="diagonal_backward"))
register(aten.flip.default, Rule(_flip, name="flip"))
register(aten.constant_pad_nd.default, Rule(_pad, name="pad"))
register(aten.select.int, Rule(_select, name="select"))
register(aten.slice_backward.default, Rule(_slice_backward, size_arg=1, name="slice_backward"))
register(aten.select_backward.default, Rule(_select_backward, size_arg=1, name="select_backward"))


def _cat(call: Call) -> list[Sig]:
    out = call.outs[0]
    dim = _norm(call.arg(1, "dim", 0), out.ndim)
    nin = len(call.ins)
    # legacy: 1-D empty tensors are skipped by cat; they can only be Broadcast
    full = [t.ndim == out.ndim for t in call.ins]
    sigs = []
    for d in range(out.ndim):
        if d != dim and out.shape[d] > 1:
            sigs.append(Sig(tuple(Split(d) if f else _B for f in full), (Split(d),)))
    if all(full):
        sigs += [Sig((p,) * nin, (p,)) for p in _PARTIALS]
    return sigs


def _stack(call: Call) -> list[Sig]:
    dim = _norm(call.arg(1, "dim", 0), call.outs[0].ndim)
    return _moves(call, lambda d: d if d < dim else d + 1, nin=len(call.ins))


def _split(call: Call) -> list[Sig]:
    dim = _norm(call.arg(2, "dim", 0), call.ins[0].ndim)
    return _moves(call, lambda d: None if d == dim else d, nout=len(call.outs))


def _unbind(call: Call) -> list[Sig]:
    dim = _norm(call.arg(1, "dim", 0), call.ins[0].ndim)
    return _moves(call, lambda d: None if d == dim else d - (d > dim), nout=len(call.outs))


register(aten.cat.default, Rule(_cat, name="cat"))
register(aten.stack.default, Rule(_stack, name="stack"))
register([aten.split.Tensor, aten.split_with_sizes.default], Rule(_split, name="split"))
register(aten.unbind.int, Rule(_unbind, name="unbind"))


# -- the scatters: a base with a view's value written in (functionalization's inverses of views) -----


def _scatters(call: Call, dim_map) -> list[Sig]:
    """(self, src) -> out: self's dim d and src's ``dim_map(d)`` split alike, where d is not written
    along; linear in both, so Partial pairs too."""
    sigs = []
    for d in range(call.ins[0].ndim):
        e = dim_map(d)
        if e is not None and call.ins[0].shape[d] > 1:
            sigs.append(Sig((Split(d), Split(e)), (Split(d),)))
    return sigs + [Sig((p, p), (p,)) for p in _PARTIALS]


def _slice_scatter(call: Call) -> list[Sig]:
    dim = _norm(call.arg(2, "dim", 0), call.ins[0].ndim)
    return _scatters(call, lambda d: None if d == dim else d)


def _select_scatter(call: Call) -> list[Sig]:
    dim = _norm(call.arg(2, "dim"), call.ins[0].ndim)
    return _scatters(call, lambda d: None if d == dim else d - (d > dim))


def _diagonal_scatter(call: Call) -> list[Sig]:
    rest = _off_diagonal(call.ins[0].ndim, call.arg(3, "dim1", 0), call.arg(4, "dim2", 1))
    return _scatters(call, lambda d: rest.index(d) if d in rest else None)


def _as_strided_scatter_local(call: Call, ins, outs):
    """Like as_strided: ``src`` lands where as_strided under the input's own strides addresses."""
    strides = call.ins[0].stride()

    def run(full, src, size, stride, storage_offset=None):
        offset = storage_offset or 0
        buf, out = _under_strides(full, strides, size, stride, offset, 0)
        buf.as_strided(size, stride, offset).copy_(src)
        return out

    return run


register(aten.slice_scatter.default, Rule(_slice_scatter, name="slice_scatter"))
register(aten.select_scatter.default, Rule(_select_scatter, name="select_scatter"))
register(aten.diagonal_scatter.default, Rule(_diagonal_scatter, name="diagonal_scatter"))
# replicated: only the all-Broadcast signature, run as above
register(aten.as_strided_scatter.default, Rule(local=_as_strided_scatter_local, name="as_strided_scatter"))


def _roll(call: Call) -> list[Sig]:
    """roll moves elements along its dims (all of them, flattened, when none are given): those stay
    whole; it is a permutation of elements, so Partial values roll piece by piece."""
    dims = call.arg(2, "dims", ())
    rolled = set(range(call.ins[0].ndim)) if not dims else {_norm(d, call.ins[0].ndim) for d in dims}
    return _moves(call, lambda d: None if d in rolled else d)


register(aten.roll.default, Rule(_roll, name="roll"))
