"""What each device holds: ZeRO as layouts of the training states, and a report of their bytes.

ZeRO (Rajbhandari et al. 2019) is a choice of layouts over the data-parallel axis, not a new
executor: stage 1 splits the optimizer state, stage 2 also the gradients (reduce-scattered from
their partial sums as backward makes them), stage 3 also the parameters at rest (each unit's
gathered for its forward, and the gather's backward reduce-scatters its gradients). The update
then runs on shards; boxing does every collective, so the result equals the unsharded step.
``Plan(zero=...)`` sets it up in ``distribute_module``; the user's optimizer is found at its first
step (a global optimizer hook) and its state split from then on.
"""

from __future__ import annotations

import fnmatch
import weakref
from collections.abc import Sequence

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..mesh import Mesh
from ..sbp import Broadcast, Partial, Split
from ..tensor import GlobalTensor

__all__ = ["zero_layout", "shard_optimizer_state", "install_zero", "memory_per_device", "memory_report",
           "MemoryReport"]


def zero_layout(spec_sbp: tuple, shape: Sequence[int], mesh: Mesh, axis: int) -> tuple:
    """``spec_sbp`` with the Broadcast (or Partial sum, e.g. a gradient or a momentum buffer cloned
    from one) on ``axis`` turned into a split of the largest dim no other axis splits (unchanged
    when no dim is large enough)."""
    if not (isinstance(spec_sbp[axis], Broadcast) or spec_sbp[axis] == Partial("sum")):
        return spec_sbp
    taken = {s.dim for s in spec_sbp if isinstance(s, Split)}
    n = mesh.shape[axis]
    dims = [d for d in range(len(shape)) if d not in taken and shape[d] >= n]
    if not dims:
        return spec_sbp
    d = max(dims, key=lambda i: shape[i])
    return spec_sbp[:axis] + (Split(d),) + spec_sbp[axis + 1 :]


def _split_state(opt: torch.optim.Optimizer, axis_of) -> None:
    """Every state tensor of ``opt`` split over its parameter's ZeRO axis (``axis_of(param, value)``:
    the axis index, or None to leave it)."""
    for p, st in opt.state.items():
        for k, v in list(st.items()):
            if isinstance(v, GlobalTensor) and v.ndim > 0:
                a = axis_of(p, v)
                if a is not None:
                    want = zero_layout(v.sbp, v.shape, v.mesh, a)
                    if want != v.sbp:
                        st[k] = v.to_global(v.mesh, want).detach()


def shard_optimizer_state(optimizer: torch.optim.Optimizer, mesh: Mesh, axis: str | int = "dp"):
    """ZeRO-1 by hand: keep every optimizer state tensor on ``mesh`` split over ``axis`` (where its
    parameter is Broadcast there). The update then reduce-scatters gradients into the state and
    gathers the step into the parameters; the result equals the unsharded optimizer. Returns the
    hook handle. ``Plan(zero=1)`` does this for the optimizer of a distributed module."""
    a = mesh.axis_index(axis)

    def shard_state(opt, *_):
        _split_state(opt, lambda p, v: a if v.mesh == mesh else None)

    shard_state(optimizer)
    return optimizer.register_step_post_hook(shard_state)


# -- Plan(zero=...) ------------------------------------------------------------------------------


def dp_axis(mesh: Mesh, name: str | None) -> int | None:
    """The index of the ZeRO axis on ``mesh``: ``name``, else "dp", else the first axis; None where a
    named axis is not there (a stage's sub-mesh without it)."""
    if name is None:
        return mesh.axes.index("dp") if "dp" in mesh.axes else 0
    return mesh.axes.index(name) if name in mesh.axes else None


def install_zero(module: nn.Module, level: int, axis_name: str | None, units: Sequence[str] = ()) -> None:
    """Mark ``module``'s parameters for ZeRO ``level`` over ``axis_name`` and, for level 3, split them
    at rest and gather each unit's around its forward. Units: ``units`` (name patterns), each item of
    a ``ModuleList``, and the module itself for the rest."""
    if level not in (0, 1, 2, 3):
        raise ValueError(f"Plan(zero={level!r}): give 0 (none), 1 (optimizer state), 2 (+ gradients) or "
                         f"3 (+ parameters)")
    if level == 0:
        return
    for p in module.parameters():
        if isinstance(p, GlobalTensor) and p.requires_grad:
            a = dp_axis(p.mesh, axis_name)
            if a is not None and p.mesh.shape[a] > 1:
                p._shoal_zero = (level, a)
    if level == 3:
        _split_at_rest(module, units)
    _ZEROED.add(module)
    _install_optimizer_hook()


