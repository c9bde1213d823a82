"""The cross-process part of collectives: torch.distributed (gloo on CPU, NCCL on CUDA).

The default group is ``shoal.init()``'s. The group of any other set of ranks is made when a
collective over those ranks first needs it, by those ranks alone (torch's group-local
synchronization): ranks that run the same collectives in the same order, as a shoal program does,
make their groups in the same order, and a rank outside a group takes no part in making it.
"""

from __future__ import annotations

import atexit
import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..world import ALIVE_KEY, FAILED_KEY, HEARTBEAT, world

__all__ = ["all_reduce", "gather_along", "all_gather_blocks", "reduce_scatter_blocks", "send", "recv", "groups_made",
           "open_channels"]

_GROUPS: dict[tuple, object] = {}  # (ranks, channel) -> process group
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _group(ranks: Sequence[int], channel: int | None = None):
    """The process group of ``ranks`` (sorted), made on first use by those ranks alone: a backend
    group on the rendezvous store under a prefix naming the ranks. (torch's ``new_group`` wants every
    rank to call it, or, with group-local synchronization, hangs when a rank joins a second group.)
    A ``channel`` is a group of its own over the same ranks: its operations are ordered only among
    themselves (a pipeline's activations and gradients flow in opposite directions at once)."""
    key = (tuple(ranks), channel)
    g = _GROUPS.get(key)
    if g is None:
        if len(key[0]) == dist.get_world_size() and channel is None:
            g = dist.group.WORLD
        else:
            if not any(v is not dist.group.WORLD for v in _GROUPS.values()):
                # registered after shoal.init's shutdown, so run before it: the groups are dropped
                # while the interpreter is whole (see world.shutdown)
                atexit.register(_GROUPS.clear)
            name = "-".join(map(str, key[0])) + ("" if channel is None else f"/channel{channel}")
            store = dist.PrefixStore("shoal/group/" + name, dist.distributed_c10d._get_default_store())
            me, timeout = key[0].index(dist.get_rank()), datetime.timedelta(seconds=world().timeout)
            if dist.get_backend() == "nccl":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                g = dist.ProcessGroupNCCL(store, me, len(key[0]), opts)
            else:
                g = dist.ProcessGroupGloo(store, me, len(key[0]), timeout)
        _GROUPS[key] = g
    return g


def open_channels(channels: dict) -> None:
    """Make every channel group this process is in (``channels``: pair of ranks -> how many), pair by
    pair in sorted order and each pair's in channel order, the same order on every process. Made
    lazily instead, by the threads that use them, two processes could each wait to make a different
    one first: making a group waits for the peer, and holds the interpreter lock while it waits. A meta
    world's processes are absent (``world.meta_world``): nothing moves, no group is made."""
    if world().device_type == "meta":
        return
    me = dist.get_rank()
    for pair in sorted(channels):
        if me in pair:
            for c in range(channels[pair]):
                _group(pair, c)


def _all_reduce(t: torch.Tensor, op, ranks: Sequence[int]):
    """Start an in-place all_reduce over ``ranks``; its work handle."""
    g = _group(tuple(ranks))
    if g is dist.group.WORLD:
        return dist.all_reduce(t, op=op, async_op=True)
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    return g.allreduce([t], opts)


