"""Activation checkpointing from the plan: ``Plan(checkpoint=["blocks.*"])``.

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
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
from collections.abc import Sequence

import torch.utils.checkpoint
from torch import nn

from .memory import gathered

__all__ = ["install_checkpointing", "checkpointed"]


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
