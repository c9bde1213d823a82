"""Parallel plans as data: lay out an unmodified nn.Module's parameters, buffers and inputs on a mesh.

A ``Plan`` maps parameter/buffer name patterns (fnmatch, first match wins) to SBPs (one per mesh
axis), and submodule names to the layouts their inputs and outputs are given. ZeRO is a layout of
the optimizer state: ``shard_optimizer_state`` splits it over the data-parallel axis.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..mesh import Mesh
from ..sbp import SBP, Broadcast, Partial, Split, normalize_sbp, sbp_str
from ..tensor import GlobalTensor, onto_mesh_of, to_global
from .reducer import GradReducer

__all__ = ["Plan", "distribute_module", "shard_optimizer_state", "memory_per_device", "data_parallel"]

Layout = SBP | Sequence[SBP]


@dataclass(frozen=True)
class Plan:
    """How a module is laid out. ``params``: name pattern -> layout (unmatched: Broadcast).
    ``inputs``/``outputs``: submodule name ("" is the module itself) -> layout of each tensor
    argument / result (one layout for all, or a sequence matching the positional tensors)."""

    params: Mapping[str, Layout] = field(default_factory=dict)
    inputs: Mapping[str, Layout | Sequence[Layout]] = field(default_factory=dict)
    outputs: Mapping[str, Layout | Sequence[Layout]] = field(default_factory=dict)


def distribute_module(
    module: nn.Module,
    mesh: Mesh,
    plan: Plan | Mapping[str, Layout] | None = None,
    *,
    reduce_gradients: bool = True,
) -> nn.Module:
    """Replace ``module``'s parameters and buffers by GlobalTensors laid out per ``plan``, in place,
    and install the plan's input/output layouts as hooks. With ``reduce_gradients`` (default),
    gradients that are partial sums over an axis where their parameter is replicated (data
    parallelism) are reduced in buckets as backward produces them (``GradReducer``), instead of
    one by one when the optimizer reads them. Returns ``module``."""
    if plan is None:
        plan = Plan()
    elif not isinstance(plan, Plan):
        plan = Plan(params=dict(plan))
    rep = (Broadcast(),) * mesh.ndim
    used = set()
    done: dict = {}  # id of a tensor laid out already -> (its GlobalTensor, sbp, name): tied ones stay tied
    for mod_name, mod in module.named_modules():
        for pname, p in list(mod.named_parameters(recurse=False)):
            full = f"{mod_name}.{pname}" if mod_name else pname
            param = _laid_out(p, full, plan, used, mesh, rep, done, _param)
            setattr(mod, pname, param)
        for bname, b in list(mod.named_buffers(recurse=False)):
            if b is None:
                continue
            full = f"{mod_name}.{bname}" if mod_name else bname
            mod._buffers[bname] = _laid_out(b, full, plan, used, mesh, rep, done, lambda g, b: g)
    if reduce_gradients:
        module._shoal_reducer = GradReducer([p for p in module.parameters() if isinstance(p, GlobalTensor)])
    unused = [p for p in plan.params if p not in used]
    if unused:
        raise ValueError(
            f"distribute_module: plan pattern(s) {unused} match no parameter or buffer of "
            f"{type(module).__name__}; names look like {[n for n, _ in module.named_parameters()][:5]}"
        )
    modules = dict(module.named_modules())
    for name, layout in plan.inputs.items():
        _sub(modules, name, "inputs").register_forward_pre_hook(_relayout_hook(mesh, layout, f"inputs of {name!r}"))
    for name, layout in plan.outputs.items():
        _sub(modules, name, "outputs").register_forward_hook(_output_hook(mesh, layout, f"outputs of {name!r}"))
    return module


def _keep_grad_global(p: GlobalTensor) -> None:
    """Autograd copies a gradient whose strides differ from its parameter's into a new plain tensor
    (correct values, but full size on every device and outside shoal): lay it out like ``p`` again."""
    g = p.grad
    if g is not None and not isinstance(g, GlobalTensor):
        p.grad = to_global(g, p.mesh, tuple(Broadcast() if isinstance(s, Partial) else s for s in p.sbp))


def _param(g: GlobalTensor, p: torch.Tensor) -> nn.Parameter:
    param = nn.Parameter(g, requires_grad=p.requires_grad)
    if param.requires_grad:
        param.register_post_accumulate_grad_hook(_keep_grad_global)
    return param


def _laid_out(t: torch.Tensor, name: str, plan: Plan, used: set, mesh: Mesh, rep, done: dict, wrap):
    """``t`` laid out per the plan's layout for ``name``, made by ``wrap(global_tensor, t)``; a
    tensor met again under another name (tied weights) is the one made the first time, in its
    layout, unless the plan names a different layout for it."""
    layout = _pick(name, plan.params, used, None)
    sbp = _fit(rep if layout is None else layout, mesh, t, name)
    if id(t) in done:
        g, first_sbp, first = done[id(t)]
        if layout is not None and sbp != first_sbp:
            raise ValueError(
                f"distribute_module: {name!r} is the same tensor as {first!r} (tied), laid out "
                f"{sbp_str(first_sbp)} as {first!r}; the plan gives {name!r} {sbp_str(sbp)}. Give both names one layout"
            )
        return g
    value = t.detach()
    g = wrap(value.to_global(mesh, sbp) if isinstance(value, GlobalTensor) else to_global(value, mesh, sbp), t)
    done[id(t)] = (g, sbp, name)
    return g


def _pick(name: str, patterns: Mapping[str, Layout], used: set, default: Layout) -> Layout:
    for pat, layout in patterns.items():
        if fnmatch.fnmatchcase(name, pat):
            used.add(pat)
            return layout
    return default


def _fit(layout: Layout, mesh: Mesh, t: torch.Tensor, name: str):
    return normalize_sbp(layout, mesh.ndim, t.ndim, f"distribute_module: layout of {name!r}")


def _sub(modules: dict, name: str, what: str) -> nn.Module:
    if name not in modules:
        raise ValueError(f"distribute_module: plan.{what} names submodule {name!r}, which does not exist")
    return modules[name]


def _relayout_fn(mesh: Mesh, layout, what: str):
    def one(t, lay):
        if not isinstance(t, torch.Tensor) or lay is None:
            return t
        return to_global(t, mesh, lay) if not isinstance(t, GlobalTensor) else t.to_global(mesh, lay)

    def apply(obj):
        if isinstance(obj, torch.Tensor):
            return one(obj, layout if _is_layout(layout) else layout[0])
        if isinstance(obj, (tuple, list)):
            lays = [layout] * len(obj) if _is_layout(layout) else list(layout)
            if len(lays) != len(obj):
                raise ValueError(f"distribute_module: {len(lays)} layouts for {len(obj)} {what}")
            return type(obj)(one(o, lay) for o, lay in zip(obj, lays))
        return obj

    return apply


def _relayout_hook(mesh: Mesh, layout, what: str):
    f = _relayout_fn(mesh, layout, what)
    return lambda mod, args: f(tuple(args))


def _output_hook(mesh: Mesh, layout, what: str):
    f = _relayout_fn(mesh, layout, what)
    return lambda mod, args, out: f(out)


def _is_layout(x) -> bool:
    return isinstance(x, SBP) or (isinstance(x, (tuple, list)) and len(x) > 0 and all(isinstance(s, SBP) for s in x))


def data_parallel(mesh: Mesh, axis: str | int = 0) -> Plan:
    """Parameters Broadcast, the module's tensor inputs split on the batch dim along ``axis``."""
    a = mesh.axis_index(axis)
    batch = tuple(Split(0) if i == a else Broadcast() for i in range(mesh.ndim))
    return Plan(inputs={"": batch})


