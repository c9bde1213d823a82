"""GPU check: does shoal give plain torch's results with its shards on a GPU, and how fast is graph mode there?

(a) ops across input layouts on meshes (4,) and (2, 2), values and gradients, and a boxing round trip,
    against plain torch on the same device; (b) the rule validator's samples for a spread of ops, every
    signature, on meshes (1,), (2,), (3,), (2, 2), against plain torch on the same device; (c) one AdamW
    step of the tiny GPT: torch eager, shoal eager and shoal graph (shoal.compile) on one device, shoal
    graph data parallel on 4: step times, and losses that must agree with torch eager's.
Prints one table (check, result, detail, seconds); exit status 0 if every check passed, 1 if one did not,
2 if there is no CUDA device (and --device cpu was not given).

Runs from the source tree alone, with whatever torch the machine has, importing only torch, numpy and
the standard library besides shoal: ``PYTHONPATH=src python bench/gpu_check.py`` (``--device cpu`` tries
it on a machine without a GPU). Several virtual devices share one GPU when the machine has fewer GPUs
than --devices: shoal.init maps device d to cuda:d, so the script installs a world whose devices all
live on cuda:0 (``SharedGPU``).
Usage: PYTHONPATH=src python bench/gpu_check.py [--device cuda|cpu] [--threads T] [--ops K] [--steps N]
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import shoal
from shoal import B, Mesh, P, S
from shoal.dispatch import dispatch, signatures
from shoal.models import gpt
from shoal.models.gpt import GPT, GPTConfig
from shoal.ops.registry import lookup
from shoal.ops.validate import SAMPLES, ops_to_validate
from shoal.sbp import sbp_str
from shoal.testing import combinations, layouts, make_global

DEVICES = 4
TINY = GPTConfig(vocab_size=96, block_size=128, n_layer=2, n_head=4, n_embd=64)
# ops the validator always checks here (the rest of --ops spread over the registry)
CORE_OPS = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.add.Tensor", "aten._softmax.default",
            "aten.sum.dim_IntList", "aten.native_layer_norm.default", "aten.embedding.default",
            "aten.nll_loss_forward.default", "aten.convolution.default")


def setup_world(device: str) -> str:
    """Make the world of DEVICES devices on ``device``; returns how it was made."""
    if device == "cpu":
        shoal.init(devices=DEVICES)
        return f"{DEVICES} virtual devices on the CPU (shoal.init)"
    gpus = torch.cuda.device_count()
    if gpus >= DEVICES:
        shoal.init(devices=DEVICES, device_type="cuda")
        return f"{DEVICES} devices on cuda:0..{DEVICES - 1} (shoal.init)"
    shoal.init(devices=DEVICES, device_type="cuda", share_gpus=True)
    return f"{DEVICES} virtual devices sharing {gpus} GPU(s) (shoal.init(share_gpus=True))"


# ---------------------------------------------------------------------------------------------
# the table


class Table:
    def __init__(self) -> None:
        self.failed: list[str] = []
        print(f"| {'check':<44} | {'result':<6} | {'detail':<72} | {'s':>6} |")
        print(f"|{'-' * 46}|{'-' * 8}|{'-' * 74}|{'-' * 8}|")

    def run(self, name: str, fn: Callable[[], str], verbose: bool) -> None:
        """Run one check: ``fn`` returns its detail, or raises (AssertionError: a mismatch; else an error)."""
        t0 = time.perf_counter()
        try:
            detail, ok = fn(), True
        except Exception as e:  # noqa: BLE001 - every check reports, none stops the table
            detail, ok = f"{type(e).__name__}: {e}".strip().splitlines()[0], False
            if verbose:
                traceback.print_exc()
        if not ok:
            self.failed.append(name)
        self.row(name, "ok" if ok else "FAIL", detail, time.perf_counter() - t0)

    def row(self, name: str, result: str, detail: str, seconds: float | None = None) -> None:
        s = "" if seconds is None else f"{seconds:.1f}"
        print(f"| {name:<44} | {result:<6} | {detail:<72} | {s:>6} |", flush=True)


def close(got: torch.Tensor, ref: torch.Tensor, what: str, rtol: float, atol: float) -> None:
    if isinstance(got, shoal.GlobalTensor):
        got = got.full()
    if got.device != ref.device:
        raise AssertionError(f"{what}: result on {got.device}, plain torch's on {ref.device}")
    torch.testing.assert_close(got, ref, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{what}: {m}")


def fallbacks() -> str:
    ops = sorted(str(op) for op in shoal.coverage().by_fallback)
    return f"; ran replicated (no rule): {', '.join(ops)}" if ops else ""


# ---------------------------------------------------------------------------------------------
# (a) ops across layouts, backward, boxing


@dataclass(frozen=True)
class OpCase:
    name: str
    fn: Callable
    shapes: tuple[tuple[int, ...], ...]


OP_CASES = (
    OpCase("matmul", lambda a, b: a @ b, ((5, 7), (7, 6))),
    OpCase("add, relu", lambda a, b: (a + b).relu(), ((5, 7), (5, 7))),
    OpCase("softmax", lambda a: a.softmax(-1), ((5, 7),)),
    OpCase("sum over dim 0", lambda a: a.sum(0), ((5, 7),)),
    OpCase("linear", F.linear, ((5, 7), (6, 7), (6,))),
    OpCase("layer_norm", lambda a, w, b: F.layer_norm(a, (7,), w, b), ((5, 7), (7,), (7,))),
    OpCase("scaled_dot_product_attention", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
           ((2, 3, 5, 8), (2, 3, 5, 8), (2, 3, 5, 8))),
)


def check_op(case: OpCase, mesh: Mesh, device: str, combos: int, rtol: float, atol: float) -> str:
    """``case.fn`` on GlobalTensors in sampled input layouts equals it on plain tensors on ``device``:
    the output and every input's gradient."""
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(s, generator=gen) for s in case.shapes]
    plain = [t.to(device).requires_grad_() for t in inputs]
    ref = case.fn(*plain)
    cot = torch.randn(ref.shape, generator=gen)
    ref_grads = torch.autograd.grad(ref, plain, cot.to(device))
    shoal.coverage(reset=True)
    picked = combinations([layouts(t.ndim, mesh) for t in inputs], combos, seed=0)
    for combo in picked:
        what = f"{case.name} on {mesh.shape} with " + ", ".join(map(sbp_str, combo))
        gins = [make_global(t, mesh, s, seed=i, requires_grad=True) for i, (t, s) in enumerate(zip(inputs, combo))]
        out = case.fn(*gins)
        close(out, ref, what, rtol, atol)
        grads = torch.autograd.grad((out * cot.to(device)).sum(), gins)
        for k, (g, r) in enumerate(zip(grads, ref_grads)):
            close(g, r, f"{what}: gradient of input {k}", rtol, atol)
    return f"{len(picked)} layouts, values and gradients" + fallbacks()


