"""torch's OpInfo database as an oracle: every op of ``op_db`` that supports float32 (and complex64
where it does) on CPU, on GlobalTensors laid out at random, equals plain single-device torch.

For each op, dtype and sample input (``op.sample_inputs``), every tensor of the sample is laid out
at random on meshes (2,), (3,) and (2, 2): per mesh axis Split of any dim, Broadcast, or Partial(sum)
(genuinely partial pieces, see ``lay_out``) for floating and complex tensors (never for integer or
boolean tensors: indices and masks are not sums). The op runs on plain tensors holding those
global values and on the GlobalTensors, both after ``torch.manual_seed`` with the same seed (random
ops must draw what one device draws), and the results are compared: every output, every input (an
op may write its input), and, for ops that support autograd, the gradients of the inputs that
require grad for a random cotangent (itself laid out at random), against ``torch.autograd.grad``.
A few ops are also compiled (``shoal.compile``) and run as a graph.

Tolerances: op_db's own for the dtype where it gives them (``toleranceOverride``), else rtol 1e-4 /
atol 1e-5 (never below torch's defaults for a low-precision result dtype). A value off by more is
judged by torch's own sensitivity there, then in double precision (``_compare_all``, ``run_sample``):
both are counted and listed by the summary. Outputs torch leaves undefined
(``has_nondeterministic_output``: ``empty_like`` and friends) are compared by shape and dtype; results
torch leaves open otherwise (ties in sort, topk, max, the order of unique) are compared as one device
gives them: shoal runs such ops on whole rows (or replicated), with torch's kernel, and no sample
needed more. A sample torch itself refuses (a CUDA-only op, as_strided reaching into the storage of a
view's base) must be refused by shoal with the same kind of error.

``make test`` (plain pytest) runs one sample per op (the first of the op's samples whose tensors have
the most non-empty dims, so that splits have something to cut) with two seeds (a seed draws the
layouts), each on two meshes: seed 0 on (2,) and (2, 2), seed 1 on (3,) and (2,). ``make test-ops``
(``SHOAL_OPINFO=full``) runs every sample, and a third seed on (3,) and (2, 2). ``test_summary`` prints
what was covered (``pytest -s`` shows it; ``summary()`` returns it).

An op that shoal does not run belongs in ``GAPS`` with the reason and the error it raises, which its
test checks; the table must never name an op whose result is wrong.
"""

from __future__ import annotations

import math
import os
import random
import re
import warnings
import zlib
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
from torch.testing._internal.common_device_type import toleranceOverride
from torch.testing._internal.common_methods_invocations import op_db

import shoal
from shoal import GlobalTensor
from shoal.graph.trace import TraceError
from shoal.sbp import Broadcast, Partial, Split, sbp_str
from shoal.testing import assert_same_value

FULL = os.environ.get("SHOAL_OPINFO", "") == "full"
SEEDS = (0, 1, 2) if FULL else (0, 1)
MESH_SHAPES = ((2,), (3,), (2, 2))
# the meshes each seed runs on: the default seeds meet every mesh, the full sweep's the 2-D one twice
# (a cold decision on a 2-D mesh costs about ten times one on a 1-D mesh: the boxing planner searches
# every pair of axis layouts for each candidate signature)
SEED_MESHES = {0: ((2,), (2, 2)), 1: ((3,), (2,)), 2: ((3,), (2, 2))}
RUNS = tuple((seed, shape) for seed in SEEDS for shape in SEED_MESHES[seed])
RTOL, ATOL = 1e-4, 1e-5
# torch's defaults for result dtypes less precise than float32 (torch.testing.assert_close)
_LOW_PRECISION = {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.complex32: (1e-3, 1e-5)}

# The known gaps: op (OpInfo name, with its variant) -> (why shoal does not run it, a regex of the
# error every failing run raises). Its test checks that the runs that fail raise exactly that, that
# the others still give torch's value, and that at least one still fails (else the gap is closed:
# remove the entry). Only ops that do not run belong here; a wrong value is a bug, never a gap.
_SPARSE = ("a sparse CSR input: GlobalTensors hold strided (dense) shards only",
           r"to_global: shoal lays out strided \(dense\) tensors only")
GAPS: dict[str, tuple[str, str]] = {
    "sparse.sampled_addmm": _SPARSE,
    "sparse.mm.reduce": _SPARSE,
    "resize_": ("resize_ changes a tensor's shape in place: a GlobalTensor's shape is fixed outside in-place "
                "view ops (torch's wrapper subclasses keep their sizes)", r"shoal: aten\.resize_\.default changes"),
}


