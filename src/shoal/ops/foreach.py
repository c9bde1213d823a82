"""Foreach ops (``torch._foreach_*``, the optimizers' multi-tensor path) and ``linalg_vector_norm``.
(``shoal.torch_patches`` makes GlobalTensor a foreach-supported type, so optimizers and
``clip_grad_norm_`` take that path.)

A foreach op is one pointwise op per list index. Its rule is n-D (``nd=True``): each index keeps one
layout, the written element's (in place) or the cheapest of its operands' (out of place), and the
other operands of that index are boxed to it. Partial passes only where the op is linear in it
(``_LINEAR``); the pointwise overloads not listed in ``_OPS`` get the same signatures from one generic
rule. Norms of split tensors need a reduction across shards: ``_foreach_norm`` and
``linalg_vector_norm`` give Partial results for ord 0, 1 and inf and are decomposed otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import boxing, schema
from ..sbp import Broadcast, NdSBP, Partial, Split
from .empty import pad_empty_local
from .reduction import reduced_dims
from .registry import Call, Rule, Sig, register, register_generic

aten = torch.ops.aten
_B = Broadcast()
_SUM = Partial("sum")

# per overload: groups of list arguments (0 = the first) the op is jointly linear in while the other
# tensor arguments are Broadcast (scalars do not count: x + 2 is not linear in x)
_LINEAR: dict[tuple[str, str], tuple[tuple[int, ...], ...]] = {
    ("add", "List"): ((0, 1),),
    ("sub", "List"): ((0, 1),),
    ("mul", "Scalar"): ((0,),),
    ("mul", "ScalarList"): ((0,),),
    ("mul", "Tensor"): ((0,),),
    ("mul", "List"): ((0,), (1,)),
    ("div", "Scalar"): ((0,),),
    ("div", "ScalarList"): ((0,),),
    ("div", "Tensor"): ((0,),),
    ("div", "List"): ((0,),),
    ("lerp", "Scalar"): ((0, 1),),
    ("lerp", "List"): ((0, 1),),
    ("neg", "default"): ((0,),),
    ("zero_", "default"): ((0,),),
    ("copy_", "default"): ((0, 1),),
    ("addcmul", "Scalar"): ((0, 1), (0, 2)),
    ("addcmul", "ScalarList"): ((0, 1), (0, 2)),
    ("addcdiv", "Scalar"): ((0, 1),),
    ("addcdiv", "ScalarList"): ((0, 1),),
}

# registered overloads: name (without ``_foreach_``) -> overloads, in place and out of place
_OPS = {
    "add": ("List", "Scalar", "Tensor", "ScalarList"),
    "sub": ("List", "Scalar"),
    "mul": ("List", "Scalar", "Tensor", "ScalarList"),
    "div": ("List", "Scalar", "Tensor", "ScalarList"),
    # not the .Tensor overloads: their CPU ``scalars`` tensor has no meta run, so dispatch could not use a rule
    "addcmul": ("Scalar", "ScalarList"),
    "addcdiv": ("Scalar", "ScalarList"),
    "lerp": ("Scalar", "List"),
    "maximum": ("List",),
    "neg": ("default",),
    "sqrt": ("default",),
    "abs": ("default",),
    "sign": ("default",),
    "reciprocal": ("default",),
}
_INPLACE_ONLY = ("zero_", "copy_")


@dataclass(frozen=True, slots=True)
class _Args:
    """Where a foreach call's tensors are: flat input indices per list argument, and the single tensors."""

    lists: tuple[tuple[int, ...], ...]
    singles: tuple[int, ...]
    per_index: tuple[str, ...]  # arguments with one entry per list index (tensor and scalar lists)


def base_name(func) -> tuple[str, str, bool]:
    """(name without ``_foreach_`` and trailing ``_``, overload, in place)."""
    name = func._schema.name.split("::")[1].removeprefix("_foreach_")
    inplace = name.endswith("_")
    base = name[:-1] if inplace and name not in _INPLACE_ONLY else name
    return base, func._overloadname, inplace


