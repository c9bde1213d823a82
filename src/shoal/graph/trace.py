"""The tracer: run a step once on GlobalTensors whose shards are meta tensors and record the IR.

Eager dispatch runs unchanged (same rules, same boxing choices); a ``TorchDispatchMode`` sees every
ATen op: ops on GlobalTensors become ``Node``s, the ops dispatch then runs on meta shards become
per-device ``Op``s, ops on real plain tensors become host ``Op``s (re-run every step: ``arange``,
random draws). The tracer is the recording side of ``shoal.seam``: conversions between layouts,
collectives and placements of host tensors reach it through the seam and are recorded whole.
Values that would decide Python control flow (``.item()``, ``bool(t)``) are an error naming the
user's line.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from .. import dispatch as _dispatch
from .. import schema
from ..errors import TraceError, library_file, user_line, value_read
from ..sbp import sbp_str
from ..seam import Collective, Execution
from ..tensor import GlobalTensor
from ..world import world
from .ir import Graph, Local, Node, Op, Ref, Value, contiguous_strides

__all__ = ["Tracer", "TraceError", "DEVICE", "value_read", "library_file", "user_line"]

_GT = GlobalTensor
# a device argument of a device op: replaced by that device's torch device when lowered
DEVICE = "<device>"
_DATA_DEPENDENT = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default}


class Tracer(TorchDispatchMode, Execution):
    tracing = True

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
        self.phase = "F"  # what recorded ops are part of in a pipelined step (``Op.phase``)
        self._metas: dict = {}  # (op, its arguments' metadata) -> its outputs' metadata: see _meta_call

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
                raise TraceError(
                    f"shoal.compile: the step reads a GlobalTensor ({spec}) it was not given at\n  {user_line()}\n"
                    "A compiled step sees its arguments and the modules, optimizers and GlobalTensors its "
                    "own code names (globals, closure variables): pass this one (or the module holding "
                    "it) as an argument of the step.")
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

    @contextlib.contextmanager
    def recording_rng(self):
        """``torch.get_rng_state`` / ``torch.set_rng_state`` run for real and recorded as host work,
        in program order with the random draws: a checkpointed module's recomputation in backward
        sets the state its forward drew from, in the run as in the trace."""
        get, put = torch.get_rng_state, torch.set_rng_state

        def get_state():
            state = _get_rng_state()
            lid = self.new_local(state, None)
            self._op(kind="host", fn=_get_rng_state, args=(), kwargs={}, outs=Ref(lid), device=None, reads=(),
                     writes=(), out_ids=(lid,))
            return state

        def set_state(state):
            _set_rng_state(state)
            lid = self.lid(state)
            arg, reads = (Ref(lid), (lid,)) if lid is not None else (state.clone(), ())
            self._op(kind="host", fn=_set_rng_state, args=(arg,), kwargs={}, outs=None, device=None, reads=reads,
                     writes=(), out_ids=())

        torch.get_rng_state, torch.set_rng_state = get_state, set_state
        try:
            yield
        finally:
            torch.get_rng_state, torch.set_rng_state = get, put

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
        op = Op(node=self._current(), phase=self.phase, **kw)
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
        flat, spec = tree_flatten((args, kwargs))
        if any(type(a) is _GT for a in flat):
            return self._global(func, args, kwargs, flat)
        return self._local(func, args, kwargs, flat, spec)

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

    def _local(self, func, args, kwargs, flat, spec):
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        lids = [self.lid(t) for t in tensors]
        if any(lid is None for lid in lids):  # meta tensors made to decide layouts: not part of the step
            if any(lid is not None and self.g.locals[lid].device is not None for lid in lids):
                raise TraceError(f"shoal tracer: {func} mixes traced shards with untraced meta tensors")
            return func(*args, **kwargs)
        devices = {self.g.locals[lid].device for lid in lids} - {None}
        if len(devices) > 1:
            raise TraceError(f"shoal tracer: {func} mixes shards of devices {sorted(devices)}")
        if schema.of(func).mutable:  # host work runs for real: a tensor the step only refers to gets its values back
            for lid in _written(func, args, kwargs, self):
                if lid in self.g.constants and lid not in self._overwritten:
                    self._overwritten[lid] = (self.g.constants[lid], self.g.constants[lid].clone())
        out = self._meta_call(func, args, kwargs, flat, spec) if devices else func(*args, **kwargs)
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

    def _meta_call(self, func, args, kwargs, flat, spec):
        """``func`` on the meta shards of one device. Every device of a mesh runs the same op on shards
        of the same shapes, and a meta kernel's outputs depend on nothing but its arguments' metadata:
        an op that makes new tensors (no view, no write) is run once per distinct call and its outputs
        are made again from their metadata for the other devices (ATen's meta kernels, many written in
        Python, are most of a trace's time)."""
        if not schema.of(func).fresh:
            return func(*args, **kwargs)
        try:
            key = (func, tuple(_meta_key(a) for a in flat), spec)
        except _Unkeyed:
            return func(*args, **kwargs)
        made = self._metas.get(key)
        if made is None:
            out = func(*args, **kwargs)
            self._metas[key] = _remake(*tree_flatten(out))
            return out
        if made is False:
            return func(*args, **kwargs)
        leaves, out_spec = made
        return out_spec.unflatten([torch.empty_strided(a[0], a[1], dtype=a[2], device="meta")
                                   if isinstance(a, tuple) else a for a in leaves])

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

    # -- the seam: what eager execution does, recorded ------------------------------------------
    def box(self, shards, src, dst, run):
        """A conversion between layouts, recorded as a node (its collectives and slicing inside)."""
        ins = [self.value_of(shards, src)]
        with self.node("box", f"{sbp_str(src.sbp)} -> {sbp_str(dst.sbp)}", ins) as n:
            out = run(shards, src, dst)
        n.outputs = [self.value_of(out, dst)]
        return out

    def collective(self, c: Collective, args: tuple):
        """A collective recorded whole: one task over its devices; its outputs (meta tensors) come
        from running it on the meta shards (a meta tensor crosses no process)."""
        if c.start_of is not None:  # traced, a started collective is one task: done when it returns
            res = self.collective(c.start_of, args)
            return lambda: res
        if c.p2p:
            src, dst, t = args[0], args[1], args[2]
            devs, xs = (src, dst), [t]
        else:
            devs, xs = tuple(args[0]), list(args[1])
        in_refs = [None if x is None else Ref(self.lid(x)) for x in xs]
        self._quiet += 1
        try:
            if c.p2p:  # moving meta data: only where it lands matters
                res = self._meta_like(t) if world().owns(dst) and t is not None else None
                if res is None and world().owns(dst):
                    res = torch.empty(args[3], dtype=args[4], device="meta")
            else:
                res = c.run(*args)
        finally:
            self._quiet -= 1
        outs = [res] if c.p2p else list(res)
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
            dev = dst if c.p2p else devs[i]
            out_refs.append(Ref(self.new_local(o, dev)))
            fresh.append(o)
        rest = args[3:] if c.p2p else args[2:]
        self._op(kind="comm", fn=c, args=(devs, in_refs, *rest), kwargs={}, outs=out_refs, device=None,
                 reads=tuple(r.id for r in in_refs if r is not None),
                 out_ids=tuple(r.id for r in out_refs if r is not None), devices=devs)
        return fresh[0] if c.p2p else fresh

    def read_value(self, what: str, value):
        """A value read into Python: a traced value has none (its shards are meta), a constant's is
        what it holds now."""
        if value.device.type == "meta":
            raise value_read(what)
        return value

    def place(self, t: torch.Tensor, mesh, copy: bool, run) -> tuple:
        """A host tensor handed to each local device of ``mesh`` (a copy per device when ``copy``)."""
        out = [None] * mesh.size
        for p in mesh.local_positions:
            out[p] = self._place_one(t, mesh.devices[p], copy)
        return tuple(out)

    def _place_one(self, t: torch.Tensor, device: int, copy: bool) -> torch.Tensor:
        """``t`` on ``device``, strided as eager's: the copy contiguous, else ``t`` itself or what
        ``t.to(device)`` gives."""
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


def _get_rng_state() -> torch.Tensor:
    return torch.random.default_generator.get_state()


def _set_rng_state(state: torch.Tensor) -> None:
    torch.random.default_generator.set_state(state)


# what the passes look for in a random op: the stream must advance (and be set) as in eager
_get_rng_state.tags = _set_rng_state.tags = (torch.Tag.nondeterministic_seeded,)


class _Unkeyed(Exception):
    pass


_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


def _meta_key(a):
    """What a meta kernel's outputs can depend on, of one flat argument."""
    if isinstance(a, torch.Tensor):
        if a.device.type != "meta" or type(a) is not torch.Tensor:
            raise _Unkeyed
        return (a.shape, a.stride(), a.dtype, a.storage_offset())
    if type(a) in _PLAIN:
        return (type(a), a)
    raise _Unkeyed


def _remake(leaves, spec):
    """(per output: its (shape, stride, dtype) or the value itself, the tree) when each tensor output is
    a storage of its own that ``empty_strided`` makes again exactly; else False (not cached)."""
    remade, storages = [], set()
    for o in leaves:
        if not isinstance(o, torch.Tensor):
            if type(o) not in _PLAIN:
                return False
            remade.append(o)
            continue
        if type(o) is not torch.Tensor or o.device.type != "meta" or o.storage_offset() != 0:
            return False
        size = torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device="meta").untyped_storage().nbytes()
        st = o.untyped_storage()
        if st._cdata in storages or st.nbytes() != size:
            return False
        storages.add(st._cdata)
        remade.append((tuple(o.shape), o.stride(), o.dtype))
    return remade, spec


def _written(func, args, kwargs, tr: Tracer) -> list[int]:
    """Locals an ATen op writes in place: the schema's ``a!`` arguments."""
    tensors: list = []
    by_arg = []
    for v in schema.bind(func, args, kwargs).values():
        ts = [t for t in (v if isinstance(v, (list, tuple)) else (v,)) if isinstance(t, torch.Tensor)]
        by_arg.append(tuple(range(len(tensors), len(tensors) + len(ts))))
        tensors += ts
    mutated, _ = schema.mutated(func, by_arg)
    return [lid for i in mutated if (lid := tr.lid(tensors[i])) is not None]

