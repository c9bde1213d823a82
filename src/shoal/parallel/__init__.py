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
from ..sbp import SBP, Broadcast, Partial, Split, normalize_sbp, reduced, sbp_str
from ..spec import TensorSpec
from ..tensor import GlobalTensor, onto_mesh_of, to_global
from .balance import balance, describe, unit_costs
from .memory import install_zero, memory_per_device, memory_report, shard_optimizer_state, zero_layout
from .precision import Precision, install_precision, loss_scale
from .recompute import install_checkpointing, install_regathering
from .reducer import GradReducer

__all__ = ["Plan", "Stages", "pipeline_stages", "balance", "distribute_module", "shard_optimizer_state",
           "memory_per_device", "memory_report", "zero_layout", "data_parallel", "Precision", "loss_scale"]

Layout = SBP | Sequence[SBP]


@dataclass(frozen=True)
class Plan:
    """How a module is laid out. ``params``: name pattern -> layout (unmatched: Broadcast).
    ``inputs``/``outputs``: submodule name or name pattern (fnmatch: "blocks.*.attn"; "" is the
    module itself) -> layout of each tensor argument / result (one layout for all, or a sequence
    matching the positional tensors). Dispatch picks each op's layouts by the cost of its own inputs'
    boxing (greedy); an output layout fixes where a sub-block's result goes, e.g. Megatron-LM's
    all-reduce of a row-parallel layer's partial sums (the GPT's tp plans do this).
    ``stages``: pipeline stages, submodule name pattern -> stage index (or "auto": contiguous
    stages balanced by parameter count); stage ``i`` lives on the sub-mesh ``stage_axis = i % p``
    and the ``params`` layouts then name the other axes. ``zero``: 0 none, 1 optimizer state split over
    ``dp_axis`` (default: the mesh's "dp", else its first axis), 2 gradients too, 3 parameters at rest
    too, gathered around the forward of each unit (each item of a ``ModuleList``, the modules named by
    ``zero_unit`` patterns, the module itself for the rest). ``checkpoint``: module patterns whose
    activations are recomputed in backward; ``regather``: module patterns with an input pin that
    gathers, whose saved copies of that input are kept split and gathered again in backward
    (``parallel.recompute``)."""

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
    regather: Sequence[str] = ()  # module name patterns whose gathered inputs backward gathers again

    def staged(self, stages: Mapping[str, int] | str) -> Plan:
        """A plan for the whole mesh with a stage axis in front, from this one written for one stage's
        sub-mesh: its parameter layouts and its submodules' output layouts (they name the other axes),
        the module's batch Broadcast over the stage axis (where this plan lays it out), its submodules'
        input layouts (regathered as this plan regathers them), and ``stages``; nothing else is carried."""
        inputs = {k: v for k, v in self.inputs.items() if k}
        if "" in self.inputs:
            batch = self.inputs[""]
            inputs = {"": (Broadcast(), *(batch if isinstance(batch, tuple) else (batch,))), **inputs}
        return Plan(params=self.params, inputs=inputs, outputs={k: v for k, v in self.outputs.items() if k},
                    stages=stages, regather=self.regather)


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
    if staged is not None:
        staged.find_tied(module)
    used = set()
    done: dict = {}  # id of a tensor laid out already -> (its GlobalTensor, sbp, name): tied ones stay tied
    for mod_name, mod in module.named_modules():
        where = mesh if staged is None else staged.mesh_of(mod_name)
        rep = (Broadcast(),) * where.ndim
        for pname, p in list(mod.named_parameters(recurse=False)):
            full = f"{mod_name}.{pname}" if mod_name else pname
            widen = None if staged is None else staged.widening(p)
            param = _laid_out(p, full, plan, used, where, rep, done, _param, widen)
            setattr(mod, pname, param)
            if staged is not None:
                staged.own(param, mod_name)
        for bname, b in list(mod.named_buffers(recurse=False)):
            if b is None:
                continue
            full = f"{mod_name}.{bname}" if mod_name else bname
            mod._buffers[bname] = _laid_out(b, full, plan, used, where, rep, done, lambda g, b: g)
    if staged is not None:
        staged.install(module)
    if plan.dp_axis is not None and plan.dp_axis not in mesh.axes:
        raise ValueError(f"Plan(dp_axis={plan.dp_axis!r}): the mesh has axes {mesh.axes}")
    install_precision(module, mesh, plan.precision)
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

    def on(sub: str) -> Mesh:  # under stages: the submodule's stage's sub-mesh
        return mesh if staged is None or not sub else staged.mesh_of(sub)

    pins = {sub: _relayout_fn(on(sub), layout, f"inputs of {sub!r}")
            for name, layout in plan.inputs.items() for sub in _subs(modules, name, "inputs")}
    install_regathering(module, plan.regather, pins)  # these pins run inside the forward they wrap
    for sub, pin in pins.items():
        modules[sub].register_forward_pre_hook(lambda mod, args, pin=pin: pin(tuple(args)))
    for name, layout in plan.outputs.items():
        for sub in _subs(modules, name, "outputs"):
            modules[sub].register_forward_hook(_output_hook(on(sub), layout, f"outputs of {sub!r}"))
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
        self._spans: dict[int, Mesh] = {}  # id(tensor held on several stages' sub-meshes) -> their union

    def mesh_of(self, module_name: str) -> Mesh:
        return self.meshes[self.of[module_name] % self.p]

    def find_tied(self, module: nn.Module) -> None:
        """Note the parameters held by modules of stages on different sub-meshes (tied weights: an
        embedding and an output head): each is laid out on the union of those sub-meshes."""
        held: dict[int, set] = {}
        for name, mod in module.named_modules():
            for p in mod._parameters.values():
                if p is not None:
                    held.setdefault(id(p), set()).add(self.of[name] % self.p)
        for pid, ranks in held.items():
            if len(ranks) > 1:
                self._spans[pid] = _union_mesh(self.mesh, self.axis, sorted(ranks))

    def widening(self, t: torch.Tensor):
        """For a tied parameter: a function from its layout on a stage's sub-mesh (the plan's) to
        (the union mesh, the layout there: Broadcast over the stage axis); else None."""
        union = self._spans.get(id(t))
        if union is None:
            return None
        a = union.axis_index(self.axis)
        if self.mesh.ndim == 1:
            return lambda sbp: (union, (Broadcast(),))
        return lambda sbp: (union, sbp[:a] + (Broadcast(),) + sbp[a:])

    def own(self, param, module_name: str) -> None:
        """Record ``param``'s stage (``param._shoal_stage``); a parameter held by several stages (tied) has
        the tuple of them."""
        held = getattr(param, "_shoal_stage", ())
        stages = {*(held if isinstance(held, tuple) else (held,)), self.of[module_name]}
        param._shoal_stage = stages.pop() if len(stages) == 1 else tuple(sorted(stages))

    def install(self, module: nn.Module) -> None:
        """Each submodule that starts a stage moves its GlobalTensor inputs onto its stage's sub-mesh
        (the module itself does not: what it computes outside its submodules runs where its inputs
        are, the whole mesh's moving onto a stage's as dispatch meets them). A module holding a tied
        parameter sees it restricted onto its stage's sub-mesh during its forward (``_TiedUse``)."""
        mods = dict(module.named_modules())
        for name, stage in self.of.items():
            sub = self.meshes[stage % self.p]
            if name and (self.of.get(name.rpartition(".")[0]) != stage or "." not in name):
                mods[name].register_forward_pre_hook(_onto_stage(sub, self.axis), with_kwargs=True)
            tied = [k for k, p in mods[name]._parameters.items()
                    if isinstance(p, GlobalTensor) and p.mesh not in self.meshes]  # on a union of sub-meshes
            if tied:
                use, done = _tied_hooks(tied, sub, self.axis)
                mods[name].register_forward_pre_hook(use)
                mods[name].register_forward_hook(done)
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


