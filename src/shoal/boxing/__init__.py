"""Boxing: convert a global tensor's shards between any two (mesh, nd-SBP) pairs.

``box(shards, src, dst)`` runs the planner's 1-D steps with the collectives in ``comm``;
across meshes it moves shards point-to-point. ``cost(src, dst_sbp)`` is the planner's estimate.
"""

from __future__ import annotations

import torch

from .. import comm, seam
from ..sbp import Broadcast, NdSBP, Partial, Split
from ..spec import TensorSpec, _itemsize, chunk_bounds
from .planner import Step, plan, plan_cost

__all__ = ["box", "cost", "Step", "plan"]

Shards = tuple  # one entry per mesh position; None where another process owns the device


def cost(src: TensorSpec, dst_sbp: NdSBP) -> float:
    if src.sbp == dst_sbp:
        return 0.0
    return plan_cost(src.mesh.shape, src.shape, _itemsize(src.dtype), src.sbp, dst_sbp)


def box(shards: Shards, src: TensorSpec, dst: TensorSpec) -> Shards:
    """The shards of the same global value laid out as ``dst`` (through the seam: a traced step
    records the conversion as one node)."""
    if src is dst or (src.mesh == dst.mesh and src.sbp == dst.sbp):
        return shards
    return seam.current().box(shards, src, dst, _box)


def _box(shards: Shards, src: TensorSpec, dst: TensorSpec) -> Shards:
    if src.mesh == dst.mesh:
        steps = plan(src.mesh.shape, src.shape, _itemsize(src.dtype), src.sbp, dst.sbp)
        out = list(shards)
        state = src
        for st in steps:
            _run_step(out, state, st)
            state = state.with_sbp(state.sbp[: st.axis] + (st.dst,) + state.sbp[st.axis + 1 :])
        return tuple(out)
    return _cross_mesh(shards, src, dst)


def _run_step(shards: list, spec: TensorSpec, st: Step) -> None:
    """One 1-D step on every device group along ``st.axis``; ``spec`` is the layout before it."""
    mesh = spec.mesh
    n = mesh.shape[st.axis]
    kind = st.kind
    if n == 1 or kind == "relabel":
        return
    local = mesh.is_fully_local
    for group in mesh.groups(st.axis):
        devs = [mesh.devices[p] for p in group]
        xs = [shards[p] for p in group]
        shapes = None if local else [spec.local_shape(p) for p in group]
        if kind == "all_gather":
            ys = comm.all_gather(devs, xs, st.src.dim, shapes)
        elif kind == "all_reduce":
            ys = comm.all_reduce(devs, xs, st.src.op)
        elif kind == "reduce_scatter":
            ys = comm.reduce_scatter(devs, xs, st.dst.dim, st.src.op)
        elif kind == "all_to_all":
            ys = comm.all_to_all(devs, xs, st.src.dim, st.dst.dim, shapes)
        elif kind == "slice":
            ys = [
                None if x is None else x.narrow(st.dst.dim, *_start_len(x.shape[st.dst.dim], n, i))
                for i, x in enumerate(xs)
            ]
        elif kind == "keep_one":
            ys = _keep_one(xs, st.dst.op)
        else:  # pragma: no cover - the planner only emits the kinds above
            raise AssertionError(kind)
        for p, y in zip(group, ys):
            shards[p] = y


def _start_len(size: int, n: int, i: int) -> tuple[int, int]:
    a, b = chunk_bounds(size, n, i)
    return a, b - a


def _keep_one(xs: list, op: str) -> list:
    if op != "sum":  # max/min of equal copies is the value itself
        return xs
    zero = None
    out = []
    for i, x in enumerate(xs):
        if i == 0 or x is None:
            out.append(x)
        else:
            if zero is None or zero.device != x.device or x.device.type == "meta":  # traced: a zero per device
                zero = torch.zeros_like(x)
            out.append(zero)
    return out


