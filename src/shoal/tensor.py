"""GlobalTensor: a torch.Tensor wrapper subclass holding a global value as shards on a mesh.

Its value is the global value; the layout (``TensorSpec``) only changes cost. Ops reach
``dispatch`` through ``__torch_dispatch__`` below autograd, so gradients need no special code.
Explicit redistribution (``to_global``) and leaving the global world (``full``) are autograd
functions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from . import boxing, comm, debug, seam
from .mesh import Mesh
from .sbp import SBP, Broadcast, Partial, Split, normalize_sbp, reduced, sbp_str
from .spec import TensorSpec
from .world import world

__all__ = ["GlobalTensor", "to_global", "from_local", "from_local_batch"]


class GlobalTensor(torch.Tensor):
    _spec: TensorSpec
    _shards: tuple  # one per mesh position; None where another process owns the device

    @staticmethod
    def _make(spec: TensorSpec, shards: tuple, stride=None, requires_grad: bool = False, device=None) -> GlobalTensor:
        r = torch.Tensor._make_wrapper_subclass(
            GlobalTensor,
            spec.shape,
            strides=stride,
            dtype=spec.dtype,
            device=device or _wrapper_device(),
            requires_grad=requires_grad,
        )
        r._spec = spec
        r._shards = shards
        r._resolved = None
        r._view = None  # aliasing.ViewOf when a view op made it
        r._members = None  # the views whose root it is (aliasing), once it has any
        return r

    def __reduce_ex__(self, protocol):
        """Pickled (torch.save) as its layout, this process's shards and strides."""
        param = getattr(self, "_is_param", False)
        return _unpickle, (self._spec, self._shards, self.stride(), self.requires_grad, param)

    def _set_shards(self, shards, spec: TensorSpec | None = None, resolved=None) -> None:
        """The one way a GlobalTensor's memory or layout changes: ``shards`` (laid out as ``spec``,
        default its own layout) become its shards, or its shards were written in place (``shards``
        are its own); what was derived from the old ones (``_shards_as``'s memo) is dropped, or
        set to ``resolved`` (graph mode putting back what a trace stood in for)."""
        if spec is not None:
            self._spec = spec
        self._shards = tuple(shards)
        self._resolved = resolved

    def _as(self, dst: TensorSpec) -> GlobalTensor:
        """This value laid out as ``dst`` (on another mesh, too), below autograd: no gradient edge."""
        return GlobalTensor._make(dst, self._shards_as(dst), self.stride())

    def _shards_as(self, dst: TensorSpec) -> tuple:
        """This value's shards in layout ``dst`` (boxing if needed).

        Summing Partial shards rounds differently along different boxing paths, so the first
        conversion out of Partial(sum) is remembered and later ones start from it: the same tensor
        never shows two values (``x == x.amax()`` in a backward stays consistent), and is reduced
        once. It is valid while this tensor is not written: writes through it or any autograd-level
        alias bump its version; writes inside dispatch reset it. Its shards are never handed out to be
        written (explicit layout changes copy them).
        """
        src = self._spec
        if src.sbp == dst.sbp and src.mesh == dst.mesh:
            return self._shards
        memo = self._resolved
        if memo is not None and memo[2] == self._version:
            return boxing.box(memo[1], memo[0], dst)
        out = boxing.box(self._shards, src, dst)
        if src.mesh == dst.mesh and _has_sum(src.sbp) and not _has_sum(dst.sbp):
            self._resolved = (dst, out, self._version)
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch_op(func, args, kwargs or {})

    # -- layout -------------------------------------------------------------------------------
    @property
    def spec(self) -> TensorSpec:
        return self._spec

    @property
    def mesh(self) -> Mesh:
        return self._spec.mesh

    @property
    def sbp(self) -> tuple[SBP, ...]:
        return self._spec.sbp

    def __repr__(self, *, tensor_contents=None) -> str:
        grad = ", requires_grad=True" if self.requires_grad else ""
        if self.grad_fn is not None:
            grad = f", grad_fn=<{type(self.grad_fn).__name__}>"
        return (
            f"GlobalTensor(shape={list(self.shape)}, dtype={self.dtype}, mesh={self.mesh}, "
            f"sbp={sbp_str(self.sbp)}{grad})"
        )

    def __format__(self, spec: str) -> str:  # f"{loss:.4f}", as for a plain 0-dim tensor
        if self.dim() == 0:
            return self.item().__format__(spec)
        return object.__format__(self, spec)

    def tolist(self):
        """The global value as (nested) Python numbers (gathered on every process)."""
        return self._host_value("tolist").tolist()

    def numpy(self, *, force: bool = False):
        """The global value as a NumPy array (gathered on every process)."""
        return self._host_value("numpy").numpy(force=force)

    def _host_value(self, what: str) -> torch.Tensor:
        """The global value, read into Python by ``what`` (through the seam: a traced step refuses)."""
        return seam.current().read_value(f"GlobalTensor.{what}()", self.full())

    # -- conversions --------------------------------------------------------------------------
    def to_global(self, mesh: Mesh | None = None, sbp: SBP | Sequence[SBP] | None = None) -> GlobalTensor:
        """The same global value laid out as (mesh, sbp); differentiable. Missing parts stay as they are."""
        mesh = self.mesh if mesh is None else mesh
        if sbp is None:
            if mesh.ndim != self.mesh.ndim:
                raise ValueError(f"to_global: give sbp when moving to a mesh with {mesh.ndim} axes")
            sbp = self.sbp
        dst = TensorSpec(self._spec.shape, self.dtype, mesh, normalize_sbp(sbp, mesh.ndim, self.ndim, "to_global"))
        if dst == self._spec:
            return self
        return _Redistribute.apply(self, dst)

    def full(self) -> torch.Tensor:
        """A plain tensor holding the global value (gathered on every process); differentiable."""
        if self.requires_grad and torch.is_grad_enabled():
            return _ToFull.apply(self)
        return _full_value(self)

    def to_local(self, device: int | None = None):
        """{device id: shard} for this process's devices of the mesh (however many it owns); with
        ``device``, that device's shard."""
        mesh = self.mesh
        if device is not None:
            if device not in mesh.devices:
                raise ValueError(f"to_local: device {device} is not in {mesh}")
            if not world().owns(device):
                raise ValueError(f"to_local: device {device} belongs to another process")
            return self._shards[mesh.devices.index(device)]
        return {mesh.devices[p]: self._shards[p] for p in mesh.local_positions}

    def local_shard(self) -> torch.Tensor:
        """The shard of this process's one device of the mesh (one device per process, as under
        ``torchrun --nproc-per-node N``)."""
        mesh = self.mesh
        pos = mesh.local_positions
        if len(pos) != 1:
            mine = [mesh.devices[p] for p in pos]
            raise ValueError(
                f"local_shard: process {world().rank} owns {len(mine)} devices of {mesh} ({mine}), not one; "
                "use to_local() for {device: shard}, or to_local(device) for one device's shard"
            )
        return self._shards[pos[0]]




