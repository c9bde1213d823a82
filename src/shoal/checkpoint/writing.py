"""Saving: each process writes the slices its devices hold first (a Partial value reduced), rank 0
the index; the directory is published by an atomic rename once all have written. A background
save copies those slices to host memory, then writes and publishes on a thread of its own.

Cross-process steps (barriers, the gather of the files' digests) run on the checkpoint's own gloo
group, never on the default group: a background save's thread runs them while the training's
collectives run on the default group, and two threads sharing one group could order their
collectives differently on different ranks and deadlock.
"""

from __future__ import annotations

import atexit
import datetime
import hashlib
import json
import math
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..comm.dist import failed_ranks
from ..sbp import reduced, sbp_str
from ..tensor import GlobalTensor
from ..world import world
from .collect import Collected, collect
from .index import FORMAT, OLD, ST_NAMES, TMP, VERSION, Entry, Piece, complete, file_name, fsync, write_index

__all__ = ["save", "Saving", "write_safetensors"]


def save(path: str | os.PathLike, state: Mapping[str, object] | nn.Module, *, keep: int | None = None,
         background: bool = False) -> Path | Saving:
    """Save ``state`` (top-level key -> module, optimizer, tensor or JSON value) as checkpoint
    directory ``path``, published by an atomic rename once every process has written its files.

    Every process calls it (the same ``state``, each with its own shards). An optimizer is saved by
    the names of its parameters in the module(s) beside it. ``keep``: afterwards, delete all but the
    newest ``keep`` checkpoints in ``path``'s parent directory. Returns ``path``.

    ``background=True`` copies the slices this process writes to host memory (training may change
    the parameters as soon as it returns), then writes and publishes on a thread; it returns a
    ``Saving`` whose ``wait()`` returns ``path`` or raises the save's error. A save waits for the
    background save before it (and raises that one's error if no ``wait()`` has yet).
    """
    path = Path(path)
    if isinstance(state, nn.Module):
        state = {"": state}
    if keep is not None and keep < 1:
        raise ValueError(f"checkpoint.save: keep={keep!r}; give the number of checkpoints to keep (>= 1) or None")
    Saving.finish_pending()
    col = collect(state)
    mine: dict[str, torch.Tensor] = {}
    entries = {name: Entry(tuple(t.shape), t.dtype, _layout(t), _pieces(name, t, mine))
               for name, t in col.tensors.items()}
    mine = {k: _host(v, copy=background) for k, v in mine.items()}
    tmp = path.with_name(f"{path.name}{TMP}{_shared_token()}")

    def write() -> None:
        _write(path, tmp, entries, col, mine, keep)

    if not background:
        write()
        return path
    return Saving(path, write)


class Saving:
    """A save running in the background: ``done()`` says whether it has finished; ``wait()`` waits,
    raises the save's error if it failed, and returns the checkpoint's path."""

    _pending: Saving | None = None  # the latest background save of this process

    def __init__(self, path: Path, write: Callable[[], None]) -> None:
        self.path = path
        self._error: BaseException | None = None
        self._seen = False  # its error was raised to the caller
        # not a daemon: the interpreter waits for it before exiting (and before shoal's process groups go)
        self._thread = threading.Thread(target=self._run, args=(write,), name=f"shoal checkpoint {path.name}")
        Saving._pending = self
        self._thread.start()

    def _run(self, write: Callable[[], None]) -> None:
        try:
            write()
        except BaseException as e:  # noqa: BLE001 - handed to wait()
            self._error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> Path:
        self._thread.join()
        if self._error is not None:
            self._seen = True
            raise self._error
        return self.path

    @classmethod
    def finish_pending(cls) -> None:
        """Wait for this process's background save in flight, if any; raise its error if nobody has seen it."""
        prev, cls._pending = cls._pending, None
        if prev is not None:
            prev._thread.join()
            if prev._error is not None and not prev._seen:
                prev._seen = True
                raise RuntimeError(f"checkpoint.save: the background save of {prev.path} failed ({prev._error}); "
                                   "that checkpoint was not published") from prev._error


