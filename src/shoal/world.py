"""The world: which devices exist and which this process owns.

Device ``d`` lives in process ``d // K`` at local index ``d % K`` (K devices per process).
One process with K virtual CPU devices is the default; nothing outside this module assumes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass

import torch

__all__ = ["World", "init", "world", "is_initialized", "shutdown", "meta_world", "FAILED_KEY", "ALIVE_KEY", "HEARTBEAT"]


@dataclass(frozen=True, slots=True)
class World:
    processes: int
    devices_per_process: int
    rank: int
    device_type: str  # "cpu", "cuda", or "meta" (devices that hold shapes, not data: plans are traced, not run)
    local_rank: int = 0  # this process's index on its host (picks its GPUs)
    timeout: float = 60.0  # seconds a collective waits for a peer before it fails
    gpus: int = 0  # one process's devices share this many GPUs (0: a GPU each)
    memory_per_device: int | None = None  # bytes a plan may hold per device (None: unchecked)

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
        if self.device_type in ("cpu", "meta"):
            return torch.device(self.device_type)
        k = self.devices_per_process
        if self.gpus:  # several virtual devices per GPU, round robin
            return torch.device(self.device_type, (device % k) % self.gpus)
        return torch.device(self.device_type, self.local_rank * k + device % k)

    def with_budget(self, budget: int | None) -> World:
        return dataclasses.replace(self, memory_per_device=budget)

    def check(self, device: int) -> None:
        if not isinstance(device, int) or not 0 <= device < self.size:
            raise ValueError(
                f"device {device!r} is not in the world of {self.size} devices "
                f"({self.processes} process(es) x {self.devices_per_process}); "
                f"use ids 0..{self.size - 1} or call shoal.init(devices=N) with a larger N"
            )


_WORLD: World | None = None
# called whenever the world changes: caches of what this process owns (dispatch's bound decisions)
# hold for one world only
_ON_CHANGE: list = []


def on_change(fn):
    """Register ``fn()`` to run whenever the world changes (``init``, ``meta_world``)."""
    _ON_CHANGE.append(fn)
    return fn


def _set(w: World | None) -> World | None:
    global _WORLD
    _WORLD = w
    for fn in _ON_CHANGE:
        fn()
    return w


def init(devices: int | None = None, device_type: str | None = None, timeout: float | None = None,
         share_gpus: bool = False, memory_per_device: int | str | None = None) -> World:
    """Set up the world.

    One process (default): ``devices`` virtual devices (default ``$SHOAL_DEVICES`` or 1);
    ``device_type="meta"``: devices whose shards are meta tensors (shapes, no memory; host work
    stays on the CPU), for tracing and pricing a plan for a cluster this machine cannot hold. Under
    torchrun / ``shoal run`` (``RANK``, ``WORLD_SIZE`` set): one process per rank, each owning
    ``$SHOAL_DEVICES_PER_PROCESS`` devices (or ``devices`` // processes), over torch.distributed
    (gloo on CPU, NCCL on CUDA) with a ``timeout`` in seconds (default ``$SHOAL_TIMEOUT`` or 60)
    after which a collective whose peer died fails instead of hanging. ``share_gpus`` (one process,
    cuda): more devices than GPUs, spread round robin over the GPUs (several virtual devices on one
    GPU, as on one CPU). ``memory_per_device``: a budget per device (bytes, or a string such as
    "512MiB" or "80GB"); plans whose states (``distribute_module``, an optimizer's first step) or
    planned peak (``shoal.compile``) exceed it are refused before they run.
    """
    budget = parse_bytes(memory_per_device)
    if device_type is None:
        device_type = os.environ.get("SHOAL_DEVICE_TYPE", "cpu")
    if device_type not in ("cpu", "cuda", "meta"):
        raise ValueError(f"shoal.init: device_type must be 'cpu', 'cuda' or 'meta', got {device_type!r}")
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    if "RANK" in os.environ and processes > 1 and device_type != "meta":
        return _set(_init_distributed(devices, device_type, processes, timeout).with_budget(budget))
    if devices is None:
        devices = int(os.environ.get("SHOAL_DEVICES", "1"))
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"shoal.init: devices must be a positive int, got {devices!r}")
    gpus = 0
    if device_type == "cuda" and devices > torch.cuda.device_count():
        if not share_gpus or torch.cuda.device_count() == 0:
            raise ValueError(
                f"shoal.init: asked for {devices} cuda devices but this process sees {torch.cuda.device_count()}; "
                "pass share_gpus=True to put several devices on one GPU"
            )
        gpus = torch.cuda.device_count()
    return _set(World(processes=1, devices_per_process=devices, rank=0, device_type=device_type, gpus=gpus,
                      memory_per_device=budget))


_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def parse_bytes(x: int | str | None) -> int | None:
    """A byte count from an int or a string with a unit ("512MiB", "1.5 GB"); None stays None."""
    if x is None or (isinstance(x, int) and not isinstance(x, bool) and x > 0):
        return x
    if isinstance(x, str):
        text = x.strip().lower().replace(" ", "")
        num = text.rstrip("kmgtib")
        unit = text[len(num):] or "b"
        try:
            if unit in _UNITS and float(num) > 0:
                return int(float(num) * _UNITS[unit])
        except ValueError:
            pass
    raise ValueError(f"shoal.init: memory_per_device must be a positive number of bytes or a string such as "
                     f"'512MiB' or '80GB', got {x!r}")


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
    secs = float(timeout if timeout is not None else os.environ.get("SHOAL_TIMEOUT", "60"))
    if not dist.is_initialized():
        import atexit

        limit = datetime.timedelta(seconds=secs)
        store = _attempt_store(rank, processes, limit)
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", store=store, rank=rank,
                                world_size=processes, timeout=limit)
        atexit.register(shutdown)

    _install_failure_report(rank)
    return World(processes=processes, devices_per_process=k, rank=rank, device_type=device_type, local_rank=local_rank,
                 timeout=secs)


def _attempt_store(rank: int, processes: int, timeout):
    """The rendezvous store (torchrun's ``env://``) under a prefix naming this attempt of the job.

    torchrun's agent hosts one store for the whole job and every restarted attempt's workers use
    it as it is; the keys an attempt leaves there (a killed rank's gloo addresses, failure reports)
    would be read by the next attempt, whose ranks then connect to dead ones and fail or hang."""
    import torch.distributed as dist

    store, _, _ = next(dist.rendezvous("env://", rank, processes, timeout=timeout))
    store.set_timeout(timeout)
    _PREFIX[:] = [f"shoal/attempt-{_attempt(store, rank, processes, timeout)}"]
    return dist.PrefixStore(_PREFIX[0], store)


def _attempt(store, rank: int, processes: int, timeout) -> int:
    """A number every process of this attempt agrees on and no earlier attempt of the job used.

    torchrun's restart count is not one: an agent that joins later (a node added or replaced under
    ``--nnodes min:max``) counts from 0 while the others do not, and a restart for a change of
    membership counts nothing. So rank 0 draws the next number from the job's store and serves it
    from a store of its own, which lives no longer than this attempt's rank 0: the address an
    earlier attempt left names a dead server, and the others retry until rank 0 replaces it."""
    import datetime
    import time

    import torch.distributed as dist

    n = store.add("shoal/attempts", 1) if rank == 0 else None
    if processes == 1:
        return n
    deadline = time.monotonic() + timeout.total_seconds()
    if rank == 0:
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        own = dist.TCPStore(host, 0, None, True, timeout, wait_for_workers=False)
        own.set("attempt", str(n))
        store.set("shoal/attempt-at", f"{host}:{own.port}")
        while own.add("read", 0) < processes - 1:  # serve until every other rank has the number
            if time.monotonic() > deadline:
                raise TimeoutError(f"shoal.init: rank 0 waited {timeout} for the other {processes - 1} ranks of "
                                   f"this attempt to start (see SHOAL_TIMEOUT)")
            time.sleep(0.01)
        return n
    while True:
        host, port = store.get("shoal/attempt-at").decode().rsplit(":", 1)
        try:
            own = dist.TCPStore(host, int(port), None, False, datetime.timedelta(seconds=2))
            n = int(own.get("attempt"))
            own.add("read", 1)
            return n
        except (RuntimeError, TimeoutError, ValueError, OSError):  # an earlier attempt's rank 0: gone
            if time.monotonic() > deadline:
                raise TimeoutError(f"shoal.init: rank {rank} found no rank 0 of this attempt at {host}:{port} "
                                   f"within {timeout} (see SHOAL_TIMEOUT)") from None
            time.sleep(0.05)


# where a process that fails reports its error (the rendezvous store), for the others' messages
FAILED_KEY = "shoal/failed/{}"
# a counter each process advances every HEARTBEAT seconds while it lives: a process killed outright
# (SIGKILL, a lost node) reports nothing, and the others name it by its counter standing still
ALIVE_KEY = "shoal/alive/{}"
HEARTBEAT = 0.5
_BEAT: list = []  # the heartbeat's stop event and thread, while one runs
_PREFIX: list = []  # this attempt's store prefix


def _install_failure_report(rank: int) -> None:
    """An uncaught error in this process is written to the rendezvous store, so that the other
    ranks' failing collectives can name this rank."""
    import contextlib
    import sys

    import torch.distributed as dist

    prev = sys.excepthook

    def hook(tp, val, tb):
        with contextlib.suppress(Exception):
            dist.distributed_c10d._get_default_store().set(FAILED_KEY.format(rank), f"{tp.__name__}: {val}"[:500])
        prev(tp, val, tb)

    sys.excepthook = hook
    _start_heartbeat(rank)


def _start_heartbeat(rank: int) -> None:
    import threading

    import torch.distributed as dist

    # a connection of its own: a TCPStore client is not safe to share with the main thread's calls
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port or not _PREFIX or os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") == "0":
        return  # only where a restart follows (with it on, ~1 in 5 runs aborted at exit: not understood yet)
    import datetime

    store = dist.PrefixStore(_PREFIX[0], dist.TCPStore(host, int(port), None, False, datetime.timedelta(seconds=10)))
    stop = threading.Event()

    def beat():
        while not stop.wait(HEARTBEAT):
            try:
                store.add(ALIVE_KEY.format(rank), 1)
            except Exception:  # noqa: BLE001 - the store went with its host: nobody is listening
                return

    t = threading.Thread(target=beat, name="shoal-heartbeat", daemon=True)
    t.start()
    _BEAT[:] = [stop, t]


def shutdown() -> None:
    """Destroy the process groups while the interpreter is whole (registered at exit by
    ``shoal.init``). A group torch still holds lives into interpreter finalization, and its worker
    thread, dropping the last reference to a finished asynchronous collective's tensors there, needs
    the GIL and aborts the process."""
    import gc

    import torch.distributed as dist

    if _BEAT:
        _BEAT[0].set()
        _BEAT[1].join()
        _BEAT.clear()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()  # the groups' last references may sit in cycles: free them (joining their threads) now


def world() -> World:
    """The current world, initialising a default one on first use."""
    if _WORLD is None:
        return init()
    return _WORLD


def is_initialized() -> bool:
    return _WORLD is not None


@contextlib.contextmanager
def meta_world(devices: int, per_process: int | None = None, rank: int = 0):
    """A world of ``devices`` meta devices for the duration (``init(device_type="meta")``), then the
    world before it: a plan for more devices than this machine has, or a model larger than its memory,
    traced as shoal would run it (``auto.census``). ``per_process`` (default all): the world is
    ``devices // per_process`` processes, this one ``rank`` (default the first) and the others absent
    (rank -1: the last, e.g. a pipeline's last stage, which holds the head). Meshes span
    every device, tensors hold shards on this process's alone, and collectives with the absent
    processes move nothing (their results are shapes): one process's devices stand for the others,
    so a plan for 1024 devices is traced by the ops of ``per_process`` of them."""
    per_process = devices if per_process is None else per_process
    if per_process < 1 or devices % per_process:
        raise ValueError(f"meta_world({devices}, per_process={per_process}): the devices must split into "
                         f"processes of equally many; give a per_process that divides {devices}")
    processes = devices // per_process
    if not -processes <= rank < processes:
        raise ValueError(f"meta_world({devices}, per_process={per_process}, rank={rank}): there are {processes} "
                         f"processes; give a rank in 0..{processes - 1} (or -1 for the last)")
    before = _WORLD
    _set(World(processes=processes, devices_per_process=per_process, rank=rank % processes, device_type="meta"))
    try:
        yield _WORLD
    finally:
        _set(before)
