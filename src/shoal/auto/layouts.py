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

Dispatch decides each op by its own inputs' boxing; a plan steers it only by pinning submodules'
results (``Plan.outputs``). So the program's layouts of those results become output pins, and the
step is replayed through dispatch's own ``decide`` (``_dispatched``: the pins and their backward, a
Partial value reduced once, in a world of meta devices; a test holds it to shoal's compiled step).
Where dispatch runs the program's choice slower than Megatron's plan, the layouts are moved toward
it a group at a time while the replayed step gets faster (``_descend``).

``Layouts`` holds the choice (``params``, ``outputs``, ``plan()``: a ``shoal.Plan``), the predicted
seconds by kind, as dispatch runs it, and the solve time. ``fixed=`` prices a given parameter layout
(Megatron's: ``megatron``) with the same program, the ops' signatures left free: the two are
comparable.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import functools
import inspect
import itertools
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from ..boxing.planner import level_bytes
from ..boxing.planner import plan as box_plan
from ..dispatch.decide import _DECOMPOSING, Input, _decomposition, decide, signatures
from ..dispatch.key import _template
from ..mesh import Mesh
from ..models import gpt
from ..ops.registry import lookup
from ..parallel import Plan, _is_layout
from ..sbp import Broadcast, NdSBP, Split, normalize_sbp, reduced, sbp_str
from ..spec import TensorSpec
from ..tensor import _has_sum
from ..world import meta_world
from .cluster import Cluster
from .profile import OpCost, _layout, _Ops, gpt_config
from .simulate import _STATES, _UPDATE, DTYPES, _op_seconds

__all__ = ["Layouts", "Graph", "trace", "solve", "megatron", "gpt_layouts", "box_seconds", "box_steps"]

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
    results: dict[int, tuple[str, int]] = dataclasses.field(default_factory=dict)  # value -> (submodule, k)
    grads_at: dict[int, list[tuple[int, int]]] = dataclasses.field(default_factory=dict)  # op index -> (value, grad)


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
    results: dict[int, tuple[str, int]] = {}  # id of a submodule's result -> (its name, which result)
    grads_at: dict = {}  # how many ops ran -> [(a submodule's result, its gradient)] as backward makes them
    hooks = [mod.register_forward_hook(functools.partial(_result, name, results, grads_at, rec, keep))
             for name, mod in model.named_modules() if name]
    try:  # autograd.grad, not backward: no AccumulateGrad copies (the recorder holds every gradient)
        with rec, _AsOnCPU():
            grads = torch.autograd.grad(_loss(model(*args)), [p for _, p in named], allow_unused=True)
    finally:
        for h in hooks:
            h.remove()
    for i, call in enumerate((*rec.calls, None)):
        for res, gr in grads_at.get(i, ()):  # a result's gradient, made by the calls before the i-th
            if id(gr) in ids:
                g.grads_at.setdefault(len(g.ops), []).append((ids[id(res)], ids[id(gr)]))
        if call is None:
            break
        func, a, kw, out, cost = call
        ins = tuple(ids[id(t)] if id(t) in ids else new(t, rep) for t in _tensors(a, kw))
        outs_t = _tensors(out if isinstance(out, (tuple, list)) else (out,))
        sigs = tuple(s for s in signatures(func, a, kw, shape_only) if len(s[1]) == len(outs_t))
        if not sigs:  # no rule, a value op: dispatch runs it once on Broadcast inputs
            sigs = (((rep,) * len(ins), (rep,) * len(outs_t)),)
        g.ops.append(_Op(func.overloadpacket.__name__, func, a, kw, ins, tuple(new(t) for t in outs_t), sigs, cost))
        g.results.update((ids[id(t)], results[id(t)]) for t in outs_t if id(t) in results)
    g.grads = {n: ids[id(gr)] for (n, _), gr in zip(named, grads) if gr is not None and id(gr) in ids}
    return g


class _AsOnCPU(TorchFunctionMode):
    """Attention as dispatch meets it on shoal's CPU devices (and in a meta world, whose tensors are
    the CPU's): ``F.scaled_dot_product_attention`` without a mask or dropout runs CPU's fused kernel,
    which the meta device would decompose into products and a softmax."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            a = _SDPA.bind(*args, **kwargs).arguments
            q = a["query"]
            if (a.get("attn_mask") is None and not a.get("dropout_p") and not a.get("enable_gqa") and q.dim() == 4
                    and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)):
                return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q, a["key"], a["value"], 0.0, bool(a.get("is_causal", False)), scale=a.get("scale"))[0]
        return func(*args, **kwargs)


_SDPA = inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=d) for n, d in (
    ("query", None), ("key", None), ("value", None), ("attn_mask", None), ("dropout_p", 0.0),
    ("is_causal", False), ("scale", None), ("enable_gqa", False))])


def _result(name: str, results: dict, grads_at: dict, rec: _Recorder, keep: list, mod, args, out):
    """A forward hook of ``trace``: each tensor a submodule returns is passed on as a view of it (a value
    of its own, as an output pin's result is), noted with the gradient backward gives it."""
    def one(t, k):
        if not isinstance(t, torch.Tensor):
            return t
        v = t.view_as(t)
        keep.append(v)
        results[id(v)] = (name, k)
        if v.requires_grad:
            def noted(gr, v=v) -> None:  # the gradient stays alive: its id is its name
                grads_at.setdefault(len(rec.calls), []).append((v, gr))
                keep.append(gr)

            v.register_hook(noted)
        return v

    if isinstance(out, tuple):
        return tuple(one(t, k) for k, t in enumerate(out))
    return one(out, 0)


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
    return sum(cluster.collective(kind, nbytes, mesh_shape[axis], math.prod(mesh_shape[axis + 1:]))
               for kind, nbytes, axis in box_steps(mesh_shape, shape, itemsize, src, dst))


def box_steps(mesh_shape: tuple[int, ...], shape: tuple[int, ...], itemsize: int, src: NdSBP, dst: NdSBP):
    """The collectives of relaying a tensor from ``src`` to ``dst`` (the boxing planner's steps that
    move data): (kind, bytes of the tensor its group works on, mesh axis) each."""
    state = src
    for st in box_plan(mesh_shape, shape, itemsize, src, dst):
        if st.kind not in _FREE:
            yield st.kind, level_bytes(state, mesh_shape, st.axis, shape, itemsize), st.axis
        state = state[:st.axis] + (st.dst,) + state[st.axis + 1:]


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

    def __init__(self, cluster: Cluster, mesh_shape: tuple[int, ...], precision: str,
                 log: list | None = None) -> None:
        self.cluster, self.mesh_shape, self.precision = cluster, mesh_shape, precision
        self.itemsize = torch.finfo(DTYPES[precision]).bits // 8
        self.peak = cluster.peak(precision)
        self._box: dict = {}
        self.log = log  # where each relayout's collectives are listed (``box_steps``), if given

    def op(self, cost: OpCost | None, sig) -> float:
        """An op's time unsplit (``simulate``'s model), its work beyond a kernel launch cut by ``_share``."""
        if cost is None:
            return 0.0
        full = _op_seconds(cost, self.cluster, self.peak, 1, False, 0)
        overhead = min(self.cluster.op_overhead, full)
        return overhead + _share(sig, self.mesh_shape) * (full - overhead)

    def box(self, shape: tuple[int, ...], src: NdSBP, dst: NdSBP) -> float:
        key = (shape, src, dst)
        if self.log is not None:
            self.log += box_steps(self.mesh_shape, shape, self.itemsize, src, dst)
        if key not in self._box:
            self._box[key] = 0.0 if src == dst else box_seconds(self.cluster, self.mesh_shape, shape, self.itemsize,
                                                                src, dst)
        return self._box[key]

    def update(self, shape: tuple[int, ...], lay: NdSBP) -> float:
        """An Adam step over the parameter's shard (``simulate``'s bytes per parameter)."""
        return _local_numel(shape, lay, self.mesh_shape) * _UPDATE[self.precision] / self.cluster.hbm


@dataclass
class Layouts:
    """The chosen layouts: ``params`` (every parameter's nd-SBP) and ``outputs`` (submodules' output
    pins), for the module's tensor arguments in ``inputs``; ``seconds`` predicted for one step under
    ``params`` with every op in the program's signature, and ``breakdown`` by compute / communication
    / optimizer; ``optimum``: the program's price of the layouts it chose itself, before they were
    moved toward those dispatch runs faster (``solve``); ``ops``: op name -> (how many run split on
    some axis, how many); ``dispatched``: the breakdown of the step as dispatch's ``decide`` runs it
    under ``plan()``; ``solve_seconds``, the program's size."""

    params: dict[str, NdSBP]
    inputs: list[NdSBP]  # the layouts of the module's tensor arguments, as given
    outputs: dict  # submodule name -> the layout its results are pinned to (a Plan's ``outputs``)
    seconds: float
    optimum: float  # the program's price of its own layouts (``seconds`` is that of ``params``)
    breakdown: dict[str, float]
    ops: dict[str, tuple[int, int]]
    dispatched: dict[str, float]
    solve_seconds: float
    variables: int
    constraints: int

    @property
    def run_seconds(self) -> float:
        """A step's seconds as dispatch runs ``plan()`` (``dispatched``'s sum)."""
        return sum(self.dispatched.values())

    def plan(self) -> Plan:
        """A ``shoal.Plan`` of these layouts (Broadcast parameters left out: the default), the module's
        tensor arguments laid out as ``inputs`` (positional arguments, all tensors)."""
        params = {n: lay for n, lay in self.params.items() if any(s != _B for s in lay)}
        split = any(s != _B for lay in self.inputs for s in lay)
        return Plan(params=params, inputs={"": list(self.inputs)} if split else {}, outputs=_grouped(self.outputs))

    def explain(self, versus: Layouts | None = None, name: str = "Megatron's") -> str:
        def ms(b: dict) -> str:
            return f"{sum(b.values()) * 1e3:.3f} ms (" + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in b.items()) + ")"

        lines = [f"per-op layouts: {ms(self.breakdown)} (the program's own: {self.optimum * 1e3:.3f} ms); solved in "
                 f"{self.solve_seconds:.2f} s ({self.variables} variables, {self.constraints} rows)",
                 f"  as dispatch runs plan(): {ms(self.dispatched)}"]
        lines += [f"  {n}: {sbp_str(lay)}" for n, lay in _grouped(self.params).items()]
        lines += [f"  outputs of {n}: {sbp_str(lay) if _is_layout(lay) else lay}"
                  for n, lay in _grouped(self.outputs).items()]
        if versus is not None:
            diff = sum(self.params[n] != versus.params[n] for n in self.params)
            lines.append(f"  {name} layouts: {ms(versus.breakdown)}; as dispatch runs them: {ms(versus.dispatched)}")
            lines.append(f"  {diff} parameter(s) laid out otherwise, {100 * (1 - self.seconds / versus.seconds):.1f}% "
                         f"faster by the program's prices, {100 * (1 - self.run_seconds / versus.run_seconds):.1f}% "
                         f"as dispatch runs them")
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
          outputs: Mapping | None = None, toward: Plan | None = None, memory: float | None = None,
          time_limit: float = 60.0) -> Layouts:
    """The cheapest layout of every parameter of ``module`` (and signature of every op) for a step of
    ``module(*args)`` on a mesh of ``mesh_shape`` devices of ``cluster``. ``fixed``: parameter name
    patterns -> layouts (a ``Plan``'s ``params``; unmatched: Broadcast) to price instead of choosing;
    ``outputs``: submodules' output pins (a ``Plan``'s ``outputs``) to run dispatch with; by default
    the program pins the submodules' results where it lays them out and then (without ``fixed``)
    moves its layouts and pins toward the plan ``toward`` (Megatron's) while dispatch runs the step
    faster (``_descend``), the layouts it ends at priced by the program again;
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
    if outputs is not None:
        outputs, dispatched = _run(g, params, pr, outputs)
    else:  # pins at the program's layouts of the submodules' results, moved toward ``toward`` if that helps
        pins = _chosen_pins(g, {v: next(lay for lay, cols in layout[v].items() if x[cols].sum() > 0.5)
                                for v in g.results})

        def fits(p: dict) -> bool:
            return sum(_local_numel(g.shapes[v], p[n], ms) for n, v in g.params.items()) * state_bytes <= memory

        tuned, outputs, dispatched = _descend(g, pr, params, pins, toward if fixed is None else None, fits)
        if tuned != params:  # the program prices the layouts dispatch runs fastest
            again = solve(module, args, cluster, mesh_shape, inputs=inputs, precision=precision, fixed=tuned,
                          outputs=outputs, memory=memory, time_limit=time_limit)
            again.solve_seconds, again.optimum = time.perf_counter() - t0, sum(breakdown.values())
            return again
    seconds = sum(breakdown.values())
    return Layouts(params, [g.fixed[v] for v in g.args], outputs, seconds, seconds, breakdown,
                   {k: tuple(v) for k, v in ops.items()}, dispatched, time.perf_counter() - t0,
                   len(prog.lb), len(prog.rows))


def _chosen_pins(g: Graph, chosen: dict[int, NdSBP]) -> dict:
    """A ``Plan``'s ``outputs`` from each submodule result's layout in ``chosen`` (a submodule run twice
    in two layouts is left unpinned)."""
    per: dict[str, dict[int, NdSBP | None]] = {}
    for v, (name, k) in g.results.items():
        seen = per.setdefault(name, {})
        seen[k] = chosen[v] if seen.get(k, chosen[v]) == chosen[v] else None
    return {name: ks[0] if list(ks) == [0] else tuple(ks.get(k) for k in range(max(ks) + 1))
            for name, ks in per.items() if any(lay is not None for lay in ks.values())}


def _run(g: Graph, params: dict[str, NdSBP], pr: _Pricer, pins: Mapping):
    """(``pins`` less those that move nothing, the step's breakdown as dispatch runs it under
    ``params`` and ``pins``)."""
    breakdown, moved = _dispatched(g, params, pr, pins)
    kept = {}
    for key, lay in pins.items():
        hits = [k for name, k in moved if _matches(name, key)]
        if hits:
            kept[key] = lay if _is_layout(lay) else tuple(one if k in hits else None for k, one in enumerate(lay))
    return kept, breakdown


def _descend(g: Graph, pr: _Pricer, params: dict[str, NdSBP], pins: dict, toward: Plan | None, fits):
    """Dispatch decides each op by its own inputs' boxing and does not follow the program through
    backward, so the program's layouts can run slower than they price. Starting from the better of
    the program's parameter layouts and ``toward``'s (Megatron's), each with the program's pins,
    ``toward``'s or none, set a group of parameters (a ``ModuleList``'s items alike) to the other's
    layouts, drop a group of pins, or add one of ``toward``'s, one at a time while the step as
    dispatch runs it gets faster, the parameters' states fitting (``fits``). Without ``toward`` the
    parameter layouts stay and only pins move. Returns (parameter layouts, pins, breakdown)."""
    nd = len(g.mesh_shape)
    goal = params if toward is None else {
        n: normalize_sbp(_layout(toward.params, n) or (_B,) * nd, nd, len(g.shapes[v]), n)
        for n, v in g.params.items()}
    toward = toward or Plan()

    def seconds(p, q):
        return sum(_dispatched(g, p, pr, q)[0].values())

    starts = [(p, q) for p in (params, goal) if fits(p) for q in (pins, {}, dict(toward.outputs))]
    now = min(((p, q, seconds(p, q)) for p, q in starts), key=lambda r: r[2])
    groups: dict[str, list[str]] = {}
    for n in params:
        groups.setdefault(_item_pattern(n), []).append(n)
    for _ in range(4):  # passes over every move, each taken as soon as it helps
        better = False
        moves = [(lambda p, q, ns=ns, to=to: ({**p, **{n: to[n] for n in ns}}, q))
                 for ns in groups.values() for to in (params, goal)]
        moves += [(lambda p, q, key=key: (p, {k: v for k, v in q.items() if _item_pattern(k) != key}))
                  for key in {_item_pattern(k) for k in now[1]}]
        moves += [(lambda p, q, key=key: (p, {**{k: v for k, v in q.items() if not _matches(k, key)},
                                              key: toward.outputs[key]})) for key in toward.outputs]
        for move in moves:
            p, q = move(now[0], now[1])
            if (p == now[0] and q == now[1]) or not fits(p):
                continue
            t = seconds(p, q)
            if t < now[2] * (1 - 1e-9):
                now, better = (p, q, t), True
        if not better:
            break
    return (now[0], *_run(g, now[0], pr, now[1]))


def _item_pattern(name: str) -> str:
    """``name`` with a ``ModuleList`` item's index as ``*`` ("blocks.3.attn" -> "blocks.*.attn")."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def _matches(name: str, key: str) -> bool:
    """Whether a ``Plan``'s submodule key (a name or an fnmatch pattern) names submodule ``name``."""
    return name == key or fnmatch.fnmatchcase(name, key)


