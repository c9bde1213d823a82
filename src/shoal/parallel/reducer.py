"""Bucketed gradient reduction: data-parallel gradients reduced in buckets, overlapping backward.

Under data parallelism gradients come out Partial(sum) over the data-parallel axis and would be
all-reduced one by one when the optimizer first reads each of them. ``GradReducer`` gathers them
as backward produces them (a post-accumulate-grad hook per parameter) into buckets of one
(mesh, layout); a full bucket starts its all-reduce at once, across processes asynchronously, so
it runs while backward goes on; the end of backward starts the rest and waits for all. A bucket's
local shards are flattened into one buffer and reduced along each axis where the gradients are
Partial and their parameters Broadcast: an elementwise sum, so flattening is exact whatever the
other axes do. Other Partial axes are left to the optimizer.
"""

from __future__ import annotations

import torch

from .. import comm
from ..sbp import Broadcast, Partial
from ..tensor import GlobalTensor
from .memory import split_gradient

__all__ = ["GradReducer"]

_SUM = Partial("sum")


class GradReducer:
    def __init__(self, params, bucket_bytes: int | None = None) -> None:
        self.bucket_bytes = bucket_bytes or comm.bucket_bytes()  # per device
        self._open: dict = {}  # (mesh, sbp, dtype, axes) -> [parameters, bytes]
        self._started: list = []  # functions finishing started buckets
        self._queued = False
        self.paused = False  # a pipelined step's body: its gradient accumulators are reduced once, after
        self.handles = [p.register_post_accumulate_grad_hook(self._hook) for p in params if p.requires_grad]

    def _hook(self, p: torch.nn.Parameter) -> None:
        if self.paused:
            return
        g = p.grad
        if not isinstance(g, GlobalTensor) or not isinstance(p, GlobalTensor):
            return
        mesh = g.spec.mesh
        if any(isinstance(s, Partial) and n == 1 for s, n in zip(g.sbp, mesh.shape)):
            # a partial value over one device is the value: say so (nothing to copy or reduce)
            sbp = tuple(Broadcast() if isinstance(s, Partial) and n == 1 else s for s, n in zip(g.sbp, mesh.shape))
            g = p.grad = GlobalTensor._make(g.spec.with_sbp(sbp), g._shards, g.stride())
        split = split_gradient(p, g)
        if split is not None:  # ZeRO-2: kept as this device's shard of the reduced gradient
            p.grad = split
            return
        axes = _axes(p, g)
        if not axes:
            return
        key = (g.spec.mesh, g.sbp, g.dtype, axes)
        bucket = self._open.setdefault(key, [[], 0])
        bucket[0].append(p)
        # per device: a shard's bytes (a partial sum is the whole tensor on every device of its axis)
        bucket[1] += next((t.numel() for t in g._shards if t is not None), 0) * g.element_size()
        if bucket[1] >= self.bucket_bytes:
            self._start(key)
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)

    def _start(self, key) -> None:
        params, _ = self._open.pop(key)
        mesh, sbp, _, axes = key
        self._started.append(_start_bucket(mesh, sbp, axes, params))

    def flush(self) -> None:
        """Start what is left and wait for every bucket (runs at the end of backward)."""
        for key in list(self._open):
            self._start(key)
        started, self._started, self._queued = self._started, [], False
        for finish in started:
            finish()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _axes(p: GlobalTensor, g: GlobalTensor) -> tuple[int, ...]:
    """Mesh axes where the gradient is a partial sum and the parameter is replicated."""
    if g.spec.mesh != p.spec.mesh:
        return ()
    return tuple(a for a, (s, t) in enumerate(zip(g.sbp, p.sbp)) if s == _SUM and isinstance(t, Broadcast))


def _start_bucket(mesh, sbp, axes, params):
    """Start reducing one bucket; returns the function that waits and installs the reduced grads."""
    positions = mesh.local_positions
    grads = [p.grad for p in params]
    flat: list = [None] * mesh.size
    for pos in positions:
        flat[pos] = torch.cat([g._shards[pos].reshape(-1) for g in grads])
    *first, last = axes
    for a in first:  # more than one axis: all but the last one now, in turn
        for group in mesh.groups(a):
            for q, t in zip(group, comm.all_reduce([mesh.devices[q] for q in group], [flat[q] for q in group])):
                flat[q] = t
    pending = [
        (group, comm.all_reduce_start([mesh.devices[q] for q in group], [flat[q] for q in group]))
        for group in mesh.groups(last)
    ]

    def finish() -> None:
        for group, wait in pending:
            for q, t in zip(group, wait()):
                flat[q] = t
        new_sbp = tuple(Broadcast() if a in axes else s for a, s in enumerate(sbp))
        cut = {}
        for pos in positions:
            pieces = torch.split(flat[pos], [g._shards[pos].numel() for g in grads])
            cut[pos] = [piece.view(g._shards[pos].shape) for piece, g in zip(pieces, grads)]
        for k, (p, g) in enumerate(zip(params, grads)):
            shards = tuple(cut[pos][k] if pos in cut else None for pos in range(mesh.size))
            p.grad = GlobalTensor._make(g.spec.with_sbp(new_sbp), shards, g.stride())

    return finish