def _not_installed(func, args, kwargs):
    raise RuntimeError(f"shoal: {func} on a GlobalTensor before shoal.dispatch is imported (import shoal)")


_dispatch_op = _not_installed  # what runs every ATen op on GlobalTensors: shoal.dispatch installs itself


def install_dispatch(fn) -> None:
    """Make ``fn(func, args, kwargs)`` run every ATen op on GlobalTensors (``shoal.dispatch``, at import)."""
    global _dispatch_op
    _dispatch_op = fn
_DEVICE: dict = {}


def _wrapper_device() -> torch.device:
    w = world()
    d = _DEVICE.get(w)
    if d is None:  # a meta world's host is the CPU: what a step makes on ``x.device`` is host work
        d = _DEVICE[w] = torch.device("cpu") if w.device_type == "meta" else w.torch_device(w.local_devices[0])
    return d


def _storages(shards) -> set:
    # the storage itself, not its data pointer: meta shards (a trace's) all point at 0
    return {t.untyped_storage()._cdata for t in shards if t is not None}


def _unaliased(out: tuple, *sources: tuple) -> tuple:
    """``out`` with every shard that shares memory with ``sources`` copied: explicit layout changes
    return tensors of their own, whichever collectives (or none) produced them."""
    taken = set()
    for src in sources:
        taken |= _storages(src)
    res, seen = [], set()
    for t in out:
        if t is not None:
            if t.untyped_storage()._cdata in taken and id(t) not in seen:
                t = t.clone()
            seen.add(id(t))
        res.append(t)
    return tuple(res)