def _args(call: Call) -> _Args:
    names = schema.of(call.func).names
    named = [(names[i], v) for i, v in enumerate(call.args)] + list(call.kwargs.items())
    lists, singles, per_index, k = [], [], [], 0
    for name, v in named:
        if isinstance(v, torch.Tensor):
            singles.append(k)
            k += 1
        elif isinstance(v, (list, tuple)) and any(isinstance(e, torch.Tensor) for e in v):
            lists.append(tuple(range(k, k + len(v))))
            k += len(v)
            per_index.append(name)
        elif isinstance(v, (list, tuple)):
            per_index.append(name)
    return _Args(tuple(lists), tuple(singles), tuple(per_index))


def _operand(anchor: NdSBP, out: torch.Tensor, t: torch.Tensor, in_group: bool) -> NdSBP:
    """An operand's layout for an index laid out as ``anchor`` (the operand may broadcast to it)."""
    sbp = []
    for s in anchor:
        if isinstance(s, Split):
            d = s.dim - (out.ndim - t.ndim)
            sbp.append(_B if d < 0 or (t.shape[d] == 1 and out.shape[s.dim] != 1) else Split(d))
        elif isinstance(s, Partial):
            sbp.append(s if in_group else _B)
        else:
            sbp.append(_B)
    return tuple(sbp)


def _usable(anchor: NdSBP, groups, j: int) -> tuple[NdSBP, tuple[int, ...]]:
    """``anchor`` (the layout of list ``j``'s element) made exact: Partial(sum) stays where the op is
    linear in a group holding list ``j``, other Partials become Broadcast. Returns it and the group."""
    group = next((g for g in groups if j in g), ())
    return tuple(_B if isinstance(s, Partial) and (s != _SUM or not group) else s for s in anchor), group


def _keep_size1(sbp: NdSBP, spec) -> NdSBP:
    """On a mesh axis of one device every layout holds the whole tensor: keep the operand's own."""
    return tuple(spec.sbp[a] if n == 1 else s for a, (s, n) in enumerate(zip(sbp, spec.mesh.shape)))


def _foreach(call: Call) -> list:
    """The one n-D signature: per index, every operand in the layout of the index's anchor."""
    if not call.specs:
        return []  # the validator's listing: layouts are only known for a real call
    _, _, inplace = base_name(call.func)
    where = _args(call)
    rep = (_B,) * len(call.specs[0].sbp)
    sbp_in: list = [None] * len(call.ins)
    sbp_out = []
    for i in range(len(where.lists[0])):
        idx = [lst[i] for lst in where.lists]
        _, anchor, layouts = _index_layouts(call, idx, call.ins[idx[0]] if inplace else call.outs[i], inplace)
        for x, s in zip(idx, layouts):
            sbp_in[x] = _keep_size1(s, call.specs[x])
        if not inplace:
            sbp_out.append(anchor)
    for x in where.singles:
        sbp_in[x] = rep
    return [(tuple(sbp_in), tuple(sbp_out))]


def _index_layouts(call: Call, idx: list, out: torch.Tensor, inplace: bool, back: bool = False) -> tuple:
    """(boxing cost, anchor, operand layouts) of one list index (``idx``: its flat inputs, ``out`` its
    result): in place the written element's layout, else the cheapest of its same-shaped operands'.
    ``back``: out of place, counting the result's boxing to the written element's layout too (what
    running an in-place call out of place and copying back costs)."""
    base, overload, _ = base_name(call.func)
    groups = _LINEAR.get((base, overload), ())
    specs, ins = call.specs, call.ins
    options = [0] if inplace else [j for j, x in enumerate(idx) if tuple(ins[x].shape) == tuple(out.shape)]
    best = None
    for j in options or [-1]:  # -1: every operand broadcasts to the output: Broadcast
        anchor, group = _usable(specs[idx[j]].sbp if j >= 0 else (_B,) * len(specs[0].sbp), groups, j)
        layouts = [_keep_size1(_operand(anchor, out, ins[x], jj in group), specs[x]) for jj, x in enumerate(idx)]
        cost = sum(boxing.cost(specs[x], s) for x, s in zip(idx, layouts) if specs[x].sbp != s)
        if back:
            cost += boxing.cost(specs[idx[0]].with_sbp(_keep_size1(anchor, specs[idx[0]])), specs[idx[0]].sbp)
        if best is None or cost < best[0]:
            best = (cost, anchor, layouts)
    return best


