"""Graph mode vs eager: one GPT training step in plain torch, torch.compile, shoal eager and shoal graph.

A: the tiny GPT (2 layers, width 64), batch 4 x 128, one device.
B: the GPT of the demo and dp_vs_ddp (4 layers, width 256), batch 8 x 128, one device.
C: the tiny GPT, batch 8 x 128, on 4 virtual devices: data parallel and tensor parallel plans.
Every variant starts from the same initial weights (seeded, then deep-copied), trains on the same
batch with AdamW(lr=1e-3) and runs the same number of steps, so the last losses must agree.
shoal on one device: the model laid out by shoal.distribute_module on Mesh([0]), inputs split on
the batch dim. shoal graph: shoal.compile(step) (first call traces and compiles). torch.compile
compiles the model (default inductor backend); the optimizer step runs eagerly.
Step time: median over repeats of the mean over the timed steps, after warm-up; the loss is read
(.item()) every step; the variants of a section are timed in turns, one repeat each, round robin.
torch.set_num_threads(2). A variant that fails prints its error in its row.
Usage: python bench/graph_vs_eager.py [--steps N] [--repeats R] [--warmup W] [--only A,B,C] [--quick] [--cold]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import traceback

import torch

import shoal
from shoal import S
from shoal.models import gpt
from shoal.models.gpt import GPT, GPTConfig
from shoal.train import train_step as step

THREADS = 2
TINY = GPTConfig(vocab_size=96, block_size=128, n_layer=2, n_head=4, n_embd=64)
SMALL = GPTConfig(vocab_size=96, block_size=128, n_layer=4, n_head=4, n_embd=256)
SECTIONS = {  # name -> (title, config, batch, baseline row)
    "A": ("A tiny GPT, 1 device", TINY, 4, "torch eager"),
    "B": ("B GPT, 1 device", SMALL, 8, "torch eager"),
    "C": ("C tiny GPT, 4 devices", TINY, 8, "shoal eager"),  # C: the eager row of the same plan
}


def loss_value(loss) -> float:
    if isinstance(loss, shoal.GlobalTensor):
        loss = loss.full()
    return float(loss.item())


def batch(cfg: GPTConfig, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (rows, cfg.block_size), generator=g)
    y = torch.randint(0, cfg.vocab_size, (rows, cfg.block_size), generator=g)
    return x, y


def initial(cfg: GPTConfig) -> GPT:
    torch.manual_seed(0)
    return GPT(cfg)


class Variant:
    """One row: its name and how to build (step function, model, optimizer, inputs) from the initial model."""

    def __init__(self, name: str, build):
        self.name, self.build = name, build


def torch_eager(base, x, y):
    model = copy.deepcopy(base)
    return step, model, torch.optim.AdamW(model.parameters(), lr=1e-3), x, y


def torch_compiled(base, x, y):
    torch._dynamo.reset()  # GPT.forward was compiled for another config: start clean, not with dynamic shapes
    model = torch.compile(copy.deepcopy(base))
    return step, model, torch.optim.AdamW(model.parameters(), lr=1e-3), x, y


def shoal_layout(base, x, y, mesh, plan=None):
    model = shoal.distribute_module(copy.deepcopy(base), mesh, plan)
    layout = plan.inputs[""] if plan is not None else S(0)
    gx, gy = shoal.to_global(x, mesh, layout), shoal.to_global(y, mesh, layout)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), gx, gy


def shoal_eager(mesh, plan=None):
    def build(base, x, y):
        return (step, *shoal_layout(base, x, y, mesh, plan))

    return build


def shoal_graph(mesh, plan=None, backend=None):
    def build(base, x, y):
        compile_ = shoal.compile  # AttributeError (reported in the row) while graph mode does not exist
        fn = compile_(step) if backend is None else compile_(step, backend=backend)
        return (fn, *shoal_layout(base, x, y, mesh, plan))

    return build


class Run:
    """One variant being measured: built and warmed up once, then timed a repeat at a time."""

    def __init__(self, build, base, x, y, warmup: int):
        self.fn, self.model, self.opt, self.x, self.y = build(base, x, y)
        t0 = time.perf_counter()
        self.loss = self.step()
        self.first = time.perf_counter() - t0
        for _ in range(warmup - 1):
            self.loss = self.step()
        self.samples: list[float] = []

    def step(self) -> float:
        return loss_value(self.fn(self.model, self.opt, self.x, self.y))

    def repeat(self, steps: int) -> None:
        t0 = time.perf_counter()
        for _ in range(steps):
            self.loss = self.step()
        self.samples.append((time.perf_counter() - t0) / steps)

    def result(self) -> dict:
        out = {"ms": statistics.median(self.samples) * 1e3, "first": self.first, "loss": self.loss}
        compile_seconds = getattr(self.fn, "compile_seconds_total", None)
        if isinstance(compile_seconds, (int, float)):
            out["compile"] = float(compile_seconds)
        return out


def short(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".strip().splitlines()[0]
    return text if len(text) <= 80 else text[:77] + "..."


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10, help="timed steps per repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (the first one compiles)")
    ap.add_argument("--only", default="A,B,C", help="sections to run, e.g. A,C")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 steps x 1 repeat, 2 warm-up steps")
    ap.add_argument("--verbose", action="store_true", help="print full tracebacks of failing variants")
    ap.add_argument("--cold", action="store_true", help="disable inductor's on-disk caches (cold compile times)")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.repeats, args.warmup = 2, 1, 2
    args.warmup = max(1, args.warmup)
    torch.set_num_threads(THREADS)
    if args.cold:
        import torch._inductor.config as inductor_config

        inductor_config.force_disable_caches = True
    caches = "off (--cold)" if args.cold else "on (a rerun compiles faster; --cold to disable)"
    shoal.init(devices=4)

    one = shoal.Mesh([0])
    dp_mesh = shoal.Mesh([0, 1, 2, 3], axes=("dp",))
    tp_mesh = shoal.Mesh([0, 1, 2, 3], axes=("tp",))
    one_device = [
        Variant("torch eager", torch_eager),
        Variant("torch.compile", torch_compiled),
        Variant("shoal eager", shoal_eager(one)),
        Variant("shoal graph", shoal_graph(one)),
        Variant("shoal graph + inductor", shoal_graph(one, backend="inductor")),
    ]
    dp_plan, tp_plan = gpt.plans(dp_mesh, "dp"), gpt.plans(tp_mesh, "tp")
    four_devices = [
        Variant("shoal eager, dp", shoal_eager(dp_mesh, dp_plan)),
        Variant("shoal graph, dp", shoal_graph(dp_mesh, dp_plan)),
        Variant("shoal eager, tp", shoal_eager(tp_mesh, tp_plan)),
        Variant("shoal graph, tp", shoal_graph(tp_mesh, tp_plan)),
    ]

    sections = [s.strip().upper() for s in args.only.split(",") if s.strip()]
    rows, notes, results = [], [], {}
    for sec in sections:
        title, cfg, rows_per_batch, baseline = SECTIONS[sec]
        base = initial(cfg)
        params = sum(p.numel() for p in base.parameters())
        x, y = batch(cfg, rows_per_batch)
        label = f"{sec}: {params / 1e6:.2f}M, {rows_per_batch}x{cfg.block_size}"
        print(
            f"{title}: {cfg.n_layer} layers x {cfg.n_embd}, {params:,} params, batch {rows_per_batch}x{cfg.block_size}"
        )
        res = results[sec] = {}
        runs = {}

        def failed(name, e, sec=sec, res=res, runs=runs):
            res[name] = {"error": short(e)}
            runs.pop(name, None)
            if res[name]["error"] != f"{type(e).__name__}: {e}":
                notes.append(f"{sec} {name}: {type(e).__name__}: {e}")
            if args.verbose:
                traceback.print_exc()

        variants = one_device if sec in ("A", "B") else four_devices
        for v in variants:  # build, compile (first step) and warm up every variant
            t0 = time.perf_counter()
            res[v.name] = {}
            try:
                runs[v.name] = Run(v.build, base, x, y, args.warmup)
            except Exception as e:  # a variant that fails is a row, not a crash
                failed(v.name, e)
            print(f"  {v.name:24s} first {args.warmup} steps: {time.perf_counter() - t0:6.1f} s", flush=True)
        for _ in range(args.repeats):  # then time them in turns, so that drift in machine speed hits all alike
            for name, run in list(runs.items()):
                try:
                    run.repeat(args.steps)
                except Exception as e:
                    failed(name, e)
        for name, run in runs.items():
            res[name] = run.result()
        for i, (name, r) in enumerate(res.items()):
            # A, B: against torch eager; C: each row against the shoal eager row of the same plan
            base_row = res.get(baseline) if sec != "C" else res.get(name.replace("graph", "eager"))
            rows.append((label if i == 0 else "", name, r, base_row))

    print()
    print(
        f"GPT training step, AdamW(lr=1e-3), fp32, torch {torch.__version__}, "
        f"torch.set_num_threads({THREADS}) (set explicitly); inductor caches {caches}"
    )
    print(f"ms/step: median of {args.repeats} repeats x {args.steps} steps, after {args.warmup} warm-up steps")
    cols = [("ms/step", 8), ("vs base", 7), ("1st step s", 10), ("compile s", 9), ("last loss", 9)]
    head = f"| {'workload':21s} | {'variant':22s} | " + " | ".join(f"{c:>{w}s}" for c, w in cols) + " |"
    rest = sum(w for _, w in cols) + 3 * (len(cols) - 1)
    print(head)
    print("|" + "|".join("-" * len(p) for p in head.split("|")[1:-1]) + "|")
    for label, name, r, base_row in rows:
        if "error" in r:
            print(f"| {label:21s} | {name:22s} | {r['error']:<{rest}s} |")
            continue
        ratio = "" if base_row is None or "ms" not in base_row else f"{base_row['ms'] / r['ms']:.2f}x"
        comp = f"{r['compile']:9.1f}" if "compile" in r else " " * 9
        cells = f"{r['ms']:8.1f} | {ratio:>7s} | {r['first']:10.1f} | {comp} | {r['loss']:9.4f}"
        print(f"| {label:21s} | {name:22s} | {cells} |")
    print("vs base: base ms / variant ms (above 1 is faster); base: torch eager (A, B), shoal eager, same plan (C)")
    print(
        "1st step s: the first step's wall time (tracing and compiling included); compile s: every trace + compile "
        "(compiled.compile_seconds_total: the first step's, which creates the optimizer state, and the steady one's)"
    )

    def speedup(sec, name, base_name):
        r, b = results.get(sec, {}).get(name, {}), results.get(sec, {}).get(base_name, {})
        return b["ms"] / r["ms"] if "ms" in r and "ms" in b else None

    def verdict(value, ok, fmt):
        return "not measured" if value is None else (fmt.format(value) + (" (met)" if ok(value) else " (NOT met)"))

    a = speedup("A", "shoal graph", "torch eager")
    b = speedup("B", "shoal graph", "torch eager")
    graph_b = results.get("B", {}).get("shoal graph", {})
    c = graph_b.get("compile", graph_b.get("first"))  # the first step if compile_seconds is missing
    tc = results.get("B", {}).get("torch.compile", {}).get("first")
    print(f"target A: shoal graph >= 1.4x faster than torch eager: {verdict(a, lambda s: s >= 1.4, '{:.2f}x')}")
    print(f"target B: shoal graph no slower than torch eager:      {verdict(b, lambda s: s >= 1.0, '{:.2f}x')}")
    c_text = verdict(c, lambda s: s < 10, "{:.1f} s") + ("" if "compile" in graph_b or c is None else " (1st step)")
    print(f"target B: shoal graph compile (trace + compile) < 10 s: {c_text}")
    if tc is not None:
        print(f"(torch.compile, B: first step including compile {tc:.1f} s)")
    for sec in sections:
        losses = [r["loss"] for r in results[sec].values() if "loss" in r]
        if len(losses) > 1:
            print(f"{sec}: last losses agree within {max(losses) - min(losses):.1e}")
    for n in notes:
        print("error in", n.splitlines()[0][:300])


if __name__ == "__main__":
    main()
