"""The world: which devices exist and which this process owns.

Device ``d`` lives in process ``d // K`` at local index ``d % K`` (K devices per process).
One process with K virtual CPU devices is the default; nothing outside this module assumes it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = ["World", "init", "world", "is_initialized"]


@dataclass(frozen=True, slots=True)
class World:
    processes: int
    devices_per_process: int
    rank: int
    device_type: str  # "cpu" or "cuda"

    @property
    def size(self) -> int:
        return self.processes * self.devices_per_process

    @property
    def local_devices(self) -> tuple[int, ...]:
        k = self.devices_per_process
        return tuple(range(self.rank * k, (self.rank + 1) * k))

    def process_of(self, device: int) -> int:
        self.check(device)
        return device // self.devices_per_process

    def owns(self, device: int) -> bool:
        return device // self.devices_per_process == self.rank

    def torch_device(self, device: int) -> torch.device:
        """The torch device that holds global device ``device``'s shards (owned devices only)."""
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, device % self.devices_per_process)

    def check(self, device: int) -> None:
        if not isinstance(device, int) or not 0 <= device < self.size:
            raise ValueError(
                f"device {device!r} is not in the world of {self.size} devices "
                f"({self.processes} process(es) x {self.devices_per_process}); "
                f"use ids 0..{self.size - 1} or call shoal.init(devices=N) with a larger N"
            )


_WORLD: World | None = None


def init(devices: int | None = None, device_type: str | None = None) -> World:
    """Set up the world: ``devices`` virtual devices in this process (default ``$SHOAL_DEVICES`` or 1).

    Calling it again with other arguments replaces the world (single-process only).
    """
    global _WORLD
    if devices is None:
        devices = int(os.environ.get("SHOAL_DEVICES", "1"))
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"shoal.init: devices must be a positive int, got {devices!r}")
    if device_type is None:
        device_type = os.environ.get("SHOAL_DEVICE_TYPE", "cpu")
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"shoal.init: device_type must be 'cpu' or 'cuda', got {device_type!r}")
    if device_type == "cuda" and devices > torch.cuda.device_count():
        raise ValueError(
            f"shoal.init: asked for {devices} cuda devices but this process sees {torch.cuda.device_count()}"
        )
    _WORLD = World(processes=1, devices_per_process=devices, rank=0, device_type=device_type)
    return _WORLD


def world() -> World:
    """The current world, initialising a default one on first use."""
    if _WORLD is None:
        return init()
    return _WORLD


def is_initialized() -> bool:
    return _WORLD is not None
