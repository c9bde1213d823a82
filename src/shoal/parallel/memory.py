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

import contextlib
import fnmatch
import weakref
from collections.abc import Sequence

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..errors import DoesNotFit
from ..mesh import Mesh
from ..sbp import Broadcast, Partial, Split, reduced
from ..spec import TensorSpec
from ..tensor import GlobalTensor
from ..world import world

__all__ = ["zero_layout", "shard_optimizer_state", "install_zero", "memory_per_device", "memory_report",
           "MemoryReport", "state_bytes", "check_fit", "byte_size", "gathered"]


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
    module._shoal_zero_level = level
    _DISTRIBUTED.add(module)
    for p in module.parameters() if level else ():
        if isinstance(p, GlobalTensor) and p.requires_grad:
            a = dp_axis(p.mesh, axis_name)
            if a is not None and p.mesh.shape[a] > 1:
                p._shoal_zero = (level, a)
    if level == 3:
        _split_at_rest(module, units)
    check_fit(module, level, "distribute_module")
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
            q = replacement(p, p.detach().to_global(p.mesh, want))
            q._shoal_full_sbp = p.sbp
            split[id(p)] = q
        mod._parameters[pname] = split[id(p)]
        gathers[unit].append((mod, pname))
    for u, entries in gathers.items():
        if entries:
            names[u].register_forward_pre_hook(_gather(entries))
            names[u].register_forward_hook(_release(entries))


def replacement(p: nn.Parameter, value: torch.Tensor) -> nn.Parameter:
    """A parameter holding ``value`` in ``p``'s place: its gradient hooks and shoal's marks on it
    (ZeRO, stage, master dtype) carried over."""
    q = nn.Parameter(value, requires_grad=p.requires_grad)
    for h in (p._post_accumulate_grad_hooks or {}).values():
        q.register_post_accumulate_grad_hook(h)
    for k, v in vars(p).items():
        if k.startswith("_shoal_"):
            setattr(q, k, v)
    return q


def _gather(entries):
    """Before a unit's forward: its parameters gathered to their full layouts, and what autograd
    saves of them for backward not kept but gathered again when backward needs it."""
    def hook(mod, args):
        _swap_in(entries)
        saving = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
        saving.__enter__()
        mod._shoal_saving = [*getattr(mod, "_shoal_saving", []), saving]
    return hook


def _release(entries):
    """After a unit's forward: its parameters split at rest again (the gathered ones are freed)."""
    def hook(mod, args, out):
        mod._shoal_saving.pop().__exit__(None, None, None)
        _swap_out(entries)
    return hook


@contextlib.contextmanager
def gathered(module: nn.Module):
    """ZeRO-3: ``module``'s parameters at rest gathered while inside, as its unit's forward hooks
    gather them, for a forward run outside those hooks: a checkpointed module's recomputation in
    backward, which must see the layouts (and so run the ops) the first forward did."""
    done = _swap_in([(m, n) for m in module.modules() for n, p in m._parameters.items()
                     if hasattr(p, "_shoal_full_sbp")])
    try:
        yield
    finally:
        _swap_out(done)


def _swap_in(entries) -> list:
    """Each ``(module, name)``'s parameter at rest replaced by it gathered (differentiably); returns
    the entries it gathered (one gathered already, by a unit called inside its own forward, stays)."""
    done = []
    for m, name in entries:
        p = m._parameters[name]
        if hasattr(p, "_shoal_rest"):
            continue
        full = p.to_global(p.mesh, p._shoal_full_sbp)
        full._shoal_rest = p
        m._parameters[name] = full
        _GATHERED[_storage(full)] = full
        done.append((m, name))
    return done


def _swap_out(entries) -> None:
    """Each ``(module, name)``'s gathered parameter replaced by the one at rest again."""
    for m, name in entries:
        full = m._parameters[name]
        if hasattr(full, "_shoal_rest"):
            _GATHERED.pop(_storage(full), None)
            m._parameters[name] = full._shoal_rest


_GATHERED: dict = {}  # storage of a gathered parameter's first local shard -> the gathered parameter


def _storage(t: GlobalTensor):
    return t._shards[t.mesh.local_positions[0]].untyped_storage()._cdata


def _pack(t):
    """What autograd keeps of a tensor it saves: for a gathered parameter (or its transpose, as
    ``linear`` saves it), the parameter at rest and how to make the view again."""
    if not isinstance(t, GlobalTensor) or not _GATHERED:
        return t
    full = _GATHERED.get(_storage(t))
    if full is None:
        return t
    if t.shape == full.shape and t.stride() == full.stride():
        return _Regather(full._shoal_rest, False)
    if t.ndim == 2 and t.shape == full.shape[::-1] and t.stride() == full.stride()[::-1]:
        return _Regather(full._shoal_rest, True)
    return t


def _unpack(x):
    if not isinstance(x, _Regather):
        return x
    with torch.no_grad():
        full = x.rest.detach().to_global(x.rest.mesh, x.rest._shoal_full_sbp)
    return full.t() if x.transposed else full


class _Regather:
    __slots__ = ("rest", "transposed")

    def __init__(self, rest, transposed: bool) -> None:
        self.rest, self.transposed = rest, transposed


_DISTRIBUTED: weakref.WeakSet = weakref.WeakSet()  # modules distribute_module laid out (for the fit check)
_SPLIT_OPTIMIZERS: weakref.WeakSet = weakref.WeakSet()
_HOOK = []


def _install_optimizer_hook() -> None:
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_first_step))


