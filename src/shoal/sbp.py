"""SBP: how a global tensor is laid out along one mesh axis.

``Split(dim)`` cuts it into balanced chunks, ``Broadcast()`` replicates it, ``Partial(op)`` holds
pieces whose elementwise ``op`` (sum, max or min) is the global value. ``S``, ``B``, ``P`` are aliases.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["SBP", "Split", "Broadcast", "Partial", "S", "B", "P", "NdSBP", "normalize_sbp", "sbp_str"]


@dataclass(frozen=True, slots=True)
class Split:
    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int):
            raise TypeError(f"Split(dim) takes an int dim, got {self.dim!r}")

    def __repr__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class Broadcast:
    def __repr__(self) -> str:
        return "B"


PARTIAL_OPS = ("sum", "max", "min")


@dataclass(frozen=True, slots=True)
class Partial:
    op: str = "sum"

    def __post_init__(self) -> None:
        if self.op not in PARTIAL_OPS:
            raise ValueError(f"Partial(op): op must be one of {PARTIAL_OPS}, got {self.op!r}")

    def __repr__(self) -> str:
        return "P" if self.op == "sum" else f"P({self.op})"


SBP = Split | Broadcast | Partial
NdSBP = tuple[SBP, ...]

S = Split
B = Broadcast()
P = Partial("sum")


def normalize_sbp(sbp: SBP | Sequence[SBP], mesh_ndim: int, tensor_ndim: int, what: str = "sbp") -> NdSBP:
    """One SBP per mesh axis, with negative split dims made non-negative against ``tensor_ndim``."""
    if isinstance(sbp, SBP):
        sbp = (sbp,) * mesh_ndim if mesh_ndim == 1 else [sbp]
    sbp = tuple(sbp)
    if len(sbp) != mesh_ndim:
        raise ValueError(
            f"{what}: got {len(sbp)} SBP(s) {list(sbp)} for a mesh with {mesh_ndim} axes; "
            f"give one SBP per mesh axis, e.g. {[B] * mesh_ndim}"
        )
    out = []
    for s in sbp:
        if not isinstance(s, SBP):
            raise TypeError(f"{what}: {s!r} is not an SBP; use S(dim), B or P")
        if isinstance(s, Split):
            d = s.dim + tensor_ndim if s.dim < 0 else s.dim
            if not 0 <= d < tensor_ndim:
                raise ValueError(
                    f"{what}: split dim {s.dim} is out of range for a tensor with {tensor_ndim} dim(s); "
                    f"use a dim in [{-tensor_ndim}, {tensor_ndim - 1}] or B"
                )
            s = Split(d)
        out.append(s)
    return tuple(out)


def reduced(sbp: NdSBP) -> NdSBP:
    """``sbp`` with every Partial turned into Broadcast: the layout of the value once reduced."""
    return tuple(Broadcast() if isinstance(s, Partial) else s for s in sbp)


def sbp_str(sbp: NdSBP) -> str:
    return "[" + ", ".join(map(repr, sbp)) + "]"
