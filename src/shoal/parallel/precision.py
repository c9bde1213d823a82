"""Mixed precision from the plan: ``Plan(precision="bf16")`` or ``Precision(param, reduce, master)``.

Megatron-LM's recipe on shoal's layouts. The module's floating-point parameters are held and
computed in ``param`` (bf16), and so are the module's floating-point inputs; batch norms keep fp32
parameters (as apex and Megatron do: ATen's batch norm takes bf16 inputs with fp32 statistics and
affine parameters, not bf16 ones). Gradients come out of backward in bf16 as partial sums over the
data-parallel axes, and are reduced (all-reduce, or reduce-scatter under ZeRO-2/3) in fp32 and
rounded to bf16 once: every collective adds low-precision partial sums in fp32 (``shoal.comm``).
The user's optimizer (a plain torch optimizer over ``model.parameters()``) is found at its first
step and given fp32 master copies instead of the bf16 parameters (split over the ZeRO axis like its
state); before each step a master's gradient is its parameter's, in fp32; after it the parameter is
the master rounded to bf16. A step takes the bf16 gradients (they are None after it, as under
DeepSpeed), and ``opt.zero_grad()`` clears them too (a backward not followed by a step); optimizer
state loaded before the first step (resuming) becomes the masters'.

float16 (``precision="fp16"``) adds dynamic loss scaling, as ``torch.amp.GradScaler`` does it: the
gradient flowing into each of the module's outputs is multiplied by the loss scale (the same as
scaling the loss: the outputs are fresh aliases, so a loss computed inside the module and the logits
it came from are each scaled once), so small gradients survive backward in float16; before the step
the masters take the gradients unscaled in fp32, and if any is inf or nan anywhere the step is
skipped (masters and optimizer state unchanged) and the scale halves; after ``growth_interval``
clean steps it doubles. Eager steps skip by giving the optimizer no gradients; a compiled step,
which cannot branch on a value, runs the update and keeps the old values where it overflowed. Until
the step, ``p.grad`` holds the scaled gradient (as GradScaler's before ``unscale_``: clipping inside
the step clips the scaled norm). Every parameter the optimizer steps is unscaled and checked, batch
norms' fp32 ones too. The scale, its count of clean steps and whether the last step overflowed are
buffers of the module (``_shoal_loss_scale``, ``_shoal_clean_steps``, ``_shoal_overflowed``: not in
its ``state_dict``); ``loss_scale(module)`` reads the scale. fp32 parameters under ``torch.autocast`` with
``torch.amp.GradScaler`` work as in plain torch.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._pytree import tree_map

from .. import seam
from ..sbp import Broadcast
from ..tensor import GlobalTensor, to_global
from .memory import replacement, zero_layout

__all__ = ["Precision", "install_precision", "loss_scale", "keeping_host_state", "master_weights",
           "skipped_step"]


@dataclass(frozen=True, slots=True)
class Precision:
    """Dtypes of the parameters and compute (``param``), of gradient reduction (``reduce``), and of
    the master weights and optimizer state (``master``). float16 parameters scale the loss,
    starting at ``init_scale`` (2^15: the gradient of a float16 loss, 1, times 2^16 is past float16's
    largest value) and doubling after ``growth_interval`` steps without overflow."""

    param: torch.dtype = torch.bfloat16
    reduce: torch.dtype = torch.float32
    master: torch.dtype = torch.float32
    init_scale: float = 2.0**15
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        if self.reduce != torch.float32:
            raise ValueError(f"Precision(reduce={self.reduce}): shoal reduces low-precision partial sums in float32 "
                             f"only (as one device accumulates them)")
        if self.param not in (torch.bfloat16, torch.float16) or self.master != torch.float32:
            raise ValueError(f"Precision(param={self.param}, master={self.master}): give param=torch.bfloat16 "
                             f"or torch.float16 and master=torch.float32")

    @property
    def scaled(self) -> bool:
        return self.param == torch.float16

    @staticmethod
    def of(x) -> Precision | None:
        if x is None or isinstance(x, Precision):
            return x
        if x == "bf16":
            return Precision()
        if x == "fp16":
            return Precision(param=torch.float16)
        raise ValueError(f"Plan(precision={x!r}): give 'bf16', 'fp16' or a shoal.Precision(param=..., ...)")


def install_precision(module: nn.Module, mesh, precision) -> None:
    """Hold ``module``'s floating-point parameters in ``precision.param``, mark them for master
    weights; under float16, scale the gradients of its outputs by a loss scale held on ``mesh``."""
    prec = Precision.of(precision)
    if prec is None:
        return
    scaler = _LossScale(module, mesh, prec) if prec.scaled else None
    made: dict[int, nn.Parameter] = {}  # tied parameters stay tied
    for mod in module.modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            continue  # its running statistics are fp32, and ATen's batch norm wants its affine parameters so
        for name, p in list(mod._parameters.items()):
            if p is None or not p.is_floating_point() or not isinstance(p, GlobalTensor):
                continue
            if id(p) not in made:
                q = replacement(p, p.detach().to(prec.param))
                q._shoal_master_dtype = prec.master
                q._shoal_scaler = scaler
                made[id(p)] = q
            mod._parameters[name] = made[id(p)]
    module.register_forward_pre_hook(_cast_inputs(prec.param), with_kwargs=True)
    if scaler is not None:
        module.register_forward_hook(scaler.scale_outputs)
    _install_hooks()


def _cast_inputs(dtype: torch.dtype):
    """A forward pre-hook casting the module's floating-point tensor arguments (images) to the
    compute dtype, as FSDP's mixed precision does; integer ones (token ids) stay as they are."""
    def cast(t):
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    def hook(mod, args, kwargs):
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}
    return hook