def _cross_mesh(shards: Shards, src: TensorSpec, dst: TensorSpec) -> Shards:
    """Move between meshes: onto a sub-mesh or from one onto the whole (pipeline stages), position-
    wise sends when the mesh shapes match, else via replicas."""
    fixed = dst.mesh.fixed_in(src.mesh)
    if fixed:
        return _restrict(shards, src, dst, fixed)
    fixed = src.mesh.fixed_in(dst.mesh)
    if fixed and len(fixed) < dst.mesh.ndim:
        return _extend(shards, src, dst, fixed)
    if src.mesh.shape == dst.mesh.shape:
        wire = dst if set(src.mesh.devices) & set(dst.mesh.devices) else _scattered(dst)
        mid = box(shards, src, src.with_sbp(wire.sbp))
        sent = tuple(_send(src.mesh.devices[p], d, mid[p], wire.local_shape(p), dst.dtype)
                     for p, d in enumerate(dst.mesh.devices))
        return box(sent, wire, dst)
    if any(isinstance(s, Partial) for s in dst.sbp):
        # build B on the destination first, then keep one copy there
        rep = _cross_mesh(shards, src, dst.with_sbp((Broadcast(),) * dst.mesh.ndim))
        return box(rep, dst.with_sbp((Broadcast(),) * dst.mesh.ndim), dst)
    full = box(shards, src, src.with_sbp((Broadcast(),) * src.mesh.ndim))
    out = []
    for p, d in enumerate(dst.mesh.devices):
        sp = p % src.mesh.size
        region = dst.local_region(p)
        piece = None if full[sp] is None else full[sp][region]
        out.append(_send(src.mesh.devices[sp], d, piece, dst.local_shape(p), dst.dtype))
    return tuple(out)


def _scattered(dst: TensorSpec) -> TensorSpec:
    """How a tensor laid out as ``dst`` crosses to ``dst.mesh`` from a disjoint mesh of the same shape
    (the next pipeline stage's): split over each axis where ``dst`` replicates it, on the largest dim no other
    axis splits, so each device sends 1/n of the replicated bytes and the n devices that share them
    all-gather them on arrival (Megatron-LM's scatter-gather across stages: the slow link carries the
    bytes once, the fast one inside the stage the rest). Unchanged where no dim is long enough."""
    sbp = list(dst.sbp)
    for a, s in enumerate(sbp):
        n = dst.mesh.shape[a]
        if not isinstance(s, Broadcast) or n == 1:
            continue
        taken = {t.dim for t in sbp if isinstance(t, Split)}
        free = [d for d in range(len(dst.shape)) if d not in taken and dst.shape[d] >= n]
        if free:
            sbp[a] = Split(max(free, key=lambda d: dst.shape[d]))
    return dst.with_sbp(tuple(sbp))


def _with_fixed_broadcast(sbp: NdSBP, fixed: dict[int, int], ndim: int) -> NdSBP:
    """``sbp`` (one per kept axis) on a mesh of ``ndim`` axes, with Broadcast on the ``fixed`` ones."""
    kept = iter(sbp)
    return tuple(Broadcast() if a in fixed else next(kept) for a in range(ndim))


def _restrict(shards: Shards, src: TensorSpec, dst: TensorSpec, fixed: dict[int, int]) -> Shards:
    """Onto ``dst.mesh``, ``src.mesh`` with the axes ``fixed``: src relaid (on its own mesh) as
    Broadcast on those axes and ``dst.sbp`` on the others, then the shards of dst's devices. Exact;
    no data moves when src already has that layout (the usual Broadcast over the stage axis): the
    result holds src's very shards."""
    mid = box(shards, src, src.with_sbp(_with_fixed_broadcast(dst.sbp, fixed, src.mesh.ndim)))
    pos = {d: p for p, d in enumerate(src.mesh.devices)}
    return tuple(mid[pos[d]] for d in dst.mesh.devices)


def _extend(shards: Shards, src: TensorSpec, dst: TensorSpec, fixed: dict[int, int]) -> Shards:
    """From ``src.mesh``, ``dst.mesh`` with the axes ``fixed``: src relaid (on its own mesh) as
    ``dst.sbp`` on the kept axes, each shard sent to every device with the same kept coordinates
    (Broadcast on the fixed axes), then relaid on dst's mesh (locally: a slice, or zeros for Partial)."""
    kept_sbp = tuple(s for a, s in enumerate(dst.sbp) if a not in fixed)
    mid = box(shards, src, src.with_sbp(kept_sbp))
    rep = dst.with_sbp(_with_fixed_broadcast(kept_sbp, fixed, dst.mesh.ndim))
    src_pos = {c: p for p, c in enumerate(src.mesh.coords)}
    out = []
    for p, (d, c) in enumerate(zip(dst.mesh.devices, dst.mesh.coords)):
        q = src_pos[tuple(x for a, x in enumerate(c) if a not in fixed)]
        out.append(_send(src.mesh.devices[q], d, mid[q], rep.local_shape(p), dst.dtype))
    return box(tuple(out), rep, dst)


def _send(src_dev: int, dst_dev: int, t, shape, dtype):
    if src_dev == dst_dev:
        return t
    return comm.transfer(src_dev, dst_dev, t, shape, dtype)
