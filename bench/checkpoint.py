"""Checkpoints: shoal (foreground and background saves, resharded loads) vs torch.save/torch.load of
the gathered state and torch.distributed.checkpoint (DCP) of the same state as DTensors.

A GPT of ``--params`` parameters (default 100M: 12 layers, width 768, vocabulary 8192) after one AdamW
step (its state: about 12 bytes a parameter in fp32), data parallel on 2 processes x 1 device; then
saved under dp,tp on 2 processes x 2 devices and loaded by one process onto 2 devices under tp.
Seconds are the slowest rank's, medians over ``--repeats``; memory is the most a rank's resident
memory (less file-backed pages) rose above where it stood during the operation (sampled every
2 ms). Everything is written under a temporary directory (``--dir``) that is removed at the end.
Usage: python bench/checkpoint.py [--params 10M] [--repeats 3] [--threads 1]   (launches itself)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist

PAGE = os.sysconf("SC_PAGE_SIZE")
VOCAB, LAYERS = 8192, 12


def config(params: float):
    """The GPT config of about ``params`` parameters: 12 layers, width a multiple of 64."""
    from shoal.models import GPTConfig

    # 12 d^2 per layer, 2 V d for the token embedding and the head
    d = (-2 * VOCAB + math.sqrt(4 * VOCAB**2 + 48 * LAYERS * params)) / (24 * LAYERS)
    d = max(64, round(d / 64) * 64)
    return GPTConfig(vocab_size=VOCAB, block_size=64, n_layer=LAYERS, n_head=d // 64, n_embd=d)


def parse_count(text: str) -> float:
    units = {"K": 1e3, "M": 1e6, "G": 1e9, "B": 1e9}
    return float(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else float(text)


class Peak:
    """The most this process's resident memory rose above its level at entry (bytes), sampled on a thread."""

    def __enter__(self) -> Peak:
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def _rss() -> int:
    """Resident memory less the file-backed pages (a file that safetensors maps is page cache, not a copy)."""
    with open("/proc/self/statm") as f:
        resident, shared = f.read().split()[1:3]
    return (int(resident) - int(shared)) * PAGE


def measure(fn) -> tuple[float, int, object]:
    """(seconds, extra memory, fn's result) of ``fn`` on this rank, started together on every rank."""
    if dist.is_initialized():
        dist.barrier()
    with Peak() as peak:
        t0 = time.perf_counter()
        out = fn()
        secs = time.perf_counter() - t0
    return secs, peak.extra, out


