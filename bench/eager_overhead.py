"""Eager overhead per op: plain torch vs shoal vs PyTorch DTensor, side by side from one run.

Same small ops, same layout (inputs split on dim 0 of a one-device mesh, weights replicated) for
shoal and DTensor (world of one process, gloo); shoal also on 2 and 4 virtual devices. The floor
beside them: a do-nothing ``__torch_dispatch__`` wrapper subclass (unwrap, run the op, wrap), the
least any tensor subclass costs. Overhead = time per op minus plain torch's. Medians over repeats;
torch.set_num_threads(1).
Usage: python bench/eager_overhead.py [--iters N] [--repeats R]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._pytree import tree_map

import shoal
from shoal import B, S


class Wrapper(torch.Tensor):
    """A tensor subclass that does nothing: each op unwraps, runs on the inner tensor, wraps."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, strides=inner.stride(),
                                                   requires_grad=inner.requires_grad)

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    __slots__ = ("inner",)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args = [a.inner if type(a) is Wrapper else a for a in args]
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            return Wrapper(out)
        return tree_map(lambda o: Wrapper(o) if isinstance(o, torch.Tensor) else o, out)


def per_op_us(fn, iters: int, repeats: int) -> float:
    for _ in range(max(10, iters // 10)):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(samples)


def workloads(x, y, w, b):
    def linear_fwd_bwd():
        out = F.linear(x, w, b)
        out.sum().backward()

    return {
        "add 64x64": lambda: x + y,
        "mul 64x64": lambda: x * y,
        "matmul 64x64": lambda: x @ y,
        "Linear fwd+bwd": linear_fwd_bwd,
    }


def tensors(to_dist, requires_grad_w=True):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g)
    w, b = torch.randn(64, 64, generator=g), torch.randn(64, generator=g)
    x, y, w, b = to_dist(x, "split"), to_dist(y, "split"), to_dist(w, "rep"), to_dist(b, "rep")
    w.requires_grad_(requires_grad_w)
    b.requires_grad_(requires_grad_w)
    return x, y, w, b


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    dmesh = init_device_mesh("cpu", (1,))

    def to_dtensor(t, kind):
        return distribute_tensor(t, dmesh, [Shard(0) if kind == "split" else Replicate()])

    shoal.init(devices=4)
    meshes = {n: shoal.Mesh(list(range(n))) for n in (1, 2, 4)}

    def to_shoal(n):
        return lambda t, kind: shoal.to_global(t, meshes[n], S(0) if kind == "split" else B)

    columns = {
        "torch": workloads(*tensors(lambda t, k: t)),
        "do-nothing": workloads(*tensors(lambda t, k: Wrapper(t))),
        "shoal 1 dev": workloads(*tensors(to_shoal(1))),
        "DTensor 1 dev": workloads(*tensors(to_dtensor)),
        "shoal 2 dev": workloads(*tensors(to_shoal(2))),
        "shoal 4 dev": workloads(*tensors(to_shoal(4))),
    }
    results = {c: {op: per_op_us(f, args.iters, args.repeats) for op, f in ops.items()} for c, ops in columns.items()}
    ops = list(results["torch"])
    print(f"time per op (us, median of {args.repeats} x {args.iters}), torch.set_num_threads(1), {torch.__version__}")
    head = f"| {'op':16s} | " + " | ".join(f"{c:>13s}" for c in columns) + " | shoal/DTensor overhead |"
    print(head)
    print("|" + "|".join("-" * (len(p) + 0) for p in head.split("|")[1:-1]) + "|")
    for op in ops:
        base = results["torch"][op]
        cells = [f"{results[c][op]:13.1f}" for c in columns]
        ratio = (results["shoal 1 dev"][op] - base) / max(results["DTensor 1 dev"][op] - base, 1e-9)
        print(f"| {op:16s} | " + " | ".join(cells) + f" | {ratio:22.2f} |")
    floor = statistics.median(results["do-nothing"][op] - results["torch"][op] for op in ops)
    print(f"do-nothing wrapper overhead (median over ops): {floor:.1f} us per op")
    print("overhead = time - torch; target: shoal 1 dev overhead <= 1/3 of DTensor's (ratio <= 0.33)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