def _pattern(key: str) -> bool:
    return any(c in key for c in "*?[")


def _dispatched(g: Graph, params: dict[str, NdSBP], pr: _Pricer,
                outputs: Mapping | None = None) -> tuple[dict[str, float], set]:
    """The step priced as shoal runs it under ``params`` and the output pins ``outputs`` (a ``Plan``'s:
    submodule name or pattern -> layout(s)): each op's signature from dispatch's own ``decide``,
    which weighs only the boxing of that op's inputs (the program weighs the whole step); an op it
    decomposes is replayed part by part (torch's decomposition, each part decided alike), one it runs
    replicated is priced replicated. A value's first conversion out of a Partial sum is remembered
    and later ones start from it (``GlobalTensor._shards_as``). A pin that moves its value boxes it
    there, and its gradient back to the layout the value came in (Partial reduced), as
    ``to_global``'s backward does. Returns the breakdown and the (submodule, result) pins that moved
    something. Dispatch decides in a world of the mesh's meta devices (``world.meta_world``)."""
    size = math.prod(g.mesh_shape)
    with meta_world(size):
        return _replay(g, params, pr, outputs, Mesh(np.arange(size).reshape(g.mesh_shape).tolist()))


def _replay(g: Graph, params: dict[str, NdSBP], pr: _Pricer, outputs: Mapping | None, mesh: Mesh):
    out = dict.fromkeys(_KINDS, 0.0)
    vals = _Values(pr, out, dict(g.fixed) | {g.params[n]: p for n, p in params.items()})
    lay = vals.lay
    pins = _pins(g, outputs or {})
    came: dict[int, NdSBP] = {}  # a pinned value -> the layout dispatch gave it
    moved = set()

    def relaid(v: int, dst: NdSBP) -> None:  # a new tensor of the same value (to_global): no memo
        vals.box(v, g.shapes[v], dst)
        lay[v] = dst
        vals.resolved.pop(v, None)

    for i, op in enumerate((*g.ops, None)):
        for res, grad in g.grads_at.get(i, ()):
            if res in came:
                relaid(grad, reduced(came[res]))
        if op is None:
            break
        memo: dict[int, NdSBP] = {}
        lay.update(zip(op.outs, _decided(op.func, op.args, op.kwargs, op.cost, [lay[v] for v in op.ins],
                                         len(op.outs), mesh, pr, out,
                                         lambda k, dst, ins=op.ins: vals.box(ins[k], g.shapes[ins[k]], dst), memo)))
        vals.resolved.update((op.outs[k], r) for k, r in memo.items())
        for v in op.outs:
            if pins.get(v, lay[v]) != lay[v]:
                came[v] = lay[v]
                moved.add(g.results[v])
                relaid(v, pins[v])
    for name, v in g.grads.items():
        vals.box(v, g.shapes[v], params[name])
    for name, v in g.params.items():
        out["optimizer"] += pr.update(g.shapes[v], params[name])
    return out, moved


