"""Per-op layouts by an integer program: a layout (nd-SBP) for every parameter, and thereby every op.

``solve(module, args, cluster, mesh_shape)`` traces one forward + backward of ``module`` on meta
tensors (every ATen op, as dispatch sees them, with ``profile``'s FLOPs and bytes), asks the rule
registry for each op's exact signatures (``dispatch.signatures``: the rules dispatch decides with)
and picks one signature per op and one layout per parameter by a mixed-integer linear program
(``scipy.optimize.milp``):

- a binary per (op, signature) and per (parameter, layout); one of each is chosen;
- compute: the op's time on one device (``simulate``'s per-op model), cut by the size of each mesh
  axis on which the signature splits a tensor;
- communication: from a value's layout to each consumer's input layout, the boxing planner's steps
  (``boxing.planner.plan``: the path dispatch runs) priced by the cluster's alpha-beta collectives.
  An edge whose two ends both vary gets continuous w[s, t] >= 0 whose sums over t and over s are the
  producer's and the consumer's one-hot choices (the usual linearisation of their product, exact at
  integer points); an edge with one fixed end is linear in the other;
- each parameter's gradient is boxed to the parameter's layout; its optimizer update costs the
  bytes of its shard (``simulate``'s Adam model), and the states of all shards must fit in memory.

``Layouts`` holds the choice (``params``, ``plan()``: a ``shoal.Plan``), the predicted seconds by
kind, and the solve time. ``fixed=`` prices a given parameter layout (Megatron's: ``megatron``)
with the same program, the ops' signatures left free: the two are comparable.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ..boxing.planner import level_bytes
from ..boxing.planner import plan as box_plan
from ..dispatch.decide import _DECOMPOSING, Input, _decomposition, decide, signatures
from ..dispatch.key import _template
from ..mesh import Mesh
from ..models import gpt
from ..ops.registry import lookup
from ..parallel import Plan
from ..sbp import Broadcast, NdSBP, Split, normalize_sbp, sbp_str
from ..spec import TensorSpec
from ..world import is_initialized, world
from .cluster import Cluster
from .profile import OpCost, _layout, _Ops, gpt_config
from .simulate import _STATES, _UPDATE, DTYPES, _op_seconds

__all__ = ["Layouts", "Graph", "trace", "solve", "megatron", "gpt_layouts", "box_seconds"]

_B = Broadcast()
_KINDS = ("compute", "communication", "optimizer")
_FREE = ("slice", "keep_one", "relabel")  # boxing steps that move no data


@dataclass(frozen=True, slots=True)
class _Op:
    """One traced ATen op: value ids in and out, its exact signatures, its FLOPs and bytes."""

    name: str
    func: torch._ops.OpOverload
    args: tuple  # the call's arguments, meta tensors: what ``decide`` is asked with when replayed
    kwargs: dict
    ins: tuple[int, ...]
    outs: tuple[int, ...]
    sigs: tuple[tuple[tuple[NdSBP, ...], tuple[NdSBP, ...]], ...]
    cost: OpCost | None  # None: moves no data (a view, an allocation)


@dataclass
class Graph:
    """A traced step: ``shapes`` per value id; ``ops`` in order; ``fixed``: the layouts of values
    no op makes (inputs, constants: plain tensors are Broadcast); ``params``/``grads``: parameter
    name -> the value id of the parameter and of its gradient."""

    mesh_shape: tuple[int, ...]
    shapes: list[tuple[int, ...]]
    ops: list[_Op]
    fixed: dict[int, NdSBP]
    params: dict[str, int]
    grads: dict[str, int]
    args: list[int]  # the values of the module's tensor arguments


class _Recorder(_Ops):
    """``profile``'s op recorder (FLOPs and bytes per op), keeping every op's arguments and outputs."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__({"stack": [""], "where": "", "backward": False}, dtype)
        self.calls: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        n = len(self.ops)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        cost = OpCost(*self.ops[-1][:3], False, *self.ops[-1][3:]) if len(self.ops) > n else None
        self.calls.append((func, args, kwargs or {}, out, cost))
        return out