def slowest(values: list[float]) -> list[float]:
    """Each value's maximum over the ranks."""
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def trained_model(kind: str, params: float):
    """A GPT laid out by plan ``kind`` over all devices, after one AdamW step."""
    import shoal
    from shoal.models import GPT, gpt

    w = shoal.world()
    shape = (w.size // 2, 2) if kind == "dp,tp" else (w.size,)
    axes = ("dp", "tp")[: len(shape)] if kind == "dp,tp" else (kind,)
    mesh = shoal.Mesh(torch.arange(w.size).reshape(shape).tolist(), axes=axes)
    torch.manual_seed(0)
    model = shoal.distribute_module(GPT(config(params)), mesh, gpt.plans(mesh, kind))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(VOCAB, (2 * w.size, 16), generator=torch.Generator().manual_seed(1))
    if kind == "dp":
        idx = shoal.to_global(idx, mesh, [shoal.S(0)])
    _, loss = model(idx, idx)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def local(t: torch.Tensor) -> torch.Tensor:
    """A replicated tensor's one local copy (plain tensors are themselves)."""
    return t.local_shard() if hasattr(t, "local_shard") else t


def optimizer_tensors(model, opt) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {f"{names[id(p)]}/{k}": v for p, st in opt.state.items() for k, v in st.items()}


def worker_dp(args) -> None:
    """2 processes x 1 device, dp: shoal, torch.save/load and DCP on the same state."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.tensor import DeviceMesh, DTensor, Replicate

    import shoal
    from shoal import checkpoint

    torch.set_num_threads(args.threads)
    w = shoal.init()
    model, opt = trained_model("dp", parse_count(args.params))
    nparams = sum(p.numel() for p in model.parameters())
    state_bytes = sum(local(t).nbytes for t in [*model.state_dict().values(), *optimizer_tensors(model, opt).values()])
    rows: dict[str, list] = {}

    def record(name: str, *values) -> None:
        rows.setdefault(name, []).append(slowest(list(values)))

    state = {"model": model, "optim": opt, "step": 1}
    for r in range(args.repeats):
        path = os.path.join(args.dir, f"shoal-{r}")
        secs, mem, _ = measure(lambda: checkpoint.save(path, state))  # noqa: B023
        record("shoal save", secs, mem, secs)
        secs, mem, _ = measure(lambda: checkpoint.load(path, {"model": model, "optim": opt}))  # noqa: B023
        record("shoal load", secs, mem, secs)
        secs, mem, _ = measure(lambda: checkpoint.load(path, {"model": model, "optim": opt}, verify=False))  # noqa: B023
        record("shoal load, verify=False (no sha256)", secs, mem, secs)

        path = os.path.join(args.dir, f"shoal-bg-{r}")
        with Peak() as peak:
            dist.barrier()
            t0 = time.perf_counter()
            saving = checkpoint.save(path, state, background=True)
            blocked = time.perf_counter() - t0
            saving.wait()
            total = time.perf_counter() - t0
        record("shoal save, background", total, peak.extra, blocked)

        path = os.path.join(args.dir, f"torch-{r}.pt")

        def gathered(path: str = path) -> None:
            sd = {"model": {k: v.detach().full() for k, v in model.state_dict().items()},
                  "optim": {k: v.full() if isinstance(v, shoal.GlobalTensor) else v.clone()
                            for k, v in optimizer_tensors(model, opt).items()}}
            if w.rank == 0:
                torch.save(sd, path)
            dist.barrier()

        def torch_load(path: str = path) -> None:
            sd = torch.load(path, map_location="cpu", weights_only=True)
            with torch.no_grad():
                for k, v in model.state_dict().items():
                    local(v).copy_(sd["model"][k])
                for k, v in optimizer_tensors(model, opt).items():
                    local(v).copy_(sd["optim"][k])

        secs, mem, _ = measure(gathered)
        record("torch.save of the gathered state", secs, mem, secs)
        secs, mem, _ = measure(torch_load)
        record("torch.load", secs, mem, secs)

        dmesh = DeviceMesh("cpu", list(range(w.processes)))
        dstate = {"model": {k: DTensor.from_local(local(v.detach()), dmesh, [Replicate()], run_check=False)
                            for k, v in model.state_dict().items()},
                  "optim": {k: DTensor.from_local(local(v), dmesh, [Replicate()], run_check=False)
                            if v.ndim else v for k, v in optimizer_tensors(model, opt).items()}}
        path = os.path.join(args.dir, f"dcp-{r}")
        secs, mem, _ = measure(lambda: dcp.save(dstate, checkpoint_id=path))  # noqa: B023
        record("DCP save (DTensors)", secs, mem, secs)
        secs, mem, _ = measure(lambda: dcp.load(dstate, checkpoint_id=path))  # noqa: B023
        record("DCP load", secs, mem, secs)
        dist.barrier()
        if w.rank == 0:
            for p in os.listdir(args.dir):
                shutil.rmtree(os.path.join(args.dir, p)) if os.path.isdir(os.path.join(args.dir, p)) \
                    else os.remove(os.path.join(args.dir, p))
        dist.barrier()
    if w.rank == 0:
        print("INFO", json.dumps({"params": nparams, "state_bytes": state_bytes}))
        print("ROWS", json.dumps(rows))


def worker_dp_tp(args) -> None:
    """2 processes x 2 devices, dp,tp: save the checkpoint the resharded load reads."""
    import shoal
    from shoal import checkpoint

    torch.set_num_threads(args.threads)
    shoal.init()
    model, opt = trained_model("dp,tp", parse_count(args.params))
    checkpoint.save(os.path.join(args.dir, "dp-tp"), {"model": model, "optim": opt, "step": 1})


def resharded_load(args) -> list:
    """1 process x 2 devices, tp: load the dp,tp checkpoint of 2 processes x 2 devices."""
    import shoal
    from shoal import checkpoint
    from shoal.models import GPT, gpt

    shoal.init(devices=2)
    mesh = shoal.Mesh([0, 1], axes=("tp",))
    torch.manual_seed(0)
    model = shoal.distribute_module(GPT(config(parse_count(args.params))), mesh, gpt.plans(mesh, "tp"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    path = os.path.join(args.dir, "dp-tp")
    out = []
    for _ in range(args.repeats):
        secs, mem, _ = measure(lambda: checkpoint.load(path, {"model": model, "optim": opt}))
        out.append([secs, mem, secs])
    return out


def launch(args, processes: int, devices: int, role: str) -> str:
    cmd = [sys.executable, "-m", "shoal.launch", "-n", str(processes), "--devices-per-process", str(devices),
           __file__, "--role", role, "--params", args.params, "--repeats", str(args.repeats),
           "--threads", str(args.threads), "--dir", args.dir]
    # a fixed mmap threshold: freed tensors go back to the system, so each operation's peak starts clean
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "SHOAL_TIMEOUT": "600"}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode:
        sys.exit(f"bench/checkpoint.py: the {role} run failed:\n{(p.stdout + p.stderr)[-4000:]}")
    return p.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", default="100M", help="model size, e.g. 100M (default) or 10M for a quick run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in every process")
    ap.add_argument("--dir", default=None, help="where to write (a temporary directory inside it, removed after)")
    ap.add_argument("--role", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "dp":
        return worker_dp(args)
    if args.role == "dp,tp":
        return worker_dp_tp(args)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="shoal-bench-ckpt-", dir=args.dir) as tmp:
        args.dir = tmp
        print(f"torch {torch.__version__}, torch.set_num_threads({args.threads}), --params {args.params}, "
              f"{args.repeats} repeats, writing under {tmp}", flush=True)
        out = launch(args, 2, 1, "dp")
        info = json.loads(out.split("INFO ", 1)[1].splitlines()[0])
        rows = json.loads(out.split("ROWS ", 1)[1].splitlines()[0])
        print(f"dp run done ({info['params'] / 1e6:.1f}M parameters)", flush=True)
        launch(args, 2, 2, "dp,tp")
        rows["shoal load, 2 x 2 devices (dp,tp) -> 1 x 2 (tp)"] = resharded_load(args)
    gib = 2**30
    print(f"\nGPT {info['params'] / 1e6:.1f}M parameters + AdamW state: {info['state_bytes'] / gib:.2f} GiB per "
          f"process, fp32; 2 processes x 1 device (dp) unless named; torch.set_num_threads({args.threads}); "
          f"median of {args.repeats}")
    print("| operation | seconds | training blocked (s) | peak extra memory per process (GiB) |")
    print("|---|---|---|---|")
    for name, runs in rows.items():
        secs, mem, blocked = (statistics.median(r[i] for r in runs) for i in range(3))
        print(f"| {name} | {secs:.2f} | {blocked:.2f} | {mem / gib:.2f} |")


if __name__ == "__main__":
    main()
