"""Rule validator: every registered op x every signature its rule offers x meshes (1,), (2,), (3,), (2,2)
x uneven shapes, against the single-device result. ``python -m shoal.ops.validate [op-substring ...]``
prints a table and exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import dispatch, schema
from ..mesh import Mesh
from ..sbp import sbp_str
from ..tensor import GlobalTensor
from ..testing import assert_same_value, combinations, layouts, make_global
from ..world import init, world
from .registry import lookup, registered_ops
from .samples import SAMPLES as FAMILY_SAMPLES

aten = torch.ops.aten
_G = torch.Generator().manual_seed(0)


def r(*shape, dtype=torch.float32) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, generator=_G, dtype=dtype)
    if dtype == torch.bool:
        return torch.rand(shape, generator=_G) > 0.5
    return torch.randint(-5, 6, shape, generator=_G).to(dtype)


@dataclass
class Sample:
    args: tuple
    kwargs: dict
    values: bool = True  # False: compare shapes only (empty_like and friends)
    # outputs not compared: opaque to all but the op's own backward (oneDNN's LSTM workspace),
    # which its backward's samples check through the gradients
    opaque: tuple[int, ...] = ()


def S_(*args, values: bool = True, opaque: tuple[int, ...] = (), **kwargs) -> Sample:
    return Sample(args, kwargs, values, opaque)


def _cdist_backward_sample(s1, s2, p) -> Sample:
    x1, x2 = r(*s1), r(*s2)
    dist = aten._cdist_forward.default(x1, x2, p, None)
    return S_(r(*dist.shape), x1, x2, p, dist)


# Each op gets samples with uneven sizes (5 and 7 over 2, 3 and 4 devices) and sizes smaller than the mesh.
SAMPLES: dict[torch._ops.OpOverload, Callable[[], list[Sample]]] = {
    # pointwise
    aten.add.Tensor: lambda: [
        S_(r(5, 7), r(5, 7)),
        S_(r(5, 7), r(7)),
        S_(r(5, 1), r(1, 7)),
        S_(r(5, 7), 2.5),
        S_(r(5, 7, dtype=torch.int64), r(5, 7)),
        S_(r(2, 3), r(2, 3), alpha=3),
    ],
    aten.sub.Tensor: lambda: [S_(r(5, 7), r(3, 1, 7)), S_(r(2, 5), 1)],
    aten.mul.Tensor: lambda: [S_(r(5, 7), r(5, 7)), S_(r(5, 7), 3.0), S_(r(7), r(5, 7))],
    aten.div.Tensor: lambda: [S_(r(5, 7), r(5, 7).abs() + 1), S_(r(5, 7), 2.0)],
    aten.mul.Scalar: lambda: [S_(r(5, 7), 3.0)],
    aten.div.Scalar: lambda: [S_(r(5, 7), 3.0)],
    aten.neg.default: lambda: [S_(r(5, 7))],
    aten.relu.default: lambda: [S_(r(5, 7))],
    aten.exp.default: lambda: [S_(r(3, 5))],
    aten.tanh.default: lambda: [S_(r(3, 5))],
    aten.sigmoid.default: lambda: [S_(r(3, 5))],
    aten.gelu.default: lambda: [S_(r(3, 5))],
    aten.pow.Tensor_Scalar: lambda: [S_(r(5, 3), 2)],
    aten.gt.Scalar: lambda: [S_(r(5, 3), 0.0)],
    aten.maximum.default: lambda: [S_(r(5, 3), r(3))],
    aten.where.self: lambda: [
        S_(r(5, 3, dtype=torch.bool), r(5, 3), r(5, 3)),
        S_(r(5, 1, dtype=torch.bool), r(5, 3), r(3)),
    ],
    aten.clone.default: lambda: [S_(r(5, 7))],
    aten.lerp.Scalar: lambda: [S_(r(5, 3), r(5, 3), 0.3)],
    aten.add_.Tensor: lambda: [S_(r(5, 7), r(5, 7)), S_(r(5, 7), r(7)), S_(r(5, 7), 1.5)],
    aten.sub_.Tensor: lambda: [S_(r(5, 7), r(5, 7))],
    aten.mul_.Tensor: lambda: [S_(r(5, 7), r(5, 7)), S_(r(5, 7), 0.5)],
    aten.mul_.Scalar: lambda: [S_(r(5, 7), 0.5)],
    aten.div_.Tensor: lambda: [S_(r(5, 7), r(5, 7).abs() + 1)],
    aten.copy_.default: lambda: [S_(r(5, 7), r(5, 7)), S_(r(5, 7), r(7)), S_(r(5, 7), r(5, 7, dtype=torch.float64))],
    aten.detach.default: lambda: [S_(r(5, 7))],
    aten.alias.default: lambda: [S_(r(5, 7))],
    aten.fill_.Scalar: lambda: [S_(r(5, 7), 2.0)],
    aten.fill_.Tensor: lambda: [S_(r(5, 7), r())],
    aten.zero_.default: lambda: [S_(r(5, 7))],
    aten._to_copy.default: lambda: [
        S_(r(5, 7), dtype=torch.float64),
        S_(r(5, 3), dtype=torch.int32),
        S_(r(5, 3, dtype=torch.int64), dtype=torch.float32),
        S_(r(5, 7), dtype=torch.bfloat16),  # rounds: Partial(sum) may not pass (each piece rounded), max and min do
    ],
    # reductions
    aten.sum.default: lambda: [S_(r(5, 7)), S_(r(2))],
    aten.sum.dim_IntList: lambda: [
        S_(r(5, 7), [0]),
        S_(r(5, 7), [1], True),
        S_(r(3, 5, 2), [0, 2]),
        S_(r(3, 5, 2), [-1], False, dtype=torch.float64),
    ],
    aten.mean.default: lambda: [S_(r(5, 7))],
    aten.mean.dim: lambda: [S_(r(5, 7), [0]), S_(r(5, 7), [1], True), S_(r(3, 5, 2), [0, 2])],
    aten.amax.default: lambda: [S_(r(5, 7), [0]), S_(r(5, 7), [0, 1], True), S_(r(), [0]), S_(r(), [-1], True)],
    aten.amin.default: lambda: [S_(r(5, 7), [1]), S_(r(), [-1])],  # a number's dim 0 or -1: nothing reduced
    aten.max.default: lambda: [S_(r(5, 7))],
    aten.min.default: lambda: [S_(r(5, 7))],
    aten.max.dim: lambda: [S_(r(5, 7), 1), S_(r(5, 7), 0, True), S_(r(), -1)],
    aten.min.dim: lambda: [S_(r(5, 7), 1)],
    aten.argmax.default: lambda: [S_(r(5, 7), 1)],
    aten.argmin.default: lambda: [S_(r(5, 7), 0)],
    aten.var.correction: lambda: [
        S_(r(5, 7), [1]),
        S_(r(5, 7), [0], correction=0, keepdim=True),
        S_(r(3, 5, 2), [0, 2]),
        S_(r(5, 7)),
        S_(r(1, 3), [0]),  # one element: nan, as torch
        S_(r(), [-1]),
    ],
    aten.std.correction: lambda: [S_(r(5, 7), [0]), S_(r(3, 5, 2), [-1], correction=2, keepdim=True)],
    aten.var_mean.correction: lambda: [S_(r(5, 7), [1]), S_(r(3, 5, 2), [0, 2], correction=0, keepdim=True)],
    aten.std_mean.correction: lambda: [S_(r(5, 7), [0]), S_(r(5, 7))],
    aten.prod.dim_int: lambda: [S_(r(5, 7), 1), S_(r(3, 5, 2), 0, True)],
    aten.as_strided.default: lambda: [
        S_(r(5, 7), [5, 3], [7, 2], 1),
        S_(r(4, 6), [4], [7]),
        S_(r(3, 4, 5), [3, 2, 2], [20, 5, 1], 6),
    ],
    aten.diagonal.default: lambda: [S_(r(5, 7)), S_(r(5, 7), 1), S_(r(3, 5, 4), -1, 1, 2), S_(r(4, 3, 5), 0, 2, 0)],
    aten.diagonal_backward.default: lambda: [
        S_(aten.diagonal.default(r(3, 5, 4), -1, 1, 2).clone(), [3, 5, 4], -1, 1, 2),
        S_(aten.diagonal.default(r(4, 3, 5), 1, 2, 0).clone(), [4, 3, 5], 1, 2, 0),
        S_(r(5), [5, 7], 0, 0, 1),
    ],
    aten.cumsum.default: lambda: [S_(r(5, 7), 1), S_(r(5, 7), 0), S_(r(3, 5, 2), -1, dtype=torch.float64)],
    aten.cumprod.default: lambda: [S_(r(5, 7), 1), S_(r(3, 5, 2), 0)],
    aten.logcumsumexp.default: lambda: [S_(r(5, 7), 0), S_(r(3, 5, 2), -1)],
    aten.cummax.default: lambda: [S_(r(5, 7), 1), S_(r(3, 5, 2), 0)],
    aten.cummin.default: lambda: [S_(r(5, 7), 0)],
    aten.constant_pad_nd.default: lambda: [
        S_(r(5, 7), [1, 2]),
        S_(r(3, 5, 4), [0, 0, 2, 1], 1.5),
        S_(r(5, 7), [-1, 1]),
    ],
    aten.tril.default: lambda: [S_(r(5, 7)), S_(r(3, 5, 4), 1), S_(r(2, 3, 5, 4), -2)],
    aten.triu.default: lambda: [S_(r(5, 7), 2), S_(r(3, 5, 4))],
    # matrix
    aten.mm.default: lambda: [S_(r(5, 7), r(7, 3)), S_(r(2, 3), r(3, 5))],
    aten.bmm.default: lambda: [S_(r(3, 5, 7), r(3, 7, 2))],
    aten.addmm.default: lambda: [
        S_(r(3), r(5, 7), r(7, 3)),
        S_(r(5, 3), r(5, 7), r(7, 3), beta=0.5, alpha=2.0),
        S_(r(5, 1), r(5, 7), r(7, 3)),
    ],
    aten.mv.default: lambda: [S_(r(5, 7), r(7))],
    aten.dot.default: lambda: [S_(r(7), r(7))],
    aten._cdist_forward.default: lambda: [
        S_(r(5, 3), r(7, 3), 2.0, None),
        S_(r(5, 3), r(4, 3), 1.0, None),
        S_(r(2, 5, 3), r(2, 4, 3), float("inf"), 2),
        S_(r(3, 5, 3), r(1, 4, 3), 3.0, None),
        S_(r(2, 5, 3), r(4, 3), 2.0, None),  # batch dims broadcast: the operands differ in rank
        S_(r(5, 3), r(2, 4, 3), 1.0, None),
    ],
    aten._cdist_backward.default: lambda: [_cdist_backward_sample(*a) for a in (
        ((5, 3), (7, 3), 2.0), ((5, 3), (4, 3), 1.0), ((3, 5, 3), (3, 4, 3), 3.0),
        ((2, 5, 3), (2, 4, 3), float("inf")), ((2, 5, 3), (4, 3), 2.0), ((5, 3), (2, 4, 3), 1.0),
        ((1, 2, 2), (2, 1, 1, 2), 2.0))],  # one row of x2: a (3,) mesh leaves shards without rows
    # views and shapes
    aten.view.default: lambda: [
        S_(r(6, 4), [24]),
        S_(r(6, 4), [2, 3, 4]),
        S_(r(5, 4), [20]),
        S_(r(5, 4), [5, 2, 2]),
        S_(r(4, 6), [4, 2, 3]),
        S_(r(2, 3, 4), [6, 4]),
        S_(r(12), [3, 4]),
        S_(r(5, 4), [-1]),
    ],
    aten._unsafe_view.default: lambda: [S_(r(6, 4), [3, 8]), S_(r(7, 2), [14])],
    aten.permute.default: lambda: [S_(r(3, 5, 2), [2, 0, 1])],
    aten.transpose.int: lambda: [S_(r(3, 5, 2), 0, 2), S_(r(5, 3), -1, -2)],
    aten.t.default: lambda: [S_(r(5, 3)), S_(r(5))],
    aten.unsqueeze.default: lambda: [S_(r(5, 3), 1), S_(r(5, 3), -1)],
    aten.squeeze.dim: lambda: [S_(r(5, 1, 3), 1), S_(r(5, 3), 0)],
    aten.squeeze.dims: lambda: [S_(r(1, 5, 1, 3), [0, 2])],
    aten.transpose_.default: lambda: [S_(r(3, 5, 2), 0, 2), S_(r(5, 3), -1, -2)],
    aten.t_.default: lambda: [S_(r(5, 3)), S_(r(5))],
    aten.unsqueeze_.default: lambda: [S_(r(5, 3), 1), S_(r(5, 3), -1)],
    aten.squeeze_.default: lambda: [S_(r(5, 1, 3))],
    aten.squeeze_.dim: lambda: [S_(r(5, 1, 3), 1), S_(r(5, 3), 0)],
    aten.squeeze_.dims: lambda: [S_(r(1, 5, 1, 3), [0, 2])],
    aten.squeeze.default: lambda: [S_(r(1, 5, 1, 3))],
    aten.expand.default: lambda: [S_(r(5, 1), [5, 7]), S_(r(3), [4, 3]), S_(r(5, 3), [2, 5, 3]), S_(r(5, 1), [-1, 6])],
    aten.slice.Tensor: lambda: [S_(r(7, 5), 0, 1, 6), S_(r(7, 5), 1, 0, 5, 2), S_(r(7, 5), -1, 2)],
    aten.roll.default: lambda: [S_(r(7, 5), [2], [0]), S_(r(7, 5), [-1, 3], [1, 0]), S_(r(7, 5), [4]),
                                S_(r(3, 7, 5), [1], [-1])],
    aten.slice_scatter.default: lambda: [S_(r(7, 5), r(5, 5), 0, 1, 6), S_(r(7, 5), r(7, 3), 1, 0, 5, 2),
                                         S_(r(3, 7, 5), r(3, 7, 2), -1, 3)],
    aten.select_scatter.default: lambda: [S_(r(7, 5), r(5), 0, 3), S_(r(3, 7, 5), r(3, 7), 2, -1)],
    aten.diagonal_scatter.default: lambda: [S_(r(5, 7), r(5)), S_(r(5, 7), r(5), 2), S_(r(5, 7), r(4), -1),
                                            S_(r(3, 5, 4), r(5, 2), -1, 0, 2)],
    aten.as_strided_scatter.default: lambda: [S_(r(5, 7), r(3, 2), [3, 2], [7, 2], 4),
                                              S_(r(6), r(2, 2), [2, 2], [1, 2])],
    aten.flip.default: lambda: [S_(r(7, 5), [0]), S_(r(3, 7, 5), [-1, 0])],
    aten.select.int: lambda: [S_(r(7, 5), 0, 3), S_(r(7, 5), 1, -1)],
    aten.slice_backward.default: lambda: [S_(r(5, 3), [7, 3], 0, 1, 6, 1), S_(r(7, 2), [7, 5], 1, 1, 5, 2)],
    aten.select_backward.default: lambda: [S_(r(5), [5, 7], 1, 2), S_(r(7), [3, 7], 0, 0)],
    aten.cat.default: lambda: [S_([r(5, 3), r(2, 3)]), S_([r(5, 3), r(5, 4)], 1), S_([r(5, 3), r(0)], 0)],
    aten.stack.default: lambda: [S_([r(5, 3), r(5, 3)]), S_([r(5, 3), r(5, 3)], 2)],
    aten.split.Tensor: lambda: [S_(r(7, 5), 3), S_(r(7, 5), 2, 1)],
    aten.split_with_sizes.default: lambda: [S_(r(7, 5), [2, 5]), S_(r(7, 5), [1, 4], 1)],
    aten.unbind.int: lambda: [S_(r(3, 5)), S_(r(3, 5), 1)],
    # factories and value ops
    aten.zeros_like.default: lambda: [S_(r(5, 3))],
    aten.ones_like.default: lambda: [S_(r(5, 3))],
    aten.empty_like.default: lambda: [S_(r(5, 3), values=False)],
    aten.full_like.default: lambda: [S_(r(5, 3), 7.0)],
    aten.new_zeros.default: lambda: [S_(r(5, 3), [2, 4])],
    aten.new_ones.default: lambda: [S_(r(5, 3), [4])],
    aten.new_empty.default: lambda: [S_(r(5, 3), [2, 2], values=False)],
    aten.new_empty_strided.default: lambda: [S_(r(5, 3), [2, 3], [1, 2], values=False), S_(r(5), [5, 3], [3, 1],
                                                                                          values=False)],
    aten.new_full.default: lambda: [S_(r(5, 3), [3, 2], 1.5)],
    aten._local_scalar_dense.default: lambda: [S_(r())],
    aten.equal.default: lambda: [S_(r(5, 3), r(5, 3))],
}


def _family_samples() -> None:
    """The rule families' samples (``samples.SAMPLES = {op: lambda: [(args, kwargs), ...]}``) join these."""
    for op, make in FAMILY_SAMPLES.items():
        if op in SAMPLES:
            raise ValueError(f"validator samples for {op} are given twice")
        SAMPLES[op] = lambda make=make: [S_(*a, **k) if isinstance(a, tuple) else a for a, k in make()]


