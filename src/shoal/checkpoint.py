"""Sharded checkpoints: each process writes the slices its devices own as safetensors, plus one
``index.json`` (global shapes, dtypes, saved layouts, which file holds which slice, a sha256 per
file); loading reads only the slices each local shard needs, into any mesh, plan or device count.

``save(path, {"model": m, "optim": opt, "step": 100})``, ``load(path, {"model": m, "optim": opt})``,
``latest(dir)``, ``export(path, out)``, ``describe(path)``. No pickle: loading never runs code.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import secrets
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .sbp import Broadcast, reduced, sbp_str
from .tensor import GlobalTensor, from_local, to_global
from .world import world

__all__ = ["save", "load", "latest", "export", "describe", "LoadResult"]

FORMAT, VERSION = "shoal.checkpoint", 1
INDEX = "index.json"
_TMP = ".tmp-"  # a save in progress (or one that crashed): never a checkpoint
_OLD = ".old-"  # a checkpoint being replaced by a save to the same path
# safetensors' dtype names (a plain file's header), and the index's (torch's names)
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
              "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
_DTYPES = {str(d).removeprefix("torch."): d for d in _ST_DTYPES.values()}


@dataclass(frozen=True, slots=True)
class Piece:
    """One stored slice of a tensor: ``key`` in ``file``, starting at global index ``offset``."""

    file: str
    key: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Entry:
    """A saved tensor: its global shape and dtype, the layout it was saved from (informational) and its pieces."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: str | None
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class LoadResult:
    """What ``load`` found: names the targets have and the checkpoint lacks (``missing_keys``), names
    it holds under the targets' keys that they lack (``unexpected_keys``), and the saved values
    (JSON) of the keys that were not targets (``values``, e.g. ``{"step": 100}``)."""

    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    values: dict = field(default_factory=dict)


# -- what is saved -------------------------------------------------------------------------------


@dataclass
class _Collected:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> tensor, each stored once
    ties: dict[str, str] = field(default_factory=dict)  # name -> the name it is stored under
    values: dict = field(default_factory=dict)  # top-level key -> JSON value
    kinds: dict[str, str] = field(default_factory=dict)  # top-level key -> module | optimizer | tensor | value