def _first_step(opt, args, kwargs) -> None:
    """At an optimizer's first step: check that the state it is about to make fits the budget, and
    if it updates ZeRO parameters, split its state from then on."""
    if opt in _SPLIT_OPTIMIZERS:
        return
    _SPLIT_OPTIMIZERS.add(opt)
    if world().memory_per_device is not None and not opt.state:
        for m in list(_DISTRIBUTED):
            mine = {id(p) for p in m.parameters()}
            if any(id(p) in mine for g in opt.param_groups for p in g["params"]):
                check_fit(m, m._shoal_zero_level, f"{type(opt).__name__}'s first step", _state_slots(opt))
    if any(hasattr(p, "_shoal_zero") for g in opt.param_groups for p in g["params"]):
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
        for dev, n in t.spec.bytes_per_device().items():
            out[dev] = out.get(dev, 0) + n

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
        mine = {id(p) for p in params}
        masters = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in mine]
        if masters:
            kinds["master weights"] = memory_per_device(masters)
    return MemoryReport(kinds)


# -- the fit check -------------------------------------------------------------------------------


def _state_slots(opt: torch.optim.Optimizer) -> float:
    """State tensors per parameter the optimizer will make (Adam-like: 2)."""
    d = opt.defaults
    name = type(opt).__name__
    if name in ("SGD",):
        return 1.0 if d.get("momentum", 0) else 0.0
    if name in ("Adagrad", "Rprop", "ASGD"):
        return 1.0 if name == "Adagrad" else 2.0
    if name == "RMSprop":
        return 1.0 + bool(d.get("momentum", 0)) + bool(d.get("centered", False))
    return 2.0 + bool(d.get("amsgrad", False))


def _bytes_on(shape, dtype, mesh: Mesh, sbp) -> dict[int, int]:
    return TensorSpec(tuple(shape), dtype, mesh, tuple(sbp)).bytes_per_device()


def state_bytes(module: nn.Module, level: int, slots: float = 2.0) -> dict[int, list[tuple[int, str, str]]]:
    """What each device will hold for ``module`` under ZeRO ``level`` with an optimizer keeping
    ``slots`` state tensors per parameter: device -> [(bytes, kind, name)], from the layouts alone."""
    out: dict[int, list] = {}
    seen: set = set()

    def add(per: dict, kind: str, name: str, scale: float = 1.0) -> None:
        for d, b in per.items():
            if b:
                out.setdefault(d, []).append((int(b * scale), kind, name))

    for name, p in module.named_parameters():
        if not isinstance(p, GlobalTensor) or id(p) in seen:
            continue
        seen.add(id(p))
        whole = reduced(getattr(p, "_shoal_full_sbp", p.sbp))
        a = getattr(p, "_shoal_zero", (0, dp_axis(p.mesh, None)))[1]
        split = zero_layout(whole, p.shape, p.mesh, a) if p.mesh.shape[a] > 1 else whole
        add(_bytes_on(p.shape, p.dtype, p.mesh, split if level >= 3 else whole), "parameters", name)
        if p.requires_grad:
            add(_bytes_on(p.shape, p.dtype, p.mesh, split if level >= 2 else whole), "gradients", name)
            master = getattr(p, "_shoal_master_dtype", None)
            on = split if level >= 1 else whole
            if master is not None:
                add(_bytes_on(p.shape, master, p.mesh, on), "master weights", name)
            add(_bytes_on(p.shape, master or p.dtype, p.mesh, on), "optimizer state", name, slots)
    for name, b in module.named_buffers():
        if isinstance(b, GlobalTensor) and id(b) not in seen:
            seen.add(id(b))
            add(_bytes_on(b.shape, b.dtype, b.mesh, reduced(b.sbp)), "buffers", name)
    return out


def byte_size(n: float) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= k:
            return f"{n / k:.2f} {unit}"
    return f"{int(n)} B"


def check_fit(module: nn.Module, level: int, where: str, slots: float = 2.0) -> None:
    """Refuse (``DoesNotFit``) a plan whose states exceed ``shoal.init(memory_per_device=...)`` on
    some device, naming the largest consumers there and the ZeRO stages that would fit."""
    budget = world().memory_per_device
    if budget is None:
        return
    per = state_bytes(module, level, slots)
    totals = {d: sum(b for b, _, _ in items) for d, items in per.items()}
    if not totals or max(totals.values()) <= budget:
        return
    worst = max(totals, key=totals.get)
    kinds: dict[str, int] = {}
    for b, kind, _ in per[worst]:
        kinds[kind] = kinds.get(kind, 0) + b
    top = sorted(per[worst], reverse=True)[:5]
    by_kind = ", ".join(f"{k} {byte_size(v)}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))
    lines = [f"shoal: {where}: the plan holds {byte_size(totals[worst])} on device {worst}, over its budget of "
             f"{byte_size(budget)} (shoal.init(memory_per_device=...)) by {byte_size(totals[worst] - budget)}, before "
             f"activations. By kind: {by_kind}",
             f"  largest on device {worst}: " + ", ".join(f"{n} ({k}) {byte_size(b)}" for b, k, n in top)]
    options = []
    for lv in range(4):
        if lv != level:
            t = max(sum(b for b, _, _ in items) for items in state_bytes(module, lv, slots).values())
            verdict = f"fits, {byte_size(budget - t)} to spare" if t <= budget else f"over by {byte_size(t - budget)}"
            options.append(f"Plan(zero={lv}): {byte_size(t)} ({verdict})")
    lines.append("  with the same layouts otherwise: " + "; ".join(options)
                 + ". Mixed precision (Plan(precision='bf16')), more devices on the data-parallel axis, or "
                   "pipeline stages also shrink it.")
    raise DoesNotFit("\n".join(lines))
