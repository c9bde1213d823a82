"""Pipeline schedules: bubble by theory, on the virtual clock and on the wall clock, and memory.

Part 1: for p in (2, 4) stages and m in (4, 8, 16) micro-batches, each schedule (GPipe, 1F1B,
interleaved with v=2, ZB-H1) trains a 4p-block MLP stack one step on p virtual devices (axis "pp").
Columns: the bubble by the closed form; on the virtual clock (``train_step.simulate``: per stage and
micro-batch F lasts 1 and backward 2, B = W = 1 where split, transfers 0; the worst stage); on the
wall clock (p=2 only, 2 cores, one thread per stage: the worst stage's idle fraction of the
forward/backward span of a real step); the planned peak activation micro-batches and bytes of stage
0. Part 2: the bundled GPT (4 layers, width 256, batch 16 x 128) on 4 virtual devices under dp,
dp,tp and pp,dp (1F1B, m=8): ms per step (median) and planned peak bytes per device.
torch.set_num_threads(2), set explicitly.
Usage: python bench/pipeline.py [--quick]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

import shoal
from shoal import B, S
from shoal.models.gpt import GPT, GPTConfig, plans
from shoal.runtime import bubble

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_pipeline import Net, even_stages, step_fn  # noqa: E402 - the test model and step

THREADS = 2


def theory(schedule: str, p: int, m: int, v: int) -> float:
    if schedule == "zb":
        return None  # no closed form for ZB-H1 here: about a third of 1F1B's
    return (p - 1) / (v * m + p - 1)


def step_for(model, schedule: str, m: int):
    return shoal.compile(step_fn, micro_batches=m, schedule=schedule), torch.optim.AdamW(model.parameters(), lr=1e-3)


def uniform(plan):
    """Virtual-clock durations: per stage and micro-batch F = 1 and backward = 2 (B = W = 1 when the
    schedule splits it; a stage whose input gradient nothing needs, the first, has all of it in W),
    shared evenly among the tasks that make up each."""
    tasks = [t for t in plan.tasks if t.kind == "compute"]
    split = any(t.phase == "W" for t in tasks)

    def seconds(task):
        if task.kind != "compute":
            return 0.0
        mine = [t for t in tasks if t.device == task.device and t.stage == task.stage]
        same = [t for t in mine if t.phase == task.phase]
        total = 1.0 if task.phase == "F" or (split and any(t.phase == "B" for t in mine)) else 2.0
        return total / len(same)

    return seconds


def part1(ps, ms, width: int) -> None:
    print(f"\n## Schedules (MLP stack, width {width}, 4 blocks per device, batch 8 rows per micro-batch)")
    print("| p | m | schedule | bubble theory | virtual clock | wall clock | stage-0 micro-batches held | stage-0 "
          "planned peak bytes |")
    print("|---|---|---|---|---|---|---|---|")
    for p in ps:
        mesh = shoal.Mesh(list(range(p)), axes=("pp",))
        for m in ms:
            for schedule in ("gpipe", "1f1b", "interleaved", "zb"):
                v = 2 if schedule == "interleaved" else 1
                if schedule == "interleaved" and m % p:
                    continue
                torch.manual_seed(0)
                model = shoal.distribute_module(Net(4 * p, width), mesh,
                                                shoal.Plan(stages=even_stages(p * v, 4 * p)))
                step, opt = step_for(model, schedule, m)
                x = shoal.to_global(torch.randn(8 * m, 8), mesh, B)
                y = shoal.to_global(torch.randn(8 * m, 4), mesh, B)
                step(model, opt, x, y)
                step(model, opt, x, y)
                virtual = max(bubble(step.simulate(uniform(step.plan))).values())
                wall = ""
                if p == 2:
                    walls = []
                    for _ in range(3):
                        step(model, opt, x, y)
                        walls.append(max(bubble(step.timeline).values()))
                    wall = f"{statistics.median(walls):.3f}"
                t = theory(schedule, p, m, v)
                print(f"| {p} | {m} | {schedule}{' v=2' if v == 2 else ''} | {'-' if t is None else f'{t:.3f}'} | "
                      f"{virtual:.3f} | {wall or '-'} | {step.plan.in_flight[0]} | {step.plan.peak_bytes[0]:,} |")


def gpt_row(kind: str, steps: int):
    cfg = GPTConfig(n_layer=4, n_embd=256, block_size=128)
    torch.manual_seed(0)
    base = GPT(cfg)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (16, cfg.block_size), generator=g)
    y = torch.randint(0, cfg.vocab_size, (16, cfg.block_size), generator=g)
    if kind == "pp,dp":
        mesh = shoal.Mesh([[0, 1], [2, 3]], axes=("pp", "dp"))
        stages = {"tok_emb": 0, "pos_emb": 0, "blocks.0": 0, "blocks.1": 0, "blocks.2": 1, "blocks.3": 1,
                  "ln_f": 1, "lm_head": 1}
        model = shoal.distribute_module(copy.deepcopy(base), mesh, shoal.Plan(stages=stages))
        lay = (B, S(0))
        m = 8
    else:
        mesh = shoal.Mesh([0, 1, 2, 3], axes=("dp",)) if kind == "dp" else shoal.Mesh([[0, 1], [2, 3]],
                                                                                        axes=("dp", "tp"))
        model = shoal.distribute_module(copy.deepcopy(base), mesh, plans(mesh, kind))
        lay = (S(0),) if kind == "dp" else (S(0), B)
        m = 1
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def body(model, opt, x, y):
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        return loss

    step = shoal.compile(body, micro_batches=m, schedule="1f1b") if m > 1 else shoal.compile(body)
    gx, gy = shoal.to_global(x, mesh, lay), shoal.to_global(y, mesh, lay)
    for _ in range(3):
        step(model, opt, gx, gy)
    samples = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = step(model, opt, gx, gy)
        float(loss)
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples), step.plan.peak_bytes


def part2(steps: int) -> None:
    print("\n## GPT (4 layers, width 256, batch 16 x 128) on 4 virtual devices, AdamW")
    print("| plan | ms per step (median) | planned peak bytes per device |")
    print("|---|---|---|")
    for kind in ("dp", "dp,tp", "pp,dp"):
        ms, peak = gpt_row(kind, steps)
        print(f"| {kind}{' (1F1B, m=8)' if kind == 'pp,dp' else ''} | {ms:.1f} | "
              f"{', '.join(f'{peak[d]:,}' for d in sorted(peak))} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="p=2, m=4 only, and 2 GPT steps")
    a = ap.parse_args()
    torch.set_num_threads(THREADS)
    shoal.init(devices=4)
    print(f"torch.set_num_threads({THREADS}); shoal {shoal.world().device_type} virtual devices")
    if a.quick:
        part1((2,), (4,), 64)
        part2(2)
    else:
        part1((2, 4), (4, 8, 16), 256)
        part2(7)


if __name__ == "__main__":
    main()
