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
    local_rank: int = 0  # this process's index on its host (picks its GPUs)

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
        k = self.devices_per_process
        return torch.device(self.device_type, self.local_rank * k + device % k)

    def check(self, device: int) -> None:
        if not isinstance(device, int) or not 0 <= device < self.size:
            raise ValueError(
                f"device {device!r} is not in the world of {self.size} devices "
                f"({self.processes} process(es) x {self.devices_per_process}); "
                f"use ids 0..{self.size - 1} or call shoal.init(devices=N) with a larger N"
            )


_WORLD: World | None = None


def init(devices: int | None = None, device_type: str | None = None, timeout: float | None = None) -> World:
    """Set up the world.

    One process (default): ``devices`` virtual devices (default ``$SHOAL_DEVICES`` or 1). Under
    torchrun / ``shoal run`` (``RANK``, ``WORLD_SIZE`` set): one process per rank, each owning
    ``$SHOAL_DEVICES_PER_PROCESS`` devices (or ``devices`` // processes), over torch.distributed
    (gloo on CPU, NCCL on CUDA) with a ``timeout`` in seconds (default ``$SHOAL_TIMEOUT`` or 60)
    after which a collective whose peer died fails instead of hanging.
    """
    global _WORLD
    if device_type is None:
        device_type = os.environ.get("SHOAL_DEVICE_TYPE", "cpu")
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"shoal.init: device_type must be 'cpu' or 'cuda', got {device_type!r}")
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    if "RANK" in os.environ and processes > 1:
        _WORLD = _init_distributed(devices, device_type, processes, timeout)
        return _WORLD
    if devices is None:
        devices = int(os.environ.get("SHOAL_DEVICES", "1"))
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"shoal.init: devices must be a positive int, got {devices!r}")
    if device_type == "cuda" and devices > torch.cuda.device_count():
        raise ValueError(
            f"shoal.init: asked for {devices} cuda devices but this process sees {torch.cuda.device_count()}"
        )
    _WORLD = World(processes=1, devices_per_process=devices, rank=0, device_type=device_type)
    return _WORLD


def _init_distributed(devices, device_type: str, processes: int, timeout) -> World:
    import datetime

    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    k = int(os.environ.get("SHOAL_DEVICES_PER_PROCESS", "0")) or None
    if devices is not None:
        if devices % processes:
            raise ValueError(f"shoal.init: {devices} devices do not divide over {processes} processes")
        if k is not None and k * processes != devices:
            raise ValueError(f"shoal.init: devices={devices} but {processes} processes x SHOAL_DEVICES_PER_PROCESS={k}")
        k = devices // processes
    k = k or 1
    if device_type == "cuda":
        if (local_rank + 1) * k > torch.cuda.device_count():
            raise ValueError(
                f"shoal.init: local rank {local_rank} needs cuda devices {local_rank * k}..{(local_rank + 1) * k - 1} "
                f"but this host has {torch.cuda.device_count()}"
            )
        torch.cuda.set_device(local_rank * k)
    from .comm.dist import install_failure_report, shutdown

    if not dist.is_initialized():
        import atexit

        secs = float(timeout if timeout is not None else os.environ.get("SHOAL_TIMEOUT", "60"))
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=secs))
        atexit.register(shutdown)

    install_failure_report(rank)
    return World(processes=processes, devices_per_process=k, rank=rank, device_type=device_type, local_rank=local_rank)


def world() -> World:
    """The current world, initialising a default one on first use."""
    if _WORLD is None:
        return init()
    return _WORLD


def is_initialized() -> bool:
    return _WORLD is not None
