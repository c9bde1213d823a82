"""Data parallel GPT: shoal eager vs torch DistributedDataParallel, same processes, one run.

The GPT of shoal.models (4 layers, width 256, ~3.7M parameters), batch 8 x 128 tokens split over
2 processes (one device, one thread each), AdamW, fp32. Prints median step times side by side.
Usage: python bench/dp_vs_ddp.py [--steps N]   (launches itself with `shoal run -n 2`)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from shoal.launch import on_processes


def step_times(model, opt, idx, tgt, steps: int) -> list[float]:
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        _, loss = model(idx, tgt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if isinstance(loss, torch.Tensor) and hasattr(loss, "full"):
            loss = loss.full()
        loss.item()
        dist.barrier()
        if i >= 2:  # warm-up: caches and allocator
            times.append(time.perf_counter() - t0)
    return times


def worker(steps: int) -> None:
    import shoal
    from shoal.models import GPT, GPTConfig

    torch.set_num_threads(1)
    w = shoal.init()
    rank = w.rank
    cfg = GPTConfig(vocab_size=96, block_size=128, n_layer=4, n_head=4, n_embd=256)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (8, 128), generator=g)
    tgt = torch.randint(0, cfg.vocab_size, (8, 128), generator=g)
    local = slice(rank * 4, rank * 4 + 4)

    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(GPT(cfg))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    t_ddp = step_times(ddp, opt, idx[local], tgt[local], steps)

    torch.manual_seed(0)
    mesh = shoal.Mesh(list(range(w.size)), axes=("dp",))
    model = shoal.distribute_module(GPT(cfg), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gidx, gtgt = shoal.from_local_batch(idx[local], mesh), shoal.from_local_batch(tgt[local], mesh)
    t_shoal = step_times(model, opt, gidx, gtgt, steps)

    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        d, s = statistics.median(t_ddp) * 1e3, statistics.median(t_shoal) * 1e3
        print(f"GPT {params / 1e6:.2f}M params, batch 8x128 over 2 processes x 1 thread, AdamW, {steps} steps")
        print("| step time (ms, median) | DDP | shoal eager | shoal / DDP |")
        print("|---|---|---|---|")
        print(f"| data parallel, 2 processes | {d:.1f} | {s:.1f} | {s / d:.2f}x |")
        print("target: shoal within 1.2x of DDP")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    on_processes(2)
    worker(args.steps)


if __name__ == "__main__":
    main()