def _layout(t: torch.Tensor) -> str | None:
    return f"mesh {'x'.join(map(str, t.mesh.shape))} {sbp_str(t.sbp)}" if isinstance(t, GlobalTensor) else None


def _pieces(name: str, t: torch.Tensor, mine: dict[str, torch.Tensor]) -> tuple[Piece, ...]:
    """Where ``t``'s slices are stored (every process computes the same); the ones this process
    writes go into ``mine``. Each distinct slice is written by the first device that holds it; a
    Partial value is reduced first."""
    w = world()
    if not isinstance(t, GlobalTensor):
        if w.rank == 0:
            mine[name] = t.detach()
        return (Piece(file_name(0, w.processes), name, (0,) * t.ndim, tuple(t.shape)),)
    if t.spec.has_partial:
        with torch.no_grad():
            t = t.detach().to_global(t.mesh, reduced(t.sbp))
    spec, mesh, local = t.spec, t.mesh, t.to_local()
    pieces, taken = [], set()
    for pos, dev in enumerate(mesh.devices):
        region = spec.local_region(pos)
        bounds = tuple((s.start, s.stop) for s in region)
        if bounds in taken or math.prod(s.stop - s.start for s in region) == 0:
            continue
        taken.add(bounds)
        key = f"{name}#{len(pieces)}"
        pieces.append(Piece(file_name(w.process_of(dev), w.processes), key, spec.local_offset(pos),
                            spec.local_shape(pos)))
        if w.owns(dev):
            mine[key] = local[dev].detach()
    return tuple(pieces)


def _host(t: torch.Tensor, copy: bool) -> torch.Tensor:
    """``t`` in host memory, contiguous; a copy of its own if ``copy`` (a background save's snapshot)."""
    if copy:
        return torch.empty_like(t, device="cpu", memory_format=torch.contiguous_format).copy_(t)
    return t.cpu().contiguous()


def write_safetensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str]) -> tuple[str, int]:
    """Write host ``tensors`` as safetensors file ``path`` (fsynced); returns its sha256 and size.

    Each tensor's memory is written and hashed as it is: safetensors' ``save_file`` first copies
    every tensor into a bytes object (twice the memory) and holds the GIL doing it, and the file
    would then be read again for its digest. Largest items first, so that every tensor is aligned.
    """
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict = {"__metadata__": metadata}
    offset = 0
    for k in order:
        t = tensors[k]
        if t.dtype not in ST_NAMES:
            raise TypeError(f"checkpoint.save: tensor {k!r} has dtype {t.dtype}, which safetensors cannot hold; "
                            f"convert it to one of {sorted(str(d) for d in ST_NAMES)}")
        header[k] = {"dtype": ST_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in (len(head).to_bytes(8, "little"), head):
            f.write(chunk)
            digest.update(chunk)
        for k in order:
            t = tensors[k]
            if t.numel():
                data = memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())
                f.write(data)  # both release the GIL while they work
                digest.update(data)
        f.flush()
        os.fsync(f.fileno())
    return digest.hexdigest(), 8 + len(head) + offset


def _write(path: Path, tmp: Path, entries: dict[str, Entry], col: Collected, mine: dict[str, torch.Tensor],
           keep: int | None) -> None:
    w = world()
    try:
        if w.rank == 0:
            tmp.mkdir(parents=True)
        _barrier(path)
        name, digest, size = None, "", 0
        if mine:
            name = file_name(w.rank, w.processes)
            digest, size = write_safetensors(tmp / name, mine, {"format": FORMAT})
        files = _gather_files(name, digest, size, path)
        if w.rank == 0:
            write_index(tmp, _index(entries, col, files))
            _publish(tmp, path)
        _barrier(path)
    except BaseException:
        if not _distributed():  # several processes: the others may still be writing; latest() ignores it
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep is not None and w.rank == 0:
        for old in complete(path.parent)[:-keep]:
            if old != path:
                shutil.rmtree(old)
    _barrier(path)