def _decomposes(call: Call, specs) -> bool:
    """Run an in-place call as the op out of place and a ``_foreach_copy_``: where it writes a Partial
    element (``_writes_partial``), or where boxing the operands to the written elements' layouts costs
    more than boxing the results back (ZeRO-1's AdamW: a Broadcast parameter updated from split
    states gathers its update once, not each state it reads)."""
    if _writes_partial(call, specs):
        return True
    if base_name(call.func)[0] in _PER_TENSOR or not call.specs:
        return False  # no out-of-place form
    where = _args(call)
    rows = [[lst[i] for lst in where.lists] for i in range(len(where.lists[0]))]
    here = sum(_index_layouts(call, idx, call.ins[idx[0]], True)[0] for idx in rows)
    return here > 0 and sum(_index_layouts(call, idx, call.ins[idx[0]], False, back=True)[0] for idx in rows) < here


def _writes_partial(call: Call, specs) -> bool:
    """In place into a Partial element: its shards may be one shared piece of memory (a kept-one copy
    beside shared zeros), which a list op cannot unshare; run it as per-tensor ops instead."""
    where = _args(call)
    return any(isinstance(s, Partial) for x in where.lists[0] for s in specs[x].sbp)


def _zero_each(self) -> None:
    for t in self:
        aten.zero_.default(t)


def _copy_each(self, src, non_blocking=False) -> None:
    for t, s in zip(self, src):
        aten.copy_.default(t, s)


# the ops that exist in place only (``_INPLACE_ONLY``), as one per-tensor op per element
_PER_TENSOR = {"zero_": _zero_each, "copy_": _copy_each}


def _inplace_decomposition(func):
    """The op out of place, then a ``_foreach_copy_`` into the elements (per tensor where one is Partial)."""
    base, overload, _ = base_name(func)
    if base in _PER_TENSOR:
        return _PER_TENSOR[base]
    out_of_place = getattr(getattr(aten, "_foreach_" + base), overload)

    def run(self, *args, **kwargs) -> None:
        aten._foreach_copy_.default(self, out_of_place(self, *args, **kwargs))

    return run


def _inplace_local(call: Call, ins, outs):
    """In place, every element keeps its layout; refuse what cannot be computed so exactly. (Elements
    whose shards several devices share are written once: dispatch tracks each list element's memory.)"""
    where = _args(call)
    moved = [x for x in where.lists[0] if call.specs and _keep_size1(ins[x], call.specs[x]) != call.specs[x].sbp]
    if moved:  # the pointwise rules decompose such calls (_writes_partial): the fused optimizers get here
        raise ValueError(
            f"shoal: {call.func} writes list elements laid out {[str(call.specs[x].sbp) for x in moved]}, which "
            f"it cannot compute in place exactly (Partial, op not linear). Reduce them first, e.g. "
            f"x.to_global(sbp=shoal.B) for Partial axes, or call the op per tensor."
        )
    return None  # the op itself runs on each device's shards


def _register_pointwise() -> list:
    ops = [getattr(getattr(aten, f"_foreach_{base}{inplace}"), ov)
           for base, overloads in _OPS.items() for ov in overloads for inplace in ("", "_")]
    ops += [aten._foreach_zero_.default, aten._foreach_copy_.default]
    for op in ops:
        register(op, _rule(op))
    return ops


