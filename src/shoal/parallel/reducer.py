"""Bucketed gradient reduction: data-parallel gradients reduced in one collective per layout.

Under data parallelism gradients come out Partial(sum) over the data-parallel axis and would be
all-reduced one by one when the optimizer first reads each of them. ``GradReducer`` waits for the
end of backward, then reduces every such gradient of a module together: the local shards of all
gradients that share a (mesh, layout) are flattened into one buffer and all-reduced along each
axis where the gradient is Partial and its parameter Broadcast (an elementwise sum, so flattening
is exact whatever the other axes do), then cut back. Other Partial axes are left to the optimizer.
"""

from __future__ import annotations

import torch

from .. import comm
from ..sbp import Broadcast, Partial
from ..tensor import GlobalTensor

__all__ = ["GradReducer"]

_SUM = Partial("sum")


class GradReducer:
    def __init__(self, params) -> None:
        self._ready: list[torch.nn.Parameter] = []
        self._queued = False
        self.handles = [p.register_post_accumulate_grad_hook(self._hook) for p in params if p.requires_grad]

    def _hook(self, p: torch.nn.Parameter) -> None:
        g = p.grad
        if not isinstance(g, GlobalTensor) or not isinstance(p, GlobalTensor) or not _axes(p, g):
            return
        self._ready.append(p)
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)

    def flush(self) -> None:
        """Reduce the gradients gathered since the last flush (runs at the end of backward)."""
        ready, self._ready, self._queued = self._ready, [], False
        groups: dict = {}
        for p in ready:
            g = p.grad
            if isinstance(g, GlobalTensor):
                groups.setdefault((g.spec.mesh, g.sbp, g.dtype, _axes(p, g)), []).append(p)
        for (mesh, sbp, _, axes), params in groups.items():
            _reduce_bucket(mesh, sbp, axes, params)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _axes(p: GlobalTensor, g: GlobalTensor) -> tuple[int, ...]:
    """Mesh axes where the gradient is a partial sum and the parameter is replicated."""
    if g.spec.mesh != p.spec.mesh:
        return ()
    return tuple(a for a, (s, t) in enumerate(zip(g.sbp, p.sbp)) if s == _SUM and isinstance(t, Broadcast))


def _reduce_bucket(mesh, sbp, axes, params) -> None:
    positions = mesh.local_positions
    grads = [p.grad for p in params]
    flat: list = [None] * mesh.size
    for pos in positions:
        flat[pos] = torch.cat([g._shards[pos].reshape(-1) for g in grads])
    for a in axes:
        for group in mesh.groups(a):
            out = comm.all_reduce([mesh.devices[q] for q in group], [flat[q] for q in group], "sum")
            for q, t in zip(group, out):
                flat[q] = t
    new_sbp = tuple(Broadcast() if a in axes else s for a, s in enumerate(sbp))
    cut: dict = {}  # position -> the reduced shards, in grads order
    for pos in positions:
        sizes = [g._shards[pos].numel() for g in grads]
        pieces = torch.split(flat[pos], sizes)
        cut[pos] = [piece.view(g._shards[pos].shape) for piece, g in zip(pieces, grads)]
    for k, (p, g) in enumerate(zip(params, grads)):
        shards = tuple(cut[pos][k] if pos in cut else None for pos in range(mesh.size))
        p.grad = GlobalTensor._make(g.spec.with_sbp(new_sbp), shards, g.stride())