# -- loss scaling (float16) -----------------------------------------------------------------------

class _LossScale:
    """``module``'s dynamic loss scale: its buffers, the output hook that applies it, and the skip
    or update of each step."""

    def __init__(self, module: nn.Module, mesh, prec: Precision) -> None:
        rep = [Broadcast()] * mesh.ndim
        module.register_buffer("_shoal_loss_scale", to_global(torch.tensor(prec.init_scale), mesh, rep),
                               persistent=False)
        module.register_buffer("_shoal_clean_steps", to_global(torch.tensor(0.0), mesh, rep), persistent=False)
        module.register_buffer("_shoal_overflowed", to_global(torch.tensor(0.0), mesh, rep), persistent=False)
        self.module, self.interval = weakref.ref(module), prec.growth_interval

    @property
    def scale(self) -> GlobalTensor:
        return self.module()._shoal_loss_scale  # read when used: a loaded or replaced buffer counts

    @property
    def overflowed_last(self) -> GlobalTensor:
        return self.module()._shoal_overflowed

    def scale_outputs(self, mod, args, out):
        def scaled(t):
            if not (isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad):
                return t
            alias = t.view_as(t)  # its own node: each output's incoming gradient scaled once
            alias.register_hook(lambda g: (g * self.scale).to(g.dtype))
            return alias
        return tree_map(scaled, out)

    def overflowed(self, grads: list) -> GlobalTensor:
        """1.0 where any of ``grads`` has an inf or nan on any device, else 0.0 (max minus min is not
        finite exactly then, without a copy of each gradient)."""
        grads = [g for g in grads if g.numel()]
        if not grads:
            return None
        return (~torch.isfinite(sum(g.amax() - g.amin() for g in grads))).float()

    def update(self, found: GlobalTensor) -> None:
        """GradScaler's rule: halve on overflow (and restart the count), double after ``interval``
        clean steps."""
        clean = self.module()._shoal_clean_steps
        counted = (clean + 1) * (1 - found)
        grow = (counted >= self.interval).float()
        self.scale.mul_(0.5 * found + (1 - found) * (1 + grow))
        clean.copy_(counted * (1 - grow))


def loss_scale(module: nn.Module) -> float | None:
    """The loss scale of a module under ``precision="fp16"`` (None otherwise)."""
    s = getattr(module, "_shoal_loss_scale", None)
    return None if s is None else s.item()


# -- master weights --------------------------------------------------------------------------------

_MASTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> [(parameter, master)]
_SCALED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> what its step's end needs
_HOOKS: list = []


def _scaler_of(opt: torch.optim.Optimizer) -> _LossScale | None:
    """The loss scale of the float16 parameters ``opt`` steps through masters (None: none)."""
    pairs = _MASTERS.get(opt)
    return pairs[0][0]._shoal_scaler if pairs else None


