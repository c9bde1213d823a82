"""The tracer: run a step once on GlobalTensors whose shards are meta tensors and record the IR.

Eager dispatch runs unchanged (same rules, same boxing choices); a ``TorchDispatchMode`` sees every
ATen op: ops on GlobalTensors become ``Node``s, the ops dispatch then runs on meta shards become
per-device ``Op``s, ops on real plain tensors become host ``Op``s (re-run every step: ``arange``,
random draws), collectives are recorded whole. Values that would decide Python control flow
(``.item()``, ``bool(t)``) are an error naming the user's line.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from .. import boxing, comm
from .. import dispatch as _dispatch
from .. import tensor as _tensor
from ..comm import dist as _dist
from ..sbp import sbp_str
from ..tensor import GlobalTensor
from ..world import world
from .ir import Graph, Local, Node, Op, Ref, Value, contiguous_strides

__all__ = ["Tracer", "TraceError", "DEVICE", "value_read", "library_file", "user_line"]

_GT = GlobalTensor
# code that is not the user's: shoal, torch, the standard library (and installed packages, below)
_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in (os.path.dirname(__file__), torch.__file__,
                                                                               os.__file__))
# a device argument of a device op: replaced by that device's torch device when lowered
DEVICE = "<device>"
_DATA_DEPENDENT = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default}
_COMM_FNS = ("all_gather", "all_reduce", "all_reduce_start", "reduce_scatter", "all_to_all", "transfer")


# frames between a reading library function and the tracer: not worth naming
_PLUMBING = ("/shoal/graph/", "/shoal/dispatch.py", "/shoal/tensor.py", "/shoal/aliasing.py", "/_python_dispatch.py",
             "/_ops.py", "/_dynamo/", "/_compile.py")
# shoal's code written with shoal as a user's would be: named where no user's frame is on the stack
_SHIPPED = tuple(_LIBRARY_DIRS[0] + p for p in ("models" + os.sep, "train.py", "demo.py"))


class TraceError(RuntimeError):
    pass


def value_read(what: str) -> TraceError:
    """The error for reading a traced tensor's value into Python (by ``what``), naming the user's line."""
    return TraceError(
        f"shoal.compile: {what} reads a tensor's value into Python (.item(), bool(t), .tolist(), .numpy(), "
        f"torch.equal) at\n  {user_line()}\nA compiled step cannot branch on tensor values: compute it "
        f"with tensor ops (torch.where), or return the tensor and read it outside the compiled function."
    )


def library_file(filename: str) -> bool:
    """Whether code in ``filename`` is a library's (shoal, torch, the standard library, an installed
    package), not the user's."""
    f = os.path.abspath(filename)
    return f.startswith(_LIBRARY_DIRS) or f"{os.sep}site-packages{os.sep}" in f or f"{os.sep}dist-packages{os.sep}" in f


def user_line(frames=None) -> str:
    """The innermost frame of the user's code in ``frames`` (a ``traceback.StackSummary``; default:
    the current stack), as 'file:line: code', and the library function below it that did the
    reading, if any. Without a user's frame (``shoal train``): the innermost frame of code written
    with shoal that ships as a library (shoal's models and training loop, an installed package)."""
    inner = shipped = None
    for fr in reversed(traceback.extract_stack() if frames is None else frames):
        f = os.path.abspath(fr.filename)
        if library_file(f):
            if not any(s in f for s in _PLUMBING):
                inner = inner or fr
                if shipped is None and (f.startswith(_SHIPPED) or not f.startswith(_LIBRARY_DIRS)):
                    shipped = fr
            continue
        return _where(fr, inner)
    return "<unknown>" if shipped is None else _where(shipped, None if inner is shipped else inner)


def _where(fr, inner) -> str:
    via = f"\n  (in {inner.filename}:{inner.lineno} {inner.name})" if inner is not None else ""
    return f"{fr.filename}:{fr.lineno}: {fr.line}{via}"