def _union_mesh(mesh: Mesh, axis: str, ranks: list[int]) -> Mesh:
    """The sub-meshes ``ranks`` of ``axis`` together: ``mesh`` with that axis cut to those coordinates."""
    a = mesh.axis_index(axis)
    devs = [d for d, c in zip(mesh.devices, mesh.coords) if c[a] in ranks]
    shape = mesh.shape[:a] + (len(ranks),) + mesh.shape[a + 1:]
    return Mesh(torch.tensor(devs).reshape(shape).tolist(), axes=mesh.axes)


def _tied_hooks(names: list[str], sub: Mesh, axis: str):
    """Forward hooks putting a module's tied parameters ``names`` in its ``_parameters`` restricted
    onto its stage's sub-mesh ``sub`` for its forward, and back after it."""
    saved: list = []

    def use(mod, args):
        saved.append({k: mod._parameters[k] for k in names})
        for k, p in saved[-1].items():
            mod._parameters[k] = _TiedUse.apply(p, sub, axis)

    def done(mod, args, out):
        mod._parameters.update(saved.pop())

    return use, done


class _TiedUse(torch.autograd.Function):
    """A tied parameter (on the union of its stages' sub-meshes, Broadcast over the stage axis) as one
    stage uses it: its own shards on that stage's sub-mesh, no data moved. The gradient goes back as a
    partial sum over the stage axis (this stage's gradient there, zeros on the other stages), so the
    stages' gradients add up with no transfer per micro-batch and are summed across stages once, where
    data-parallel gradients are reduced."""

    @staticmethod
    def forward(ctx, p: GlobalTensor, sub: Mesh, axis: str) -> GlobalTensor:
        a = p.mesh.axis_index(axis)
        ctx.union, ctx.sub, ctx.axis, ctx.shards = p._spec, sub, a, p._shards
        sbp = (Broadcast(),) if p.mesh.ndim == 1 else p.sbp[:a] + p.sbp[a + 1:]
        dst = TensorSpec(p.shape, p.dtype, sub, sbp)
        return p._as(dst)

    @staticmethod
    def backward(ctx, g: GlobalTensor):
        union, sub, a = ctx.union, ctx.sub, ctx.axis
        if not isinstance(g, GlobalTensor):
            g = to_global(g, sub, (Broadcast(),) * sub.ndim)
        sbp = (Partial("sum"),) if union.mesh.ndim == 1 else g.sbp[:a] + (Partial("sum"),) + g.sbp[a:]
        spec = TensorSpec(union.shape, g.dtype, union.mesh, sbp)
        at = {d: q for q, d in enumerate(sub.devices)}

        def shard(pos, d, ref):  # zeros made from the parameter's shard: on its device, traced or not
            if d in at:
                return g._shards[at[d]]
            return None if ref is None else ref.new_zeros(spec.local_shape(pos), dtype=g.dtype)

        shards = tuple(shard(pos, d, ref) for pos, (d, ref) in enumerate(zip(union.mesh.devices, ctx.shards)))
        return GlobalTensor._make(spec, shards, g.stride()), None, None


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


def _laid_out(t: torch.Tensor, name: str, plan: Plan, used: set, mesh: Mesh, rep, done: dict, wrap, widen=None):
    """``t`` laid out per the plan's layout for ``name``, made by ``wrap(global_tensor, t)``; a
    tensor met again under another name (tied weights) is the one made the first time, in its
    layout, unless the plan names a different layout for it. ``widen``: layout on ``mesh`` ->
    (mesh, layout) it is laid out on instead (a parameter tied across pipeline stages)."""
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
    if widen is not None:
        mesh, sbp = widen(sbp)
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


def _subs(modules: dict, name: str, what: str) -> list[str]:
    """The submodules ``name`` names: itself, or those its pattern matches."""
    if name in modules:
        return [name]
    hits = [m for m in modules if m and fnmatch.fnmatchcase(m, name)]
    if not hits:
        raise ValueError(f"distribute_module: plan.{what} names submodule {name!r}, which does not exist "
                         f"(names look like {[m for m in modules if m][:5]})")
    return hits


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