def _rule(op) -> Rule:
    """A pointwise foreach op's rule; one writing in place into a Partial element is decomposed."""
    if not base_name(op)[2]:
        return Rule(_foreach, nd=True, name="foreach")
    return Rule(_foreach, nd=True, local=_inplace_local, local_ctx=True, decompose=_decomposes,
                decomposition=_inplace_decomposition(op), name="foreach_")


FOREACH_OPS = _register_pointwise()

# The fused optimizers' one-kernel update (``torch.optim.AdamW(fused=True)``): elementwise per list
# index, every list (and each 0-dim step count) in the layout of the parameter it updates.
FUSED_OPTIMIZER_OPS = [aten._fused_adamw_.default, aten._fused_adamw_.tensor_lr, aten._fused_adam_.default,
                       aten._fused_adam_.tensor_lr]
# the lists they write, by schema name (params, grads and the states)
_FUSED_WRITES = ("self", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs")


def _fused_local(call: Call, ins, outs):
    """The kernel walks each tensor's memory as if contiguous; a split along a later dim is a strided
    view: run on contiguous copies of such shards and write them back."""
    _inplace_local(call, ins, outs)
    func = call.func

    def run(shard, *args, **kwargs):
        args, kwargs, back = list(args), dict(kwargs), []
        for k, name in enumerate(_FUSED_WRITES):
            given, key = (args, k) if k < len(args) else (kwargs, name)  # by position or by keyword
            lst = list(given[key])
            for i, t in enumerate(lst):
                if not t.is_contiguous():
                    lst[i] = t.contiguous()
                    back.append((t, lst[i]))
            given[key] = lst
        func(*args, **kwargs)
        for t, c in back:
            t.copy_(c)

    return run


for _op in FUSED_OPTIMIZER_OPS:
    register(_op, Rule(_foreach, nd=True, local=_fused_local, local_ctx=True, name="fused_optimizer"))


def _returns_nothing(*args, **kwargs) -> None:
    return None


# op overload name -> Meta kernel, for the overloads torch 2.13 has none for (the tensor-lr ones: in
# place, nothing returned); ``shoal.torch_patches`` registers them
META_KERNELS = {"_fused_adamw_.tensor_lr": _returns_nothing, "_fused_adam_.tensor_lr": _returns_nothing}


def _other_pointwise_foreach(op) -> bool:
    """Every other ``_foreach_*`` overload that maps a pointwise op over lists (not ``out=`` ones)."""
    name = op._schema.name
    if not name.startswith("aten::_foreach_") or op._overloadname.endswith("out"):
        return False
    packet = getattr(aten, name[len("aten::_foreach_") :].rstrip("_"), None)
    return packet is not None and any(torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads())


# Without a rule, an in-place list op would run on Broadcast copies and its writes would be lost: give
# the rest of the pointwise family the same signatures (Partial only through Broadcast, as none is
# known to be linear). Validated through the explicit ones, which share the code.
register_generic(_other_pointwise_foreach, _rule)


# -- norms ------------------------------------------------------------------------------------

# ord -> the Partial that per-shard norms of a split tensor reduce with (|x| >= 0: a zero pads max)
_NORM_PARTIAL = {0.0: "sum", 1.0: "sum", math.inf: "max"}


def _vector_norm(call: Call) -> list[Sig]:
    x = call.ins[0]
    dims, keepdim = reduced_dims(call, 2)
    kind = _NORM_PARTIAL.get(float(call.arg(1, "ord", 2)))
    sigs = []
    for d in range(x.ndim):
        if d not in dims:
            od = d if keepdim else d - sum(1 for r in dims if r < d)
            sigs.append(Sig((Split(d),), (Split(od),)))
        elif kind is not None:
            sigs.append(Sig((Split(d),), (Partial(kind),)))
    return sigs


def _splits_reduced(call: Call, specs) -> bool:
    """ord 2 (and any other p) of a split reduced dim: sum |x|^p across shards, then the root."""
    if float(call.arg(1, "ord", 2)) in _NORM_PARTIAL:
        return False
    dims, _ = reduced_dims(call, 2)
    return any(isinstance(s, Split) and s.dim in dims for s in specs[0].sbp)


def _vector_norm_decomposition(x, ord=2, dim=None, keepdim=False, *, dtype=None):
    if dtype is not None:
        x = aten._to_copy.default(x, dtype=dtype)
    dims = list(range(x.ndim)) if dim is None else ([dim] if isinstance(dim, int) else list(dim))
    p = float(ord)
    a = aten.abs.default(x)
    if math.isinf(p):
        return (aten.amax.default if p > 0 else aten.amin.default)(a, dims, keepdim)
    s = aten.sum.dim_IntList(aten.mul.Tensor(a, a) if p == 2 else aten.pow.Tensor_Scalar(a, p), dims, keepdim)
    return aten.sqrt.default(s) if p == 2 else aten.pow.Tensor_Scalar(s, 1.0 / p)


register(
    aten.linalg_vector_norm.default,
    Rule(
        _vector_norm,
        local=pad_empty_local,
        local_ctx=True,
        decompose=_splits_reduced,
        decomposition=_vector_norm_decomposition,
        name="vector_norm",
    ),
)


def _foreach_norm(call: Call) -> list:
    """Per element: split axes give the ord's Partial (0, 1, inf); anything else must be Broadcast."""
    if not call.specs:
        return []
    kind = _NORM_PARTIAL.get(float(call.arg(1, "ord", 2)))
    if kind is None:
        return []
    sbp_in, sbp_out = [], []
    for spec in call.specs:
        ins = tuple(s if isinstance(s, Split) else _B for s in spec.sbp)
        sbp_in.append(ins)
        sbp_out.append(tuple(Partial(kind) if isinstance(s, Split) else _B for s in ins))
    return [(tuple(sbp_in), tuple(sbp_out))]


def _foreach_norm_splits(call: Call, specs) -> bool:
    return float(call.arg(1, "ord", 2)) not in _NORM_PARTIAL and any(not spec.is_replicated for spec in specs)


def _foreach_norm_decomposition(self, ord=2, dtype=None):
    return [aten.linalg_vector_norm.default(t, ord, dtype=dtype) for t in self]


register(
    aten._foreach_norm.Scalar,
    Rule(
        _foreach_norm,
        nd=True,
        local=pad_empty_local,
        local_ctx=True,
        decompose=_foreach_norm_splits,
        decomposition=_foreach_norm_decomposition,
        name="foreach_norm",
    ),
)



def _mesh_groups(args: tuple) -> list[list[int]]:
    """A foreach op's list indices grouped by the mesh of their GlobalTensors (one group: one mesh)."""
    lists = [j for j, a in enumerate(args) if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
    if not lists:
        return []
    groups: dict = {}
    for i in range(len(args[lists[0]])):
        m = next((args[j][i]._spec.mesh for j in lists if hasattr(args[j][i], "_spec")), None)
        groups.setdefault(m, []).append(i)
    return list(groups.values())


def spans_meshes(func, args: tuple) -> bool:
    return func.__name__.startswith("_foreach_") and len(_mesh_groups(args)) > 1


def by_mesh(func, args: tuple, kwargs: dict, run):
    """A foreach op whose lists hold GlobalTensors of several meshes (a model's pipeline stages, an
    optimizer over all of them): one call per mesh on the indices there, through ``run(func, args,
    kwargs)`` (dispatch); results put back in index order (None for an op that returns nothing)."""
    groups = _mesh_groups(args)
    n = sum(len(idx) for idx in groups)
    out: list = [None] * n
    returned = False
    for idx in groups:
        sub = tuple([a[i] for i in idx] if isinstance(a, (list, tuple)) and len(a) == n else a for a in args)
        res = run(func, sub, kwargs)
        if isinstance(res, (list, tuple)):
            returned = True
            for i, r in zip(idx, res):
                out[i] = r
    return out if returned else None
