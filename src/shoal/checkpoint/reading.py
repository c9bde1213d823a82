"""Reading a checkpoint: ``Source`` opens a checkpoint directory (or a plain safetensors file) and
reads any region of a saved tensor from the pieces it overlaps, or a whole local layout at once."""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

import torch
from safetensors import safe_open

from ..sbp import reduced
from ..tensor import GlobalTensor, from_local
from ..world import world
from .index import INDEX, ST_DTYPES, VERSION, Entry, Piece, read_index, sha256


class Source:
    """An opened checkpoint directory, or a plain safetensors file (one piece per tensor, no prefix)."""

    def __init__(self, path: str | os.PathLike, verify: bool) -> None:
        self.path = Path(path)
        self.verify = verify
        self._stack = contextlib.ExitStack()
        self._open: dict[str, object] = {}
        if self.path.is_dir():
            index = read_index(self.path)
            if index is None:
                raise ValueError(f"checkpoint {self.path}: no valid {INDEX}; not a complete shoal checkpoint "
                                 f"(an interrupted save?); use shoal.checkpoint.latest(dir) to find one")
            if index.get("version") != VERSION:
                raise ValueError(f"checkpoint {self.path}: format version {index.get('version')}, this shoal reads "
                                 f"version {VERSION}")
            self.dir, self.files = self.path, index["files"]
            self.kinds, self.values = index["kinds"], index["values"]
            self.ties = {n: e["same_as"] for n, e in index["tensors"].items() if "same_as" in e}
            self.entries = {n: Entry.from_json(e) for n, e in index["tensors"].items() if "same_as" not in e}
        elif self.path.is_file():
            self.dir, self.files, self.kinds, self.values, self.ties = self.path.parent, {}, {}, {}, {}
            f = self.open_file(self.path.name)
            self.entries = {}
            for k in sorted(f.keys()):
                sl = f.get_slice(k)
                shape = tuple(sl.get_shape())
                if sl.get_dtype() not in ST_DTYPES:
                    raise ValueError(f"{self.path}: tensor {k!r} has dtype {sl.get_dtype()}, which shoal does not load")
                self.entries[k] = Entry(shape, ST_DTYPES[sl.get_dtype()], None,
                                        (Piece(self.path.name, k, (0,) * len(shape), shape),))
        else:
            raise FileNotFoundError(f"checkpoint {self.path} does not exist")

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def names(self) -> list[str]:
        return [*self.entries, *self.ties]

    def has(self, name: str) -> bool:
        return name in self.entries or name in self.ties

    def under(self, prefix: str) -> list[str]:
        """The names under top-level key ``prefix`` (all names if it is empty)."""
        return [n for n in self.names() if not prefix or n.startswith(prefix + "/")]

    def modules(self) -> list[str]:
        return [k for k, v in self.kinds.items() if v == "module"]

    def module_prefix(self, what: str) -> str:
        """The key a bare module is read from: the one module in a checkpoint directory, or none (a
        plain safetensors file)."""
        modules = self.modules()
        if not self.kinds:
            return ""
        if len(modules) != 1:
            raise ValueError(f"checkpoint.{what}: {self.path} holds modules {modules}; name the one to use "
                             f"(load: a mapping such as {{{modules[0]!r}: model}} if any; export: prefix=...)")
        return modules[0]

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


def _check_file(p: Path, want: dict) -> None:
    if not p.is_file():
        raise FileNotFoundError(f"checkpoint file {p} is missing")
    size = p.stat().st_size
    if size != want["bytes"]:
        raise ValueError(f"checkpoint file {p} is {size} bytes, the index says {want['bytes']}: truncated or "
                         "replaced; load an earlier checkpoint")
    if sha256(p) != want["sha256"]:
        raise ValueError(f"checkpoint file {p} does not match its sha256 in the index: corrupted; load an earlier "
                         "checkpoint")
