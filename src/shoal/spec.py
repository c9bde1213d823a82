"""TensorSpec: (global shape, dtype, mesh, nd-SBP), frozen and hashable; owns local-shape and offset math.

Splits are balanced: the first ``size % n`` chunks are one larger; chunks may be empty. Mesh axes
apply outer to inner, so an inner axis splits the chunk the outer axes left.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from .mesh import Mesh
from .sbp import Broadcast, NdSBP, Partial, Split, sbp_str

__all__ = ["TensorSpec", "chunk_bounds"]


def chunk_bounds(size: int, n: int, i: int) -> tuple[int, int]:
    """[start, end) of chunk ``i`` when ``size`` is split into ``n`` balanced chunks."""
    q, r = divmod(size, n)
    start = i * q + min(i, r)
    return start, start + q + (1 if i < r else 0)


@dataclass(frozen=True, slots=True, eq=False)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    mesh: Mesh
    sbp: NdSBP
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # specs key every dispatch cache lookup: hash once
        object.__setattr__(self, "_hash", hash((self.shape, self.dtype, self.mesh, self.sbp)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):  # the hash is recomputed where it is loaded (dtype and str hashes differ by process)
        return TensorSpec, (self.shape, self.dtype, self.mesh, self.sbp)

    def __eq__(self, other) -> bool:
        if self is other:
            return True
        if type(other) is not TensorSpec:
            return NotImplemented
        return (
            self._hash == other._hash
            and self.shape == other.shape
            and self.dtype == other.dtype
            and self.sbp == other.sbp
            and self.mesh == other.mesh
        )

    def __repr__(self) -> str:
        return f"TensorSpec({list(self.shape)}, {self.dtype}, mesh={self.mesh.shape}, sbp={sbp_str(self.sbp)})"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)

    def bytes_per_device(self) -> dict[int, int]:
        """Device -> bytes of its shard."""
        item = _itemsize(self.dtype)
        return {dev: math.prod(self.local_shape(pos)) * item for pos, dev in enumerate(self.mesh.devices)}

    def with_sbp(self, sbp: NdSBP) -> TensorSpec:
        return TensorSpec(self.shape, self.dtype, self.mesh, sbp)

    def local_shape(self, pos: int) -> tuple[int, ...]:
        """Shape of the shard at mesh position ``pos`` (index into ``mesh.devices``)."""
        return _layout(self)[pos][0]

    def local_offset(self, pos: int) -> tuple[int, ...]:
        """Global index of the first element of the shard at mesh position ``pos``."""
        return _layout(self)[pos][1]

    def local_region(self, pos: int) -> tuple[slice, ...]:
        shape, off = _layout(self)[pos]
        return tuple(slice(o, o + s) for o, s in zip(off, shape))

    @property
    def has_partial(self) -> bool:
        return any(isinstance(s, Partial) for s in self.sbp)

    @property
    def is_replicated(self) -> bool:
        return all(isinstance(s, Broadcast) for s in self.sbp)

    def split_factor(self, dim: int) -> int:
        return math.prod(n for n, s in zip(self.mesh.shape, self.sbp) if s == Split(dim))


@lru_cache(maxsize=8192)
def _layout(spec: TensorSpec) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    out = []
    for coord in spec.mesh.coords:
        shape = list(spec.shape)
        off = [0] * len(shape)
        for axis, s in enumerate(spec.sbp):
            if isinstance(s, Split):
                a, b = chunk_bounds(shape[s.dim], spec.mesh.shape[axis], coord[axis])
                off[s.dim] += a
                shape[s.dim] = b - a
        out.append((tuple(shape), tuple(off)))
    return tuple(out)


@lru_cache(maxsize=64)
def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