def check_boxing(mesh: Mesh, device: str) -> str:
    """A tensor relaid through a cycle of layouts keeps its value at every step; collectives counted."""
    t = torch.randn(7, 5, generator=torch.Generator().manual_seed(1))
    ref = t.to(device)
    if mesh.ndim == 1:
        chain = [(S(0),), (B,), (S(1),), (P,), (S(0),), (S(1),), (B,), (S(0),)]
    else:
        chain = [(S(0), S(1)), (B, B), (S(1), B), (P, S(0)), (S(0), P), (B, S(1)), (S(1), S(0)), (S(0), S(1))]
    x = make_global(t, mesh, chain[0])
    cc = shoal.CommCounter()
    for sbp in chain[1:]:
        with cc:  # the relayouts only, not the gathers that read the value back
            x = x.to_global(mesh, sbp)
        if tuple(x.sbp) != sbp:
            raise AssertionError(f"to_global(..., {sbp_str(sbp)}) gave {sbp_str(x.sbp)}")
        close(x, ref, f"relaid to {sbp_str(sbp)} on {mesh.shape}", 1e-5, 1e-5)
    if cc.total == 0:
        raise AssertionError("no collective ran: the round trip cannot have moved data")
    return " -> ".join(sbp_str(s) for s in chain) + f"; collectives {dict(cc.counts)}"


# ---------------------------------------------------------------------------------------------
# (b) the rule validator's samples on the device


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    return []


def _map(obj, fn):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    return obj


def _globalize(args, mesh: Mesh, sbps) -> tuple:
    k = iter(range(len(sbps)))

    def one(t: torch.Tensor):
        i = next(k)
        return make_global(t, mesh, sbps[i], seed=i)

    return _map(args, one)


def _written(op, args) -> list[torch.Tensor]:
    schema = op._schema.arguments
    return [t for a, arg in zip(args, schema) if arg.alias_info is not None and arg.alias_info.is_write
            for t in _tensors(a)]


