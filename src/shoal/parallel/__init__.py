"""Parallel plans as data: lay out an unmodified nn.Module's parameters, buffers and inputs on a mesh.

A ``Plan`` maps parameter/buffer name patterns (fnmatch, first match wins) to SBPs (one per mesh
axis), and submodule names to the layouts their inputs and outputs are given. ZeRO is a layout of
the optimizer state: ``shard_optimizer_state`` splits it over the data-parallel axis. Pipeline
stages (``Plan(stages=...)``) put submodules on the sub-meshes of a pipeline axis (``Stages``).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..mesh import Mesh
from ..sbp import SBP, Broadcast, Split, normalize_sbp, reduced, sbp_str
from ..tensor import GlobalTensor, onto_mesh_of, to_global
from .balance import balance, describe, unit_costs
from .memory import install_zero, memory_per_device, memory_report, shard_optimizer_state, zero_layout
from .precision import Precision, install_precision
from .recompute import install_checkpointing
from .reducer import GradReducer

__all__ = ["Plan", "Stages", "pipeline_stages", "balance", "distribute_module", "shard_optimizer_state",
           "memory_per_device", "memory_report", "zero_layout", "data_parallel", "Precision"]

Layout = SBP | Sequence[SBP]


@dataclass(frozen=True)
class Plan:
    """How a module is laid out. ``params``: name pattern -> layout (unmatched: Broadcast).
    ``inputs``/``outputs``: submodule name ("" is the module itself) -> layout of each tensor
    argument / result (one layout for all, or a sequence matching the positional tensors).
    ``stages``: pipeline stages, submodule name pattern -> stage index (or "auto": contiguous
    stages balanced by parameter count); stage ``i`` lives on the sub-mesh ``stage_axis = i % p``
    and the ``params`` layouts then name the other axes. ``zero``: 0 none, 1 optimizer state split over
    ``dp_axis`` (default: the mesh's "dp", else its first axis), 2 gradients too, 3 parameters at rest
    too, gathered around the forward of each unit (each item of a ``ModuleList``, the modules named by
    ``zero_unit`` patterns, the module itself for the rest)."""

    params: Mapping[str, Layout] = field(default_factory=dict)
    inputs: Mapping[str, Layout | Sequence[Layout]] = field(default_factory=dict)
    outputs: Mapping[str, Layout | Sequence[Layout]] = field(default_factory=dict)
    stages: Mapping[str, int] | str | None = None
    stage_axis: str = "pp"
    zero: int = 0
    dp_axis: str | None = None
    zero_unit: Sequence[str] = ()
    precision: object = None  # None (the module's dtypes), "bf16", "fp16" or a Precision
    checkpoint: Sequence[str] = ()  # module name patterns whose activations are recomputed in backward


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
    staged = pipeline_stages(module, mesh, plan) if plan.stages is not None else None
    used = set()
    done: dict = {}  # id of a tensor laid out already -> (its GlobalTensor, sbp, name): tied ones stay tied
    for mod_name, mod in module.named_modules():
        where = mesh if staged is None else staged.mesh_of(mod_name)
        rep = (Broadcast(),) * where.ndim
        for pname, p in list(mod.named_parameters(recurse=False)):
            full = f"{mod_name}.{pname}" if mod_name else pname
            param = _laid_out(p, full, plan, used, where, rep, done, _param)
            setattr(mod, pname, param)
            if staged is not None:
                staged.own(param, mod_name, full)
        for bname, b in list(mod.named_buffers(recurse=False)):
            if b is None:
                continue
            full = f"{mod_name}.{bname}" if mod_name else bname
            mod._buffers[bname] = _laid_out(b, full, plan, used, where, rep, done, lambda g, b: g)
    if staged is not None:
        staged.install(module)
    if plan.dp_axis is not None and plan.dp_axis not in mesh.axes:
        raise ValueError(f"Plan(dp_axis={plan.dp_axis!r}): the mesh has axes {mesh.axes}")
    install_precision(module, plan.precision)
    install_zero(module, plan.zero, plan.dp_axis, plan.zero_unit)
    install_checkpointing(module, plan.checkpoint)
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


class Stages:
    """A module cut into pipeline stages: stage ``i`` of ``count`` on the sub-mesh ``axis = i % p``
    of ``mesh`` (``v = count / p`` virtual stages per device). ``of``: submodule name -> stage."""

    def __init__(self, mesh: Mesh, axis: str, of: dict[str, int]) -> None:
        self.mesh, self.axis, self.of = mesh, axis, of
        self.p = mesh.axis_size(axis)
        self.count = max(of.values()) + 1
        if self.count < self.p or self.count % self.p:
            raise ValueError(
                f"Plan.stages: {self.count} stage(s) on a {axis!r} axis of {self.p} devices; give a multiple of "
                f"{self.p} stages (stage i runs on {axis}=i % {self.p}; more than {self.p} are virtual stages)")
        self.v = self.count // self.p
        self.meshes = [_stage_mesh(mesh, axis, i) for i in range(self.p)]
        self._owner: dict[int, str] = {}  # id(parameter) -> the first name it was laid out under

    def mesh_of(self, module_name: str) -> Mesh:
        return self.meshes[self.of[module_name] % self.p]

    def own(self, param, module_name: str, name: str) -> None:
        """Record ``param``'s stage (``param._shoal_stage``); a parameter tied across stages is refused."""
        stage = self.of[module_name]
        first = self._owner.setdefault(id(param), name)
        if getattr(param, "_shoal_stage", stage) != stage:
            raise ValueError(f"Plan.stages: {name!r} is the same parameter as {first!r} (tied) but on stage {stage}, "
                             f"not {param._shoal_stage}; put both modules on one stage")
        param._shoal_stage = stage

    def install(self, module: nn.Module) -> None:
        """Each submodule that starts a stage moves its GlobalTensor inputs onto its stage's sub-mesh
        (the module itself does not: what it computes outside its submodules runs where its inputs
        are, the whole mesh's moving onto a stage's as dispatch meets them)."""
        mods = dict(module.named_modules())
        for name, stage in self.of.items():
            if name and (self.of.get(name.rpartition(".")[0]) != stage or "." not in name):
                mods[name].register_forward_pre_hook(_onto_stage(self.meshes[stage % self.p], self.axis),
                                                     with_kwargs=True)
        module._shoal_stages = self

    def __repr__(self) -> str:
        firsts = {}
        for name, stage in self.of.items():
            firsts.setdefault(stage, name or "(root)")
        return (f"Stages({self.count} on {self.axis}={self.p}, v={self.v}: "
                + ", ".join(f"{s}: {n}.." for s, n in sorted(firsts.items())) + ")")


def _stage_mesh(mesh: Mesh, axis: str, i: int) -> Mesh:
    if mesh.ndim == 1:
        return Mesh([mesh.devices[i]], axes=(axis,))
    return mesh.submesh(**{axis: i})


def pipeline_stages(module: nn.Module, mesh: Mesh, plan: Plan) -> Stages:
    """Every submodule's stage: the first ``plan.stages`` pattern its name matches, else the stage
    of the module before it (pre-order: a child without a pattern stays with its parent); the
    module itself is stage 0 unless named. ``stages="auto"``: contiguous stages over the module's
    children (a ModuleList's items) balanced by parameter count (``shoal.parallel.balance``)."""
    axis = plan.stage_axis
    if axis not in mesh.axes:
        raise ValueError(f"Plan.stages: the mesh has no axis {axis!r} (its axes are {mesh.axes}); name the "
                         f"pipeline axis with Plan(stage_axis=...)")
    patterns = plan.stages
    if patterns == "auto":
        costs = unit_costs(module, cost="params")
        patterns = balance(module, mesh.axis_size(axis), cost="params")
        print(f"shoal: stages='auto' cut {type(module).__name__} into {mesh.axis_size(axis)} stages by "
              f"parameter count:\n{describe(patterns, costs)}")
    elif not isinstance(patterns, Mapping):
        raise ValueError(f"Plan.stages: give a mapping of module name patterns to stage numbers, or 'auto'; got "
                         f"{patterns!r}")
    of: dict[str, int] = {}
    used: set = set()
    prev = 0
    for name, _ in module.named_modules():
        stage = _pick(name, patterns, used, None)
        if stage is None:
            stage = prev if name else 0
        of[name] = prev = stage
    unused = [p for p in patterns if p not in used]
    if unused:
        raise ValueError(f"Plan.stages: pattern(s) {unused} match no submodule of {type(module).__name__}; "
                         f"names look like {[n for n, _ in module.named_modules()][1:6]}")
    return Stages(mesh, axis, of)


def _onto_stage(sub: Mesh, axis: str):
    """A forward pre-hook moving GlobalTensor arguments onto the stage's sub-mesh ``sub``: from the
    whole mesh by dropping the pipeline axis's layout (Broadcast there: no data moves), from another
    stage's sub-mesh position by position (the stage boundary's send and receive)."""

    def move(t):
        if not isinstance(t, GlobalTensor) or t.mesh == sub:
            return t
        src = t.mesh
        if axis in src.axes and src.ndim == sub.ndim + 1:
            a = src.axis_index(axis)
            return t.to_global(sub, t.sbp[:a] + t.sbp[a + 1:])
        if src.shape == sub.shape:
            return t.to_global(sub, t.sbp)
        return t.to_global(sub, (Broadcast(),) * sub.ndim)

    def hook(mod, args, kwargs):
        return tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}

    return hook


def _keep_grad_global(p: GlobalTensor) -> None:
    """Autograd copies a gradient whose strides differ from its parameter's into a new plain tensor
    (correct values, but full size on every device and outside shoal): lay it out like ``p`` again."""
    g = p.grad
    if g is not None and not isinstance(g, GlobalTensor):
        p.grad = to_global(g, p.mesh, reduced(p.sbp))


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


def onto_param_mesh(param, value):
    """A loaded optimizer state tensor for ``param``: ``Optimizer.load_state_dict`` casts each to its
    parameter's dtype and device (``value``); a GlobalTensor saved under another plan (another mesh)
    also moves onto the parameter's mesh, in its layout where the shapes match (ZeRO's hook splits it
    again after the next step). ``shoal.torch_patches`` installs it."""
    if isinstance(param, GlobalTensor) and isinstance(value, GlobalTensor) and value.mesh != param.mesh:
        return onto_mesh_of(value, param)
    return value