def skipped_step(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt``'s last step was skipped for an overflow (float16)."""
    scaler = _scaler_of(opt)
    return scaler is not None and bool(scaler.overflowed_last.item())


def _install_hooks() -> None:
    if not _HOOKS:
        _HOOKS.append(register_optimizer_step_pre_hook(_before_step))
        _HOOKS.append(register_optimizer_step_post_hook(_after_step))


def master_weights(opt: torch.optim.Optimizer) -> list[GlobalTensor]:
    """The master copies ``opt`` updates (empty before its first step or without mixed precision)."""
    return [m for _, m in _MASTERS.get(opt, ())]


def _master_of(p: nn.Parameter) -> nn.Parameter:
    """``p``'s master copy in the master dtype: split over the ZeRO axis from ZeRO-1 on."""
    level, axis = getattr(p, "_shoal_zero", (0, None))
    sbp = zero_layout(p.sbp, p.shape, p.mesh, axis) if level >= 1 else p.sbp
    with torch.no_grad():
        m = nn.Parameter(p.detach().to(p._shoal_master_dtype).to_global(p.mesh, sbp))
    if hasattr(p, "_shoal_zero"):
        m._shoal_zero = p._shoal_zero
    return m


def _before_step(opt, args, kwargs) -> None:
    pairs = _MASTERS.get(opt)
    if pairs is None:  # the first step: the masters take the parameters' places in the optimizer
        pairs = []
        for group in opt.param_groups:
            for i, p in enumerate(group["params"]):
                if hasattr(p, "_shoal_master_dtype"):
                    m = _master_of(p)
                    group["params"][i] = m
                    pairs.append((p, m))
                    if p in opt.state:  # loaded before the first step (resuming): the master's state now
                        opt.state[m] = _state_of_master(opt.state.pop(p), m)
        if not pairs:
            return
        _MASTERS[opt] = pairs
        opt.zero_grad = _clearing(opt.zero_grad, pairs)
    with torch.no_grad():
        for p, m in pairs:
            m.grad = None if p.grad is None else p.grad.to(m.dtype).to_global(m.mesh, m.sbp)
            p.grad = None  # taken: a zero_grad bound before the first step (not the wrapper) leaves none behind
        scaler = _scaler_of(opt)
        if scaler is not None:  # every gradient the step takes was scaled: the masters' and batch norms' (fp32)
            stepped = [q for group in opt.param_groups for q in group["params"] if q.grad is not None]
            inv = scaler.scale.reciprocal()
            for q in stepped:
                q.grad.mul_(inv)
            _SCALED[opt] = _skip_if_overflowed(opt, scaler, stepped)


def _skip_if_overflowed(opt, scaler: _LossScale, stepped: list):
    """Make the coming step a no-op if a gradient of ``stepped`` overflowed: eagerly by taking their
    gradients away (the optimizer passes over a parameter without one); traced, by keeping each
    one's and its state's value before the step, to be put back where ``found`` (``_after_step``)."""
    found = scaler.overflowed([q.grad for q in stepped])
    if found is None:
        return None
    kept = []
    if not seam.current().tracing:
        if found.item():
            for q in stepped:
                q.grad = None
    else:  # plain tensors (step counters) are the host's: ``keeping_host_state`` puts them back
        for q in stepped:
            for t in (q, *opt.state.get(q, {}).values()):
                if isinstance(t, GlobalTensor):
                    kept.append((t, t.clone()))
    return scaler, found, kept


@contextlib.contextmanager
def keeping_host_state(optimizers):
    """Around a compiled step's run: the plain tensors in the state of an optimizer under float16
    (Adam's step counters: host work, which the traced step cannot make depend on a device value)
    put back as they were before where the step overflowed (one read of a flag a step)."""
    kept = []
    for opt in optimizers:
        scaler = _scaler_of(opt)
        if scaler is not None:
            kept.append((scaler, [(t, t.clone()) for group in opt.param_groups for q in group["params"]
                                  for t in opt.state.get(q, {}).values()
                                  if isinstance(t, torch.Tensor) and not isinstance(t, GlobalTensor)]))
    yield
    for scaler, saved in kept:
        if scaler.overflowed_last.item():
            for t, before in saved:
                t.copy_(before)


def _state_of_master(state: dict, m: nn.Parameter) -> dict:
    """A parameter's optimizer state (``load_state_dict`` cast it to the parameter's dtype) as its
    master's: floating-point tensors in the master's dtype, those of its shape in its layout."""
    out = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point() and k != "step":  # torch keeps "step" as is
            v = v.detach().to(m.dtype)
            if isinstance(v, GlobalTensor) and v.shape == m.shape and v.mesh == m.mesh:
                v = v.to_global(m.mesh, m.sbp)
        out[k] = v
    return out


def _after_step(opt, args, kwargs) -> None:
    with torch.no_grad():
        scaled = _SCALED.pop(opt, None)
        if scaled is not None:
            scaler, found, kept = scaled
            for t, before in kept:
                t.copy_(torch.where(found.bool(), before, t))
            scaler.overflowed_last.copy_(found)
            scaler.update(found)
        for p, m in _MASTERS.get(opt, ()):
            # rounded once, then gathered where the master is split: the gather carries the low precision
            p.copy_(m if m.dtype == p.dtype else m.to(p.dtype))
            m.grad = None


def _clearing(zero_grad, pairs):
    """``opt.zero_grad`` that clears the parameters' gradients as well as the masters'."""
    def clear(set_to_none: bool = True) -> None:
        zero_grad(set_to_none)
        for p, _ in pairs:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
    return clear