def _loss(out) -> torch.Tensor:
    """What backward starts from: the module's last scalar output (a loss), else its first output summed."""
    leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not leaves:
        raise ValueError("auto.layouts: the module's output needs a gradient (no parameter reaches it)")
    scalars = [t for t in leaves if t.ndim == 0]
    return scalars[-1] if scalars else leaves[0].sum()


def _tensors(args: Sequence, kwargs: Mapping | None = None) -> list[torch.Tensor]:
    """The tensors of an op's arguments (or results), in the order dispatch's templates number them."""
    found: list = []
    for a in (*args, *(kwargs or {}).values()):
        _template(a, found, [])
    return found


def trace(module: nn.Module, args: Sequence, mesh_shape: Sequence[int], *, inputs: Sequence | None = None,
          dtype: torch.dtype = torch.float32) -> Graph:
    """One forward (and backward, from the last scalar output) of ``module(*args)`` on meta tensors,
    as a ``Graph`` of ATen ops with their exact signatures on a mesh of ``mesh_shape``. ``inputs``: the
    layout of each tensor in ``args`` (default Broadcast); ``dtype``: the compute dtype bytes are priced at."""
    mesh_shape = tuple(mesh_shape)
    nd = len(mesh_shape)
    rep = (_B,) * nd
    model = copy.deepcopy(module).to("meta")
    args = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)
    arg_tensors = _tensors(args)
    layouts = [rep] * len(arg_tensors) if inputs is None else list(inputs)
    if len(layouts) != len(arg_tensors):
        raise ValueError(f"auto.layouts: {len(layouts)} input layouts for {len(arg_tensors)} tensor arguments")
    g = Graph(mesh_shape, [], [], {}, {}, {}, [])
    ids: dict[int, int] = {}  # id(tensor) -> its latest value
    keep: list = []  # every tensor seen stays alive: ids stay unique

    def new(t: torch.Tensor, fixed: NdSBP | None = None) -> int:
        g.shapes.append(tuple(t.shape))
        keep.append(t)
        v = ids[id(t)] = len(g.shapes) - 1
        if fixed is not None:
            g.fixed[v] = fixed
        return v

    for name, p in model.named_parameters():
        g.params[name] = new(p)
    for t, lay in zip(arg_tensors, layouts):
        g.args.append(new(t, normalize_sbp(lay, nd, t.ndim, "input layout")))
    shape_only = SimpleNamespace(shape=mesh_shape)  # signatures read the mesh's shape only
    rec = _Recorder(dtype)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    with rec:  # autograd.grad, not backward: no AccumulateGrad copies (the recorder holds every gradient)
        grads = torch.autograd.grad(_loss(model(*args)), [p for _, p in named], allow_unused=True)
    for func, a, kw, out, cost in rec.calls:
        ins = tuple(ids[id(t)] if id(t) in ids else new(t, rep) for t in _tensors(a, kw))
        outs_t = _tensors(out if isinstance(out, (tuple, list)) else (out,))
        sigs = tuple(s for s in signatures(func, a, kw, shape_only) if len(s[1]) == len(outs_t))
        if not sigs:  # no rule, a value op: dispatch runs it once on Broadcast inputs
            sigs = (((rep,) * len(ins), (rep,) * len(outs_t)),)
        g.ops.append(_Op(func.overloadpacket.__name__, func, a, kw, ins, tuple(new(t) for t in outs_t), sigs, cost))
    g.grads = {n: ids[id(gr)] for (n, _), gr in zip(named, grads) if gr is not None and id(gr) in ids}
    return g