def all_gather_blocks(block: torch.Tensor, dim: int, ranks: Sequence[int],
                      sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Every rank's ``block`` concatenated along ``dim`` in rank order: one all-gather, each rank
    sending its block once (a ring moves (n-1)/n of the result per rank, half of what
    ``gather_along``'s all-reduce of a zero-padded whole moves). ``sizes``: each rank's length along
    ``dim`` where they differ (default all as this one's): blocks travel padded to the longest."""
    n = len(ranks)
    sizes = [block.shape[dim]] * n if sizes is None else list(sizes)
    top = max(sizes)
    if _nothing_moves(block, ranks):
        return torch.cat([block] * n, dim) if n == 1 or top == min(sizes) else _shaped(block, dim, sum(sizes))

    def run(out, w, g):
        if g is dist.group.WORLD:
            getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, w)  # torch renamed it
        else:  # a backend group of shoal's own (``_group``): its own methods
            g._allgather_base(out, w).wait()

    out = _on_dim0("all_gather", _padded(block, dim, top), dim, ranks, lambda rows: rows * n, run)
    if top == min(sizes):
        return out
    if all(k == top for k in sizes[:-1]):  # only the last block is short: the padding ends the buffer
        return out.narrow(dim, 0, sum(sizes)).contiguous()
    return torch.cat([out.narrow(dim, i * top, k) for i, k in enumerate(sizes)], dim)


def reduce_scatter_blocks(whole: torch.Tensor, op: str, dim: int, ranks: Sequence[int],
                          sizes: Sequence[int] | None = None) -> torch.Tensor:
    """This rank's block (of ``len(ranks)`` along ``dim``, in rank order: equal, or ``sizes`` long) of
    the reduction of every rank's ``whole``: one reduce-scatter (half the bytes of an all-reduce of the
    whole), blocks of differing sizes padded to the longest."""
    n = len(ranks)
    sizes = [whole.shape[dim] // n] * n if sizes is None else list(sizes)
    mine = sizes[list(ranks).index(world().rank)] if n > 1 else whole.shape[dim]
    if _nothing_moves(whole, ranks):
        return whole.narrow(dim, 0, mine)
    top = max(sizes)
    if top != min(sizes):
        whole = torch.cat([_padded(p, dim, top) for p in torch.split(whole, sizes, dim)], dim)

    def run(out, w, g):
        if g is dist.group.WORLD:
            getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(out, w, op=_OPS[op])
        else:
            opts = dist.ReduceScatterOptions()
            opts.reduceOp = _OPS[op]
            g._reduce_scatter_base(out, w, opts).wait()

    out = _on_dim0("reduce_scatter", whole, dim, ranks, lambda rows: rows // n, run)
    return out if top == min(sizes) else out.narrow(dim, 0, mine)


def _padded(t: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """``t`` with zeros after it along ``dim`` up to ``length``."""
    short = length - t.shape[dim]
    return t if short == 0 else torch.cat([t, _shaped(t, dim, short).zero_()], dim)


def _shaped(t: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """An empty tensor like ``t``, ``length`` long along ``dim``."""
    shape = list(t.shape)
    shape[dim] = length
    return t.new_empty(shape)


def _on_dim0(what: str, t: torch.Tensor, dim: int, ranks: Sequence[int], rows, run) -> torch.Tensor:
    """``run(out, w, group)`` with ``w`` = ``t`` moved to dim 0 (bools as uint8) and ``out`` an empty
    buffer of ``rows(w's rows)`` rows, on the ranks' group; ``out`` moved back to ``dim``."""
    w = _wire(t).movedim(dim, 0).contiguous()
    out = w.new_empty((rows(w.shape[0]), *w.shape[1:]))
    g = _group(tuple(ranks))
    _guarded(what, ranks, lambda: run(out, w, g))
    out = out.movedim(0, dim).contiguous()
    return out.to(torch.bool) if t.dtype == torch.bool else out


def groups_made() -> list[tuple[int, ...]]:
    """The rank sets whose process groups this process has made so far (not the default group,
    ``shoal.init``'s)."""
    return sorted({k[0] for k, g in _GROUPS.items() if g is not dist.group.WORLD})


def _wire(t: torch.Tensor) -> torch.Tensor:
    """Gloo reduces no bool: send bools as uint8."""
    return t.to(torch.uint8) if t.dtype == torch.bool else t


def failed_ranks() -> dict[int, str]:
    """Ranks that reported an uncaught error (``shoal.init`` installs the report), with the error."""
    try:
        store = dist.distributed_c10d._get_default_store()
        out = {}
        for r in range(dist.get_world_size()):
            key = FAILED_KEY.format(r)
            if store.check([key]):
                out[r] = store.get(key).decode(errors="replace")
        return out
    except Exception:  # noqa: BLE001 - the store may be gone with the failed rank
        return {}


def silent_ranks(ranks: Sequence[int]) -> list[int]:
    """The ranks among ``ranks`` (not this one) whose heartbeat stood still for four beats: killed
    outright (SIGKILL, a lost node) or hung. Takes about two seconds; for error messages."""
    import time

    try:
        store = dist.distributed_c10d._get_default_store()
        others = [r for r in ranks if r != dist.get_rank()]
        before = [store.add(ALIVE_KEY.format(r), 0) for r in others]
        time.sleep(4 * HEARTBEAT)
        return [r for r, b in zip(others, before, strict=True) if store.add(ALIVE_KEY.format(r), 0) == b]
    except Exception:  # noqa: BLE001 - the store may be gone with the failed rank
        return []


def _guarded(what: str, ranks, fn):
    try:
        return fn()
    except Exception as e:  # a peer died, raised, or timed out
        failed = failed_ranks()
        silent = [] if failed else silent_ranks(ranks)
        if failed:
            who = "; ".join(f"rank {r} failed: {m}" for r, m in sorted(failed.items()))
        elif silent:
            who = (f"rank{'s' * (len(silent) > 1)} {', '.join(map(str, silent))} stopped answering (killed, lost "
                   f"with its node, or hung: its heartbeat stopped)")
        else:
            who = "a peer process exited or stopped answering within the timeout"
        raise RuntimeError(
            f"shoal: {what} over ranks {list(ranks)} failed on rank {dist.get_rank()}: {who}"
        ) from e


def _nothing_moves(t: torch.Tensor, ranks) -> bool:
    """A group of one rank, or a meta tensor (graph mode's trace runs collectives on shapes alone:
    only the result's shape matters, and it is the input's)."""
    return len(ranks) < 2 or t.device.type == "meta"


def all_reduce(t: torch.Tensor, op: str, ranks: Sequence[int]) -> None:
    """In place: ``t`` becomes the reduction of every rank's ``t``."""
    if _nothing_moves(t, ranks):
        return
    w = _wire(t)
    _guarded("all_reduce", ranks, lambda: _all_reduce(w, _OPS[op], ranks).wait())
    if w is not t:
        t.copy_(w.to(torch.bool))


def all_reduce_async(t: torch.Tensor, op: str, ranks: Sequence[int]):
    """Start an in-place all_reduce; returns its work handle (None if there is nothing to do)."""
    if _nothing_moves(t, ranks):
        return None
    if t.dtype == torch.bool:  # no async path for the uint8 round trip
        all_reduce(t, op, ranks)
        return None
    return _guarded("all_reduce", ranks, lambda: _all_reduce(t, _OPS[op], ranks))


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
    if _nothing_moves(full, ranks):
        return full
    if full.dtype == torch.bool:
        w = full.to(torch.uint8)
        _guarded("all_gather", ranks, lambda: _all_reduce(w, dist.ReduceOp.MAX, ranks).wait())
        return w.to(torch.bool)
    _guarded("all_gather", ranks, lambda: _all_reduce(full, dist.ReduceOp.SUM, ranks).wait())
    return full


def _p2p(t: torch.Tensor, peer: int, channel: int | None, sending: bool):
    """Send ``t`` to, or receive it from, rank ``peer``: on the default group, or on the pair's
    ``channel`` group (see ``_group``); waits."""
    if channel is None:
        return (dist.send if sending else dist.recv)(t, peer)
    pair = tuple(sorted((dist.get_rank(), peer)))
    g = _group(pair, channel)
    return (g.send if sending else g.recv)([t], pair.index(peer), 0).wait()


def send(t: torch.Tensor, rank: int, channel: int | None = None) -> None:
    if t.device.type == "meta":
        return
    w = _wire(t.contiguous())
    _guarded(f"send to rank {rank}", [dist.get_rank(), rank], lambda: _p2p(w, rank, channel, True))


def recv(buf: torch.Tensor, rank: int, channel: int | None = None) -> None:
    if buf.device.type == "meta":
        return
    w = _wire(buf)
    _guarded(f"recv from rank {rank}", [rank, dist.get_rank()], lambda: _p2p(w, rank, channel, False))
    if w is not buf:
        buf.copy_(w.to(torch.bool))


def broadcast(t: torch.Tensor, src: int) -> None:
    """In place, over every process."""
    if t.device.type == "meta":
        return
    w = _wire(t)
    if w is t and not t.is_contiguous():
        raise ValueError("broadcast needs a contiguous tensor")
    _guarded("broadcast", range(dist.get_world_size()), lambda: dist.broadcast(w, src))
    if w is not t:
        t.copy_(w.to(torch.bool))
