"""Activations recomputed in backward from the plan: ``Plan(checkpoint=["blocks.*"])`` and
``Plan(regather=["blocks.*.attn"])``.

The named modules (the outermost a pattern matches) keep no activations for backward: their
forward runs under torch's own non-reentrant checkpoint, which saves the inputs and runs the
forward again when backward needs what it made, restoring torch's random state first, so dropout
draws the same masks (shoal draws every random tensor whole with torch's generator; in graph mode
the tracer records the generator's state changes as host work, in order with the draws). A batch
norm in training recomputes with its batch's statistics, and its running ones are put back after
(updated once, as without checkpointing). Under ZeRO-3 the recomputation gathers the module's
parameters as its unit's forward hooks did (it runs outside them), so it sees the layouts the first
forward saw. In graph mode the recomputation is traced into the backward, and the planned peak
shows what it saves.

Regathering (Megatron-LM's sequence parallelism keeps activations this way): a module whose input
pin gathers its input (split over some mesh axis before, Broadcast there after) keeps what its
forward saves of the gathered input as the split input, and gathers it again when backward reads
it: the column-parallel layers after a sequence-parallel region hold 1/tp of their input between
forward and backward, for one more all-gather each in backward. An all-gather is exact, so the
values are those of the first gather.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
from collections.abc import Sequence

import torch.utils.checkpoint
from torch import nn

from ..sbp import Broadcast, Split
from ..tensor import GlobalTensor
from .memory import gathered

__all__ = ["install_checkpointing", "checkpointed", "install_regathering"]


def install_checkpointing(module: nn.Module, patterns: Sequence[str]) -> list[str]:
    """Recompute the activations of ``module``'s submodules whose names match ``patterns``; returns
    their names."""
    if isinstance(patterns, str):
        patterns = [patterns]
    if not patterns:
        return []
    mods = dict(module.named_modules())
    used: set = set()
    chosen: list[str] = []
    for name in mods:
        hits = [p for p in patterns if fnmatch.fnmatchcase(name, p)]
        used.update(hits)
        if hits and not any(name.startswith(c + ".") or not c for c in chosen):
            chosen.append(name)
    unused = [p for p in patterns if p not in used]
    if unused:
        raise ValueError(f"Plan(checkpoint=...): pattern(s) {unused} match no submodule of {type(module).__name__}; "
                         f"names look like {list(mods)[1:6]}")
    for name in chosen:
        m = mods[name]
        m.forward = functools.partial(checkpointed, m, m.forward)
    return chosen


def install_regathering(module: nn.Module, patterns: Sequence[str], pins: dict) -> list[str]:
    """For each submodule of ``module`` whose name matches ``patterns`` (not inside, nor itself, a
    checkpointed one: that keeps no activations anyway), its input pin (``pins``: name -> the function
    laying out its inputs, run here instead of as a hook) and regathering around its forward; returns
    the names."""
    mods = dict(module.named_modules())
    unused = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in mods)]
    if unused:
        raise ValueError(f"Plan(regather=...): pattern(s) {unused} match no submodule of {type(module).__name__}; "
                         f"names look like {list(mods)[1:6]}")
    done = []
    for name in [n for n in mods if any(fnmatch.fnmatchcase(n, p) for p in patterns)]:
        if name not in pins:
            raise ValueError(f"Plan(regather=...): {name!r} has no input pin (Plan.inputs) to gather its input; "
                             "name submodules whose inputs the plan lays out")
        parts = name.split(".")
        if any(_is_checkpointed(mods[".".join(parts[:i])]) for i in range(1, len(parts) + 1)):
            continue  # inside (or itself) a checkpointed module
        m = mods[name]
        m.forward = functools.partial(_regathered, m.forward, pins.pop(name))
        done.append(name)
    return done


def _is_checkpointed(m: nn.Module) -> bool:
    f = m.__dict__.get("forward")
    return isinstance(f, functools.partial) and f.func is checkpointed


class _Gathered:
    """A gathered input, kept as the split tensor it was gathered from (``source``) and gathered again
    once for all the saved views of it that backward reads (``left`` of them not read yet)."""

    __slots__ = ("source", "mesh", "sbp", "left", "full")

    def __init__(self, source, mesh, sbp) -> None:
        self.source, self.mesh, self.sbp, self.left, self.full = source, mesh, sbp, 0, None

    def view(self, shape):
        if torch.is_grad_enabled():  # a backward that builds a graph (create_graph): gathered with grad
            return self.source.to_global(self.mesh, self.sbp).view(shape)
        if self.full is None:
            with torch.no_grad():
                self.full = self.source.detach().to_global(self.mesh, self.sbp)
        out = self.full.view(shape)
        self.left -= 1
        if self.left <= 0:
            self.full = None
        return out


class _Regather:
    """A saved tensor kept as a view of a ``_Gathered`` input: that input and the view's shape."""

    __slots__ = ("input", "shape")

    def __init__(self, input: _Gathered, shape) -> None:
        self.input, self.shape = input, shape


def _regathered(forward, pin, *args, **kwargs):
    laid = pin(tuple(args))
    gathered = {}
    for before, after in zip(args, laid):
        if isinstance(before, GlobalTensor) and isinstance(after, GlobalTensor) and _gathers(before, after):
            key = _first_storage(after)
            if key is not None:
                gathered[key] = (_Gathered(before, after.mesh, after.sbp), after.numel())
    if not gathered or not torch.is_grad_enabled():
        return forward(*laid, **kwargs)

    def pack(t):
        hit = gathered.get(_first_storage(t)) if isinstance(t, GlobalTensor) else None
        if hit is None or t.numel() != hit[1] or not _whole(t):
            return t
        hit[0].left += 1
        return _Regather(hit[0], tuple(t.shape))

    def unpack(x):
        return x.input.view(x.shape) if isinstance(x, _Regather) else x

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return forward(*laid, **kwargs)


def _gathers(before, after) -> bool:
    """``after`` is ``before`` gathered: the same mesh, Broadcast where ``before`` is split."""
    return before.mesh == after.mesh and any(isinstance(b, Split) and isinstance(a, Broadcast)
                                             for b, a in zip(before.sbp, after.sbp))


def _first_storage(t):
    """(storage, offset) of a GlobalTensor's first local shard, None without one."""
    s = next((x for x in t._shards if x is not None), None)
    return None if s is None else (s.untyped_storage()._cdata, s.storage_offset())


def _whole(t) -> bool:
    """Each local shard of ``t`` is contiguous: a reshape of the gathered tensor it shares storage with."""
    return all(s is None or s.is_contiguous() for s in t._shards)


def checkpointed(module: nn.Module, forward, *args, **kwargs):
    """``forward(*args, **kwargs)`` of ``module``, its activations recomputed in backward (while grad
    is on)."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return torch.utils.checkpoint.checkpoint(
        forward, *args, use_reentrant=False,
        context_fn=lambda: (contextlib.nullcontext(), _recomputing(module)), **kwargs)


@contextlib.contextmanager
def _recomputing(module: nn.Module):
    """Around the recomputation in backward: the module's ZeRO-3 parameters gathered, its batch
    norms' statistics kept."""
    with gathered(module), _statistics_kept(module):
        yield


@contextlib.contextmanager
def _statistics_kept(module: nn.Module):
    """While recomputing: batch norms in training normalize by the batch again (as the first time),
    and their running statistics and batch count are put back as the first forward left them."""
    bufs = [b for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
            for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None]
    with torch.no_grad():
        kept = [b.clone() for b in bufs]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, k in zip(bufs, kept):
                b.copy_(k)