def _split_at_rest(module: nn.Module, units: Sequence[str]) -> None:
    """ZeRO-3: each parameter held split over its ZeRO axis, and gathered (differentiably: the
    gather's backward reduce-scatters the gradient) by the innermost unit holding it, around that
    unit's forward."""
    names = dict(module.named_modules())
    unit_names = [""] + [n for n, m in names.items() if n and (
        any(fnmatch.fnmatchcase(n, u) for u in units) or isinstance(names.get(n.rpartition(".")[0]), nn.ModuleList))]
    owner: dict = {}  # (module name, param name) -> unit name: the innermost unit above it
    for mod_name, mod in names.items():
        for pname in mod._parameters:
            owner[(mod_name, pname)] = max((u for u in unit_names if not u or mod_name == u
                                            or mod_name.startswith(u + ".")), key=len)
    split: dict[int, GlobalTensor] = {}  # id(full parameter) -> its split replacement (tied ones stay tied)
    gathers: dict[str, list] = {u: [] for u in unit_names}
    for (mod_name, pname), unit in owner.items():
        mod = names[mod_name]
        p = mod._parameters[pname]
        if p is None or getattr(p, "_shoal_zero", (0,))[0] != 3:
            continue
        if id(p) not in split:
            a = p._shoal_zero[1]
            want = zero_layout(p.sbp, p.shape, p.mesh, a)
            q = nn.Parameter(p.detach().to_global(p.mesh, want), requires_grad=True)
            q._shoal_zero, q._shoal_full_sbp = p._shoal_zero, p.sbp
            for h in p._post_accumulate_grad_hooks.values() if p._post_accumulate_grad_hooks else ():
                q.register_post_accumulate_grad_hook(h)
            split[id(p)] = q
        mod._parameters[pname] = split[id(p)]
        gathers[unit].append((mod, pname))
    for u, entries in gathers.items():
        if entries:
            names[u].register_forward_pre_hook(_gather(entries))
            names[u].register_forward_hook(_release(entries))


def _gather(entries):
    def hook(mod, args):
        for m, name in entries:
            p = m._parameters[name]
            m._parameters[name] = p.to_global(p.mesh, p._shoal_full_sbp)
            m._parameters[name]._shoal_rest = p
    return hook


def _release(entries):
    def hook(mod, args, out):
        for m, name in entries:
            m._parameters[name] = m._parameters[name]._shoal_rest
    return hook


_ZEROED: weakref.WeakSet = weakref.WeakSet()  # modules under Plan(zero >= 1)
_SPLIT_OPTIMIZERS: weakref.WeakSet = weakref.WeakSet()
_HOOK = []


def _install_optimizer_hook() -> None:
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_first_step))


def _first_step(opt, args, kwargs) -> None:
    """At an optimizer's first step: if it updates ZeRO parameters, split its state from then on."""
    if opt in _SPLIT_OPTIMIZERS:
        return
    if any(hasattr(p, "_shoal_zero") for g in opt.param_groups for p in g["params"]):
        _SPLIT_OPTIMIZERS.add(opt)
        opt.register_step_post_hook(_split_zero_state)


def _split_zero_state(opt, *_):
    _split_state(opt, lambda p, v: getattr(p, "_shoal_zero", (0, None))[1] if v.mesh == p.mesh else None)


def split_gradient(p: GlobalTensor, g: GlobalTensor) -> GlobalTensor | None:
    """ZeRO-2 and 3: ``p``'s gradient ``g`` reduce-scattered over the ZeRO axis (None: not a ZeRO-2
    parameter, or nothing to reduce there)."""
    z = getattr(p, "_shoal_zero", None)
    if z is None or z[0] < 2 or g.mesh != p.mesh:
        return None
    want = zero_layout(g.sbp, g.shape, g.mesh, z[1])
    return None if want == g.sbp else g.to_global(g.mesh, want)


# -- what each device holds ----------------------------------------------------------------------


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


class MemoryReport:
    """Bytes per device by kind (``kinds``: kind -> device -> bytes); printed as a table."""

    def __init__(self, kinds: dict[str, dict[int, int]]) -> None:
        self.kinds = kinds
        self.devices = sorted({d for per in kinds.values() for d in per})

    def total(self) -> dict[int, int]:
        return {d: sum(per.get(d, 0) for per in self.kinds.values()) for d in self.devices}

    def __str__(self) -> str:
        rows = [["kind", *(f"device {d}" for d in self.devices)]]
        for kind, per in [*self.kinds.items(), ("total", self.total())]:
            rows.append([kind, *(f"{per.get(d, 0):,}" for d in self.devices)])
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                         for r in rows)

    __repr__ = __str__


def memory_report(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> MemoryReport:
    """Bytes each device holds for ``model``'s parameters, buffers and gradients and
    ``optimizer``'s state (as it is now: an optimizer makes its state at its first step)."""
    params = list(model.parameters())
    kinds = {"parameters": memory_per_device(params), "buffers": memory_per_device(list(model.buffers())),
             "gradients": memory_per_device([p.grad for p in params if p.grad is not None])}
    if optimizer is not None:
        kinds["optimizer state"] = memory_per_device(optimizer)
    return MemoryReport(kinds)