def _share(sig, mesh_shape) -> float:
    """The fraction of an op's work one device does under ``sig``: 1/n per mesh axis of n devices on
    which some tensor is split."""
    f = 1.0
    for a, n in enumerate(mesh_shape):
        if any(isinstance(s[a], Split) for s in (*sig[0], *sig[1])):
            f /= n
    return f


def box_seconds(cluster: Cluster, mesh_shape: tuple[int, ...], shape: tuple[int, ...], itemsize: int,
                src: NdSBP, dst: NdSBP) -> float:
    """Seconds to relay a tensor from ``src`` to ``dst``: the boxing planner's steps (what dispatch runs),
    each a collective over its mesh axis priced by the cluster (axis ``a``'s groups are devices
    ``prod(mesh_shape[a+1:])`` apart) on the bytes its group works on; local slices are free."""
    t, state = 0.0, src
    for st in box_plan(mesh_shape, shape, itemsize, src, dst):
        if st.kind not in _FREE:
            t += cluster.collective(st.kind, level_bytes(state, mesh_shape, st.axis, shape, itemsize),
                                    mesh_shape[st.axis], math.prod(mesh_shape[st.axis + 1:]))
        state = state[:st.axis] + (st.dst,) + state[st.axis + 1:]
    return t


def _param_options(shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> list[NdSBP]:
    """Layouts a parameter may take: per mesh axis Broadcast or an even split of a dim, the splits of
    one dim over several axes dividing it."""
    per_axis = [[_B, *(Split(d) for d in range(len(shape)) if shape[d] % n == 0)] for n in mesh_shape]
    out = []
    for combo in itertools.product(*per_axis):
        cuts = [math.prod(n for s, n in zip(combo, mesh_shape) if s == Split(d)) for d in range(len(shape))]
        if all(shape[d] % c == 0 for d, c in enumerate(cuts)):
            out.append(tuple(combo))
    return out


def _local_numel(shape, sbp: NdSBP, mesh_shape) -> float:
    return math.prod(shape) / math.prod(n for s, n in zip(sbp, mesh_shape) if isinstance(s, Split))


class _Program:
    """A MILP under construction: columns with a cost per kind, equality rows, one <= row."""

    def __init__(self) -> None:
        self.cost = {k: [] for k in _KINDS}
        self.const = dict.fromkeys(_KINDS, 0.0)
        self.integral: list[int] = []
        self.lb: list[float] = []
        self.ub: list[float] = []
        self.rows: list[tuple[list[tuple[int, float]], float, float]] = []

    def var(self, integral: bool, lb: float = 0.0, ub: float = 1.0) -> int:
        for k in _KINDS:
            self.cost[k].append(0.0)
        self.integral.append(int(integral))
        self.lb.append(lb)
        self.ub.append(ub)
        return len(self.lb) - 1

    def row(self, terms: list[tuple[int, float]], lo: float, hi: float) -> None:
        self.rows.append((terms, lo, hi))

    def edge(self, src: dict, dst: dict, price) -> None:
        """Charge ``price(s, t)`` for the producer's layout s (``src``: layout -> columns whose sum says
        it is chosen, None when fixed) and the consumer's t (``dst`` alike)."""
        if len(src) == 1 and len(dst) == 1:
            self.const["communication"] += price(next(iter(src)), next(iter(dst)))
        elif len(src) == 1 or len(dst) == 1:  # one end known: linear in the other's columns
            one, many, first = (src, dst, True) if len(src) == 1 else (dst, src, False)
            known = next(iter(one))
            for lay, cols in many.items():
                p = price(known, lay) if first else price(lay, known)
                for c in cols:
                    self.cost["communication"][c] += p
        else:
            prices = {(s, t): price(s, t) for s in src for t in dst}
            if not any(prices.values()):
                return
            w = {st: self.var(False) for st in prices}
            for st, c in w.items():
                self.cost["communication"][c] = prices[st]
            for s, cols in src.items():
                self.row([(w[s, t], 1.0) for t in dst] + [(c, -1.0) for c in cols], 0.0, 0.0)
            for t, cols in dst.items():
                self.row([(w[s, t], 1.0) for s in src] + [(c, -1.0) for c in cols], 0.0, 0.0)

    def solve(self, time_limit: float) -> np.ndarray:
        from scipy.optimize import Bounds, LinearConstraint, milp  # imported here: ``import shoal`` stays light
        from scipy.sparse import coo_array

        n = len(self.lb)
        r, c, v, lo, hi = [], [], [], [], []
        for i, (terms, a, b) in enumerate(self.rows):
            for col, coef in terms:
                r.append(i)
                c.append(col)
                v.append(coef)
            lo.append(a)
            hi.append(b)
        a = coo_array((v, (r, c)), shape=(len(self.rows), n)).tocsr()
        cost = np.sum([np.asarray(self.cost[k]) for k in _KINDS], axis=0)
        res = milp(cost, integrality=np.asarray(self.integral), bounds=Bounds(self.lb, self.ub),
                   constraints=LinearConstraint(a, lo, hi), options={"time_limit": time_limit})
        if res.x is None:
            raise ValueError(f"auto.layouts: the integer program has no solution ({res.message}); with a memory "
                             f"limit, raise it or use more devices")
        return res.x


class _Pricer:
    """Seconds on ``cluster`` for a mesh of ``mesh_shape``: an op under a signature, a relayout, an update."""

    def __init__(self, cluster: Cluster, mesh_shape: tuple[int, ...], precision: str) -> None:
        self.cluster, self.mesh_shape, self.precision = cluster, mesh_shape, precision
        self.itemsize = torch.finfo(DTYPES[precision]).bits // 8
        self.peak = cluster.peak(precision)
        self._box: dict = {}

    def op(self, cost: OpCost | None, sig) -> float:
        """An op's time unsplit (``simulate``'s model), its work beyond a kernel launch cut by ``_share``."""
        if cost is None:
            return 0.0
        full = _op_seconds(cost, self.cluster, self.peak, 1, False, 0)
        overhead = min(self.cluster.op_overhead, full)
        return overhead + _share(sig, self.mesh_shape) * (full - overhead)

    def box(self, shape: tuple[int, ...], src: NdSBP, dst: NdSBP) -> float:
        key = (shape, src, dst)
        if key not in self._box:
            self._box[key] = 0.0 if src == dst else box_seconds(self.cluster, self.mesh_shape, shape, self.itemsize,
                                                                src, dst)
        return self._box[key]

    def update(self, shape: tuple[int, ...], lay: NdSBP) -> float:
        """An Adam step over the parameter's shard (``simulate``'s bytes per parameter)."""
        return _local_numel(shape, lay, self.mesh_shape) * _UPDATE[self.precision] / self.cluster.hbm


@dataclass
class Layouts:
    """The chosen layouts: ``params`` (every parameter's nd-SBP), for the module's tensor arguments
    in ``inputs``; ``seconds`` predicted for one step
    with every op in the program's signature, and ``breakdown`` by compute / communication /
    optimizer; ``ops``: op name -> (how many run split on some axis, how many); ``dispatched``: the
    breakdown of the step as dispatch's ``decide`` runs it under ``plan()`` (None without a world of
    the mesh's devices); ``solve_seconds``, the program's size."""

    params: dict[str, NdSBP]
    inputs: list[NdSBP]  # the layouts of the module's tensor arguments, as given
    seconds: float
    breakdown: dict[str, float]
    ops: dict[str, tuple[int, int]]
    dispatched: dict[str, float] | None
    solve_seconds: float
    variables: int
    constraints: int

    def plan(self) -> Plan:
        """A ``shoal.Plan`` of these layouts (Broadcast parameters left out: the default), the module's
        tensor arguments laid out as ``inputs`` (positional arguments, all tensors)."""
        params = {n: lay for n, lay in self.params.items() if any(s != _B for s in lay)}
        split = any(s != _B for lay in self.inputs for s in lay)
        return Plan(params=params, inputs={"": list(self.inputs)} if split else {})

    def explain(self, versus: Layouts | None = None, name: str = "Megatron's") -> str:
        def ms(b: dict) -> str:
            return f"{sum(b.values()) * 1e3:.3f} ms (" + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in b.items()) + ")"

        lines = [f"per-op layouts: {ms(self.breakdown)}; solved in {self.solve_seconds:.2f} s ({self.variables} "
                 f"variables, {self.constraints} rows)"]
        if self.dispatched is not None:
            lines.append(f"  as dispatch runs plan(): {ms(self.dispatched)}")
        lines += [f"  {n}: {sbp_str(lay)}" for n, lay in _grouped(self.params).items()]
        if versus is not None:
            diff = sum(self.params[n] != versus.params[n] for n in self.params)
            lines.append(f"  {name} layouts: {ms(versus.breakdown)}" + (
                f"; as dispatch runs them: {ms(versus.dispatched)}" if versus.dispatched is not None else ""))
            lines.append(f"  the program lays out {diff} parameter(s) otherwise, "
                         f"{100 * (1 - self.seconds / versus.seconds):.1f}% faster by the program's prices")
        return "\n".join(lines)