class _Values:
    """Values' layouts (``lay``: key -> layout) and, as ``GlobalTensor._shards_as`` remembers, where a
    Partial-sum value's first conversion out of Partial put it (``resolved``): later conversions start
    there. ``box`` prices a conversion into ``out``."""

    def __init__(self, pr: _Pricer, out: dict, lay: dict) -> None:
        self.pr, self.out, self.lay, self.resolved = pr, out, lay, {}

    def box(self, key, shape: tuple[int, ...], dst: NdSBP) -> None:
        src = self.lay[key]
        if src == dst:
            return
        self.out["communication"] += self.pr.box(shape, self.resolved.get(key, src), dst)
        if key not in self.resolved and _has_sum(src) and not _has_sum(dst):
            self.resolved[key] = dst


def _pins(g: Graph, outputs: Mapping) -> dict[int, NdSBP]:
    """Value -> the layout ``outputs`` (submodule name or fnmatch pattern -> one layout, or one per
    result, None: left as it is) pins it to; the last matching pattern wins, as its hook runs last."""
    pins = {}
    for v, (name, k) in g.results.items():
        for pattern, lay in outputs.items():
            if _matches(name, pattern):
                one = lay if _is_layout(lay) else lay[k] if k < len(lay) else None
                if one is not None:
                    pins[v] = normalize_sbp(one, len(g.mesh_shape), len(g.shapes[v]), f"outputs of {name!r}")
    return pins


