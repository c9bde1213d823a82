"""Memory per device under ZeRO, mixed precision and activation checkpointing, beside the formulas.

The bundled GPT (4 layers, width 256, vocabulary 96, block 128; batch 16 x 128) on 4 virtual devices,
data parallel, AdamW, compiled (``shoal.compile``). For dp and ZeRO-1/2/3, fp32 and bf16
(``Plan(precision="bf16")``: bf16 parameters and gradients, fp32 master weights and Adam state):
the bytes per parameter each device holds for its states after a backward (``shoal.memory_report``)
beside the ZeRO paper's formula (Rajbhandari et al. 2019, sections 3.1 and 5: mixed-precision Adam
holds 2 + 2 + 12 bytes a parameter, so 16, 4 + 12/N, 2 + 14/N, 16/N; fp32 the same split of 4 + 4
+ 8), the planned peak of the compiled step and the part of it that is not states (activations
and other temporaries), with and without ``Plan(checkpoint=["blocks.*"])``; ms per step (median)
against dp's from the same run; plain torch's step on one device in fp32 and in bf16 (this CPU's bf16
kernels set the bf16 rows' times). torch.set_num_threads(2), set explicitly.
Usage: python bench/memory.py [--steps N]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

import shoal
from shoal import S
from shoal.models.gpt import GPT, GPTConfig, plans

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_zero import gpt_step as step_fn  # noqa: E402 - the tests' step: zero_grad before backward

THREADS = 2
N = 4


def formula(zero: int, precision: str | None) -> float:
    """Bytes per parameter per device: (parameters, gradients, optimizer state incl. master weights)."""
    p, g, s = (2.0, 2.0, 12.0) if precision else (4.0, 4.0, 8.0)
    return {0: p + g + s, 1: p + g + s / N, 2: p + (g + s) / N, 3: (p + g + s) / N}[zero]


def run(base, x, y, zero: int, precision: str | None, checkpoint: bool, steps: int):
    mesh = shoal.Mesh(list(range(N)), axes=("dp",))
    plan = dataclasses.replace(plans(mesh, "dp"), zero=zero, precision=precision,
                               checkpoint=["blocks.*"] if checkpoint else [])
    model = shoal.distribute_module(copy.deepcopy(base), mesh, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = shoal.compile(step_fn)
    gx, gy = shoal.to_global(x, mesh, S(0)), shoal.to_global(y, mesh, S(0))
    for _ in range(2):  # eager first call (makes the optimizer state), then trace and compile
        step(model, opt, gx, gy).item()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step(model, opt, gx, gy).item()
        times.append(time.perf_counter() - t0)
    # the states at their fullest: after a backward, before the step takes the gradients
    opt.zero_grad()
    model(gx, gy)[1].backward()
    report = shoal.memory_report(model, opt)
    states = report.total()[0]
    return statistics.median(times) * 1e3, states, step.plan.peak_bytes[0], report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    shoal.init(devices=N)
    torch.manual_seed(0)
    base = GPT(GPTConfig())
    psi = sum(p.numel() for p in base.parameters())
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 96, (16, 128), generator=g)
    y = torch.randint(0, 96, (16, 128), generator=g)
    print(f"bundled GPT ({psi / 1e6:.2f}M parameters), batch 16 x 128, {N} virtual devices, data parallel, AdamW, "
          f"compiled; torch.set_num_threads({THREADS}); {torch.__version__}")
    print("| zero | precision | checkpoint | bytes/param/device | formula | ratio | planned peak MB | "
          "of which not states MB | ms/step | vs dp |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    dp_ms = None
    for precision in (None, "bf16"):
        for zero in (0, 1, 2, 3):
            for checkpoint in ((False, True) if zero in (0, 3) else (False,)):
                try:
                    ms, states, peak, _ = run(base, x, y, zero, precision, checkpoint, args.steps)
                except NotImplementedError as e:
                    print(f"| {zero} | {precision or 'fp32'} | {'on' if checkpoint else 'off'} | not built: {e} |")
                    continue
                dp_ms = ms if dp_ms is None else dp_ms
                per = states / psi
                want = formula(zero, precision)
                print(f"| {zero} | {precision or 'fp32'} | {'on' if checkpoint else 'off'} | {per:.2f} | {want:.2f} | "
                      f"{per / want:.3f} | {peak / 1e6:.1f} | {(peak - states) / 1e6:.1f} | {ms:.0f} | "
                      f"{ms / dp_ms:.2f} |", flush=True)
    fp32, bf16 = plain_torch(base, x, y, None, args.steps), plain_torch(base, x, y, torch.bfloat16, args.steps)
    print(f"\nplain torch, one device, the whole batch: fp32 {fp32:.0f} ms/step, bf16 parameters and compute "
          f"{bf16:.0f} ms/step ({bf16 / fp32:.1f}x: this CPU's bf16 kernels)")


def plain_torch(base, x, y, dtype, steps: int) -> float:
    """ms per step of the same model in plain torch on one device (AdamW; bf16: parameters in bf16)."""
    model = copy.deepcopy(base)
    if dtype is not None:
        model.to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        step_fn(model, opt, x, y).item()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


if __name__ == "__main__":
    main()