def _grouped(params: dict[str, NdSBP]) -> dict[str, NdSBP]:
    """``params`` with the items of a ``ModuleList`` written once ("blocks.*.ln1.weight") where all agree."""
    groups: dict[str, dict[str, NdSBP]] = {}
    for n, lay in params.items():
        groups.setdefault(re.sub(r"\.\d+\.", ".*.", n), {})[n] = lay
    out = {}
    for pattern, members in groups.items():
        out.update({pattern: next(iter(members.values()))} if len(set(members.values())) == 1 else members)
    return out


def solve(module: nn.Module, args: Sequence, cluster: Cluster, mesh_shape: Sequence[int], *,
          inputs: Sequence | None = None, precision: str = "fp32", fixed: Mapping | None = None,
          memory: float | None = None, time_limit: float = 60.0) -> Layouts:
    """The cheapest layout of every parameter of ``module`` (and signature of every op) for a step of
    ``module(*args)`` on a mesh of ``mesh_shape`` devices of ``cluster``. ``fixed``: parameter name
    patterns -> layouts (a ``Plan``'s ``params``; unmatched: Broadcast) to price instead of choosing;
    ``memory``: bytes of parameter states per device (default the cluster's); ``precision``: the dtype
    priced (bytes, peak rate, optimizer states)."""
    t0 = time.perf_counter()
    g = trace(module, args, mesh_shape, inputs=inputs, dtype=DTYPES[precision])
    ms = g.mesh_shape
    pr = _Pricer(cluster, ms, precision)
    prog = _Program()
    layout: dict[int, dict] = {v: {lay: None} for v, lay in g.fixed.items()}  # value -> layout -> columns
    choice: dict[str, dict] = {}
    memory = cluster.memory if memory is None else memory
    state_bytes = sum(_STATES[precision])
    mem_terms = []
    for name, v in g.params.items():
        shape = g.shapes[v]
        options = _param_options(shape, ms)
        want = None
        if fixed is not None:
            found = _layout(fixed, name)
            want = normalize_sbp(found, len(ms), len(shape), name) if found else (_B,) * len(ms)
            options = list(dict.fromkeys([*options, want]))
        cols = choice[name] = {}
        for lay in options:
            c = cols[lay] = [prog.var(True, *((1.0, 1.0) if lay == want else (0.0, 0.0) if want else (0.0, 1.0)))]
            prog.cost["optimizer"][c[0]] = pr.update(shape, lay)
            mem_terms.append((c[0], _local_numel(shape, lay, ms) * state_bytes))
        prog.row([(c[0], 1.0) for c in cols.values()], 1.0, 1.0)
        layout[v] = cols
    if math.isfinite(memory):
        prog.row(mem_terms, 0.0, memory)
    picks = []
    for op in g.ops:
        cols = [prog.var(True) for _ in op.sigs]
        picks.append(cols)
        prog.row([(c, 1.0) for c in cols], 1.0, 1.0)
        for c, sig in zip(cols, op.sigs):
            prog.cost["compute"][c] = pr.op(op.cost, sig)
        for m, v in enumerate(op.ins):
            dst: dict = {}
            for c, sig in zip(cols, op.sigs):
                dst.setdefault(sig[0][m], []).append(c)
            prog.edge(layout[v], dst, lambda s, t, shape=g.shapes[v]: pr.box(shape, s, t))
        for k, v in enumerate(op.outs):
            layout[v] = {}
            for c, sig in zip(cols, op.sigs):
                layout[v].setdefault(sig[1][k], []).append(c)
    for name, v in g.grads.items():  # the optimizer reads each gradient in its parameter's layout
        prog.edge(layout[v], choice[name], lambda s, t, shape=g.shapes[v]: pr.box(shape, s, t))
    x = np.round(prog.solve(time_limit), 6)
    breakdown = {k: float(np.dot(prog.cost[k], x)) + prog.const[k] for k in _KINDS}
    params = {n: next(lay for lay, c in cols.items() if x[c[0]] > 0.5) for n, cols in choice.items()}
    chosen = [op.sigs[int(np.argmax(x[cols]))] for op, cols in zip(g.ops, picks)]
    ops: dict[str, list[int]] = {}
    for op, sig in zip(g.ops, chosen):
        counts = ops.setdefault(op.name, [0, 0])
        counts[0] += _share(sig, ms) < 1
        counts[1] += 1
    return Layouts(params, [g.fixed[v] for v in g.args], sum(breakdown.values()), breakdown,
                   {k: tuple(v) for k, v in ops.items()}, _dispatched(g, params, pr), time.perf_counter() - t0,
                   len(prog.lb), len(prog.rows))