def _name(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def _cases() -> list:
    out = []
    for op in op_db:
        dtypes = op.supported_dtypes("cpu")
        if torch.float32 not in dtypes:
            continue
        for dtype in (torch.float32, torch.complex64):
            if dtype in dtypes:
                out.append(pytest.param(op, dtype, id=f"{_name(op)}-{str(dtype).removeprefix('torch.')}"))
    return out


CASES = _cases()


# -- what is compared, and how closely -------------------------------------------------------------


_OP_TOL: dict = {}


def _op_tolerance(op, dtype) -> tuple[float, float]:
    """op_db's own (rtol, atol) for ``dtype``: the largest any of its toleranceOverrides gives."""
    key = (_name(op), dtype)
    if key not in _OP_TOL:
        rtol, atol = RTOL, ATOL
        for info in op.decorators:
            for dec in getattr(info, "decorators", (info,)):
                if isinstance(dec, toleranceOverride) and dtype in dec.d:
                    rtol, atol = max(rtol, dec.d[dtype].rtol), max(atol, dec.d[dtype].atol)
        _OP_TOL[key] = (rtol, atol)
    return _OP_TOL[key]


def _tolerance(op, dtype, t) -> tuple[float, float]:
    rtol, atol = _op_tolerance(op, dtype)
    low = _LOW_PRECISION.get(t.dtype) if isinstance(t, torch.Tensor) else None
    return (max(rtol, low[0]), max(atol, low[1])) if low else (rtol, atol)


def _flat(obj) -> list:
    if isinstance(obj, (list, tuple)):
        return [x for o in obj for x in _flat(o)]
    return [obj]


def _map(fn, obj):
    """``obj`` (a sample's input, args or kwargs) with every tensor replaced by ``fn(tensor)``."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map(fn, o) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(fn, o) for o in obj)
    if isinstance(obj, dict):
        return {k: _map(fn, v) for k, v in obj.items()}
    return obj


def _tensors(obj) -> list[torch.Tensor]:
    found: list = []
    _map(found.append, obj)
    return found


def _compare(op, dtype, got, want, what: str) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{what}: {type(got).__name__} where torch gives a tensor"
        if op.has_nondeterministic_output:  # torch leaves the values undefined (empty_like)
            assert (tuple(got.shape), got.dtype) == (tuple(want.shape), want.dtype), f"{what}: {got} != {want}"
            return
    rtol, atol = _tolerance(op, dtype, want)
    assert_same_value(got, want, what, rtol=rtol, atol=atol)


# -- one run: a sample on a mesh with a seed -------------------------------------------------------


@dataclass
class Stats:
    samples: int = 0  # (sample, mesh, seed) runs compared
    outputs: int = 0  # tensors and values compared
    grads: int = 0  # input gradients compared
    no_tensor: int = 0  # samples without a tensor: nothing reaches shoal
    gap_raised: int = 0  # runs of a GAPS op that raised its documented error
    layouts: Counter = field(default_factory=Counter)  # SBPs laid out, by kind
    meshes: Counter = field(default_factory=Counter)  # runs per mesh shape
    ops: set = field(default_factory=set)  # (op, dtype) with at least one compared run
    factories: set = field(default_factory=set)  # (op, dtype) none of whose samples holds a tensor
    gap_cases: set = field(default_factory=set)  # (op, dtype) of GAPS checked
    compiled: int = 0  # compiled runs compared
    compiled_value_reads: int = 0  # compiled runs refused because the op reads a value while tracing
    sensitive: list = field(default_factory=list)  # comparisons passed within torch's own sensitivity
    rounding: list = field(default_factory=list)  # runs that differ in float32 only (equal in double precision)
    torch_raises: list = field(default_factory=list)  # runs where torch raised, and shoal alike

    def add(self, other: Stats) -> None:
        for k in ("samples", "outputs", "grads", "no_tensor", "gap_raised", "compiled", "compiled_value_reads"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.layouts.update(other.layouts)
        self.meshes.update(other.meshes)
        self.ops |= other.ops
        self.factories |= other.factories
        self.gap_cases |= other.gap_cases
        self.sensitive += other.sensitive
        self.rounding += other.rounding
        self.torch_raises += other.torch_raises


STATS = Stats()


def _seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def _on_grid(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``v`` rounded to 4 significant bits fewer than its dtype has, the grid step of each element:
    2**(exponent - those bits)). Multiples of an element's step whose magnitudes stay below 16 |v| add
    up exactly, in any order (float32: 20 bits; bfloat16: 4)."""
    if v.is_complex():
        (re, gr), (im, gi) = _on_grid(v.real), _on_grid(v.imag)
        return torch.complex(re, im), torch.complex(gr, gi)
    finite = torch.isfinite(v)
    _, e = torch.frexp(torch.where(finite, v, 0))
    tiny = torch.finfo(v.dtype).smallest_normal * torch.finfo(v.dtype).eps  # the least subnormal
    bits = round(-math.log2(torch.finfo(v.dtype).eps)) + 1 - 4
    step = torch.ldexp(torch.ones_like(v), e - bits).clamp_min(tiny)
    return torch.where(finite, torch.round(v / step) * step, v), step


def _pieces(v: torch.Tensor, step: torch.Tensor, n: int, gen: torch.Generator) -> list[torch.Tensor]:
    """``n`` pieces summing to ``v`` (on its grid) exactly: noise of either sign, up to |v| each."""
    def noise(part, st):  # none for inf, nan and values near overflow: they stay whole in the first piece
        r = torch.rand(part.shape, generator=gen, dtype=part.dtype) * 2 - 1
        room = part.abs() < torch.finfo(part.dtype).max / 16
        return torch.where(room, torch.round(r * part.abs() / st) * st, 0)

    if v.is_complex():
        rs = [torch.complex(noise(v.real, step.real), noise(v.imag, step.imag)) for _ in range(n - 1)]
    else:
        rs = [noise(v, step) for _ in range(n - 1)]
    return [v - sum(rs), *rs]


def lay_out(t: torch.Tensor, mesh, sbp: tuple, seed: int, requires_grad: bool = False) -> GlobalTensor:
    """``t`` laid out as ``sbp``, as ``shoal.testing.make_global`` does, except that

    - a tensor with a Partial(sum) axis is first rounded to 4 significant bits fewer than its dtype
      has (20 for float32), and its pieces are noise of either sign, up to as large as the value
      (elementwise), on the value's grid: they sum to the value exactly, in any order, as do the pieces
      a linear op makes of them with a Broadcast operand on the grid (``x - x.amax()``). make_global's
      unit noise would bury a small value under its pieces' rounding (exact zeros come back as 1e-8s,
      at which ``x / x.norm()`` is anything) and round each sum another way: a test of rounding, not
      of shoal's layouts;
    - the copies along a Broadcast axis are copies, also of the Partial pieces of inner axes (make_global
      draws other pieces for each copy: each sums to the value but rounds differently, a state shoal
      never makes and need not expect)."""
    gen = torch.Generator().manual_seed(seed)
    v = t.detach()
    step = None
    if any(isinstance(s, Partial) for s in sbp):
        v, step = _on_grid(v)
    # noise is at most |v| per piece and a (2, 2) mesh makes 4 pieces: magnitudes stay below 16 |v|

    def rec(v: torch.Tensor, step, axis: int) -> list:
        """The shards of the sub-mesh of axes ``axis``... (row-major) holding ``v``."""
        if axis == mesh.ndim:
            return [v.clone()]
        n, s = mesh.shape[axis], sbp[axis]
        if isinstance(s, Broadcast):
            sub = rec(v, step, axis + 1)
            return [x.clone() for _ in range(n) for x in sub]
        if isinstance(s, Split):
            pieces = list(zip(torch.tensor_split(v, n, s.dim),
                              torch.tensor_split(step, n, s.dim) if step is not None else [None] * n))
        else:
            pieces = [(p, step) for p in _pieces(v, step, n, gen)]
        return [x for piece, st in pieces for x in rec(piece, st, axis + 1)]

    shards = dict(zip(mesh.devices, rec(v, step, 0)))
    g = shoal.from_local(shards, mesh, sbp, shape=tuple(t.shape), dtype=t.dtype)
    return g.requires_grad_(requires_grad) if requires_grad else g


def _layout(t: torch.Tensor, mesh, rng: random.Random) -> tuple:
    one = [Broadcast(), *(Split(d) for d in range(t.ndim))]
    if t.dtype.is_floating_point or t.dtype.is_complex:
        one.append(Partial("sum"))
    return tuple(rng.choice(one) for _ in range(mesh.ndim))


class _Laid:
    """A sample's tensors as GlobalTensors laid out at random, and as plain tensors holding the
    same global values (a Partial's pieces sum to the value up to rounding: torch gets that sum)."""

    def __init__(self, sample, mesh, rng: random.Random, stats: Stats) -> None:
        self.glob: dict[int, GlobalTensor] = {}
        self.plain: dict[int, torch.Tensor] = {}
        self.sbps: list = []
        self.mesh, self.rng, self.stats = mesh, rng, stats
        self.parts = (sample.input, sample.args, sample.kwargs)
        self.gparts = _map(self._lay, self.parts)
        self.pparts = _map(lambda t: self.plain[id(t)], self.parts)

    def _lay(self, t: torch.Tensor) -> GlobalTensor:
        if id(t) in self.glob:  # one tensor passed twice stays one tensor
            return self.glob[id(t)]
        if t.layout != torch.strided:  # shoal's answer (a clear error) is what the gap table expects
            return shoal.to_global(t, self.mesh, (Broadcast(),) * self.mesh.ndim)
        sbp = _layout(t, self.mesh, self.rng)
        g = lay_out(t, self.mesh, sbp, self.rng.randrange(1 << 30), t.requires_grad)
        with torch.no_grad():
            p = g.full()
        self.glob[id(t)], self.plain[id(t)] = g, p.requires_grad_(t.requires_grad)
        self.sbps.append(sbp)
        self.stats.layouts.update(type(s).__name__ for s in sbp)
        return g

    def leaves(self) -> tuple[list, list]:
        keys = [k for k, p in self.plain.items() if p.requires_grad]
        return [self.glob[k] for k in keys], [self.plain[k] for k in keys]

    def describe(self) -> str:
        return ", ".join(sbp_str(s) for s in self.sbps)


def _call(op, parts):
    inp, args, kwargs = parts
    return op(inp, *args, **kwargs)


def _differentiable(sample, out) -> list:
    return [o for o in _flat(sample.output_process_fn_grad(out)) if isinstance(o, torch.Tensor) and o.requires_grad]


def _torch_run(op, sample, plain: dict, parts, seed: int, cots) -> list:
    """Plain torch on ``parts`` (whose tensors are ``plain``'s): every output, every input after the
    op, and with cotangents ``cots`` the gradients of the inputs that require grad."""
    torch.manual_seed(seed)
    out = _call(op, parts)
    found = _flat(out) + [t.detach() for t in plain.values()]
    if cots is not None:
        leaves = [t for t in plain.values() if t.requires_grad]
        found += torch.autograd.grad(_differentiable(sample, out), leaves, cots, allow_unused=True)
    return found


_WIDER = {torch.float32: torch.float64, torch.complex64: torch.complex128}


def _upcast(sample):
    """The sample in double precision (float32 and complex64 tensors and dtype arguments)."""
    seen: dict = {}

    def f(t):
        if isinstance(t, torch.dtype):
            return _WIDER.get(t, t)
        if id(t) not in seen:
            seen[id(t)] = t.to(_WIDER.get(t.dtype, t.dtype)).requires_grad_(t.requires_grad)
        return seen[id(t)]

    return sample.transform(f)


def run_sample(op, dtype, sample, mesh, seed: int, stats: Stats) -> None:
    """One sample of ``op`` on ``mesh``, layouts drawn with ``seed``: outputs, inputs (an op may write
    them) and gradients equal plain torch's.

    A difference beyond the tolerance and torch's own sensitivity (``_compare_all``) is looked at again
    in double precision, same layouts: a wrong layout rule is as wrong there, while the rounding of
    sums taken in another order (a Partial's pieces minus a number cancelling to ulps of 2000, in
    logsumexp's backward at large inputs) shrinks by 2**29. Such comparisons are counted and listed."""
    try:
        _run_sample(op, dtype, sample, mesh, seed, stats)
    except AssertionError as e:
        wide = _WIDER.get(dtype)
        if wide is None or wide not in op.supported_dtypes("cpu") or "within the tolerance" not in str(e):
            raise
        try:
            _run_sample(op, wide, _upcast(sample), mesh, seed, Stats(), layouts_of=dtype)
        except Exception as e64:  # noqa: BLE001 - the double precision run decides
            raise AssertionError(f"{e}\n(in double precision too: {type(e64).__name__}: {e64})") from e
        stats.rounding.append(str(e).splitlines()[0])
        stats.samples += 1
        stats.meshes[mesh.shape] += 1


def _run_sample(op, dtype, sample, mesh, seed: int, stats: Stats, layouts_of=None) -> None:
    rng = random.Random(_seed_of(_name(op), str(layouts_of or dtype), mesh.shape, seed))
    laid = _Laid(sample, mesh, rng, stats)
    what = f"{_name(op)} {dtype} on mesh {mesh.shape} with inputs [{laid.describe()}]"
    torch.manual_seed(seed)
    try:
        want = _call(op, laid.pparts)
    except Exception as e:  # noqa: BLE001 - torch refuses the sample: so must shoal, alike
        _raises_alike(op, laid, seed, e, what, stats)
        return
    torch.manual_seed(seed)
    got = _call(op, laid.gparts)
    fw, fg = _flat(want), _flat(got)
    assert len(fg) == len(fw), f"{what}: {len(fg)} outputs, torch gives {len(fw)}"
    pairs = [(f"{what}: output {i}", g, w) for i, (g, w) in enumerate(zip(fg, fw))]
    pairs += [(f"{what}: input {i} after the op", laid.glob[k].detach(), p.detach())
              for i, (k, p) in enumerate(laid.plain.items())]
    stats.outputs += len(pairs)
    cots = None
    if op.supports_autograd and dtype in op.supported_backward_dtypes("cpu"):
        cots = _grads(sample, laid, got, want, rng, what, pairs, stats)
    _compare_all(op, dtype, pairs, lambda parts_plain, parts: _torch_run(op, sample, parts_plain, parts, seed, cots),
                 laid, stats)
    stats.samples += 1
    stats.meshes[mesh.shape] += 1


def _raises_alike(op, laid: _Laid, seed: int, err: Exception, what: str, stats: Stats) -> None:
    """Torch raised ``err`` on the sample (jiterator ops off CUDA; as_strided reaching past the
    elements of a view into its base's storage, which the values alone do not have): shoal raises the
    same kind of error."""
    torch.manual_seed(seed)
    try:
        _call(op, laid.gparts)
    except type(err):
        stats.torch_raises.append(what)
        stats.samples += 1
        stats.meshes[laid.mesh.shape] += 1
        return
    except Exception as e:
        raise AssertionError(f"{what}: torch raises {type(err).__name__}: {err}; shoal raises "
                             f"{type(e).__name__}: {e}") from e
    raise AssertionError(f"{what}: torch raises {type(err).__name__}: {err}; shoal raises nothing")


def _grads(sample, laid: _Laid, got, want, rng, what: str, pairs: list, stats: Stats):
    """Appends (what, shoal's gradient, torch's) to ``pairs`` for a random cotangent (laid out at
    random too); returns torch's cotangents, or None without a gradient to compare."""
    gleaves, pleaves = laid.leaves()
    if not gleaves:
        return None
    ow, og = _differentiable(sample, want), _differentiable(sample, got)
    assert len(og) == len(ow), f"{what}: {len(og)} differentiable outputs, torch gives {len(ow)}"
    if not ow:
        return None
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    gcots, pcots = [], []
    for o in ow:
        c = torch.randn(o.shape, dtype=o.dtype, generator=gen)
        gc = lay_out(c, laid.mesh, _layout(c, laid.mesh, rng), rng.randrange(1 << 30))
        gcots.append(gc)
        pcots.append(gc.full())
    gw = torch.autograd.grad(ow, pleaves, pcots, allow_unused=True)
    gg = torch.autograd.grad(og, gleaves, gcots, allow_unused=True)
    for k, (g, w) in enumerate(zip(gg, gw)):
        if w is not None:
            assert g is not None, f"{what}: no gradient for input {k}, torch gives one"
            stats.grads += 1
        pairs.append((f"{what}: gradient of input {k}", g, w))
    return pcots


# Where shoal's value differs from torch's by more than the tolerance, torch's own sensitivity decides:
# torch reruns on the inputs scaled elementwise by 1 + d (|d| <= 2**-20, about 8 float32 ulps, a few
# draws). A difference within twice the largest change torch itself shows there (plus the tolerance)
# is rounding, amplified by an ill-conditioned op or sample (a cancelling sum, a singular value
# compared with a threshold, pca_lowrank): shoal computes sums in other orders. Such comparisons are
# counted and listed by ``summary()``; a wrong value is far outside this on a well-conditioned op.
_PERTURB, _DRAWS = 2.0**-20, 4


def _compare_all(op, dtype, pairs: list, rerun, laid: _Laid, stats: Stats) -> None:
    failed = []
    for i, (what, g, w) in enumerate(pairs):
        if w is None:
            continue
        try:
            _compare(op, dtype, g, w, what)
        except AssertionError as e:
            failed.append((i, e))
    if not failed:
        return
    for _i, e in failed:  # only a value off: shapes, shards and copies of a Broadcast value must be right as they are
        if "are not close" not in str(e) or "copies on devices" in str(e):
            raise e
    spreads = _spreads(pairs, rerun, laid)
    for i, e in failed:
        what, g, w = pairs[i]
        if not (isinstance(w, torch.Tensor) and isinstance(g, torch.Tensor) and _within(op, dtype, g, w, spreads[i])):
            raise AssertionError(f"{e}\n(not within the tolerance and twice the change torch's own result shows "
                                 f"for its inputs perturbed by {_PERTURB:.1e})") from e
        stats.sensitive.append(what)


def _spreads(pairs: list, rerun, laid: _Laid) -> list:
    """Per compared value: the most torch's own result moves (elementwise) when its inputs do by 2**-20."""
    gen = torch.Generator().manual_seed(0)
    spread: list = [None] * len(pairs)
    for _ in range(_DRAWS):
        plain = {}
        for k, t in laid.plain.items():
            x = t.detach()
            if x.is_floating_point() or x.is_complex():
                d = (torch.rand(x.shape, generator=gen, dtype=x.dtype) * 2 - 1) * _PERTURB
                x = x * (1 + d)
            plain[k] = x.requires_grad_(t.requires_grad)
        parts = _map(lambda t, plain=plain: plain[id(t)], laid.parts)
        for i, ((_, _, w), v) in enumerate(zip(pairs, rerun(plain, parts))):
            if isinstance(w, torch.Tensor) and isinstance(v, torch.Tensor) and v.shape == w.shape:
                d = _distance(v.detach(), w.detach())
                spread[i] = d if spread[i] is None else torch.maximum(spread[i], d)
    return spread


def _distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| elementwise in float64, 0 where both are the same inf or nan, inf where one is not finite."""
    a, b = a.to(torch.complex128 if a.is_complex() else torch.float64), b.to(torch.complex128 if b.is_complex()
                                                                               else torch.float64)
    d = (a - b).abs()
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    return torch.where(same, 0.0, torch.where(torch.isfinite(d), d, torch.inf))


def _within(op, dtype, got, want, spread) -> bool:
    if spread is None:
        return False
    g = got.full() if isinstance(got, GlobalTensor) else got
    if g.shape != want.shape or g.dtype != want.dtype:
        return False
    rtol, atol = _tolerance(op, dtype, want)
    w = want.detach()
    allowed = atol + rtol * w.to(torch.complex128 if w.is_complex() else torch.float64).abs() + 2 * spread
    return bool((_distance(g.detach(), w) <= allowed).all())


# -- which samples ---------------------------------------------------------------------------------


def _requires_grad(op, dtype) -> bool:
    return op.supports_autograd and dtype in op.supported_backward_dtypes("cpu")


def _sample_iter(op, dtype):
    """``op.sample_inputs("cpu", dtype, requires_grad=...)`` without its per-sample stack walk: the
    same samples, each made after seeding the generator (with 0)."""
    it = iter(op.sample_inputs_func(op, "cpu", dtype, _requires_grad(op, dtype)))
    while True:
        torch.random.default_generator.manual_seed(0)
        try:
            yield next(it)
        except StopIteration:
            return


def samples(op, dtype, full: bool = FULL) -> list:
    """Every sample (``full``), else one: among the first eight, the first whose non-empty tensors have
    the most dims."""
    it = _sample_iter(op, dtype)
    if full:
        return list(it)
    first = [s for _, s in zip(range(8), it)]
    if not first:
        return []
    return [max(first, key=lambda s: sum(t.ndim for t in _tensors((s.input, s.args, s.kwargs)) if t.numel()))]


def run_case(op, dtype, meshes, full: bool = FULL, runs=RUNS) -> Stats:
    stats = Stats()
    found = samples(op, dtype, full)
    assert found, f"{_name(op)} has no samples for {dtype}"
    for sample in found:
        if not _tensors((sample.input, sample.args, sample.kwargs)):
            stats.no_tensor += 1  # a factory: nothing reaches shoal
            continue
        for seed, shape in runs:
            run_sample(op, dtype, sample, meshes[shape], seed, stats)
    if stats.samples:
        stats.ops.add((_name(op), dtype))
    else:
        stats.factories.add((_name(op), dtype))
    return stats


def run_gap(op, dtype, meshes, full: bool = FULL, runs=RUNS) -> Stats:
    """A GAPS op: every run either raises the documented error or gives torch's value; one raises."""
    reason, pattern = GAPS[_name(op)]
    stats = Stats()
    for sample in samples(op, dtype, full):
        for seed, shape in runs:
            try:
                run_sample(op, dtype, sample, meshes[shape], seed, stats)
            except Exception as e:  # noqa: BLE001 - checked against the table (a wrong value never matches)
                if not re.search(pattern, f"{type(e).__name__}: {e}"):
                    raise AssertionError(f"{_name(op)} is a known gap ({reason}), but it raised another "
                                         f"error than /{pattern}/: {type(e).__name__}: {e}") from e
                stats.gap_raised += 1
    assert stats.gap_raised, f"{_name(op)} {dtype} ran everywhere: remove it from GAPS ({reason})"
    return stats


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fallback notices, op_db's deprecation warnings
        yield


@pytest.mark.parametrize(("op", "dtype"), CASES)
def test_op(op, dtype, meshes):
    if _name(op) in GAPS:
        STATS.add(run_gap(op, dtype, meshes))
        STATS.gap_cases.add((_name(op), dtype))
    else:
        STATS.add(run_case(op, dtype, meshes))


# -- compiled ----------------------------------------------------------------------------------------


def _seeds_inside(op) -> bool:
    """op_db runs random ops as ``wrapper_set_seed(fn, ...)``: ``torch.manual_seed(42)`` inside the op.
    A compiled step's Python runs once, while it is traced: its plan draws from the caller's
    generator, so such ops are compared eagerly only."""
    return "wrapper_set_seed" in getattr(getattr(op.op, "__code__", None), "co_names", ())


def _compiled_cases() -> list:
    """Every eighth case (by a stable hash of its name), not a gap, not seeding inside."""
    return [c for c in CASES if _name(c.values[0]) not in GAPS and not _seeds_inside(c.values[0])
            and zlib.crc32(c.id.encode()) % 8 == 0]


# what a compiled step may answer instead of a value: an op that cannot run on shapes alone
_REFUSALS = ("reads a tensor's value into Python", "cannot be traced")


def run_compiled(op, dtype, sample, mesh, seed: int, stats: Stats) -> None:
    """``op`` on the sample's tensors inside ``shoal.compile``: traced once, run twice as a plan."""
    rng = random.Random(_seed_of("compiled", _name(op), str(dtype), mesh.shape, seed))
    laid = _Laid(sample, mesh, rng, stats)
    what = f"compiled {_name(op)} {dtype} on mesh {mesh.shape} with inputs [{laid.describe()}]"
    keys = list(laid.glob)

    def step(*ts):
        by = dict(zip(keys, ts))
        return _call(op, _map(lambda t: by[id(t)], laid.parts))

    with torch.no_grad():
        torch.manual_seed(seed)
        try:
            want = _call(op, laid.pparts)
        except Exception as e:  # noqa: BLE001 - torch refuses the sample: so must the compiled step
            with pytest.raises(type(e)):
                shoal.compile(step)(*laid.glob.values())
            stats.torch_raises.append(what)
            return
        fn = shoal.compile(step)
        for _ in range(2):  # the first call traces and runs, the second runs the plan again
            args = [lay_out(laid.plain[k], mesh, laid.glob[k].sbp, i) for i, k in enumerate(keys)]
            torch.manual_seed(seed)
            try:
                got = fn(*args)
            except TraceError as e:
                assert any(r in str(e) for r in _REFUSALS), f"{what}: {e}"
                stats.compiled_value_reads += 1
                return
            fw, fg = _flat(want), _flat(got)
            assert len(fg) == len(fw), f"{what}: {len(fg)} outputs, torch gives {len(fw)}"
            for i, (g, w) in enumerate(zip(fg, fw)):
                _compare(op, dtype, g, w, f"{what}: output {i}")
    stats.compiled += 1


@pytest.mark.parametrize(("op", "dtype"), _compiled_cases())
def test_op_compiled(op, dtype, meshes):
    stats = Stats()
    for sample in samples(op, dtype, full=False):
        if _tensors((sample.input, sample.args, sample.kwargs)):
            run_compiled(op, dtype, sample, meshes[(2, 2)], 0, stats)
    STATS.add(stats)


# -- what the sweep found, one test each (issue 15) -------------------------------------------------

_Z = torch.randn(4, 6, dtype=torch.complex64, generator=torch.Generator().manual_seed(15))


@pytest.mark.parametrize("sbp", [Broadcast(), Split(0), Split(1), Partial("sum")], ids=str)
def test_conjugate_bit_is_kept(sbp, meshes):
    """``x.conj()`` only sets a bit, which shard kernels (below the Conjugate key) would ignore: the
    conjugate is computed on the shards."""
    g = lay_out(_Z, meshes[(2,)], (sbp,), 0)
    assert_same_value(g.conj() * g, _Z.conj() * _Z, "conj(z) * z")
    assert_same_value(g.conj().imag, _Z.conj().imag, "conj(z).imag")
    assert_same_value(torch.view_as_real(g.conj()), torch.view_as_real(_Z.conj().resolve_conj()), "view_as_real")
    assert_same_value(g.mH @ g, _Z.mH @ _Z, "z^H z", rtol=1e-4, atol=1e-5)
    assert_same_value(torch._neg_view(g) + g, torch.zeros_like(_Z), "neg_view")


@pytest.mark.parametrize("sbp", [Broadcast(), Split(0), Split(1)], ids=str)
def test_hfft_values_and_gradients(sbp, meshes):
    """hfft/hfftn conjugate inside (``_conj``); their backward viewed a conjugated shard as real."""
    mesh = meshes[(2,)]
    z = _Z.clone().requires_grad_()
    want = torch.fft.hfft(z)
    cot = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    (want_grad,) = torch.autograd.grad(want, z, cot)
    g = lay_out(_Z, mesh, (sbp,), 0, requires_grad=True)
    got = torch.fft.hfft(g)
    assert_same_value(got, want, "hfft", rtol=1e-4, atol=1e-4)
    (grad,) = torch.autograd.grad(got, g, lay_out(cot, mesh, (sbp,), 1))
    assert_same_value(grad, want_grad, "hfft gradient", rtol=1e-4, atol=1e-4)
    assert_same_value(torch.fft.hfftn(lay_out(_Z, mesh, (sbp,), 0)), torch.fft.hfftn(_Z), "hfftn", rtol=1e-4, atol=1e-4)


def test_fallback_kernels_see_conjugate_bits(meshes):
    """An op without a rule runs torch's kernel on the shards; pinv's kernel conjugates (``mH``) inside."""
    g = lay_out(_Z[:, :4], meshes[(3,)], (Partial("sum"),), 0)
    assert_same_value(torch.linalg.pinv(g), torch.linalg.pinv(g.full()), "pinv", rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["cauchy_", "geometric_", "log_normal_", "exponential_", "uniform_", "normal_"])
@pytest.mark.parametrize("shape", [(2,), (3,), (2, 2)])
def test_random_fills_draw_what_one_device_draws(name, shape, meshes):
    mesh = meshes[shape]
    args = (0.3,) if name == "geometric_" else ()
    x = torch.randn(5, 7)
    for sbp in [(Split(0),) * mesh.ndim, (Split(1),) * mesh.ndim, (Broadcast(),) * mesh.ndim]:
        torch.manual_seed(3)
        want = getattr(x.clone(), name)(*args)
        torch.manual_seed(3)
        got = getattr(lay_out(x, mesh, sbp, 0), name)(*args)
        assert torch.equal(got.full(), want), f"{name} on {sbp_str(sbp)}"


@pytest.mark.parametrize("sbp", [Broadcast(), Split(0), Split(1), Partial("sum")], ids=str)
def test_random_ops_without_rules_draw_once(sbp, meshes):
    """multinomial, normal and bernoulli with tensor arguments, rrelu: no rule, drawn once on the
    gathered values (never once per device, never by a decomposition that draws other numbers)."""
    mesh = meshes[(2, 2)]
    probs = torch.rand(4, 6, generator=torch.Generator().manual_seed(0)) + 0.1
    mean, std = torch.randn(4, 6), torch.rand(4, 6) + 0.5
    fns = {
        "multinomial": lambda p, m, s: torch.multinomial(p, 3),
        "bernoulli": lambda p, m, s: torch.bernoulli(p / 2),
        "normal": lambda p, m, s: torch.normal(m, s),
        "rrelu": lambda p, m, s: torch.nn.functional.rrelu(m, training=True),
        "poisson": lambda p, m, s: torch.poisson(p),
    }
    for name, fn in fns.items():
        torch.manual_seed(7)
        want = fn(probs, mean, std)
        args = [lay_out(t, mesh, (sbp, Broadcast()), i) for i, t in enumerate((probs, mean, std))]
        torch.manual_seed(7)
        got = fn(*(a.full() for a in args))  # the values the GlobalTensors hold (a Partial rounds)
        torch.manual_seed(7)
        assert_same_value(fn(*args), got, f"{name} with {sbp_str((sbp,))}")
        if not isinstance(sbp, Partial):
            assert torch.equal(got, want)


@pytest.mark.parametrize("sbp", [Broadcast(), Split(0)], ids=str)
def test_tensor_split_by_a_tensor(sbp, meshes):
    """ATen reads the indices' memory above __torch_dispatch__: "data is not allocated yet" before."""
    mesh = meshes[(2,)]
    x = torch.randn(5, 6)
    for idx in (torch.tensor([1, 3]), torch.tensor(3)):
        for dim in (0, 1):
            want = torch.tensor_split(x, idx, dim)
            got = torch.tensor_split(lay_out(x, mesh, (Split(0),), 0), lay_out(idx, mesh, (sbp,) if idx.ndim else
                                                                               (Broadcast(),), 0), dim)
            assert_same_value(list(got), list(want), f"tensor_split({list(idx.shape)}, dim={dim})")


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
def test_householder_product_and_ormqr_gradients(dtype, meshes):
    """Their backward writes into views of its own tensors (fixed with writes through views) and
    conjugates (complex)."""
    mesh = meshes[(2,)]
    gen = torch.Generator().manual_seed(0)
    a, tau, c = (torch.randn(s, dtype=dtype, generator=gen) for s in ((5, 3), (3,), (5, 4)))
    cases = {"householder_product": (torch.linalg.householder_product, (a, tau)),
             "ormqr": (torch.ormqr, (a, tau, c))}
    for name, (fn, xs) in cases.items():
        plain = [x.clone().requires_grad_() for x in xs]
        fn(*plain).abs().sum().backward()
        for sbp in (Broadcast(), Split(0), Partial("sum")):
            leaves = [x.clone().requires_grad_() for x in xs]  # to_global is differentiable
            fn(*(shoal.to_global(x, mesh, sbp if x.ndim == 2 else Broadcast()) for x in leaves)).abs().sum().backward()
            for k, (got, want) in enumerate(zip(leaves, plain)):
                assert_same_value(got.grad, want.grad, f"{name} {dtype} {sbp_str((sbp,))}: gradient {k}",
                                  rtol=1e-4, atol=1e-4)


def test_random_like_with_a_device_argument_draws_once(meshes):
    """A new decision ran the op on meta tensors, but ``device="cpu"`` made that run real: it drew
    numbers first, and the user got the next ones."""
    x = torch.randn(7, 3)
    for fn in (torch.randn_like, torch.rand_like, lambda t, **kw: torch.randint_like(t, 9, **kw)):
        torch.manual_seed(5)
        want = fn(x, device="cpu")
        torch.manual_seed(5)
        got = fn(lay_out(x, meshes[(3,)], (Split(1),), 0), device="cpu", dtype=torch.float32)
        assert torch.equal(got.full(), want)


def test_index_decisions_tell_where_the_index_tensors_are(meshes):
    """The decision cache keyed a tensor like None: x[:, t] and x[:, :, t] (``[None, t, None]`` and
    ``[None, None, t]``) shared a decision, and the second got the first's shape (reflect padding)."""
    x, t = torch.randn(3, 4, 3), torch.tensor([0, 2, 1, 2])
    gx, gt = lay_out(x, meshes[(2,)], (Split(0),), 0), lay_out(t, meshes[(2,)], (Broadcast(),), 0)
    for indices in ([None, gt, None], [None, None, gt], [gt, None, None]):
        want = torch.ops.aten.index.Tensor(x, [None if i is None else t for i in indices])
        assert_same_value(torch.ops.aten.index.Tensor(gx, indices), want, str(indices))
    pad = torch.nn.functional.pad
    assert_same_value(pad(gx, (1, 2), mode="reflect"), pad(x, (1, 2), mode="reflect"), "reflect padding")


@pytest.mark.parametrize("shape", [(2,), (3,), (2, 2)])
def test_cdist_with_broadcast_batches_and_rowless_shards(shape, meshes):
    """cdist's rule split x2 by x1's rank (its features, when the batch dims broadcast), and torch's
    backward kernel returns zeros of x1's unbroadcast shape for a shard without rows."""
    mesh = meshes[shape]
    gen = torch.Generator().manual_seed(0)
    for s1, s2 in (((2, 5, 3), (4, 3)), ((5, 3), (2, 4, 3)), ((1, 2, 2), (2, 1, 1, 2))):
        a, b = torch.randn(s1, generator=gen), torch.randn(s2, generator=gen)
        pa, pb = a.clone().requires_grad_(), b.clone().requires_grad_()
        want = torch.cdist(pa, pb)
        cot = torch.randn(want.shape, generator=gen)
        want_grads = torch.autograd.grad(want, (pa, pb), cot)
        for k in range(4):
            sa = (Split(a.ndim - 2 + k % 2),) * mesh.ndim
            sb = (Split(b.ndim - 2 + k // 2 % 2) if k < 2 else Broadcast(),) * mesh.ndim
            ga, gb = lay_out(a, mesh, sa, 0, True), lay_out(b, mesh, sb, 1, True)
            got = torch.cdist(ga, gb)
            what = f"cdist {s1} {s2} with {sbp_str(sa)}, {sbp_str(sb)}"
            assert_same_value(got, want, what, rtol=1e-4, atol=1e-5)
            grads = torch.autograd.grad(got, (ga, gb), lay_out(cot, mesh, (Broadcast(),) * mesh.ndim, 2))
            assert_same_value(list(grads), list(want_grads), what + ": gradients", rtol=1e-4, atol=1e-4)


def test_compiled_steps_decide_unseen_ops(meshes):
    """Deciding an op runs it (and may run torch's decomposition) on meta tensors; while a step was traced,
    the tracer recorded those runs (diag_embed's ``to.dtype``) and its verifier stopped the step."""
    mesh = meshes[(2, 2)]
    z = torch.randn(3, 7, dtype=torch.complex64)  # shapes no other test uses: decisions made while tracing
    a, b, c = torch.randn(2, 3, 7), torch.randn(2, 3, 5), torch.randn(2, 5, 7)
    rep = (Broadcast(), Broadcast())
    assert_same_value(shoal.compile(torch.diag_embed)(lay_out(z, mesh, rep, 0)), torch.diag_embed(z), "diag_embed")
    got = shoal.compile(lambda *t: torch.baddbmm(*t, beta=0.5))(*(lay_out(t, mesh, rep, 0) for t in (a, b, c)))
    assert_same_value(got, torch.baddbmm(a, b, c, beta=0.5), "baddbmm", rtol=1e-4, atol=1e-5)


def test_downcast_of_a_partial_sum_rounds_the_sum(meshes):
    """bfloat16(a) + bfloat16(b) is not bfloat16(a + b): a Partial(sum) input is summed first."""
    x = torch.randn(6, 5) * 100
    g = lay_out(x, meshes[(3,)], (Partial("sum"),), 0)
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(g.to(dtype).full(), g.full().to(dtype)), dtype


def test_resize_is_refused_clearly(meshes):
    g = lay_out(torch.randn(5, 5), meshes[(2,)], (Split(0),), 0)
    with pytest.raises(NotImplementedError, match=r"resize_.*changes the shape of its input in place .*new_empty"):
        g.resize_(25, 1)


def test_compiled_steps_refuse_what_needs_values_clearly(meshes):
    mesh = meshes[(2,)]
    x = lay_out(torch.randn(5, 4), mesh, (Split(0),), 0)
    for fn, op in ((torch.nonzero, "nonzero"), (lambda t: torch.multinomial(t.abs() + 0.1, 2), "multinomial")):
        with pytest.raises(TraceError, match=rf"aten\.{op}.*cannot be traced.*\n.*test_opinfo\.py"):
            shoal.compile(fn)(x)


# -- what was covered --------------------------------------------------------------------------------


def summary(stats: Stats = STATS) -> dict:
    """What the tests of this module covered so far in this session."""
    ops = {name for name, _ in stats.ops}
    return {
        "mode": "full" if FULL else "default",
        "seeds": list(SEEDS),
        "ops": len(ops),
        "op_dtypes": len(stats.ops),
        "op_dtypes_float32": sum(1 for _, d in stats.ops if d == torch.float32),
        "op_dtypes_complex64": sum(1 for _, d in stats.ops if d == torch.complex64),
        "samples_run": stats.samples,
        "runs_per_mesh": {str(k): v for k, v in sorted(stats.meshes.items())},
        "outputs_compared": stats.outputs,
        "gradients_compared": stats.grads,
        "samples_without_tensors": stats.no_tensor,
        "ops_without_tensor_inputs": sorted({name for name, _ in stats.factories}),
        "gap_runs_raising": stats.gap_raised,
        "gaps": len(GAPS),
        "layouts_drawn": dict(stats.layouts),
        "within_torch_sensitivity": len(stats.sensitive),
        "within_torch_sensitivity_ops": sorted({w.split(" ")[0] for w in stats.sensitive}),
        "torch_raises_and_shoal_alike": len(stats.torch_raises),
        "torch_raises_and_shoal_alike_ops": sorted({w.removeprefix("compiled ").split(" ")[0]
                                                    for w in stats.torch_raises}),
        "equal_in_double_precision_only": len(stats.rounding),
        "equal_in_double_precision_only_ops": sorted({w.split(" ")[0] for w in stats.rounding}),
        "compiled_runs": stats.compiled,
        "compiled_refused_value_reads": stats.compiled_value_reads,
    }


def test_summary():
    """Runs last (pytest keeps file order); prints what the sweep covered (see it with ``pytest -s``)."""
    s = summary()
    print("\nshoal OpInfo sweep: " + ", ".join(f"{k}={v}" for k, v in s.items()))
    assert sum(STATS.meshes.values()) == STATS.samples
    cases = {(_name(c.values[0]), c.values[1]) for c in CASES}
    seen = STATS.ops | STATS.factories | STATS.gap_cases
    if seen == cases:  # the whole sweep ran in this session: every case is accounted for, and compared
        assert len(STATS.ops) + len(STATS.factories) + len(STATS.gap_cases) == len(cases)
        assert STATS.grads > 0 and STATS.compiled > 0