def validate_on(op, mesh: Mesh, device: str, rtol: float = 1e-5, atol: float = 1e-5) -> tuple[int, list[str]]:
    """shoal.ops.validate.validate_op with plain torch on ``device`` as the reference: the validator
    compares against its CPU samples, so on a GPU its results would be on another device."""
    checked, failures = 0, []
    rule = lookup(op)
    for si, sample in enumerate(SAMPLES[op]()):
        ref_args = _map(sample.args, lambda t: t.clone().to(device))
        kwargs = _map(sample.kwargs, lambda t: t.to(device))
        torch.manual_seed(si)  # random ops draw as one device would
        ref = op(*ref_args, **kwargs)
        sigs = [] if rule is not None and rule.kind == "value" else signatures(op, sample.args, sample.kwargs, mesh)
        if rule is not None and (rule.kind == "value" or rule.decompose is not None):
            per = [layouts(t.ndim, mesh) for t in _tensors(sample.args)]
            sigs += [(combo, None) for combo in combinations(per, 32, si)]
        for ins, outs in sigs:
            what = f"{op} sample {si} on {mesh.shape} with {[sbp_str(s) for s in ins]}"
            try:
                gargs = _globalize(_map(sample.args, torch.clone), mesh, ins)
                torch.manual_seed(si)
                if outs is None:
                    got = op(*gargs, **kwargs)
                else:
                    got = dispatch(op, tuple(gargs), dict(kwargs), forced=(ins, outs))
                    have = [t.sbp for t in _tensors(got) if isinstance(t, shoal.GlobalTensor)]
                    if have != list(outs):
                        raise AssertionError(f"output layouts {have} != signature {list(outs)}")
                number = not isinstance(ref, (torch.Tensor, list, tuple))  # item, equal: a number or a bool
                if number and not (got == ref or (isinstance(ref, float) and math.isclose(got, ref, rel_tol=1e-5))):
                    raise AssertionError(f"{what}: {got!r} != {ref!r}")
                gots, refs = _tensors(got), _tensors(ref)
                if sample.opaque:
                    gots = [o for i, o in enumerate(gots) if i not in sample.opaque]
                    refs = [o for i, o in enumerate(refs) if i not in sample.opaque]
                if len(gots) != len(refs):
                    raise AssertionError(f"{len(gots)} outputs, plain torch {len(refs)}")
                if sample.values:
                    for g, r in zip([*gots, *_written(op, gargs)], [*refs, *_written(op, ref_args)]):
                        close(g, r, what, rtol, atol)
                elif [tuple(t.shape) for t in gots] != [tuple(t.shape) for t in refs]:
                    raise AssertionError(f"{what}: output shapes differ")
            except Exception as e:  # noqa: BLE001 - every failure is reported, none stops the run
                failures.append(f"{what}: {type(e).__name__}: {e}".splitlines()[0][:300])
            checked += 1
    return checked, failures


def ops_sample(k: int, device: str) -> list:
    ops = [op for op in ops_to_validate() if op in SAMPLES]
    if device != "cpu":  # CPU-only kernels (oneDNN, the CPU flash attention) do not run elsewhere
        ops = [op for op in ops if "cpu" not in str(op) and "mkldnn" not in str(op)]
    core = [op for op in ops if str(op) in CORE_OPS]
    rest = [op for op in ops if op not in core]
    step = max(len(rest) / max(k - len(core), 1), 1.0)
    spread = [rest[int(i * step)] for i in range(max(k - len(core), 0)) if int(i * step) < len(rest)]
    return core + spread


def check_validator(ops: list, device: str, rtol: float, atol: float) -> str:
    meshes = [Mesh([0]), Mesh([0, 1]), Mesh([0, 1, 2]), Mesh([[0, 1], [2, 3]])]
    n, failures = 0, []
    for op in ops:
        for m in meshes:
            c, f = validate_on(op, m, device, rtol, atol)
            n += c
            failures += f
    if failures:
        for f in failures[:10]:
            print("    " + f, file=sys.stderr)
        raise AssertionError(f"{len(failures)} of {n} signatures differ; first: {failures[0]}")
    return f"{len(ops)} ops, {n} signatures on (1,), (2,), (3,), (2, 2)"


# ---------------------------------------------------------------------------------------------
# (c) graph mode vs eager, the tiny GPT


def train_step(model, opt, x, y):
    """shoal.train.train_step (imported from there, shoal.train would need tqdm)."""
    _, loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def gpt_losses(device: str, variant: str, steps: int, batch: int) -> tuple[list[float], float, float]:
    """(losses per step, median seconds per step after the first two, seconds of the first step)."""
    torch.manual_seed(0)
    base = GPT(TINY)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, TINY.vocab_size, (batch, TINY.block_size), generator=g)
    y = torch.randint(0, TINY.vocab_size, (batch, TINY.block_size), generator=g)
    model = copy.deepcopy(base)
    fn = train_step
    if variant == "torch eager":
        model, x, y = model.to(device), x.to(device), y.to(device)
    else:
        mesh = Mesh([0]) if variant.endswith("1 device") else Mesh(list(range(DEVICES)), axes=("dp",))
        plan = gpt.plans(mesh, "dp") if mesh.size > 1 else None
        model = shoal.distribute_module(model, mesh, plan)
        layout = plan.inputs[""] if plan is not None else S(0)
        x, y = shoal.to_global(x, mesh, layout), shoal.to_global(y, mesh, layout)
        if "graph" in variant:
            fn = shoal.compile(train_step)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, times = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = fn(model, opt, x, y)
        loss = loss.full() if isinstance(loss, shoal.GlobalTensor) else loss
        losses.append(float(loss.item()))  # .item() waits for the device
        times.append(time.perf_counter() - t0)
    return losses, statistics.median(times[2:]), times[0]