# -- ZeRO ------------------------------------------------------------------------------------


def zero_layout(spec_sbp: tuple, shape: Sequence[int], mesh: Mesh, axis: int) -> tuple:
    """``spec_sbp`` with the Broadcast (or Partial sum, e.g. a momentum buffer cloned from a gradient)
    on ``axis`` turned into a split of the largest dim no other axis splits (unchanged when no dim is
    large enough)."""
    if not (isinstance(spec_sbp[axis], Broadcast) or spec_sbp[axis] == Partial("sum")):
        return spec_sbp
    taken = {s.dim for s in spec_sbp if isinstance(s, Split)}
    n = mesh.shape[axis]
    dims = [d for d in range(len(shape)) if d not in taken and shape[d] >= n]
    if not dims:
        return spec_sbp
    d = max(dims, key=lambda i: shape[i])
    return spec_sbp[:axis] + (Split(d),) + spec_sbp[axis + 1 :]


def shard_optimizer_state(optimizer: torch.optim.Optimizer, mesh: Mesh, axis: str | int = "dp"):
    """ZeRO: keep every optimizer state tensor split over ``axis`` (where its parameter is Broadcast
    there). The update then reduce-scatters gradients into the state and gathers the step into the
    parameters; the result equals the unsharded optimizer. Returns the hook handle."""
    a = mesh.axis_index(axis)

    def shard_state(opt, *_):
        for st in opt.state.values():
            for k, v in list(st.items()):
                if isinstance(v, GlobalTensor) and v.ndim > 0 and v.mesh == mesh:
                    want = zero_layout(v.sbp, v.shape, mesh, a)
                    if want != v.sbp:
                        st[k] = v.to_global(mesh, want).detach()

    shard_state(optimizer)
    return optimizer.register_step_post_hook(shard_state)


def onto_param_mesh(param, value):
    """A loaded optimizer state tensor for ``param``: ``Optimizer.load_state_dict`` casts each to its
    parameter's dtype and device (``value``); a GlobalTensor saved under another plan (another mesh)
    also moves onto the parameter's mesh, in its layout where the shapes match (ZeRO's hook splits it
    again after the next step). ``shoal.torch_patches`` installs it."""
    if isinstance(param, GlobalTensor) and isinstance(value, GlobalTensor) and value.mesh != param.mesh:
        return onto_mesh_of(value, param)
    return value


def memory_per_device(*groups) -> dict[int, int]:
    """Bytes each device holds for the given tensors (parameters, gradients, optimizer states...).
    Accepts modules (parameters and their grads and buffers), optimizers (state) and tensors."""
    out: dict[int, int] = {}
    seen: set[int] = set()

    def add(t):
        if not isinstance(t, GlobalTensor) or id(t) in seen:
            return
        seen.add(id(t))
        spec = t.spec
        item = t.element_size()
        for pos, dev in enumerate(spec.mesh.devices):
            n = 1
            for s in spec.local_shape(pos):
                n *= s
            out[dev] = out.get(dev, 0) + n * item

    for g in groups:
        if isinstance(g, nn.Module):
            for p in g.parameters():
                add(p)
                add(p.grad)
            for b in g.buffers():
                add(b)
        elif isinstance(g, torch.optim.Optimizer):
            for st in g.state.values():
                for v in st.values():
                    add(v)
        elif isinstance(g, torch.Tensor):
            add(g)
        else:
            for t in g:
                add(t)
    return out
