"""What several rule families share: arguments read by their schema names, the SBPs of the tensors
among them, and the dtypes their decompositions compute in."""

from __future__ import annotations

import torch

from .. import schema
from .registry import Call

__all__ = ["named_args", "sig_of", "compute_dtype", "cast"]

aten = torch.ops.aten


def named_args(call: Call, n: int) -> list:
    """The op's first ``n`` arguments, each read by its schema name (``Call.arg``): given by position or
    by keyword, else the schema's default."""
    sc = schema.of(call.func)
    return [call.arg(i, name, default) for i, (name, default) in enumerate(zip(sc.names[:n], sc.defaults[:n]))]


def sig_of(values, sbps) -> tuple:
    """The SBPs of the arguments that hold tensors (optional tensor arguments may be None)."""
    return tuple(s for v, s in zip(values, sbps) if isinstance(v, torch.Tensor))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a decomposition computes statistics in: float32 for half precision, as torch's kernels."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def cast(t, dtype):
    """``t`` in ``dtype``, by an op that has a rule (no copy when it is in ``dtype`` already)."""
    return t if t.dtype == dtype else aten._to_copy.default(t, dtype=dtype)