def _decided(func, args, kwargs, cost, now: list, n_out: int, mesh: Mesh, pr: _Pricer, out: dict,
             box, memo: dict | None = None) -> list[NdSBP]:
    """Price one call (``n_out`` tensor results) as dispatch runs it on inputs laid out as ``now``, into
    ``out``, ``box(k, layout)`` moving its k-th input; the layouts of its results. ``memo`` gets, by
    result, where a decomposition already reduced a Partial result (``_Values.resolved``)."""
    tensors: list = []
    targs = tuple(_template(a, tensors, []) for a in args)
    tkwargs = {key: _template(a, tensors, []) for key, a in kwargs.items()}
    specs = [Input(tuple(t.shape), t.dtype, tuple(t.stride()), TensorSpec(tuple(t.shape), t.dtype, mesh, s))
             for t, s in zip(tensors, now)]
    d = decide(func, targs, tkwargs, specs, mesh)
    rep = (_B,) * mesh.ndim
    if d.kind == "decompose":
        return _decomposed(func, args, kwargs, tensors, now, mesh, pr, out, box, {} if memo is None else memo)
    if d.kind == "rule":
        ins, outs = tuple(s.sbp for s in d.in_specs), tuple(s.sbp for s in d.out_specs)
    else:
        ins, outs = (rep,) * len(tensors), (rep,) * n_out
    for k, dst in enumerate(ins):
        box(k, dst)
    out["compute"] += pr.op(cost, (ins, outs))
    return list(outs)


