"""Collectives over a group of devices, hierarchical.

Each function takes the group's global device ids and one local tensor per device of the group
(``None`` for devices another process owns) and returns the group's new local tensors (``None``
stays ``None``). The part inside a process is plain tensor ops between shards; results equal on
every device are one shared tensor (no copies on CPU). The part across processes is one
torch.distributed call on the cached process group of the ranks involved (``comm.dist``).
Functions that must know the shapes of other processes' shards take ``shapes`` (one per device).

Each collective is a ``seam.Collective``: called, it runs through the execution in force (graph
mode's tracer records it); ``place`` hands a plain tensor to devices the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import seam
from ..seam import collective
from ..world import world
from . import dist as _dist
from .counter import CommCounter, record

__all__ = [
    "CommCounter",
    "all_gather",
    "all_reduce",
    "all_reduce_start",
    "reduce_scatter",
    "all_to_all",
    "transfer",
    "broadcast_all",
    "place",
    "bucket_bytes",
    "reduced_dtype",
]

Shards = Sequence[torch.Tensor | None]

# Bytes per device of a bucket of gradients reduced as one all-reduce (``GradReducer``, the graph's
# bucketing pass): in one process on CPU a reduction's latency is a few microseconds and small
# buckets start while backward runs (DDP's first bucket, 1 MiB); across a network each collective
# pays a latency of tens of microseconds per step of its ring, amortized by DDP's 25 MiB buckets.
BUCKET_BYTES = {"cpu": 1 << 20, "meta": 1 << 20, "cuda": 25 << 20}


def bucket_bytes() -> int:
    """The gradient bucket size for this world's devices (``BUCKET_BYTES``)."""
    return BUCKET_BYTES[world().device_type]


def place(t: torch.Tensor, mesh, copy: bool = False) -> tuple:
    """Plain tensor ``t`` (a whole value) held by every local device of ``mesh``, None elsewhere:
    ``t`` itself where it lies on the device already, else ``t.to(device)``; with ``copy``, a
    contiguous copy per torch device (shared by the virtual devices on one)."""
    return seam.current().place(t, mesh, copy, _place_now)


def _place_now(t: torch.Tensor, mesh, copy: bool) -> tuple:
    w = world()
    out: list = [None] * mesh.size
    copies: dict = {}
    for p in mesh.local_positions:
        dev = w.torch_device(mesh.devices[p])
        if not copy:
            out[p] = t if t.device == dev else t.to(dev)
            continue
        if dev not in copies:
            copies[dev] = t.detach().to(dev, memory_format=torch.contiguous_format, copy=True)
        out[p] = copies[dev]
    return tuple(out)


def _place(t: torch.Tensor, devices: Sequence[int], shards: Shards | None = None) -> list:
    """One result for every local device of the group (shared on CPU, copied per GPU); None elsewhere."""
    w = world()
    out = []
    for i, d in enumerate(devices):
        if shards is not None and shards[i] is None:
            out.append(None)
        elif w.device_type == "cpu":
            out.append(t)
        else:
            td = w.torch_device(d)
            out.append(t if t.device == td else t.to(td, non_blocking=True))
    return out


def _home(shards: list[torch.Tensor]) -> list[torch.Tensor]:
    dev = shards[0].device
    return [s if s.device == dev else s.to(dev) for s in shards]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _ranks(devices: Sequence[int]) -> list[int]:
    w = world()
    return sorted({w.process_of(d) for d in devices})


def _all_local(shards: Shards) -> bool:
    return all(s is not None for s in shards)


_REDUCE = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}


# Partial sums in a low precision are added in float32 and rounded once (one device computing the
# whole sum accumulates in float32 too); max and min round nothing.
_WIDE = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def reduced_dtype(dtype: torch.dtype, op: str = "sum") -> torch.dtype:
    """The dtype a reduction ``op`` of ``dtype`` partial sums is computed in, and crosses processes in."""
    return _WIDE.get(dtype, dtype) if op == "sum" else dtype


