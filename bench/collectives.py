"""Collectives across processes: shoal's layout conversions beside torch.distributed's own calls.

Two processes x 1 device (gloo, CPU), one thread each; a float32 tensor of N MiB laid out over both:
``S(0) -> B`` (an all-gather), ``P -> S(0)`` (a reduce-scatter) and ``P -> B`` (an all-reduce), each
beside torch.distributed's ``all_gather_into_tensor``, ``reduce_scatter_tensor`` and ``all_reduce`` on
the same bytes, and beside an all-reduce of the whole tensor (how shoal gathered and reduce-scattered
across processes before: a zero-padded whole summed; until 2026-12-07 still so for uneven splits,
the "rows odd" rows). Medians of ``--reps`` calls.
Usage: python bench/collectives.py [--reps N]   (launches itself with ``shoal run -n 2``)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from shoal.launch import on_processes


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps + 2):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]) * 1e3


def worker(reps: int) -> None:
    import shoal

    torch.set_num_threads(1)
    w = shoal.init()
    mesh = shoal.Mesh([0, 1])
    if w.rank == 0:
        print(f"2 processes x 1 device (gloo), float32, median of {reps} calls, ms")
        print("| MiB | conversion | shoal | torch.distributed | shoal / torch | all-reduce of the whole |")
        print("|---|---|---|---|---|---|")
    for mib in (1, 16, 64):
        one_size(mib, mesh, reps, w.rank)


def one_size(mib: int, mesh, reps: int, rank: int) -> None:
    import shoal
    from shoal import B, P, S
    from shoal.testing import make_global

    n = mib * (1 << 20) // 4
    whole = torch.randn(n // 64, 64, generator=torch.Generator().manual_seed(0))  # the same on both
    half = whole[: whole.shape[0] // 2].contiguous()
    split = shoal.to_global(whole, mesh, S(0))
    partial = make_global(whole, mesh, P)  # random pieces on each process, summing to ``whole``

    def resolve(t, sbp):  # a Partial tensor remembers its first reduction: forget it, reduce again
        t._resolved = None
        return t.to_global(mesh, sbp)

    out = torch.empty_like(whole)
    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)  # torch renamed them
    scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    rows = [("S(0) -> B", lambda: split.to_global(mesh, B), lambda: gather(out, half)),
            ("P -> S(0)", lambda: resolve(partial, S(0)),
             lambda: scatter(torch.empty_like(half), whole)),
            ("P -> B", lambda: resolve(partial, B), lambda: dist.all_reduce(whole.clone()))]
    # an odd row count splits unevenly (one more row on rank 0): shoal pads the shorter block; torch's
    # calls beside it move the same padded blocks
    odd = whole[:-1]
    split_odd, partial_odd = shoal.to_global(odd, mesh, S(0)), make_global(odd, mesh, P)
    rows += [("S(0) -> B, rows odd", lambda: split_odd.to_global(mesh, B), lambda: gather(out, half)),
             ("P -> S(0), rows odd", lambda: resolve(partial_odd, S(0)),
              lambda: scatter(torch.empty_like(half), whole))]
    padded = median_ms(lambda: dist.all_reduce(whole.clone()), reps)
    for name, ours, theirs in rows:
        a, b = median_ms(ours, reps), median_ms(theirs, reps)
        if rank == 0:
            print(f"| {mib} | {name} | {a:.2f} | {b:.2f} | {a / b:.2f}x | {padded:.2f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    on_processes(2)
    worker(args.reps)


if __name__ == "__main__":
    main()