def _decomposed(func, args, kwargs, tensors, now, mesh, pr, out, box, memo: dict) -> list[NdSBP]:
    """Dispatch runs ``func`` in parts (``execute.run_decomposed``: the rule's decomposition, else
    torch's): the parts, recorded on meta, each decided (the call's own inputs boxed by ``box``, the
    parts' values remembering their reductions as the call's results carry them out in ``memo``)."""
    rule = lookup(func)
    fn = rule.decomposition if rule is not None and rule.decomposition is not None else _decomposition(func)
    rec = _Recorder(DTYPES[pr.precision])
    rep = (_B,) * mesh.ndim
    _DECOMPOSING.add(func)
    try:
        with rec:
            res = fn(*args, **kwargs)
        outer = {id(t): k for k, t in enumerate(tensors)}
        vals = _Values(pr, out, {id(t): s for t, s in zip(tensors, now)})
        for f, a, kw, o, cost in rec.calls:
            ins = _tensors(a, kw)
            outs = _tensors(o if isinstance(o, (tuple, list)) else (o,))
            for t in ins:
                vals.lay.setdefault(id(t), rep)

            def part_box(k, dst, ins=ins):
                if id(ins[k]) in outer:
                    box(outer[id(ins[k])], dst)
                else:
                    vals.box(id(ins[k]), tuple(ins[k].shape), dst)

            inner: dict[int, NdSBP] = {}
            got = _decided(f, a, kw, cost, [vals.lay[id(t)] for t in ins], len(outs), mesh, pr, out, part_box, inner)
            vals.lay.update({id(t): s for t, s in zip(outs, got)})
            vals.resolved.update((id(outs[k]), r) for k, r in inner.items())
    finally:
        _DECOMPOSING.discard(func)
    results = _tensors(res if isinstance(res, (tuple, list)) else (res,))
    memo.update((k, vals.resolved[id(t)]) for k, t in enumerate(results) if id(t) in vals.resolved)
    return [vals.lay.get(id(t), rep) for t in results]


