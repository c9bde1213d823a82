"""The oracle: plain single-device torch is the truth for every GlobalTensor result.

``make_global`` builds a GlobalTensor in any layout from a full tensor, with *genuinely* partial
shards for Partial axes (random pieces, not one copy and zeros). ``check`` runs a function on plain
tensors and on GlobalTensors in every input layout and compares outputs and gradients.
"""

from __future__ import annotations

import itertools
import math
import random
import sys
from collections.abc import Callable, Sequence

import torch

from .mesh import Mesh
from .sbp import SBP, Broadcast, NdSBP, Partial, Split, normalize_sbp, sbp_str
from .tensor import GlobalTensor, from_local
from .world import world

__all__ = ["make_global", "layouts", "check", "assert_same_value", "value_of_shards"]


def _noise(v: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    if v.dtype.is_floating_point:
        return torch.randn(v.shape, generator=gen, dtype=v.dtype)
    return torch.randint(-3, 4, v.shape, generator=gen).to(v.dtype)


def _pieces(v: torch.Tensor, n: int, s: SBP, gen: torch.Generator) -> list[torch.Tensor]:
    if isinstance(s, Split):
        return list(torch.tensor_split(v, n, s.dim))
    if isinstance(s, Broadcast) or n == 1:
        return [v] * n
    if s.op == "sum":
        noise = [_noise(v, gen) for _ in range(n - 1)]
        return [v - sum(noise)] + noise if noise else [v]
    owner = torch.randint(0, n, v.shape, generator=gen)
    sign = -1 if s.op == "max" else 1
    return [torch.where(owner == i, v, v + sign * _noise(v, gen).abs()) for i in range(n)]


_REDUCE = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}


def value_of_shards(shards: Sequence, mesh: Mesh, sbp: NdSBP) -> torch.Tensor:
    """The global value ``shards`` (one per mesh position) make up by the SBP definitions alone:
    Split concatenates, Partial reduces, Broadcast copies must be equal (exactly)."""
    pos = {c: i for i, c in enumerate(mesh.coords)}

    def rec(axis, coord):
        if axis == mesh.ndim:
            return shards[pos[coord]]
        parts = [rec(axis + 1, (*coord, i)) for i in range(mesh.shape[axis])]
        s = sbp[axis]
        if isinstance(s, Split):
            return torch.cat(parts, s.dim)
        if isinstance(s, Broadcast):
            for q in parts[1:]:
                torch.testing.assert_close(q, parts[0], rtol=0, atol=0, msg="Broadcast copies differ")
            return parts[0]
        acc = parts[0]
        for q in parts[1:]:
            acc = _REDUCE[s.op](acc, q)
        return acc

    return rec(0, ())


def make_global(
    t: torch.Tensor, mesh: Mesh, sbp: SBP | Sequence[SBP], *, seed: int = 0, requires_grad: bool = False
) -> GlobalTensor:
    """``t`` laid out as ``sbp`` on ``mesh``; Partial axes hold random pieces whose reduction is ``t``."""
    nd = normalize_sbp(sbp, mesh.ndim, t.ndim, "make_global")
    gen = torch.Generator().manual_seed(seed)
    shards: dict[int, torch.Tensor] = {}
    w = world()

    def rec(v: torch.Tensor, axis: int, pos: int) -> None:
        if axis == mesh.ndim:
            dev = mesh.devices[pos]
            if w.owns(dev):
                shards[dev] = v.detach().clone().to(w.torch_device(dev))
            return
        n = mesh.shape[axis]
        for i, piece in enumerate(_pieces(v, n, nd[axis], gen)):
            rec(piece, axis + 1, pos * n + i)

    rec(t.detach(), 0, 0)
    g = from_local(shards, mesh, nd, shape=tuple(t.shape), dtype=t.dtype)
    return g.requires_grad_(requires_grad) if requires_grad else g


def layouts(ndim: int, mesh: Mesh, partial: Sequence[str] = ("sum",)) -> list[NdSBP]:
    """Every nd-SBP for a tensor of ``ndim`` dims: B, S(d) for each dim, and the given Partials."""
    one = [Broadcast(), *(Split(d) for d in range(ndim)), *(Partial(o) for o in partial)]
    return list(itertools.product(one, repeat=mesh.ndim))


def combinations(per_input: Sequence[Sequence], limit: int | None, seed: int = 0) -> list[tuple]:
    """Every choice of one layout per input (``itertools.product`` order), or ``limit`` distinct
    ones drawn with ``seed``: the same draw as sampling the listed product, without listing it
    (with many inputs it does not fit in memory)."""
    total = math.prod(len(c) for c in per_input)
    if limit is None or total <= limit:
        return list(itertools.product(*per_input))
    rng = random.Random(seed)
    if total <= sys.maxsize:
        picks = rng.sample(range(total), limit)
    else:  # sample() cannot index a range this long; repeats are all but impossible
        picks = list(dict.fromkeys(rng.randrange(total) for _ in range(limit)))
    out = []
    for i in picks:
        combo = []
        for choices in reversed(per_input):  # the last input varies fastest
            i, k = divmod(i, len(choices))
            combo.append(choices[k])
        out.append(tuple(reversed(combo)))
    return out