def _index(entries: dict[str, Entry], col: Collected, files: dict) -> dict:
    tensors = {name: e.to_json() for name, e in entries.items()}
    tensors.update({name: {"same_as": first} for name, first in col.ties.items()})
    return {"format": FORMAT, "version": VERSION, "created_ns": time.time_ns(), "kinds": col.kinds,
            "files": files, "tensors": tensors, "values": col.values}


def _publish(tmp: Path, path: Path) -> None:
    """Rename the finished ``tmp`` to ``path``; an existing ``path`` is moved aside first, then deleted."""
    old = None
    if path.exists():
        old = path.with_name(f"{path.name}{OLD}{tmp.name.rpartition(TMP)[2]}")
        os.replace(path, old)
    os.replace(tmp, path)
    fsync(path.parent)
    if old is not None:
        shutil.rmtree(old)


# -- the checkpoint's process group ----------------------------------------------------------------

_GROUP: tuple | None = None  # (the default group it was made beside, the checkpoint's gloo group)


def _distributed() -> bool:
    return world().processes > 1 and dist.is_initialized()


def _group():
    """The checkpoint's gloo group over all processes, made by the first save (every process saves,
    in the same order, on its main thread); gloo also under NCCL: it carries host tensors only."""
    global _GROUP
    if _GROUP is None or _GROUP[0] is not dist.group.WORLD:
        timeout = datetime.timedelta(seconds=world().timeout)
        if _GROUP is None:  # dropped before shoal.init's shutdown (atexit runs last-in first-out): a
            atexit.register(_drop_group)  # group alive into interpreter finalization aborts the process
        _GROUP = (dist.group.WORLD, dist.new_group(backend="gloo", timeout=timeout))
    return _GROUP[1]


def _drop_group() -> None:
    global _GROUP
    _GROUP = None


def _sync(what: str, path: Path, fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as e:  # a peer died, raised, or timed out
        failed = failed_ranks()
        who = ("; ".join(f"rank {r} failed: {m}" for r, m in sorted(failed.items())) if failed
               else f"a process did not reach it within the timeout ({world().timeout:.0f} s)")
        raise RuntimeError(f"checkpoint.save {path}: {what} failed on rank {world().rank}: {who}; the checkpoint "
                           "was not published") from e


def _barrier(path: Path) -> None:
    if _distributed():
        _sync("the barrier of all processes", path, lambda: dist.barrier(group=_group()))


def _shared_token() -> str:
    """A random suffix every process agrees on (rank 0 draws it)."""
    n = torch.tensor([secrets.randbits(62)], dtype=torch.int64)
    if _distributed():
        dist.broadcast(n, 0, group=_group())
    return f"{int(n.item()):x}"


def _gather_files(name: str | None, digest: str, size: int, path: Path) -> dict[str, dict]:
    """{file: {sha256, bytes}} of the files every process wrote (a process that wrote none gives nothing)."""
    w = world()
    if not _distributed():
        return {name: {"sha256": digest, "bytes": size}} if name else {}
    # fixed-size records, so a tensor collective carries them (no pickled objects)
    rec = torch.zeros(41, dtype=torch.uint8)
    if name:
        rec[0] = 1
        rec[1:33] = torch.frombuffer(bytearray(bytes.fromhex(digest)), dtype=torch.uint8)
        rec[33:] = torch.frombuffer(bytearray(size.to_bytes(8, "little")), dtype=torch.uint8)
    recs = [torch.zeros_like(rec) for _ in range(w.processes)]
    _sync("gathering the files' digests", path, lambda: dist.all_gather(recs, rec, group=_group()))
    return {file_name(r, w.processes): {"sha256": bytes(t[1:33].tolist()).hex(),
                                        "bytes": int.from_bytes(bytes(t[33:].tolist()), "little")}
            for r, t in enumerate(recs) if t[0]}