def megatron(model: nn.Module, tp: int) -> Plan:
    """The bundled GPT's Megatron plan on a ``tp`` mesh (``models.gpt.plans``): its parameter layouts
    and output pins, by pattern."""
    gpt_config(model)
    return gpt.plans((tp,), "tp")


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
    mega = megatron(model, tp)
    out = tuple(solve(twin, (idx, idx), cluster, (tp,), precision=precision, memory=memory, fixed=fixed,
                      outputs=outputs, toward=mega)
                for fixed, outputs in ((None, None), (mega.params, mega.outputs)))
    if twin is not model:
        def name_in_twin(name: str) -> str:  # block i of n: the twin's first, a middle one, or its last
            if not name.startswith("blocks."):
                return name
            _, i, *rest = name.split(".", 2)
            j = 0 if i == "0" else layers - 1 if int(i) == n - 1 else min(1, layers - 1)
            return ".".join(("blocks", str(j), *rest))

        for lay in out:
            lay.params = {name: lay.params[name_in_twin(name)] for name, _ in model.named_parameters()}
            lay.outputs = {**{k: v for k, v in lay.outputs.items() if _pattern(k)},
                           **{name: lay.outputs[name_in_twin(name)] for name, _ in model.named_modules()
                              if name and name_in_twin(name) in lay.outputs and not _pattern(name_in_twin(name))}}
    return out
