"""shoal: train on many devices as if they were one.

Global tensors laid out on a mesh of devices by an SBP per mesh axis; every op keeps its
single-device meaning. This module only re-exports the public API.
"""

# ops and torch_patches register the op rules and make shoal's changes to torch; checkpoint is shoal.checkpoint
from . import checkpoint, ops, torch_patches  # noqa: F401
from .comm.counter import CommCounter
from .dispatch import coverage
from .graph.api import CompiledStep, compile
from .mesh import Mesh
from .parallel import (
    Plan,
    Precision,
    data_parallel,
    distribute_module,
    loss_scale,
    memory_per_device,
    memory_report,
    shard_optimizer_state,
)
from .sbp import SBP, B, Broadcast, P, Partial, S, Split
from .spec import TensorSpec
from .tensor import GlobalTensor, from_local, from_local_batch, to_global
from .world import World, init, world

__all__ = [
    "B",
    "Broadcast",
    "CommCounter",
    "CompiledStep",
    "GlobalTensor",
    "Mesh",
    "P",
    "Partial",
    "S",
    "SBP",
    "Split",
    "TensorSpec",
    "World",
    "compile",
    "coverage",
    "Plan",
    "Precision",
    "data_parallel",
    "distribute_module",
    "loss_scale",
    "memory_per_device",
    "memory_report",
    "shard_optimizer_state",
    "from_local",
    "from_local_batch",
    "init",
    "to_global",
    "world",
]
