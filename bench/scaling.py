"""Cost as the device count grows: the same work on 1, 2, 4, 8, 16 virtual devices, eager and graph.

Part 1: the tiny GPT (2 layers, width 64, block 64), global batch 16 x 64, data parallel (batch split
over every device, parameters Broadcast), AdamW; ms per step, eager and shoal.compile, the same total
compute at every device count. shoal.compile batches the devices' identical segments into one task
per worker (``graph.batch``, groups of 8 or more); also shown with ``batch=False`` (every device's
segment on its own). Part 2: compile seconds (the first call steps the
optimizer eagerly, the second traces and compiles, the third runs the plan) for GPTs of 2, 8 and 32
layers (width 128) on 1 and 4 devices. torch.set_num_threads(2) (set explicitly); medians over repeats.
Usage: python bench/scaling.py [--devices 1,2,4,8,16] [--layers 2,8,32] [--steps N] [--repeats R]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import shoal
from shoal import S
from shoal.models.gpt import GPT, GPTConfig
from shoal.train import train_step as step

THREADS = 2


def model_and_batch(cfg: GPTConfig, rows: int):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (rows, cfg.block_size), generator=g)
    y = torch.randint(0, cfg.vocab_size, (rows, cfg.block_size), generator=g)
    return GPT(cfg), x, y


def laid_out(base, x, y, n: int):
    mesh = shoal.Mesh(list(range(n)), axes=("dp",))
    model = shoal.distribute_module(copy.deepcopy(base), mesh, None)  # parameters Broadcast
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, shoal.to_global(x, mesh, S(0)), shoal.to_global(y, mesh, S(0))


def ms_per_step(fn, args, steps: int, repeats: int) -> tuple[float, float]:
    for _ in range(3):  # warm-up (the first two calls of a compiled step trace)
        fn(*args).detach().full()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = fn(*args)
        last = float(loss.detach().full())
        samples.append((time.perf_counter() - t0) / steps * 1e3)
    return statistics.median(samples), last


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", default="1,2,4,8,16")
    ap.add_argument("--layers", default="2,8,32")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    counts = [int(n) for n in args.devices.split(",")]
    shoal.init(devices=max(counts + [4]))

    cfg = GPTConfig(vocab_size=96, block_size=64, n_layer=2, n_head=4, n_embd=64)
    base, x, y = model_and_batch(cfg, 16)
    print(f"tiny GPT, global batch 16x{cfg.block_size}, data parallel, AdamW; torch.set_num_threads({THREADS}); "
          f"{torch.__version__}")
    print("| devices | eager ms/step | graph ms/step | graph / eager | graph batch=False ms/step | last loss eager | "
          "last loss graph | last loss batch=False |")
    print("|---|---|---|---|---|---|---|---|")
    graph_ms, loop_ms = {}, {}
    for n in counts:
        eager = ms_per_step(step, laid_out(base, x, y, n), args.steps, args.repeats)
        graph = ms_per_step(shoal.compile(step), laid_out(base, x, y, n), args.steps, args.repeats)
        loop = ms_per_step(shoal.compile(step, batch=False), laid_out(base, x, y, n), args.steps, args.repeats)
        graph_ms[n], loop_ms[n] = graph[0], loop[0]
        ratio = graph[0] / eager[0]
        print(f"| {n} | {eager[0]:.1f} | {graph[0]:.1f} | {ratio:.2f} | {loop[0]:.1f} | {eager[1]:.4f} | "
              f"{graph[1]:.4f} | {loop[1]:.4f} |", flush=True)
    if 2 in graph_ms and max(counts) > 2:  # issue 17's target: at most 3x
        top = max(counts)
        print(f"graph at {top} devices / graph at 2: {graph_ms[top] / graph_ms[2]:.2f}x; "
              f"batch=False: {loop_ms[top] / loop_ms[2]:.2f}x")

    print("\ncompile seconds (GPT width 128, batch 8x64): the first call (the optimizer's first step, eagerly), the "
          "second (trace + compile), the third (runs the plan); traces in all")
    print("| layers | devices | first call s | second call s | third call s | traces | trace + compile s |")
    print("|---|---|---|---|---|---|---|")
    for layers in [int(n) for n in args.layers.split(",")]:
        big = GPTConfig(vocab_size=96, block_size=64, n_layer=layers, n_head=4, n_embd=128)
        base2, x2, y2 = model_and_batch(big, 8)
        for n in (1, 4):
            fn = shoal.compile(step)
            model, opt, gx, gy = laid_out(base2, x2, y2, n)
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn(model, opt, gx, gy).detach().full()
                times.append(time.perf_counter() - t0)
            print(f"| {layers} | {n} | {times[0]:.1f} | {times[1]:.1f} | {times[2]:.2f} | {fn.traces} | "
                  f"{fn.compile_seconds_total:.1f} |", flush=True)


if __name__ == "__main__":
    main()