_family_samples()

MESH_SHAPES = ((1,), (2,), (3,), (2, 2))


def _meshes() -> list[Mesh]:
    if world().size < 4:
        init(devices=4)
    return [Mesh([0]), Mesh([0, 1]), Mesh([0, 1, 2]), Mesh([[0, 1], [2, 3]])]


def _clone_args(obj):
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone_args(o) for o in obj)
    return obj


def _globalize(obj, mesh, sbps, counter):
    if isinstance(obj, torch.Tensor):
        k = counter[0]
        counter[0] += 1
        return make_global(obj, mesh, sbps[k], seed=k)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_globalize(o, mesh, sbps, counter) for o in obj)
    return obj


def _tensors(obj) -> list:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    return []


def _written(op, args) -> list:
    """The tensors of the arguments the op's schema says it writes (``Tensor(a!)``); what a kernel
    does to others (oneDNN's LSTM backward uses its workspace as scratch) is not the op's value."""
    written = {i for i, _ in schema.of(op).written}
    return [t for i, a in enumerate(args) if i in written for t in _tensors(a)]


def _out_sbps(out) -> list:
    return [t.sbp for t in _tensors(out) if isinstance(t, GlobalTensor)]


def validate_op(op, mesh: Mesh) -> tuple[int, list[str]]:
    """(signatures checked, failures) for every sample of ``op`` on ``mesh``."""
    checked, failures = 0, []
    rule = lookup(op)
    for si, sample in enumerate(SAMPLES[op]()):
        ref_args = _clone_args(sample.args)
        torch.manual_seed(si)  # random ops must draw the same values as one device would
        ref = op(*ref_args, **sample.kwargs)
        sigs = dispatch.signatures(op, sample.args, sample.kwargs, mesh)
        if rule is not None and rule.kind == "value":
            sigs = []
        if rule is not None and (rule.kind == "value" or rule.decompose is not None):
            # value ops and decompositions take any layout: try them all (sampled), unforced
            per = [layouts(t.ndim, mesh) for t in _tensors(sample.args)]
            sigs += [(combo, None) for combo in combinations(per, 32, si)]
        for ins, outs in sigs:
            what = f"{op} sample {si} on mesh {mesh.shape} with {[sbp_str(s) for s in ins]}"
            try:
                gargs = _globalize(_clone_args(sample.args), mesh, ins, [0])
                torch.manual_seed(si)
                if outs is None:
                    got = op(*gargs, **sample.kwargs)
                else:
                    got = dispatch.dispatch(op, tuple(gargs), dict(sample.kwargs), forced=(ins, outs))
                    if _out_sbps(got) != list(outs):
                        raise AssertionError(f"output layouts {_out_sbps(got)} != signature {list(outs)}")
                if sample.opaque:
                    got, ref = ([o for i, o in enumerate(v) if i not in sample.opaque] for v in (got, ref))
                if sample.values:
                    assert_same_value(got, ref, what)
                    for g, rr in zip(_written(op, gargs), _written(op, ref_args)):  # in-place writes
                        assert_same_value(g, rr, what + " (mutated input)")
                else:
                    assert [tuple(t.shape) for t in _tensors(got)] == [tuple(t.shape) for t in _tensors(ref)]
            except Exception as e:  # noqa: BLE001 - every failure is reported, none stops the run
                failures.append(f"{what}: {type(e).__name__}: {e}".splitlines()[0][:400])
            checked += 1
    return checked, failures