def assert_same_value(got, ref, what: str = "", rtol: float = 1e-5, atol: float = 1e-5) -> None:
    """``got`` (GlobalTensor, plain tensor or nested) holds the same value as ``ref``."""
    if isinstance(ref, torch.Tensor):
        if isinstance(got, GlobalTensor):
            if tuple(got.shape) != tuple(ref.shape):
                raise AssertionError(f"{what}: global shape {list(got.shape)} != {list(ref.shape)}")
            for p in got.mesh.local_positions:
                want = tuple(got.spec.local_shape(p))
                have = tuple(got._shards[p].shape)
                if have != want:
                    raise AssertionError(f"{what}: shard {p} has shape {list(have)}, its spec says {list(want)}")
            _same_replicas(got, what, rtol, atol)
            got = got.full()
        torch.testing.assert_close(got, ref, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{what}: {m}")
    elif isinstance(ref, (list, tuple)):
        assert len(got) == len(ref), f"{what}: {len(got)} outputs != {len(ref)}"
        for i, (g, r) in enumerate(zip(got, ref)):
            assert_same_value(g, r, f"{what}[{i}]", rtol, atol)
    elif isinstance(ref, float):
        if not math.isclose(got, ref, rel_tol=rtol, abs_tol=atol):
            raise AssertionError(f"{what}: {got!r} != {ref!r}")
    elif got != ref:
        raise AssertionError(f"{what}: {got!r} != {ref!r}")


def _same_replicas(t: GlobalTensor, what: str, rtol: float, atol: float) -> None:
    """Devices holding the same piece of a value without Partial axes (they differ only along
    Broadcast axes) hold the same numbers: whichever copy is read, it is one global value. (Boxing
    may sum in a different order on each device: equal within the tolerance, not bit for bit.)"""
    if any(isinstance(s, Partial) for s in t.sbp):
        return
    mesh, groups = t.mesh, {}
    for p in mesh.local_positions:
        coord = mesh.coord_of(mesh.devices[p])
        groups.setdefault(tuple(None if isinstance(s, Broadcast) else c for c, s in zip(coord, t.sbp)), []).append(p)
    for ps in groups.values():
        for q in ps[1:]:
            torch.testing.assert_close(
                t._shards[q], t._shards[ps[0]], rtol=rtol, atol=atol, equal_nan=True,
                msg=lambda m, q=q, p=ps[0]: f"{what}: the copies on devices {mesh.devices[p]} and {mesh.devices[q]} "
                f"of a {sbp_str(t.sbp)} value differ: {m}",
            )


def _flat_tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _flat_tensors(o)]
    return []


def check(
    fn: Callable,
    inputs: Sequence[torch.Tensor],
    mesh: Mesh,
    *,
    in_layouts: Sequence[Sequence[NdSBP]] | None = None,
    partial: Sequence[str] = ("sum",),
    grad: bool = True,
    max_combos: int | None = 64,
    seed: int = 0,
    rtol: float = 1e-5,
    atol: float = 1e-5,
) -> int:
    """``fn`` on GlobalTensors equals ``fn`` on plain tensors, outputs and input gradients, for every
    combination of input layouts (sampled down to ``max_combos`` with a fixed seed). Returns the count."""
    diff = [grad and t.dtype.is_floating_point for t in inputs]
    plain = [t.detach().clone().requires_grad_(d) for t, d in zip(inputs, diff)]
    ref = fn(*plain)
    ref_outs = [o for o in _flat_tensors(ref) if o.dtype.is_floating_point and o.requires_grad]
    gen = torch.Generator().manual_seed(seed)
    cots = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in ref_outs]
    ref_grads = None
    if grad and ref_outs:
        ref_grads = torch.autograd.grad(ref_outs, [p for p, d in zip(plain, diff) if d], cots, allow_unused=True)
    per_input = in_layouts or [layouts(t.ndim, mesh, partial if t.dtype != torch.bool else ()) for t in inputs]
    combos = combinations(per_input, max_combos, seed)
    for combo in combos:
        what = f"{getattr(fn, '__name__', 'fn')} on {mesh.shape} with inputs " + ", ".join(map(sbp_str, combo))
        gins = [
            make_global(t, mesh, s, seed=seed + i, requires_grad=d)
            for i, (t, s, d) in enumerate(zip(inputs, combo, diff))
        ]
        out = fn(*gins)
        assert_same_value(out, ref, what, rtol, atol)
        if ref_grads is None:
            continue
        outs = [o for o in _flat_tensors(out) if o.dtype.is_floating_point and o.requires_grad]
        loss = sum((o * c).sum() for o, c in zip(outs, cots))
        gs = torch.autograd.grad(loss, [g for g, d in zip(gins, diff) if d], allow_unused=True)
        for k, (g, r) in enumerate(zip(gs, ref_grads)):
            if r is None:
                continue
            assert_same_value(g, r, f"{what}: grad of input {k}", rtol, atol)
    return len(combos)