def _dispatched(g: Graph, params: dict[str, NdSBP], pr: _Pricer) -> dict[str, float] | None:
    """The step priced as shoal runs it under ``params``: each op's signature from dispatch's own
    ``decide``, which weighs only the boxing of that op's inputs (the program weighs the whole step);
    an op it decomposes is replayed part by part (torch's decomposition, each part decided alike), one
    it runs replicated is priced replicated. None without a world holding the mesh's devices."""
    size = math.prod(g.mesh_shape)
    if not is_initialized() or world().size < size:
        return None
    mesh = Mesh(np.arange(size).reshape(g.mesh_shape).tolist())
    out = dict.fromkeys(_KINDS, 0.0)
    lay = dict(g.fixed) | {g.params[n]: p for n, p in params.items()}
    for op in g.ops:
        now = [lay[v] for v in op.ins]
        lay.update(zip(op.outs, _decided(op.func, op.args, op.kwargs, op.cost, now, len(op.outs), mesh, pr, out)))
    for name, v in g.grads.items():
        out["communication"] += pr.box(g.shapes[v], lay[v], params[name])
    for name, v in g.params.items():
        out["optimizer"] += pr.update(g.shapes[v], params[name])
    return out


def _decided(func, args, kwargs, cost, now: list, n_out: int, mesh: Mesh, pr: _Pricer, out: dict) -> list[NdSBP]:
    """Price one call (``n_out`` tensor results) as dispatch runs it on inputs laid out as ``now``, into
    ``out``; the layouts of its results."""
    tensors: list = []
    targs = tuple(_template(a, tensors, []) for a in args)
    tkwargs = {key: _template(a, tensors, []) for key, a in kwargs.items()}
    specs = [Input(tuple(t.shape), t.dtype, tuple(t.stride()), TensorSpec(tuple(t.shape), t.dtype, mesh, s))
             for t, s in zip(tensors, now)]
    d = decide(func, targs, tkwargs, specs, mesh)
    rep = (_B,) * mesh.ndim
    if d.kind == "decompose":
        return _decomposed(func, args, kwargs, tensors, now, mesh, pr, out)
    if d.kind == "rule":
        ins, outs = tuple(s.sbp for s in d.in_specs), tuple(s.sbp for s in d.out_specs)
    else:
        ins, outs = (rep,) * len(tensors), (rep,) * n_out
    for t, src, dst in zip(tensors, now, ins):
        out["communication"] += pr.box(tuple(t.shape), src, dst)
    out["compute"] += pr.op(cost, (ins, outs))
    return list(outs)


