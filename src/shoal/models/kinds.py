"""Plan kinds shared by the bundled models: which mesh axes split the batch and which split weights.

``dp`` (data parallel), ``zero`` (dp with the optimizer state split: ZeRO-1), ``zero2`` (and the
gradients), ``zero3`` (and the parameters at rest) and ``tp`` (Megatron tensor parallel) take a 1-D
mesh; ``dp,tp`` takes a 2-D mesh, batch split on axis 0 and weights on axis 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..mesh import Mesh
from ..sbp import SBP, B

__all__ = ["KINDS", "ZERO", "Axes", "axes"]

KINDS = ("dp", "tp", "dp,tp", "zero", "zero2", "zero3")
ZERO = {"zero": 1, "zero2": 2, "zero3": 3}  # plan kind -> ZeRO stage (``Plan.zero``)


@dataclass(frozen=True, slots=True)
class Axes:
    """The mesh axes a plan kind uses: ``dp`` splits the batch, ``tp`` splits weights (None: unused)."""

    ndim: int
    dp: int | None
    tp: int | None

    def layout(self, dp: SBP = B, tp: SBP = B) -> tuple[SBP, ...]:
        """One SBP per mesh axis: ``dp`` on the data-parallel axis, ``tp`` on the tensor-parallel one, B elsewhere."""
        return tuple(dp if a == self.dp else tp if a == self.tp else B for a in range(self.ndim))


def axes(mesh: Mesh | tuple[int, ...], kind: str) -> Axes:
    """The axes plan ``kind`` uses on ``mesh`` (a Mesh or its shape); a clear error if it does not fit."""
    if kind not in KINDS:
        raise ValueError(f"unknown plan {kind!r}; choose one of {', '.join(KINDS)}")
    shape = mesh.shape if isinstance(mesh, Mesh) else tuple(mesh)
    ndim, shape = len(shape), "x".join(map(str, shape))
    if kind == "dp,tp":
        if ndim != 2:
            raise ValueError(f"plan 'dp,tp' needs a 2-D mesh (data x tensor parallel, e.g. 2x2), got {shape}")
        return Axes(2, dp=0, tp=1)
    if ndim != 1:
        raise ValueError(f"plan {kind!r} needs a 1-D mesh, got {shape}; use plan 'dp,tp' for a 2-D mesh")
    return Axes(1, dp=None, tp=0) if kind == "tp" else Axes(1, dp=0, tp=None)