def _has_sum(sbp) -> bool:
    return any(isinstance(s, Partial) and s.op == "sum" for s in sbp)


def _box(x: GlobalTensor, dst: TensorSpec) -> GlobalTensor:
    """x laid out as ``dst``, sharing no memory with x (or x's remembered Partial resolution)."""
    out = x._shards_as(dst)
    memo = x._resolved
    out = _unaliased(out, x._shards, *(() if memo is None else (memo[1],)))
    return GlobalTensor._make(dst, out)


def onto_mesh_of(x: GlobalTensor, like: GlobalTensor) -> GlobalTensor:
    """``x``'s value on ``like``'s mesh, in ``like``'s layout where the shapes match, else Broadcast
    (a value saved under another plan, loaded into a tensor of this one); not differentiable."""
    mesh = like.mesh
    sbp = like.sbp if x.shape == like.shape else (Broadcast(),) * mesh.ndim
    return _box(x, TensorSpec(x._spec.shape, x.dtype, mesh, sbp))


def _grad_spec(spec: TensorSpec) -> TensorSpec:
    """The layout a gradient returns in: the input's, with Partial turned into Broadcast."""
    return spec.with_sbp(reduced(spec.sbp))


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: GlobalTensor, dst: TensorSpec):
        ctx.src = x._spec
        return _box(x, dst)

    @staticmethod
    def backward(ctx, g: GlobalTensor):
        return _to_spec(g, _grad_spec(ctx.src)), None


def _to_spec(g, spec: TensorSpec) -> GlobalTensor:
    if not isinstance(g, GlobalTensor):
        return _scatter_full(g, spec)
    if g._spec == spec:
        return g
    if g.shape != spec.shape or g.dtype != spec.dtype:
        raise AssertionError(f"gradient {g._spec} does not match {spec}")
    return _box(g, spec)


def _full_value(x: GlobalTensor) -> torch.Tensor:
    rep = x._spec.with_sbp((Broadcast(),) * x.mesh.ndim)
    shards = x._shards_as(rep)
    mesh = x.mesh
    w = world()
    if w.processes == 1:
        return shards[mesh.local_positions[0]].clone()
    # every process gets the value, those outside the mesh too: one broadcast from its first device
    src = w.process_of(mesh.devices[0])
    mine = shards[0].clone() if w.rank == src else None
    return comm.broadcast_all(mine, src, x.shape, x.dtype, w.torch_device(w.local_devices[0]))