def _reduce(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    f = _REDUCE[op]
    wide = reduced_dtype(xs[0].dtype, op)
    acc = xs[0] if wide == xs[0].dtype else xs[0].to(wide)
    for x in xs[1:]:
        acc = f(acc, x)
    return acc


def _reduce_group(devices: Sequence[int], shards: Shards, op: str) -> torch.Tensor | None:
    """The group's reduction on this process (None if it owns no device of the group)."""
    local = [s for s in shards if s is not None]
    if not local:
        return None
    total = _reduce(_home(local), op)
    if not _all_local(shards):
        if total is local[0]:
            total = total.clone()  # the collective writes in place
        _dist.all_reduce(total, op, _ranks(devices))
    return total.to(local[0].dtype)


@collective
def all_reduce(devices: Sequence[int], shards: Shards, op: str = "sum") -> list:
    total = _reduce_group(devices, shards, op)
    if total is None:
        return list(shards)
    record("all_reduce", _nbytes(total))
    return _place(total, devices, shards)


@collective(start_of=all_reduce)
def all_reduce_start(devices: Sequence[int], shards: Shards, op: str = "sum"):
    """Start an all_reduce that runs while the caller goes on (across processes); returns a function
    that waits for it and gives the group's new local tensors, as ``all_reduce`` does."""
    local = [s for s in shards if s is not None]
    if not local:
        return lambda: list(shards)
    total = _reduce(_home(local), op)
    work = None
    if not _all_local(shards):
        if total is local[0]:
            total = total.clone()
        work = _dist.all_reduce_async(total, op, _ranks(devices))
    record("all_reduce", _nbytes(total))

    def finish() -> list:
        if work is not None:
            _dist.wait(work, "all_reduce", _ranks(devices))
        return _place(total.to(local[0].dtype), devices, shards)

    return finish


def _blocks(devices: Sequence[int], sizes: Sequence[int], shards: Shards) -> list[int] | None:
    """Each process's length along the dim, in rank order, when each process's devices are one run of
    the group, the processes in rank order, and this process holds the shards of its devices: what
    one all-gather (or reduce-scatter) of blocks concatenates (or splits), blocks of differing lengths
    padded to the longest. None otherwise, or where the padding would move more than an all-reduce
    of the whole: then a collective goes through ``gather_along``'s (or an all-reduce's) general path."""
    w = world()
    if any((s is not None) != w.owns(d) for d, s in zip(devices, shards)):
        return None
    runs: list = []  # [process, its devices' total size]
    for d, n in zip(devices, sizes):
        p = w.process_of(d)
        if runs and runs[-1][0] == p:
            runs[-1][1] += n
        else:
            runs.append([p, n])
    procs = [p for p, _ in runs]
    lengths = [n for _, n in runs]
    if procs != sorted(set(procs)) or not 0 < len(lengths) * max(lengths) <= 2 * sum(lengths):
        return None
    return lengths


def _gather_full(devices: Sequence[int], shards: Shards, dim: int, shapes) -> torch.Tensor:
    """The concatenation of the group's shards along ``dim``, on every process of the group."""
    local = [s for s in shards if s is not None]
    if _all_local(shards):
        return torch.cat(_home(local), dim)
    sizes = [s[dim] for s in shapes]
    blocks = _blocks(devices, sizes, shards)
    if blocks is not None:
        return _dist.all_gather_blocks(torch.cat(_home(local), dim), dim, _ranks(devices), blocks)
    shape = list(shapes[0])
    shape[dim] = sum(sizes)
    return _dist.gather_along(_home(local)[0].new_zeros(shape), shards, sizes, dim, _ranks(devices))


@collective
def all_gather(devices: Sequence[int], shards: Shards, dim: int, shapes=None) -> list:
    if not any(s is not None for s in shards):
        return list(shards)
    full = _gather_full(devices, shards, dim, shapes)
    record("all_gather", _nbytes(full))
    return _place(full, devices, shards)


def _scatter(full: torch.Tensor, devices: Sequence[int], dim: int, shards: Shards) -> list:
    parts = torch.tensor_split(full, len(devices), dim)
    return [None if s is None else _on(p, d) for p, d, s in zip(parts, devices, shards)]


def _on(t: torch.Tensor, device: int) -> torch.Tensor:
    """``t`` on ``device`` (the same tensor on CPU, where every device shares the memory)."""
    w = world()
    return t if w.device_type == "cpu" else t.to(w.torch_device(device))


@collective
def reduce_scatter(devices: Sequence[int], shards: Shards, dim: int, op: str = "sum") -> list:
    local = [s for s in shards if s is not None]
    if not local:
        return list(shards)
    if not _all_local(shards):
        q, r = divmod(local[0].shape[dim], len(devices))  # each device's part, as ``tensor_split`` cuts
        parts = [q + (i < r) for i in range(len(devices))]
        blocks = _blocks(devices, parts, shards)
        if blocks is not None:  # this process's partial sum, reduce-scattered into its devices' block
            partial = _reduce(_home(local), op)
            record("reduce_scatter", _nbytes(partial))
            block = _dist.reduce_scatter_blocks(partial, op, dim, _ranks(devices), blocks).to(local[0].dtype)
            pieces = iter(torch.split(block, [n for n, s in zip(parts, shards) if s is not None], dim))
            return [None if s is None else _on(next(pieces), d) for d, s in zip(devices, shards)]
    total = _reduce_group(devices, shards, op)
    record("reduce_scatter", _nbytes(total))
    return _scatter(total, devices, dim, shards)


@collective
def all_to_all(devices: Sequence[int], shards: Shards, src_dim: int, dst_dim: int, shapes=None) -> list:
    if not any(s is not None for s in shards):
        return list(shards)
    full = _gather_full(devices, shards, src_dim, shapes)
    record("all_to_all", _nbytes(full))
    return _scatter(full, devices, dst_dim, shards)


@collective(p2p=True)
def transfer(src: int, dst: int, t: torch.Tensor | None, shape=None, dtype=None,
             channel: int | None = None) -> torch.Tensor | None:
    """Point-to-point: what device ``src`` holds, now held by device ``dst`` (None where neither is
    ours). Across processes on the pair's ``channel`` (``comm.dist._group``) when given."""
    w = world()
    if w.owns(src) and w.owns(dst):
        record("send_recv", _nbytes(t))
        td = w.torch_device(dst)
        return t if t.device == td else t.to(td)
    if w.owns(src):
        record("send_recv", _nbytes(t))
        _dist.send(t, w.process_of(dst), channel)
        return None
    if w.owns(dst):
        buf = torch.empty(shape, dtype=dtype, device=w.torch_device(dst))
        _dist.recv(buf, w.process_of(src), channel)
        return buf
    return None


def broadcast_all(t: torch.Tensor | None, src_rank: int, shape, dtype, device) -> torch.Tensor:
    """Every process gets process ``src_rank``'s ``t`` (all processes call it)."""
    if t is None:
        t = torch.empty(tuple(shape), dtype=dtype, device=device)
    _dist.broadcast(t, src_rank)
    record("broadcast", _nbytes(t))
    return t