def _decomposed(func, args, kwargs, tensors, now, mesh, pr, out) -> list[NdSBP]:
    """Dispatch runs ``func`` in parts (``execute.run_decomposed``: the rule's decomposition, else
    torch's): the parts, recorded on meta, each decided."""
    rule = lookup(func)
    fn = rule.decomposition if rule is not None and rule.decomposition is not None else _decomposition(func)
    rec = _Recorder(DTYPES[pr.precision])
    _DECOMPOSING.add(func)
    try:
        with rec:
            res = fn(*args, **kwargs)
        lay = {id(t): s for t, s in zip(tensors, now)}
        for f, a, kw, o, cost in rec.calls:
            ins = _tensors(a, kw)
            outs = _tensors(o if isinstance(o, (tuple, list)) else (o,))
            got = _decided(f, a, kw, cost, [lay.get(id(t), (_B,) * mesh.ndim) for t in ins], len(outs), mesh, pr, out)
            lay.update({id(t): s for t, s in zip(outs, got)})
    finally:
        _DECOMPOSING.discard(func)
    return [lay.get(id(t), (_B,) * mesh.ndim) for t in _tensors(res if isinstance(res, (tuple, list)) else (res,))]


def megatron(model: nn.Module, tp: int) -> dict:
    """The bundled GPT's Megatron parameter layouts on a ``tp`` mesh (``models.gpt.plans``), by pattern."""
    gpt_config(model)
    return dict(gpt.plans((tp,), "tp").params)