class _ToFull(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: GlobalTensor):
        ctx.spec = x._spec
        return _full_value(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _scatter_full(g, _grad_spec(ctx.spec))


class _FromFull(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, spec: TensorSpec):
        return _scatter_full(t.detach(), spec)

    @staticmethod
    def backward(ctx, g: GlobalTensor):
        return g.full() if isinstance(g, GlobalTensor) else g, None


def _scatter_full(t: torch.Tensor, spec: TensorSpec) -> GlobalTensor:
    """A GlobalTensor laid out as ``spec`` from a plain tensor holding the global value.

    Every process must pass the same value. The value is copied once per torch device, into
    contiguous memory (the GlobalTensor's strides are contiguous, ``t``'s need not be: a slice, a
    transpose).
    """
    rep = spec.with_sbp((Broadcast(),) * spec.mesh.ndim)
    return GlobalTensor._make(spec, boxing.box(comm.place(t, spec.mesh, copy=True), rep, spec))


def to_global(
    tensor: torch.Tensor, mesh: Mesh, sbp: SBP | Sequence[SBP], *, requires_grad: bool | None = None
) -> GlobalTensor:
    """A GlobalTensor from a full tensor (every process passes the same value) or from a GlobalTensor.

    ``sbp`` is one SBP for a 1-D mesh or one per mesh axis. Differentiable with respect to ``tensor``.
    """
    if isinstance(tensor, GlobalTensor):
        return tensor.to_global(mesh, sbp)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"to_global: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise TypeError(f"to_global: shoal lays out strided (dense) tensors only, got a {tensor.layout} tensor; "
                        f"use tensor.to_dense() first")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"to_global: mesh must be a shoal.Mesh, got {type(mesh).__name__}")
    spec = TensorSpec(tuple(tensor.shape), tensor.dtype, mesh, normalize_sbp(sbp, mesh.ndim, tensor.ndim, "to_global"))
    if debug.ENABLED and world().processes > 1:
        debug.check_same_value("to_global", tensor)
    if tensor.requires_grad:
        out = _FromFull.apply(tensor, spec)
    else:
        out = _scatter_full(tensor, spec)
    if requires_grad is not None:
        out.requires_grad_(requires_grad)
    return out