def ops_to_validate() -> list:
    """Explicitly registered ops plus the sampled ops served by generic rules (pointwise)."""
    ops = set(registered_ops()) | {op for op in SAMPLES if lookup(op) is not None}
    return sorted(ops, key=str)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m shoal.ops.validate",
        description="Check every signature of every registered op rule against single-device torch, on "
        "meshes (1,), (2,), (3,), (2,2) with uneven shapes. Prints a table; exits 1 on any mismatch.",
    )
    ap.add_argument("ops", nargs="*", metavar="OP",
                    help="check only the ops whose name contains OP, e.g. mm or aten.add (default: all)")
    ap.add_argument("--list", action="store_true", help="list the ops that can be checked, and exit")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    every = ops_to_validate()
    if args.list:
        print("\n".join(map(str, every)))
        return 0
    unknown = [a for a in args.ops if not any(a in str(op) for op in every)]
    if unknown:
        ap.error(f"no registered op matches {', '.join(map(repr, unknown))}; "
                 "list them with: python -m shoal.ops.validate --list")
    meshes = _meshes()
    ops = [op for op in every if not args.ops or any(a in str(op) for a in args.ops)]
    missing = [op for op in ops if op not in SAMPLES]
    total_fail = 0
    t0 = time.perf_counter()
    print(f"{'op':40s} " + " ".join(f"{str(m.shape):>8s}" for m in meshes) + "  status")
    for op in ops:
        if op in missing:
            print(f"{str(op):40s} no samples: add some to SAMPLES in shoal/ops/validate.py  FAIL")
            continue
        cells, fails = [], []
        for m in meshes:
            n, f = validate_op(op, m)
            cells.append(f"{n:8d}")
            fails += f
        total_fail += len(fails)
        print(f"{str(op):40s} " + " ".join(cells) + ("  ok" if not fails else f"  FAIL ({len(fails)})"))
        for f in fails[:5]:
            print("    " + f)
    bad = total_fail + len(missing)
    print(f"{len(ops)} ops, {bad} failure(s), {time.perf_counter() - t0:.1f}s (cells: signatures checked per mesh)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
