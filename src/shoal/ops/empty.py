"""Per-shard kernels that reject empty shards (pooling, convolution, attention, norms, LSTM): pad, run, cut back.

An uneven split may leave a shard with no rows along its split dim; several ATen kernels raise on that
(or crash). ``pad_empty`` runs the op on the shard with each such dim padded to one zero slice and cuts
the outputs back to the shapes their specs give. Exact for ops that are independent along the split dim
(outputs split on it lose the padded slice) or that sum over it (a zero slice adds nothing to a Partial).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .registry import Call, Shard

__all__ = ["pad_empty", "pad_empty_local"]


def _has_empty(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.numel() == 0
    if isinstance(obj, (list, tuple)):
        return any(_has_empty(e) for e in obj)
    return False


def pad_empty(fn: Callable, with_shard: bool = False) -> Callable:
    """``fn(*args)`` as a context-taking local function (``local_ctx=True``) that survives empty shards;
    ``with_shard``: ``fn`` takes the Shard first too (``fn(shard, *args)``, e.g. for its offsets)."""

    def run(shard: Shard, *args, **kwargs):
        op = functools.partial(fn, shard) if with_shard else fn
        if not (any(_has_empty(a) for a in args) or any(_has_empty(v) for v in kwargs.values())):
            return op(*args, **kwargs)
        k = 0

        def pad(obj):
            nonlocal k
            if isinstance(obj, torch.Tensor):
                glob = shard.in_specs[k].shape
                k += 1
                shape = [1 if n == 0 and g > 0 else n for n, g in zip(obj.shape, glob)]
                return obj.new_zeros(shape) if shape != list(obj.shape) else obj
            if isinstance(obj, (list, tuple)) and any(isinstance(e, torch.Tensor) for e in obj):
                return type(obj)(pad(e) for e in obj)
            return obj

        # the same order as dispatch numbers tensor inputs: positional args, then keyword args
        a = tuple(pad(x) for x in args)
        kw = {key: pad(v) for key, v in kwargs.items()}
        out = op(*a, **kw)
        j = 0

        def cut(obj):
            nonlocal j
            if isinstance(obj, torch.Tensor):
                want = shard.out_specs[j].local_shape(shard.pos)
                j += 1
                return obj[tuple(slice(0, n) for n in want)] if tuple(obj.shape) != want else obj
            if isinstance(obj, (list, tuple)):
                return type(obj)(cut(e) for e in obj)
            return obj

        return cut(out)

    return run


def pad_empty_local(call: Call, ins, outs) -> Callable:
    """A rule's ``local`` (with ``local_ctx=True``): the op itself, safe on empty shards."""
    return pad_empty(call.func)