def check_gpt(device: str, steps: int, rtol: float) -> Callable[[str], str]:
    """A check per variant: its step time, and its losses against torch eager's on the same batch."""
    eager: dict[int, tuple[list[float], float, float]] = {}  # batch -> torch eager's run

    def torch_eager(batch: int):
        if batch not in eager:
            eager[batch] = gpt_losses(device, "torch eager", steps, batch)
        return eager[batch]

    def run(variant: str) -> str:
        batch = 4 if variant == "torch eager" or "1 device" in variant else 8
        shoal.coverage(reset=True)
        if variant == "torch eager":
            losses, sec, first = torch_eager(batch)
        else:
            losses, sec, first = gpt_losses(device, variant, steps, batch)
        fb = fallbacks()
        detail = f"batch {batch}: {sec * 1e3:.1f} ms/step (1st step {first:.1f} s); last loss {losses[-1]:.4f}"
        if variant == "torch eager":
            return detail
        ref, ref_sec, _ = torch_eager(batch)
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
        detail += f"; torch eager / this {ref_sec / sec:.2f}x; losses' max rel diff from torch eager {rel:.1e}{fb}"
        if rel > rtol:
            raise AssertionError(f"losses differ from torch eager's by {rel:.1e} > {rtol:g}: {detail}")
        return detail

    return run


# ---------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(
        prog="bench/gpu_check.py",
        description="shoal on a GPU: ops and boxing against plain torch there, the rule validator, "
        "graph mode vs eager for the tiny GPT. Exits 1 on any mismatch, 2 without CUDA.",
    )
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="(default %(default)s)")
    ap.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1),
                    help="torch.set_num_threads (default: min(4, CPU cores) = %(default)s)")
    ap.add_argument("--ops", type=int, default=16, help="ops the validator checks (default %(default)s)")
    ap.add_argument("--combos", type=int, default=8, help="input layouts per op and mesh in (a) (default %(default)s)")
    ap.add_argument("--steps", type=int, default=12, help="GPT steps per variant (default %(default)s)")
    ap.add_argument("--verbose", action="store_true", help="print the traceback of each failing check")
    args = ap.parse_args()

    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"bench/gpu_check.py: no CUDA device here (torch {torch.__version__}, "
              f"cuda build {torch.version.cuda}); run with --device cpu to try it on the CPU", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    # full float32 everywhere: TF32 (cuDNN's default for convolutions) rounds differently per shard shape
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    t_start = time.perf_counter()
    where = setup_world(args.device)
    gpu = f", {torch.cuda.get_device_name(0)}" if args.device == "cuda" else ""
    print(f"shoal gpu check on {args.device}{gpu}: {where}; torch {torch.__version__}, "
          f"torch.set_num_threads({args.threads}) -> {torch.get_num_threads()} thread(s), TF32 off")
    warnings.filterwarnings("ignore", message="shoal: no SBP rule")  # fallbacks are listed in the detail

    # a GPU's reductions and kernels may sum in another order than one device's: a little more slack there
    rtol, atol = (1e-5, 1e-5) if args.device == "cpu" else (1e-4, 1e-4)
    table = Table()
    meshes = (Mesh(list(range(DEVICES)), axes=("dp",)), Mesh([[0, 1], [2, 3]], axes=("dp", "tp")))
    for case in OP_CASES:
        for mesh in meshes:
            table.run(f"a  {case.name} {mesh.shape}",
                      lambda c=case, m=mesh: check_op(c, m, args.device, args.combos, rtol, atol), args.verbose)
    for mesh in meshes:
        table.run(f"a  boxing round trip {mesh.shape}", lambda m=mesh: check_boxing(m, args.device), args.verbose)

    ops = ops_sample(args.ops, args.device)
    table.run("b  rule validator", lambda: check_validator(ops, args.device, rtol, atol), args.verbose)

    gpt_rtol = 1e-4 if args.device == "cpu" else 1e-3  # atomics in a GPU's backward sum in any order
    run = check_gpt(args.device, max(args.steps, 3), gpt_rtol)
    variants = ("torch eager", "shoal eager, 1 device", "shoal graph, 1 device", f"shoal graph, dp {DEVICES} devices")
    for variant in variants:
        table.run(f"c  tiny GPT step: {variant}", lambda v=variant: run(v), args.verbose)

    bad = table.failed
    print(f"{'FAIL' if bad else 'OK'}: {len(bad)} check(s) failed{': ' + ', '.join(bad) if bad else ''}; "
          f"{time.perf_counter() - t_start:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