def from_local(
    shards: Mapping[int, torch.Tensor],
    mesh: Mesh,
    sbp: SBP | Sequence[SBP],
    shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
) -> GlobalTensor:
    """A GlobalTensor from the shards of this process's devices ({device id: tensor}); no copies but
    of a shard strided neither contiguously nor as its region of a contiguous global tensor (a slice
    of something wider, a transpose): it is copied into contiguous memory, as the GlobalTensor's
    strides are contiguous.

    ``shape`` is the global shape; without it, it is inferred from the shards (all devices must be
    local then). Shard shapes must match the balanced layout of that shape. A process that owns no
    device of the mesh passes no shards, and ``shape`` and ``dtype``.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"from_local: mesh must be a shoal.Mesh, got {type(mesh).__name__}")
    w = world()
    for d in shards:
        w.check(d)
        if d not in mesh.devices:
            raise ValueError(f"from_local: device {d} is not in {mesh}")
        if not w.owns(d):
            raise ValueError(f"from_local: device {d} belongs to process {w.process_of(d)}, not this one")
    missing = [mesh.devices[p] for p in mesh.local_positions if mesh.devices[p] not in shards]
    if missing:
        raise ValueError(f"from_local: no shard given for local device(s) {missing} of {mesh}")
    some = next(iter(shards.values()), None)
    if some is None and (shape is None or dtype is None):
        raise ValueError(f"from_local: this process owns no device of {mesh}; pass shape= and dtype=")
    nd = normalize_sbp(sbp, mesh.ndim, len(shape) if some is None else some.ndim, "from_local")
    if shape is None:
        if not mesh.is_fully_local:
            raise ValueError("from_local: pass shape= when some devices of the mesh belong to other processes")
        shape = _infer_shape(shards, mesh, nd)
    spec = TensorSpec(tuple(shape), some.dtype if dtype is None else dtype, mesh, nd)
    out = [None] * mesh.size
    region_strides = torch.empty(spec.shape, device="meta").stride()  # a region of the contiguous global tensor
    for p in mesh.local_positions:
        t = shards[mesh.devices[p]]
        if tuple(t.shape) != spec.local_shape(p) or t.dtype != spec.dtype:
            raise ValueError(
                f"from_local: the shard of device {mesh.devices[p]} has shape {list(t.shape)} ({t.dtype}); "
                f"global shape {list(shape)} with sbp {sbp_str(nd)} needs {list(spec.local_shape(p))} "
                f"({spec.dtype}) there"
            )
        out[p] = t if t.is_contiguous() or t.stride() == region_strides else t.contiguous()
    if debug.ENABLED and w.processes > 1:
        debug.check_pieces("from_local", spec, tuple(out))
    return GlobalTensor._make(spec, tuple(out))


def _infer_shape(shards: Mapping[int, torch.Tensor], mesh: Mesh, sbp) -> tuple[int, ...]:
    first = shards[mesh.devices[0]]
    shape = list(first.shape)
    for d in range(len(shape)):
        axes = [a for a, s in enumerate(sbp) if s == Split(d)]
        if not axes:
            continue
        total = 0
        for dev, c in zip(mesh.devices, mesh.coords):
            if all(c[a] == 0 for a in range(mesh.ndim) if a not in axes):
                total += shards[dev].shape[d]
        shape[d] = total
    return tuple(shape)


def from_local_batch(
    t: torch.Tensor,
    mesh: Mesh,
    sbp: SBP | Sequence[SBP] | None = None,
    *,
    dim: int = 0,
    global_size: int | None = None,
) -> GlobalTensor:
    """One GlobalTensor from the part of a batch each process loaded (the data-loader helper).

    Every process passes the rows (along ``dim``) that its devices of ``mesh`` hold under ``sbp``
    (default: ``S(dim)`` on every axis of a 1-D mesh), i.e. a contiguous range of the global batch,
    complete in the other dims. ``global_size`` is the global length of ``dim``; on a 1-D mesh it is
    the sum of what the processes pass (found with one collective). Raises if a process's rows do
    not match the balanced layout of the global batch.
    """
    w = world()
    dim = dim % t.ndim
    if sbp is None:
        if mesh.ndim != 1:
            raise ValueError("from_local_batch: give sbp for a mesh with more than one axis")
        sbp = Split(dim)
    nd = normalize_sbp(sbp, mesh.ndim, t.ndim, "from_local_batch")
    if global_size is None:
        if mesh.ndim != 1:
            raise ValueError("from_local_batch: give global_size for a mesh with more than one axis")
        sizes = [t.shape[dim]]
        if w.processes > 1:
            import torch.distributed as dist

            sizes = [None] * w.processes
            dist.all_gather_object(sizes, t.shape[dim] if mesh.local_positions else 0)
        global_size = sum(sizes)
    shape = list(t.shape)
    shape[dim] = global_size
    spec = TensorSpec(tuple(shape), t.dtype, mesh, nd)
    pos = mesh.local_positions
    shards: dict[int, torch.Tensor] = {}
    if pos:
        base = min(spec.local_offset(p)[dim] for p in pos)
        end = max(spec.local_offset(p)[dim] + spec.local_shape(p)[dim] for p in pos)
        if end - base != t.shape[dim]:
            raise ValueError(
                f"from_local_batch: this process (rank {w.rank}) passed {t.shape[dim]} rows along dim {dim}, but "
                f"its devices hold rows {base}..{end - 1} of the global {global_size} under {sbp_str(nd)}; "
                f"give each process the rows of its devices (equal sizes work when they divide evenly)"
            )
        for p in pos:
            region = list(spec.local_region(p))
            region[dim] = slice(region[dim].start - base, region[dim].stop - base)
            shards[mesh.devices[p]] = t[tuple(region)].to(w.torch_device(mesh.devices[p]))
    return from_local(shards, mesh, nd, shape=tuple(shape), dtype=t.dtype)


def _unpickle(spec: TensorSpec, shards: tuple, stride, requires_grad: bool, param: bool = False) -> GlobalTensor:
    t = GlobalTensor._make(spec, tuple(shards), stride, requires_grad)
    if param:  # an nn.Parameter (a subclass's parameter is the subclass, flagged)
        t._is_param = True
    return t


# torch.load's default unpickler (weights_only) builds only what it is told is safe: a saved state dict
# of GlobalTensors (model or optimizer) holds these
torch.serialization.add_safe_globals([_unpickle, TensorSpec, Mesh, Split, Broadcast, Partial])
