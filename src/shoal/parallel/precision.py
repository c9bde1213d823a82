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
state loaded before the first step (resuming) becomes the masters'. float16 parameters (which need loss
scaling) are refused; fp32 parameters under ``torch.autocast(dtype=torch.float16)`` with
``torch.amp.GradScaler`` work as in plain torch.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ..tensor import GlobalTensor
from .memory import replacement, zero_layout

__all__ = ["Precision", "install_precision", "master_weights"]


# fp16 parameters need dynamic loss scaling, and torch.amp.GradScaler refuses fp16 gradients: it would
# have to see the masters before the first step, when shoal has not yet found the optimizer
_NO_FP16 = ("float16 parameters need dynamic loss scaling, which shoal's master weights do not have yet. Use "
            "precision='bf16' (fp32's range: no scaling needed), or keep fp32 parameters and compute in float16 "
            "under torch.autocast(device_type, dtype=torch.float16) with torch.amp.GradScaler, as in plain torch")


@dataclass(frozen=True, slots=True)
class Precision:
    """Dtypes of the parameters and compute (``param``), of gradient reduction (``reduce``), and of
    the master weights and optimizer state (``master``)."""

    param: torch.dtype = torch.bfloat16
    reduce: torch.dtype = torch.float32
    master: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.reduce != torch.float32:
            raise ValueError(f"Precision(reduce={self.reduce}): shoal reduces low-precision partial sums in float32 "
                             f"only (as one device accumulates them)")
        if self.param == torch.float16:
            raise NotImplementedError(f"Precision(param=torch.float16): {_NO_FP16}")

    @staticmethod
    def of(x) -> Precision | None:
        if x is None or isinstance(x, Precision):
            return x
        if x == "bf16":
            return Precision()
        if x == "fp16":
            raise NotImplementedError(f"Plan(precision='fp16'): {_NO_FP16}")
        raise ValueError(f"Plan(precision={x!r}): give 'bf16' or a shoal.Precision(param=..., reduce=..., master=...)")


def install_precision(module: nn.Module, precision) -> None:
    """Hold ``module``'s floating-point parameters in ``precision.param``, mark them for master
    weights."""
    prec = Precision.of(precision)
    if prec is None:
        return
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
                made[id(p)] = q
            mod._parameters[name] = made[id(p)]
    module.register_forward_pre_hook(_cast_inputs(prec.param), with_kwargs=True)
    _install_hooks()


def _cast_inputs(dtype: torch.dtype):
    """A forward pre-hook casting the module's floating-point tensor arguments (images) to the
    compute dtype, as FSDP's mixed precision does; integer ones (token ids) stay as they are."""
    def cast(t):
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    def hook(mod, args, kwargs):
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}
    return hook


# -- master weights --------------------------------------------------------------------------------

_MASTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> [(parameter, master)]
_HOOKS: list = []


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
        for p, m in _MASTERS.get(opt, ()):
            p.copy_(m)  # rounded once, gathered where the master is split
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
