"""The checkpoint format: a directory of safetensors files (one per process that holds slices) and
``index.json`` (each tensor's global shape, dtype, saved layout and ``Piece``s, a sha256 per file,
the saved JSON values); finding the complete checkpoints in a directory (``latest``)."""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

FORMAT, VERSION = "shoal.checkpoint", 1
INDEX = "index.json"
TMP = ".tmp-"  # a save in progress (or one that crashed): never a checkpoint
OLD = ".old-"  # a checkpoint being replaced by a save to the same path
# safetensors' dtype names (a file's header), and the index's (torch's names)
ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
             "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
ST_NAMES = {d: n for n, d in ST_DTYPES.items()}
DTYPES = {str(d).removeprefix("torch."): d for d in ST_DTYPES.values()}


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

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "dtype": str(self.dtype).removeprefix("torch."), "layout": self.layout,
                "pieces": [{"file": p.file, "key": p.key, "offset": list(p.offset), "shape": list(p.shape)}
                           for p in self.pieces]}

    @staticmethod
    def from_json(e: dict) -> Entry:
        dtype = DTYPES.get(e["dtype"])
        if dtype is None:
            raise ValueError(f"checkpoint: unknown dtype {e['dtype']!r} in the index")
        pieces = tuple(Piece(p["file"], p["key"], tuple(p["offset"]), tuple(p["shape"])) for p in e["pieces"])
        return Entry(tuple(e["shape"]), dtype, e.get("layout"), pieces)


def file_name(rank: int, processes: int) -> str:
    return f"shard-{rank:05d}-of-{processes:05d}.safetensors"


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def write_index(directory: Path, index: dict) -> None:
    p = directory / INDEX
    p.write_text(json.dumps(index, indent=1))
    fsync(p)
    fsync(directory)


def read_index(directory: Path) -> dict | None:
    try:
        index = json.loads((directory / INDEX).read_text())
    except (OSError, ValueError):
        return None
    return index if isinstance(index, dict) and index.get("format") == FORMAT else None


def complete(directory: Path) -> list[Path]:
    """The complete checkpoints directly in ``directory``, oldest first."""
    found = []
    if directory.is_dir():
        for child in directory.iterdir():
            if child.is_dir() and TMP not in child.name and OLD not in child.name:
                index = read_index(child)
                if index is not None:
                    found.append((index.get("created_ns", 0), child.name, child))
    return [c for *_, c in sorted(found)]


def latest(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in ``directory`` (one with a valid index.json; saves in
    progress or interrupted are skipped), or None."""
    found = complete(Path(directory))
    return found[-1] if found else None