class Tracer(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.g = Graph()
        self._lid: dict[int, int] = {}  # id(tensor) -> Local id
        self._keep: list = []  # every tensor seen: ids stay unique while tracing
        self._base_of: dict[int, int] = {}  # storage key -> base Local id
        self._values: dict = {}  # (locals, spec) -> Value
        self._stack: list[int] = []  # open nodes
        self._quiet = 0  # >0: inside a collective (recorded whole)
        self._floating: dict[int, list] = {}  # storage -> device ops made without device inputs, device not known yet
        self._next = 0
        self._overwritten: dict[int, tuple] = {}  # constant Local -> (the tensor, its values before the trace wrote it)
        self.code_seen: dict = {}  # code object -> its globals: every Python function on the stack of an op
        self.outer = None  # the frame that runs the step: the walk up the stack stops there

    # -- Locals and Values ----------------------------------------------------------------------
    def _new_id(self) -> int:
        self._next += 1
        return self._next

    def new_local(self, t: torch.Tensor, device: int | None) -> int:
        key = (t.device.type, t.untyped_storage()._cdata)
        base = self._base_of.get(key)
        lid = self._new_id()
        own = base is None
        if own:
            base = self._base_of[key] = lid
        nbytes = t.untyped_storage().nbytes() if own else 0
        self.g.locals[lid] = Local(lid, device, tuple(t.shape), t.dtype, tuple(t.stride()), base, nbytes)
        self._lid[id(t)] = lid
        self._keep.append(t)
        return lid

    def lid(self, t: torch.Tensor) -> int | None:
        """The Local of ``t``; a real tensor never seen is a constant (captured as it is)."""
        lid = self._lid.get(id(t))
        if lid is None and t.device.type != "meta":
            lid = self.new_local(t, None)
            self.g.constants[lid] = t
        return lid

    def value(self, t: GlobalTensor, spec=None) -> Value:
        return self.value_of(t._shards, spec or t._spec, tuple(t.stride()))

    def value_of(self, shards, spec, stride=None) -> Value:
        lids = []
        for s in shards:
            if s is None:
                lids.append(None)
                continue
            lid = self._lid.get(id(s))
            if lid is None:
                raise TraceError(f"shoal tracer: a shard of a {spec} value was made outside the trace")
            lids.append(lid)
        key = (tuple(lids), spec)
        v = self._values.get(key)
        if v is None:
            if stride is None:
                stride = contiguous_strides(spec.shape)  # a boxing result: fresh and contiguous
            v = self._values[key] = Value(self._new_id(), spec, tuple(lids), stride)
            self.g.values[v.id] = v
        return v

    def meta_input(self, spec, shards: tuple, stride) -> tuple:
        """Meta stand-ins for real shards, one Local each, on their devices."""
        out = []
        for p, s in enumerate(shards):
            if s is None:
                out.append(None)
                continue
            m = self._meta_like(s)
            self.new_local(m, spec.mesh.devices[p])
            out.append(m)
        return tuple(out)

    def _meta_like(self, t: torch.Tensor) -> torch.Tensor:
        self._quiet += 1  # the tracer's own tensors are not part of the step
        try:
            return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta")
        finally:
            self._quiet -= 1

    def host_input(self, t: torch.Tensor) -> int:
        return self.new_local(t, None)

    # -- nodes ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def node(self, kind: str, target: str, inputs: list):
        n = Node(self._new_id(), kind, target, self._stack[-1] if self._stack else None, inputs)
        self.g.nodes.append(n)
        self._stack.append(n.id)
        try:
            yield n
        finally:
            self._stack.pop()

    def _current(self) -> int:
        if self._stack:
            return self._stack[-1]
        last = self.g.nodes[-1] if self.g.nodes else None
        if last is None or last.kind != "local":  # plain-tensor work between GlobalTensor ops (hooks, reducers)
            last = Node(self._new_id(), "local", "plain-tensor work", None)
            self.g.nodes.append(last)
        return last.id

    def _op(self, **kw) -> Op:
        op = Op(node=self._current(), **kw)
        self.g.ops.append(op)
        return op

    # -- the mode -------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._quiet or func.namespace == "profiler":
            return func(*args, **kwargs)
        seen, f, outer = self.code_seen, sys._getframe(1), self.outer
        while f is not None and f is not outer:  # the functions whose Python values this op's graph bakes in
            seen.setdefault(f.f_code, f.f_globals)
            f = f.f_back
        flat, _ = tree_flatten((args, kwargs))
        if any(type(a) is _GT for a in flat):
            return self._global(func, args, kwargs, flat)
        return self._local(func, args, kwargs, flat)

    def _global(self, func, args, kwargs, flat):
        if func in _DATA_DEPENDENT:
            raise value_read(str(func))
        ins = [self.value(a) for a in flat if type(a) is _GT]
        target = str(func).removeprefix("aten.")
        with self.node("op", target, ins) as n, self:
            out = _dispatch.dispatch(func, args, kwargs)
        outs, _ = tree_flatten(out)
        n.outputs = [self.value(o) for o in outs if type(o) is _GT]
        return out

    def _local(self, func, args, kwargs, flat):
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        lids = [self.lid(t) for t in tensors]
        if any(lid is None for lid in lids):  # meta tensors made to decide layouts: not part of the step
            if any(lid is not None and self.g.locals[lid].device is not None for lid in lids):
                raise TraceError(f"shoal tracer: {func} mixes traced shards with untraced meta tensors")
            return func(*args, **kwargs)
        devices = {self.g.locals[lid].device for lid in lids} - {None}
        if len(devices) > 1:
            raise TraceError(f"shoal tracer: {func} mixes shards of devices {sorted(devices)}")
        if func._schema.is_mutable:  # host work runs for real: a tensor the step only refers to gets its values back
            for lid in _written(func, args, kwargs, self):
                if lid in self.g.constants and lid not in self._overwritten:
                    self._overwritten[lid] = (self.g.constants[lid], self.g.constants[lid].clone())
        out = func(*args, **kwargs)
        if devices:
            device = devices.pop()
            for lid in lids:
                self._settle(lid, device)
            return self._record(func, args, kwargs, out, "call", device)
        outs, _ = tree_flatten(out)
        meta_in = any(t.device.type == "meta" for t in tensors)
        meta_out = any(isinstance(o, torch.Tensor) and o.device.type == "meta" for o in outs)
        if meta_in or (not tensors and meta_out):  # device work whose device its first user decides
            return self._record(func, args, kwargs, out, "call", None, floating=True)
        return self._record(func, args, kwargs, out, "host", None)

    def _settle(self, lid: int, device) -> None:
        """Device work made without device inputs lives on the device of its first user."""
        ops = self._floating.pop(self.g.locals[lid].base, None)
        for op in ops or ():
            op.device = device
            for o in op.out_ids:
                self.g.locals[o].device = device
            for r in (*op.reads, *op.out_ids):
                self._settle(r, device)

    def restore(self) -> None:
        """Tensors the step refers to (globals, attributes) as they were before the trace wrote them."""
        for t, before in self._overwritten.values():
            with torch.no_grad():
                t.copy_(before)
        self._overwritten.clear()

    def unsettled(self) -> set:
        """Ops that only helped decide layouts (their results reached no device)."""
        return {id(op) for ops in self._floating.values() for op in ops}

    def _record(self, func, args, kwargs, out, kind: str, device, floating: bool = False):
        reads = []

        def ref(a):
            if isinstance(a, torch.Tensor):
                lid = self.lid(a)
                reads.append(lid)
                return Ref(lid)
            if isinstance(a, torch.device) and a.type == "meta":
                return DEVICE
            return a

        rargs = tree_map(ref, tuple(args))
        rkwargs = tree_map(ref, dict(kwargs))
        writes = _written(func, args, kwargs, self)
        out_ids = []
        known = {id(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}

        def mark(o):
            if isinstance(o, torch.Tensor):
                if id(o) not in known:
                    lid = self.new_local(o, device)
                    out_ids.append(lid)
                    return Ref(lid)
                return Ref(self._lid[id(o)])
            return o

        outs = tree_map(mark, out)
        op = self._op(kind=kind, fn=func, args=rargs, kwargs=rkwargs, outs=outs, device=device, reads=tuple(reads),
                      writes=tuple(writes), out_ids=tuple(out_ids))
        if floating:
            for lid in {self.g.locals[x].base for x in (*out_ids, *writes)}:
                self._floating.setdefault(lid, []).append(op)
        return out

    # -- shoal internals seen whole -------------------------------------------------------------
    def box(self, shards, src, dst):
        """boxing.box, recorded as a node (its collectives and local slicing inside)."""
        if src == dst or (src.mesh == dst.mesh and src.sbp == dst.sbp):
            return shards
        ins = [self.value_of(shards, src)]
        with self.node("box", f"{sbp_str(src.sbp)} -> {sbp_str(dst.sbp)}", ins) as n:
            out = self._orig["box"](shards, src, dst)
        n.outputs = [self.value_of(out, dst)]
        return out

    def comm(self, name: str, *args):
        if name == "all_reduce_start":  # traced, the reduction is one task: done when it returns
            res = self.comm("all_reduce", *args)
            return lambda: res
        fn = self._orig[name]
        if name == "transfer":
            src, dst, t = args[0], args[1], args[2]
            devs, xs = (src, dst), [t]
        else:
            devs, xs = tuple(args[0]), list(args[1])
        in_refs = [None if x is None else Ref(self.lid(x)) for x in xs]
        self._quiet += 1
        try:
            if name == "transfer":  # moving meta data: only where it lands matters
                res = self._meta_like(t) if world().owns(dst) and t is not None else None
                if res is None and world().owns(dst):
                    res = torch.empty(args[3], dtype=args[4], device="meta")
            else:
                res = fn(*args)
        finally:
            self._quiet -= 1
        outs = [res] if name == "transfer" else list(res)
        if all(o is x for o, x in zip(outs, xs)):  # a group of one device: nothing moves
            return res
        seen, out_refs, fresh = set(), [], []
        for i, o in enumerate(outs):
            if o is None:
                out_refs.append(None)
                fresh.append(None)
                continue
            if id(o) in seen or id(o) in {id(x) for x in xs if x is not None}:
                o = self._meta_like(o)
            seen.add(id(o))
            dev = dst if name == "transfer" else devs[i]
            out_refs.append(Ref(self.new_local(o, dev)))
            fresh.append(o)
        rest = args[3:] if name == "transfer" else args[2:]
        self._op(kind="comm", fn=fn, args=(devs, in_refs, *rest), kwargs={}, outs=out_refs, device=None,
                 reads=tuple(r.id for r in in_refs if r is not None),
                 out_ids=tuple(r.id for r in out_refs if r is not None), devices=devs)
        return fresh[0] if name == "transfer" else fresh

    def place(self, t: torch.Tensor, device: int, copy: bool) -> torch.Tensor:
        """A host tensor handed to ``device`` (a copy per device when ``copy``), strided as eager's:
        the copy contiguous (``_scatter_full``), else ``t`` itself or what ``t.to(device)`` gives."""
        lid = self.lid(t)
        if lid is None or self.g.locals[lid].device is not None:
            if lid is not None and self.g.locals[lid].device == device:
                return t
            raise TraceError(
                "shoal.compile: a plain tensor computed from a GlobalTensor's shard (x.full(), x.to_local()) "
                f"was used again as a global value at\n  {user_line()}\nKeep the computation on GlobalTensors."
            )
        m = self._meta_like(t)
        if copy or t.device != world().torch_device(device):
            self._quiet += 1
            try:
                m = m.to(memory_format=torch.contiguous_format, copy=True) if copy else torch.empty_like(m)
            finally:
                self._quiet -= 1
        out = self.new_local(m, device)
        self._op(kind="place", fn=copy, args=(Ref(lid),), kwargs={}, outs=Ref(out), device=device, reads=(lid,),
                 out_ids=(out,))
        return m

    def _plain_shards(self, t, mesh) -> tuple:
        out = [None] * mesh.size
        for p in mesh.local_positions:
            out[p] = self.place(t, mesh.devices[p], copy=False)
        return tuple(out)

    def _scatter_full(self, t, spec):
        mesh = spec.mesh
        shards = [None] * mesh.size
        for p in mesh.local_positions:
            shards[p] = self.place(t, mesh.devices[p], copy=True)
        rep = spec.with_sbp(tuple(_tensor.Broadcast() for _ in range(mesh.ndim)))
        return GlobalTensor._make(spec, boxing.box(tuple(shards), rep, spec))

    @contextlib.contextmanager
    def patched(self):
        """Route shoal's boxing, collectives and host-to-device placement through the tracer."""
        import functools

        self._orig = {"box": boxing.box, "_plain_shards": _dispatch._plain_shards,
                      "_scatter_full": _tensor._scatter_full}
        patches = [(boxing, "box", self.box), (_dispatch, "_plain_shards", self._plain_shards),
                   (_tensor, "_scatter_full", self._scatter_full)]
        for name in _COMM_FNS:
            self._orig[name] = getattr(comm, name)
            patches.append((comm, name, functools.partial(self.comm, name)))
        for name in ("all_reduce", "all_reduce_async", "wait", "send", "recv", "broadcast"):
            patches.append((_dist, name, _no_dist))
        patches.append((_dist, "gather_along", lambda full, *a: full))
        saved = [(m, n, getattr(m, n)) for m, n, _ in patches]
        for m, n, f in patches:
            setattr(m, n, f)
        try:
            yield
        finally:
            for m, n, f in saved:
                setattr(m, n, f)


def _no_dist(*args, **kwargs):
    return None


def _written(func, args, kwargs, tr: Tracer) -> list[int]:
    """Locals an ATen op writes in place: the schema's ``a!`` arguments, read by dispatch's reader."""
    tensors: list = []
    by_arg = []
    for i, a in enumerate(func._schema.arguments):
        v = args[i] if i < len(args) else kwargs.get(a.name)
        ts = [t for t in (v if isinstance(v, (list, tuple)) else (v,)) if isinstance(t, torch.Tensor)]
        by_arg.append(tuple(range(len(tensors), len(tensors) + len(ts))))
        tensors += ts
    mutated, _ = _dispatch._aliases(func, by_arg)
    return [lid for i in mutated if (lid := tr.lid(tensors[i])) is not None]

