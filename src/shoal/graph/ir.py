"""The IR: a traced step as global values and the physical ops that compute them.

A ``Value`` is a global tensor: (global shape, dtype, mesh, nd-SBP) and the ``Local`` holding its
shard on each device. A ``Node`` is what the user's program did at the global level (an ATen op on
GlobalTensors, a boxing, host work); it owns the ``Op``s that do it: ATen calls on one device's
locals, collectives across devices, host calls. Ops are in program order; state (parameters,
gradients, buffers, optimizer state) is explicit as ``Slot``s read at the start and written at the
end, and in-place writes are explicit in ``Op.writes``. ``str(graph)`` is a readable listing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..sbp import sbp_str
from ..spec import TensorSpec, _itemsize

__all__ = ["Local", "Ref", "Op", "Value", "Node", "Slot", "Graph", "local_ids", "contiguous_strides"]


def contiguous_strides(shape) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(out))


@dataclass(eq=False, slots=True)
class Local:
    """One device's tensor (or the host's, ``device`` None): shape, dtype, strides and which
    storage it views (``base``: the Local that allocated it)."""

    id: int
    device: int | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...]
    base: int
    nbytes: int  # of its own storage when it is a base, else 0

    @property
    def size_bytes(self) -> int:
        """Bytes of its elements (a view's too)."""
        return math.prod(self.shape) * _itemsize(self.dtype)

    @property
    def contiguous(self) -> bool:
        return self.stride == contiguous_strides(self.shape) or math.prod(self.shape) <= 1


@dataclass(frozen=True, slots=True)
class Ref:
    """A Local in an op's arguments."""

    id: int


@dataclass(eq=False, slots=True)
class Op:
    """One physical step. kind: "call" (an ATen op on one device), "host" (an ATen op on the host),
    "comm" (a collective or transfer across devices; ``fn`` is the ``seam.Collective``), "place"
    (a host tensor handed to a device)."""

    kind: str
    fn: object
    args: tuple
    kwargs: dict
    outs: object  # the result's structure with Ref per tensor
    device: int | None
    node: int
    reads: tuple[int, ...] = ()  # Locals read
    writes: tuple[int, ...] = ()  # Locals written in place
    out_ids: tuple[int, ...] = ()  # Locals produced
    devices: tuple[int, ...] = ()  # comm: the devices taking part
    share_out: bool = True  # comm: equal results on several devices may be one tensor (none is written)
    phase: str = "F"  # a pipelined step's part: "F" forward, "B" backward (input gradients), "W" weight gradients
    stage: int | None = None  # a pipelined step's model stage (None: not staged)

    @property
    def random(self) -> bool:
        """It draws from torch's random generator or sets its state (torch tags such ops
        ``nondeterministic_seeded``): the stream must advance, and be set, as in eager."""
        return torch.Tag.nondeterministic_seeded in getattr(self.fn, "tags", ())

    def name(self) -> str:
        if self.kind == "comm":
            return f"comm.{self.fn.name}"
        if self.kind == "place":
            return "place"
        return str(self.fn).removeprefix("aten.")


@dataclass(eq=False, slots=True)
class Value:
    id: int
    spec: TensorSpec
    locals: tuple  # Local id per mesh position (None where another process owns it)
    stride: tuple = ()
    name: str = ""

    def __str__(self) -> str:
        s = self.spec
        dt = str(s.dtype).removeprefix("torch.")
        return f"%{self.name or self.id}: {dt}{list(s.shape)} {sbp_str(s.sbp)}"


@dataclass(eq=False)
class Node:
    id: int
    kind: str  # "op" | "box" | "host" | "local"
    target: str
    parent: int | None
    inputs: list = field(default_factory=list)  # Values
    outputs: list = field(default_factory=list)


@dataclass(eq=False, slots=True)
class Slot:
    """A place state lives: ``owner[key]`` (dict-like) or ``owner.key`` (attribute); for a
    pre-existing GlobalTensor whose storage is updated in place, ``owner`` is the tensor and key None."""

    owner: object
    key: object
    label: str
    before: object  # Value | Local id (host tensor) | None: what the step reads
    after: object = None  # Value | Local id | None: what the step leaves there
    same: bool = False  # the step leaves the very tensor object it found there (written in place)
    kept: bool = False  # ... with the same layout (no Partial), its shards updated in place

    def get(self):
        if self.key is None:
            return self.owner
        if isinstance(self.owner, dict):
            return self.owner.get(self.key)
        return getattr(self.owner, self.key)

    def set(self, v) -> None:
        if isinstance(self.owner, dict):
            self.owner[self.key] = v
        else:
            setattr(self.owner, self.key, v)


@dataclass(eq=False)
class Graph:
    locals: dict = field(default_factory=dict)  # id -> Local
    values: dict = field(default_factory=dict)  # id -> Value
    nodes: list = field(default_factory=list)
    ops: list = field(default_factory=list)
    inputs: list = field(default_factory=list)  # (leaf index, path, Value | Local id) per tensor argument
    slots: list = field(default_factory=list)
    outputs: object = None  # the result's structure: Value / host Local id (as Ref) / constants
    out_refs: list = field(default_factory=list)  # Values and host Refs the result holds
    constants: dict = field(default_factory=dict)  # Local id -> a tensor captured at trace time
    kept: tuple = ()  # the Locals of the kept slots (Slot.kept)
    scalars: list = field(default_factory=list)  # (dict, key, host Local id, dtype): a number read at every call
    globals_read: tuple = ()  # (module globals, names) the user's functions the trace ran read: baked in, guarded
    devices: tuple = ()  # devices with ops, in order
    notes: list = field(default_factory=list)  # what the passes did, for the listing

    def bound(self) -> set:
        """Locals a run has before its first op: arguments, state read, constants, per-call numbers."""
        out = set(self.constants) | {lid for *_, lid, _ in self.scalars}
        for _, _, v in self.inputs:
            out |= set(local_ids(v))
        for s in self.slots:
            out |= set(local_ids(s.before))
        return out

    def unread_state(self) -> set:
        """State Locals no op reads and the step does not leave in place: what it overwrites (a
        gradient a ``zero_grad()`` in the step sets to None), released before the run."""
        read = {x for op in self.ops for x in op.reads}
        out = set()
        for s in self.slots:
            out |= set(local_ids(s.before))
        return out - read - self.returned()

    def returned(self) -> set:
        """Locals the caller gets back: the outputs and the state left behind."""
        out = set()
        for v in self.out_refs:
            out |= set(local_ids(v))
        for s in self.slots:
            out |= set(local_ids(s.after))
        return out

    # -- listing --------------------------------------------------------------------------------
    def __str__(self) -> str:
        lines = ["graph("]
        for _, path, v in self.inputs:
            lines.append(f"  input {path}: {self._describe(v)}")
        for s in self.slots:
            if s.before is not None:
                lines.append(f"  state {s.label}: {self._describe(s.before)}")
        lines.append(") {")
        by_node: dict = {}
        for op in self.ops:
            by_node.setdefault(op.node, []).append(op)
        for node in self.nodes:
            ops = by_node.get(node.id)
            if not ops and node.kind != "op":
                continue
            depth = 1 + (node.parent is not None)
            ind = "  " * depth
            outs = ", ".join(str(v) for v in node.outputs) or "-"
            ins = ", ".join(f"%{v.name or v.id}" for v in node.inputs)
            if node.kind == "op":
                gone = "  # removed by the passes" if not ops else ""
                lines.append(f"{ind}{outs} = {node.target}({ins}){gone}")
            elif node.kind == "box":
                lines.append(f"{ind}box {node.target}: {ins} -> {outs}")
            else:
                lines.append(f"{ind}{node.target}:")
            if not ops:
                continue
            comms = [o for o in ops if o.kind in ("comm", "place")]
            calls = [o for o in ops if o.kind not in ("comm", "place")]
            for o in comms:
                lines.append(f"{ind}  {o.name()} over devices {list(o.devices) or [o.device]}")
            if calls and node.kind != "op":
                names = sorted({o.name() for o in calls})
                lines.append(f"{ind}  local: {', '.join(names)}")
        lines.append("}")
        for s in self.slots:
            if s.after is not None and s.after is not s.before:
                lines.append(f"  state {s.label} <- {self._describe(s.after)}")
        lines.append(f"  returns {self._describe_out(self.outputs)}")
        lines += [f"# {n}" for n in self.notes]
        return "\n".join(lines)

    def _describe(self, v) -> str:
        if isinstance(v, Value):
            return str(v)
        loc = self.locals[v]
        return f"host {str(loc.dtype).removeprefix('torch.')}{list(loc.shape)}"

    def _describe_out(self, o) -> str:
        if isinstance(o, Value):
            return f"%{o.name or o.id}"
        if isinstance(o, Ref):
            return f"host {o.id}"
        if isinstance(o, (list, tuple)):
            return "(" + ", ".join(self._describe_out(e) for e in o) + ")"
        return repr(o)


def local_ids(v) -> tuple[int, ...]:
    """The Locals a Value (this process's shards), a Ref or a host Local id stands for."""
    if isinstance(v, Value):
        return tuple(x for x in v.locals if x is not None)
    if isinstance(v, Ref):
        return (v.id,)
    if isinstance(v, int):
        return (v,)
    return ()