def gpt_layouts(model: nn.Module, cluster: Cluster, tp: int, *, batch: int, seq: int | None = None,
                precision: str = "fp32", memory: float | None = None,
                layers: int | None = None) -> tuple[Layouts, Layouts]:
    """For a bundled GPT on ``tp`` devices of ``cluster``, a training step of ``batch`` sequences of
    ``seq`` tokens: (the program's layouts, Megatron's priced by the same program). ``layers``: solve
    on a twin of that many layers (3: the first, a middle and the last block stand for all; the
    layers are alike), its layouts given to every block of ``model``; the seconds are the twin's."""
    cfg = gpt_config(model)
    seq = seq or cfg.block_size
    n, twin = cfg.n_layer, model
    if layers is not None and layers < n:
        with torch.device("meta"):
            twin = gpt.GPT(dataclasses.replace(cfg, n_layer=layers))
    idx = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    out = tuple(solve(twin, (idx, idx), cluster, (tp,), precision=precision, memory=memory, fixed=fixed)
                for fixed in (None, megatron(model, tp)))
    if twin is not model:
        def name_in_twin(name: str) -> str:  # block i of n: the twin's first, a middle one, or its last
            if not name.startswith("blocks."):
                return name
            _, i, rest = name.split(".", 2)
            j = 0 if i == "0" else layers - 1 if int(i) == n - 1 else min(1, layers - 1)
            return f"blocks.{j}.{rest}"

        for lay in out:
            lay.params = {name: lay.params[name_in_twin(name)] for name, _ in model.named_parameters()}
    return out
