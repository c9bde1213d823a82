"""The cross-process part of collectives: torch.distributed (gloo on CPU, NCCL on CUDA).

Process groups are created for every set of ranks a mesh axis needs, when the mesh is made, by
every process in the same order (``ensure_groups``): a program that makes the same meshes in the
same order on every rank never hangs on group creation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..mesh import ON_NEW_MESH, Mesh
from ..world import world

__all__ = ["ensure_groups", "all_reduce", "gather_along", "send", "recv"]

_GROUPS: dict[tuple[int, ...], object] = {}
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and world().processes > 1


def ensure_groups(rank_sets: Sequence[tuple[int, ...]]) -> None:
    """Create the process groups for these rank sets (collective: every rank calls it alike)."""
    if not active():
        return
    for ranks in rank_sets:
        ranks = tuple(sorted(ranks))
        if len(ranks) > 1 and ranks not in _GROUPS:
            if len(ranks) == dist.get_world_size():
                _GROUPS[ranks] = dist.group.WORLD
            else:
                _GROUPS[ranks] = dist.new_group(list(ranks))


def ensure_mesh_groups(mesh: Mesh) -> None:
    """Every process group the mesh's axes need (called for every new Mesh, on every rank)."""
    if not active():
        return
    w = world()
    sets = []
    for axis in range(mesh.ndim):
        for group in mesh.groups(axis):
            sets.append(tuple(sorted({w.process_of(mesh.devices[p]) for p in group})))
    ensure_groups(sets)


ON_NEW_MESH.append(ensure_mesh_groups)


def shutdown() -> None:
    """Destroy the process groups while the interpreter is whole (registered at exit by
    ``shoal.init``). A group torch still holds, or one this module does, lives into interpreter
    finalization, and its worker thread, dropping the last reference to a finished asynchronous
    collective's tensors there, needs the GIL and aborts the process."""
    import gc

    _GROUPS.clear()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()  # the groups' last references may sit in cycles: free them (joining their threads) now


def _group(ranks: Sequence[int]):
    key = tuple(ranks)
    g = _GROUPS.get(key)
    if g is None:
        raise RuntimeError(
            f"shoal: no process group for ranks {list(key)}: meshes must be created by every process, "
            "in the same order (group creation is collective)"
        )
    return g


def _wire(t: torch.Tensor) -> torch.Tensor:
    """Gloo reduces no bool: send bools as uint8."""
    return t.to(torch.uint8) if t.dtype == torch.bool else t


def failed_ranks() -> dict[int, str]:
    """Ranks that reported an uncaught error (see ``install_failure_report``), with the error."""
    try:
        store = dist.distributed_c10d._get_default_store()
        out = {}
        for r in range(dist.get_world_size()):
            key = f"shoal/failed/{r}"
            if store.check([key]):
                out[r] = store.get(key).decode(errors="replace")
        return out
    except Exception:  # noqa: BLE001 - the store may be gone with the failed rank
        return {}


def install_failure_report(rank: int) -> None:
    """An uncaught error in this process is written to the rendezvous store, so that the other
    ranks' failing collectives can name this rank."""
    import sys

    prev = sys.excepthook

    def hook(tp, val, tb):
        with contextlib.suppress(Exception):
            dist.distributed_c10d._get_default_store().set(f"shoal/failed/{rank}", f"{tp.__name__}: {val}"[:500])
        prev(tp, val, tb)

    sys.excepthook = hook


def _guarded(what: str, ranks, fn):
    try:
        return fn()
    except Exception as e:  # a peer died, raised, or timed out
        failed = failed_ranks()
        who = (
            "; ".join(f"rank {r} failed: {m}" for r, m in sorted(failed.items()))
            if failed
            else "a peer process exited or stopped answering within the timeout"
        )
        raise RuntimeError(
            f"shoal: {what} over ranks {list(ranks)} failed on rank {dist.get_rank()}: {who}"
        ) from e


def all_reduce(t: torch.Tensor, op: str, ranks: Sequence[int]) -> None:
    """In place: ``t`` becomes the reduction of every rank's ``t``."""
    if len(ranks) < 2:
        return
    w = _wire(t)
    _guarded("all_reduce", ranks, lambda: dist.all_reduce(w, op=_OPS[op], group=_group(ranks)))
    if w is not t:
        t.copy_(w.to(torch.bool))


def all_reduce_async(t: torch.Tensor, op: str, ranks: Sequence[int]):
    """Start an in-place all_reduce; returns its work handle (None if there is nothing to do)."""
    if len(ranks) < 2:
        return None
    if t.dtype == torch.bool:  # no async path for the uint8 round trip
        all_reduce(t, op, ranks)
        return None
    return _guarded("all_reduce", ranks, lambda: dist.all_reduce(t, op=_OPS[op], group=_group(ranks), async_op=True))


def wait(work, what: str, ranks: Sequence[int]) -> None:
    if work is not None:
        _guarded(what, ranks, work.wait)


def gather_along(full: torch.Tensor, shards, sizes: Sequence[int], dim: int, ranks: Sequence[int]) -> torch.Tensor:
    """Write this process's shards into their places of ``full`` (zeros) and sum over the ranks: every
    process gets the concatenation (an all-gather that tolerates any shard sizes and placements)."""
    off = 0
    for s, n in zip(shards, sizes):
        if s is not None:
            full.narrow(dim, off, n).copy_(s)
        off += n
    if full.dtype == torch.bool:
        w = full.to(torch.uint8)
        _guarded("all_gather", ranks, lambda: dist.all_reduce(w, op=dist.ReduceOp.MAX, group=_group(ranks)))
        return w.to(torch.bool)
    _guarded("all_gather", ranks, lambda: dist.all_reduce(full, op=dist.ReduceOp.SUM, group=_group(ranks)))
    return full


def send(t: torch.Tensor, rank: int) -> None:
    w = _wire(t.contiguous())
    _guarded(f"send to rank {rank}", [dist.get_rank(), rank], lambda: dist.send(w, rank))


def recv(buf: torch.Tensor, rank: int) -> None:
    w = _wire(buf)
    _guarded(f"recv from rank {rank}", [rank, dist.get_rank()], lambda: dist.recv(w, rank))
    if w is not buf:
        buf.copy_(w.to(torch.bool))


def broadcast(t: torch.Tensor, src: int) -> None:
    """In place, over every process."""
    w = _wire(t)
    if w is t and not t.is_contiguous():
        raise ValueError("broadcast needs a contiguous tensor")
    _guarded("broadcast", range(dist.get_world_size()), lambda: dist.broadcast(w, src))
    if w is not t:
        t.copy_(w.to(torch.bool))