def _join(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


def _param_names(objs: Mapping[str, object]) -> dict[int, str]:
    """id(parameter) -> its name in the module(s) among ``objs`` (tied: the first name)."""
    names: dict[int, str] = {}
    for obj in objs.values():
        if isinstance(obj, nn.Module):
            for n, p in obj.named_parameters():
                names.setdefault(id(p), n)
    return names


def _optimizer_names(opt: torch.optim.Optimizer, names: dict[int, str], key: str, what: str) -> list[str]:
    params = [p for g in opt.param_groups for p in g["params"]]
    unnamed = sum(id(p) not in names for p in params)
    if unnamed:
        raise ValueError(
            f"checkpoint.{what}: {unnamed} parameter(s) of the optimizer {key!r} belong to no module in the same "
            "mapping; pass the model beside it (e.g. {'model': model, 'optim': opt}): optimizer state is stored "
            "by parameter name so that it can follow its parameter into another plan"
        )
    return [names[id(p)] for p in params]


def _collect(state: Mapping[str, object]) -> _Collected:
    out = _Collected()
    names = _param_names(state)
    seen: dict[int, str] = {}

    def add(name: str, t: torch.Tensor) -> None:
        if id(t) in seen:  # tied weights: stored once
            out.ties[name] = seen[id(t)]
        else:
            seen[id(t)] = name
            out.tensors[name] = t

    for key, obj in state.items():
        if not isinstance(key, str) or "/" in key:
            raise ValueError(f"checkpoint.save: top-level key {key!r} must be a string without '/'")
        if isinstance(obj, nn.Module):
            out.kinds[key] = "module"
            for n, t in obj.state_dict(keep_vars=True).items():
                add(_join(key, n), t)
        elif isinstance(obj, torch.optim.Optimizer):
            out.kinds[key] = "optimizer"
            pnames = _optimizer_names(obj, names, key, "save")
            sd = obj.state_dict()
            plain: dict[str, dict] = {}
            for i, st in sd["state"].items():
                for k, v in st.items():
                    if isinstance(v, torch.Tensor):
                        add(_join(key, f"state/{pnames[i]}/{k}"), v)
                    else:
                        plain.setdefault(pnames[i], {})[k] = _json(v, f"{key}/state/{pnames[i]}/{k}")
            groups = [{**{k: _json(v, f"{key}/param_groups/{j}/{k}") for k, v in g.items() if k != "params"},
                       "params": [pnames[i] for i in g["params"]]} for j, g in enumerate(sd["param_groups"])]
            out.values[key] = {"param_groups": groups, "state": plain}
        elif isinstance(obj, torch.Tensor):
            out.kinds[key] = "tensor"
            add(key, obj)
        else:
            out.kinds[key] = "value"
            out.values[key] = _json(obj, key)
    return out


def _json(v, where: str):
    """``v`` if JSON holds it exactly (tuples become lists); else a clear error naming ``where``."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"checkpoint.save: {where!r} is {v}, which JSON cannot hold; save a finite float")
        return v
    if isinstance(v, (list, tuple)):
        return [_json(x, f"{where}/{i}") for i, x in enumerate(v)]
    if isinstance(v, dict):
        bad = [k for k in v if not isinstance(k, str)]
        if bad:
            raise TypeError(f"checkpoint.save: {where!r} has non-string key(s) {bad[:3]}; JSON keys are strings")
        return {k: _json(x, f"{where}/{k}") for k, x in v.items()}
    if isinstance(v, torch.Tensor):
        raise TypeError(f"checkpoint.save: {where!r} is a tensor inside a value; give it a top-level key of its own")
    raise TypeError(
        f"checkpoint.save: {where!r} is a {type(v).__name__}, which JSON cannot hold; save ints, floats, strings, "
        "bools, None, lists and dicts of them (checkpoints hold no pickle, so that loading never runs code)"
    )


# -- saving --------------------------------------------------------------------------------------


def _file_name(rank: int, processes: int) -> str:
    return f"shard-{rank:05d}-of-{processes:05d}.safetensors"


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
        return (Piece(_file_name(0, w.processes), name, (0,) * t.ndim, tuple(t.shape)),)
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
        pieces.append(Piece(_file_name(w.process_of(dev), w.processes), key, spec.local_offset(pos),
                            spec.local_shape(pos)))
        if w.owns(dev):
            mine[key] = local[dev].detach()
    return tuple(pieces)


def _writable(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host, contiguous and owning its memory (safetensors refuses views of a shared buffer)."""
    t = t.cpu()
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.nbytes:
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _distributed() -> bool:
    return world().processes > 1 and torch.distributed.is_initialized()


def _barrier() -> None:
    if _distributed():
        torch.distributed.barrier()


def _shared_token() -> str:
    """A random suffix every process agrees on (rank 0 draws it)."""
    n = torch.tensor([secrets.randbits(62)], dtype=torch.int64, device=_comm_device())
    if _distributed():
        torch.distributed.broadcast(n, 0)
    return f"{int(n.item()):x}"


def _comm_device() -> torch.device:
    w = world()
    return w.torch_device(w.local_devices[0])


def _gather_files(name: str | None, digest: str, size: int) -> dict[str, dict]:
    """{file: {sha256, bytes}} of the files every process wrote (a process that wrote none gives nothing)."""
    w = world()
    mine = {name: {"sha256": digest, "bytes": size}} if name else {}
    if not _distributed():
        return mine
    # fixed-size records, so a tensor collective carries them (no pickled objects)
    rec = torch.zeros(41, dtype=torch.uint8)
    if name:
        rec[0] = 1
        rec[1:33] = torch.frombuffer(bytearray(bytes.fromhex(digest)), dtype=torch.uint8)
        rec[33:] = torch.frombuffer(bytearray(size.to_bytes(8, "little")), dtype=torch.uint8)
    recs = [torch.zeros_like(rec, device=_comm_device()) for _ in range(w.processes)]
    torch.distributed.all_gather(recs, rec.to(_comm_device()))
    out = {}
    for r, t in enumerate(recs):
        t = t.cpu()
        if t[0]:
            out[_file_name(r, w.processes)] = {"sha256": bytes(t[1:33].tolist()).hex(),
                                               "bytes": int.from_bytes(bytes(t[33:].tolist()), "little")}
    return out


def save(path: str | os.PathLike, state: Mapping[str, object] | nn.Module, *, keep: int | None = None) -> Path:
    """Save ``state`` (top-level key -> module, optimizer, tensor or JSON value) as checkpoint
    directory ``path``, published by an atomic rename once every process has written its files.

    Every process calls it (the same ``state``, each with its own shards). An optimizer is saved by
    the names of its parameters in the module(s) beside it. ``keep``: afterwards, delete all but the
    newest ``keep`` checkpoints in ``path``'s parent directory. Returns ``path``.
    """
    path = Path(path)
    if isinstance(state, nn.Module):
        state = {"": state}
    if keep is not None and keep < 1:
        raise ValueError(f"checkpoint.save: keep={keep!r}; give the number of checkpoints to keep (>= 1) or None")
    col = _collect(state)
    w = world()
    mine: dict[str, torch.Tensor] = {}
    entries = {name: Entry(tuple(t.shape), t.dtype, _layout(t), _pieces(name, t, mine))
               for name, t in col.tensors.items()}
    tmp = path.with_name(f"{path.name}{_TMP}{_shared_token()}")
    try:
        if w.rank == 0:
            tmp.mkdir(parents=True)
        _barrier()
        name, digest, size = None, "", 0
        if mine:
            name = _file_name(w.rank, w.processes)
            save_file({k: _writable(v) for k, v in mine.items()}, tmp / name, metadata={"format": FORMAT})
            _fsync(tmp / name)
            digest, size = _sha256(tmp / name), (tmp / name).stat().st_size
        files = _gather_files(name, digest, size)
        if w.rank == 0:
            _write_index(tmp, _index(entries, col, files))
            _publish(tmp, path)
        _barrier()
    except BaseException:
        if not _distributed():  # several processes: the others may still be writing; latest() ignores it
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep is not None and w.rank == 0:
        for old in _complete(path.parent)[:-keep]:
            if old != path:
                shutil.rmtree(old)
    _barrier()
    return path


def _index(entries: dict[str, Entry], col: _Collected, files: dict) -> dict:
    tensors: dict[str, dict] = {}
    for name, e in entries.items():
        tensors[name] = {
            "shape": list(e.shape),
            "dtype": str(e.dtype).removeprefix("torch."),
            "layout": e.layout,
            "pieces": [{"file": p.file, "key": p.key, "offset": list(p.offset), "shape": list(p.shape)}
                       for p in e.pieces],
        }
    for name, first in col.ties.items():
        tensors[name] = {"same_as": first}
    return {"format": FORMAT, "version": VERSION, "created_ns": time.time_ns(), "kinds": col.kinds,
            "files": files, "tensors": tensors, "values": col.values}


def _write_index(directory: Path, index: dict) -> None:
    p = directory / INDEX
    p.write_text(json.dumps(index, indent=1))
    _fsync(p)
    _fsync(directory)


def _publish(tmp: Path, path: Path) -> None:
    """Rename the finished ``tmp`` to ``path``; an existing ``path`` is moved aside first, then deleted."""
    old = None
    if path.exists():
        old = path.with_name(f"{path.name}{_OLD}{tmp.name.rpartition(_TMP)[2]}")
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync(path.parent)
    if old is not None:
        shutil.rmtree(old)


# -- finding checkpoints -------------------------------------------------------------------------


def _read_index(directory: Path) -> dict | None:
    try:
        index = json.loads((directory / INDEX).read_text())
    except (OSError, ValueError):
        return None
    return index if isinstance(index, dict) and index.get("format") == FORMAT else None


def _complete(directory: Path) -> list[Path]:
    """The complete checkpoints directly in ``directory``, oldest first."""
    found = []
    if directory.is_dir():
        for child in directory.iterdir():
            if child.is_dir() and _TMP not in child.name and _OLD not in child.name:
                index = _read_index(child)
                if index is not None:
                    found.append((index.get("created_ns", 0), child.name, child))
    return [c for *_, c in sorted(found)]


def latest(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in ``directory`` (one with a valid index.json; saves in
    progress or interrupted are skipped), or None."""
    found = _complete(Path(directory))
    return found[-1] if found else None


# -- reading -------------------------------------------------------------------------------------


class _Source:
    """An opened checkpoint directory, or a plain safetensors file (one piece per tensor, no prefix)."""

    def __init__(self, path: str | os.PathLike, verify: bool) -> None:
        self.path = Path(path)
        self.verify = verify
        self._stack = contextlib.ExitStack()
        self._open: dict[str, object] = {}
        if self.path.is_dir():
            index = _read_index(self.path)
            if index is None:
                raise ValueError(f"checkpoint {self.path}: no valid {INDEX}; not a complete shoal checkpoint "
                                 f"(an interrupted save?); use shoal.checkpoint.latest(dir) to find one")
            if index.get("version") != VERSION:
                raise ValueError(f"checkpoint {self.path}: format version {index.get('version')}, this shoal reads "
                                 f"version {VERSION}")
            self.dir, self.files = self.path, index["files"]
            self.kinds, self.values = index["kinds"], index["values"]
            self.ties = {n: e["same_as"] for n, e in index["tensors"].items() if "same_as" in e}
            self.entries = {n: _entry(e) for n, e in index["tensors"].items() if "same_as" not in e}
        elif self.path.is_file():
            self.dir, self.files, self.kinds, self.values, self.ties = self.path.parent, {}, {}, {}, {}
            f = self.open_file(self.path.name)
            self.entries = {}
            for k in sorted(f.keys()):
                sl = f.get_slice(k)
                shape = tuple(sl.get_shape())
                if sl.get_dtype() not in _ST_DTYPES:
                    raise ValueError(f"{self.path}: tensor {k!r} has dtype {sl.get_dtype()}, which shoal does not load")
                self.entries[k] = Entry(shape, _ST_DTYPES[sl.get_dtype()], None,
                                        (Piece(self.path.name, k, (0,) * len(shape), shape),))
        else:
            raise FileNotFoundError(f"checkpoint {self.path} does not exist")

    def __enter__(self) -> _Source:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def names(self) -> list[str]:
        return [*self.entries, *self.ties]

    def entry(self, name: str) -> Entry:
        return self.entries[self.ties.get(name, name)]

    def open_file(self, name: str):
        f = self._open.get(name)
        if f is None:
            p = self.dir / name
            if self.verify and name in self.files:
                _check_file(p, self.files[name])
            try:
                f = self._stack.enter_context(safe_open(p, framework="pt"))
            except Exception as e:
                raise ValueError(f"checkpoint file {p} cannot be read ({e}); it is truncated or corrupted") from e
            self._open[name] = f
        return f

    def read(self, name: str, region: tuple[slice, ...] | None, dtype: torch.dtype) -> torch.Tensor:
        """The part ``region`` of tensor ``name`` (None: all of it) as ``dtype``, read from the pieces it overlaps."""
        e = self.entry(name)
        region = region if region is not None else tuple(slice(0, n) for n in e.shape)
        out = torch.empty([s.stop - s.start for s in region], dtype=dtype)
        filled = 0
        for p in e.pieces:
            lo = [max(r.start, o) for r, o in zip(region, p.offset)]
            hi = [min(r.stop, o + n) for r, o, n in zip(region, p.offset, p.shape)]
            if any(a >= b for a, b in zip(lo, hi)):
                continue
            f = self.open_file(p.file)
            try:
                part = f.get_slice(p.key)[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, p.offset))] \
                    if p.shape else f.get_tensor(p.key)
            except Exception as e:
                raise ValueError(f"checkpoint file {self.dir / p.file}: cannot read {p.key!r} ({e}); the file is "
                                 "truncated or corrupted") from e
            out[tuple(slice(a - r.start, b - r.start) for a, b, r in zip(lo, hi, region))] = part
            filled += math.prod(b - a for a, b in zip(lo, hi))
        if filled != out.numel():
            raise ValueError(f"checkpoint {self.path}: the stored pieces of {name!r} cover {filled} of the "
                             f"{out.numel()} elements asked for; its index is inconsistent")
        return out

    def read_like(self, name: str, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Tensor ``name`` laid out as ``like`` (a GlobalTensor: each local shard read from just its
        slices; a Partial layout reads the reduced value), as ``dtype``."""
        if not isinstance(like, GlobalTensor):
            return self.read(name, None, dtype).to(like.device)
        mesh, w = like.mesh, world()
        spec = like.spec.with_sbp(reduced(like.sbp))
        shards = {mesh.devices[p]: self.read(name, spec.local_region(p), dtype).to(w.torch_device(mesh.devices[p]))
                  for p in mesh.local_positions}
        return from_local(shards, mesh, spec.sbp, shape=spec.shape, dtype=dtype)


def _entry(e: dict) -> Entry:
    dtype = _DTYPES.get(e["dtype"])
    if dtype is None:
        raise ValueError(f"checkpoint: unknown dtype {e['dtype']!r} in the index")
    pieces = tuple(Piece(p["file"], p["key"], tuple(p["offset"]), tuple(p["shape"])) for p in e["pieces"])
    return Entry(tuple(e["shape"]), dtype, e.get("layout"), pieces)


def _check_file(p: Path, want: dict) -> None:
    if not p.is_file():
        raise FileNotFoundError(f"checkpoint file {p} is missing")
    size = p.stat().st_size
    if size != want["bytes"]:
        raise ValueError(f"checkpoint file {p} is {size} bytes, the index says {want['bytes']}: truncated or "
                         "replaced; load an earlier checkpoint")
    if _sha256(p) != want["sha256"]:
        raise ValueError(f"checkpoint file {p} does not match its sha256 in the index: corrupted; load an earlier "
                         "checkpoint")


# -- loading -------------------------------------------------------------------------------------


def _module_prefix(src: _Source, what: str) -> str:
    """The key a bare module target is read from: the one module in a checkpoint directory, or none
    (a plain safetensors file)."""
    modules = [k for k, v in src.kinds.items() if v == "module"]
    if not src.kinds:
        return ""
    if len(modules) != 1:
        raise ValueError(f"checkpoint.{what}: {src.path} holds modules {modules}; name the one to use "
                         f"(load: a mapping such as {{{modules[0]!r}: model}} if any; export: prefix=...)")
    return modules[0]


def _under(src: _Source, prefix: str) -> list[str]:
    return [n for n in src.names() if not prefix or n.startswith(prefix + "/")]


def _check_shape(src: _Source, name: str, shape, errors: list[str]) -> bool:
    saved = src.entry(name).shape
    if tuple(saved) != tuple(shape):
        errors.append(f"{name}: saved shape {list(saved)}, target shape {list(shape)}")
        return False
    return True


def load(
    path: str | os.PathLike,
    targets: Mapping[str, object] | nn.Module,
    *,
    strict: bool = True,
    verify: bool = True,
) -> LoadResult:
    """Load checkpoint ``path`` (a directory ``save`` wrote, or a plain safetensors state dict) into
    ``targets`` (key -> module, optimizer or tensor, loaded in place; a bare module reads the
    checkpoint's one module), whatever their plan, mesh or device count now.

    Each local shard reads only the slices it needs and is converted to the target's dtype. A
    mismatch of names (``strict``) or shapes raises before anything is written, naming them;
    ``strict=False`` loads what matches and reports the rest. ``verify`` checks each file read
    against its sha256 in the index. Returns a ``LoadResult``.
    """
    with _Source(path, verify) as src:
        if isinstance(targets, nn.Module):
            targets = {_module_prefix(src, "load"): targets}
        missing, unexpected, errors, jobs, optims = [], [], [], [], []
        for key, obj in targets.items():
            if isinstance(obj, nn.Module):
                sd = obj.state_dict(keep_vars=True)
                names = {_join(key, n) for n in sd}
                unexpected += [n for n in _under(src, key) if n not in names]
                for n, t in sd.items():
                    full = _join(key, n)
                    if full not in src.ties and full not in src.entries:
                        missing.append(full)
                    elif _check_shape(src, full, t.shape, errors):
                        jobs.append((full, t))
            elif isinstance(obj, torch.optim.Optimizer):
                optims.append((key, obj))
            elif isinstance(obj, torch.Tensor):
                if key not in src.entries and key not in src.ties:
                    missing.append(key)
                elif _check_shape(src, key, obj.shape, errors):
                    jobs.append((key, obj))
            else:
                raise TypeError(f"checkpoint.load: target {key!r} is a {type(obj).__name__}; give modules, "
                                "optimizers or tensors to load into (saved values come back in the result's values)")
        pnames = _param_names(targets)
        loads = [_optimizer_state(src, key, opt, pnames, missing, unexpected) for key, opt in optims]
        if errors:
            raise ValueError(f"checkpoint.load: shapes differ between {src.path} and the targets:\n  "
                             + "\n  ".join(errors))
        if strict and (missing or unexpected):
            raise ValueError(f"checkpoint.load: {src.path} does not match the targets: missing {_few(missing)}; "
                             f"unexpected {_few(unexpected)}; pass strict=False to load what matches")
        for f in src.files if verify else ():  # every file checked before anything is written
            src.open_file(f)
        with torch.no_grad():
            for name, t in jobs:
                t.copy_(src.read_like(name, t, t.dtype))
        for opt, sd in filter(None, loads):
            opt.load_state_dict(sd())
        values = {k: v for k, v in src.values.items() if src.kinds.get(k) == "value" and k not in targets}
    return LoadResult(missing, unexpected, values)


def _few(names: list[str]) -> str:
    return str(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")


def _optimizer_state(src: _Source, key: str, opt: torch.optim.Optimizer, pnames: dict[int, str],
                     missing: list, unexpected: list):
    """Check the saved state of optimizer ``key`` against ``opt``; returns (opt, a function making the
    state dict that ``opt.load_state_dict`` takes), or None when the checkpoint has none. Each state
    tensor is laid out like the state ``opt`` has for its parameter, else like the parameter (torch's
    policy then casts its dtype)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    names = _optimizer_names(opt, pnames, key, "load")
    index = {id(p): i for i, p in enumerate(params)}
    saved = src.values.get(key)
    if src.kinds.get(key) != "optimizer" or saved is None:
        missing.append(key)
        return None
    groups = saved["param_groups"]
    if [g["params"] for g in groups] != [[names[index[id(p)]] for p in g["params"]] for g in opt.param_groups]:
        # other parameters (or groups): the state follows each parameter by name, the hyperparameters stay
        unexpected.append(f"{key}/param_groups")
        groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    tensors: dict[str, dict[str, str]] = {}
    head = f"{key}/state/"
    for n in _under(src, key):
        if n.startswith(head):
            pname, _, k = n[len(head):].rpartition("/")
            tensors.setdefault(pname, {})[k] = n
    stated = set(tensors) | set(saved["state"])
    unexpected += [f"{head}{n}" for n in sorted(stated - set(names))]
    if stated:
        missing += [f"{head}{n}" for n in names if n not in stated]

    def state_dict() -> dict:
        state = {}
        for i, (p, n) in enumerate(zip(params, names)):
            if n not in stated:
                continue
            have = opt.state.get(p, {})
            st = dict(saved["state"].get(n, {}))
            for k, full in tensors.get(n, {}).items():
                e, like = src.entry(full), have.get(k)
                if not (isinstance(like, torch.Tensor) and like.shape == e.shape):
                    like = p if e.shape == p.shape else None
                if like is None:  # a scalar (AdamW's step) stays plain; another shape is replicated on p's mesh
                    value = src.read(full, None, e.dtype)
                    st[k] = to_global(value, p.mesh, [Broadcast()] * p.mesh.ndim) \
                        if isinstance(p, GlobalTensor) and e.shape else value
                else:
                    st[k] = src.read_like(full, like, like.dtype if like is not p else e.dtype)
            state[i] = st
        out_groups = []
        for g, mine in zip(groups, opt.param_groups):
            # JSON made tuples lists: give back the optimizer's own types (AdamW's betas)
            hyper = {k: tuple(v) if isinstance(mine.get(k), tuple) else v for k, v in g.items() if k != "params"}
            out_groups.append({**hyper, "params": [index[id(p)] for p in mine["params"]]})
        return {"state": state, "param_groups": out_groups}

    return opt, state_dict


# -- export and description ----------------------------------------------------------------------


def export(path: str | os.PathLike, out: str | os.PathLike, prefix: str | None = None, *,
           verify: bool = True) -> Path:
    """Write the module ``prefix`` (default: the checkpoint's one module) of checkpoint ``path`` as
    one plain safetensors state dict under the module's own names (tied weights under each name)."""
    out = Path(out)
    with _Source(path, verify) as src:
        prefix = _module_prefix(src, "export") if prefix is None else prefix
        if prefix and src.kinds.get(prefix) != "module":
            raise ValueError(f"checkpoint.export: {src.path} has no module {prefix!r}; its modules are "
                             f"{[k for k, v in src.kinds.items() if v == 'module']}")
        cut = len(prefix) + 1 if prefix else 0
        tensors = {n[cut:]: src.read(n, None, src.entry(n).dtype) for n in _under(src, prefix)}
    tmp = out.with_name(f"{out.name}{_TMP}{secrets.token_hex(4)}")
    try:
        save_file(tensors, tmp)
        _fsync(tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _size(n: float) -> str:
    unit = 0
    while n >= 1024 and unit < 3:
        n, unit = n / 1024, unit + 1
    return f"{n:.0f} B" if unit == 0 else f"{n:.1f} {('KiB', 'MiB', 'GiB')[unit - 1]}"


def describe(path: str | os.PathLike, *, verify: bool = False) -> str:
    """A readable listing of checkpoint ``path``: each tensor's global shape, dtype, saved layout and
    size, the files and the saved values."""
    with _Source(path, verify) as src:
        rows = [("name", "shape", "dtype", "saved layout", "size")]
        for n in sorted(src.names()):
            if n in src.ties:
                rows.append((n, "", "", f"= {src.ties[n]} (tied)", ""))
            else:
                e = src.entry(n)
                rows.append((n, str(list(e.shape)), str(e.dtype).removeprefix("torch."), e.layout or "-",
                             _size(e.nbytes)))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        total = sum(e.nbytes for e in src.entries.values())
        lines = [f"{src.path}: {len(src.entries)} tensors, {_size(total)}"]
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        for f, meta in sorted(src.files.items()):
            lines.append(f"file {f}: {_size(meta['bytes'])}, sha256 {meta['sha256'][:16]}...")
        for k, v in src.values.items():
            if src.kinds.get(k) == "optimizer":
                groups = v["param_groups"]
                hyper = ", ".join(f"{h} {x}" for h, x in groups[0].items() if h != "params") if groups else ""
                lines.append(f"optimizer {k}: {len(groups)} parameter group(s) of "
                             f"{sum(len(g['params']) for g in groups)} parameters; {hyper}")
            else:
                lines.append(f"value {k}: {json.dumps(v)[:200]}")
    return "\n".join(lines)
