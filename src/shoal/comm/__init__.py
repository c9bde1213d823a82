"""Collectives over a group of devices.

Each function takes the group's global device ids and one local tensor per device of the group
(``None`` for devices another process owns) and returns the group's new local tensors. The part
inside a process is plain tensor ops between shards; results that are equal on every device are
one shared tensor (no copies on CPU). Crossing processes is the multi-process backend's job.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..world import world
from .counter import CommCounter, record

__all__ = ["CommCounter", "all_gather", "all_reduce", "reduce_scatter", "all_to_all", "transfer"]

Shards = Sequence[torch.Tensor | None]


def _local(devices: Sequence[int], shards: Shards, what: str) -> list[torch.Tensor]:
    if any(s is None for s in shards):
        raise NotImplementedError(
            f"{what} over devices {list(devices)} crosses processes; the multi-process backend is not built yet"
        )
    return list(shards)  # type: ignore[arg-type]


def _place(t: torch.Tensor, devices: Sequence[int]) -> list[torch.Tensor]:
    """One result shared by every device of the group (copied per device only off-CPU)."""
    w = world()
    if w.device_type == "cpu":
        return [t] * len(devices)
    out = []
    for d in devices:
        td = w.torch_device(d)
        out.append(t if t.device == td else t.to(td, non_blocking=True))
    return out


def _home(shards: list[torch.Tensor]) -> list[torch.Tensor]:
    dev = shards[0].device
    return [s if s.device == dev else s.to(dev) for s in shards]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_gather(devices: Sequence[int], shards: Shards, dim: int) -> list[torch.Tensor]:
    xs = _home(_local(devices, shards, "all_gather"))
    full = torch.cat(xs, dim)
    record("all_gather", _nbytes(full))
    return _place(full, devices)


_REDUCE = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}


def _reduce(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    f = _REDUCE[op]
    acc = xs[0]
    for x in xs[1:]:
        acc = f(acc, x)
    return acc if len(xs) > 1 else acc.clone()


def all_reduce(devices: Sequence[int], shards: Shards, op: str = "sum") -> list[torch.Tensor]:
    xs = _home(_local(devices, shards, "all_reduce"))
    total = _reduce(xs, op)
    record("all_reduce", _nbytes(total))
    return _place(total, devices)


def _scatter(full: torch.Tensor, devices: Sequence[int], dim: int) -> list[torch.Tensor]:
    parts = torch.tensor_split(full, len(devices), dim)
    w = world()
    if w.device_type == "cpu":
        return list(parts)
    return [p.to(w.torch_device(d)) for p, d in zip(parts, devices)]


def reduce_scatter(devices: Sequence[int], shards: Shards, dim: int, op: str = "sum") -> list[torch.Tensor]:
    xs = _home(_local(devices, shards, "reduce_scatter"))
    total = _reduce(xs, op)
    record("reduce_scatter", _nbytes(total))
    return _scatter(total, devices, dim)


def all_to_all(devices: Sequence[int], shards: Shards, src_dim: int, dst_dim: int) -> list[torch.Tensor]:
    xs = _home(_local(devices, shards, "all_to_all"))
    full = torch.cat(xs, src_dim)
    record("all_to_all", _nbytes(full))
    return _scatter(full, devices, dst_dim)


def transfer(src: int, dst: int, t: torch.Tensor | None) -> torch.Tensor:
    """Point-to-point: the tensor device ``src`` holds, now held by device ``dst``."""
    if t is None:
        raise NotImplementedError(
            f"send from device {src} to {dst} crosses processes; the multi-process backend is not built yet"
        )
    record("send_recv", _nbytes(t))
    w = world()
    td = w.torch_device(dst)
    return t if t.device == td else t.to(td)
