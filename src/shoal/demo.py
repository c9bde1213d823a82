"""``python -m shoal.demo``: one unmodified MLP trained three ways on 4 virtual devices.

Single-device torch (the reference), data parallel and tensor parallel give the same loss curve;
the parallel versions differ only in a ``Plan`` (data: parameter-name pattern -> SBP) that
``apply_plan`` applies by replacing parameters. Exits 1 if a curve leaves the reference.
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

import shoal
from shoal import SBP, B, Mesh, S

DEVICES = 4
IN, HIDDEN, OUT = 16, 64, 4
SAMPLES, BATCH = 1000, 50  # 50 rows over 4 devices: an uneven split (13, 13, 12, 12)
LR, MOMENTUM = 0.05, 0.9


@dataclass(frozen=True)
class Plan:
    """How a model is laid out: the batch's SBP and, per parameter-name pattern, the parameter's.

    Patterns are ``fnmatch`` patterns tried in order; every parameter must match one.
    """

    batch: SBP | tuple[SBP, ...]
    params: dict[str, SBP | tuple[SBP, ...]] = field(default_factory=dict)


PLANS: dict[str, Plan] = {
    # batch split over devices, every parameter replicated: gradients come out P and are reduced
    "dp": Plan(batch=S(0), params={"*": B}),
    # Megatron-style: first Linear column-parallel (out features split), second row-parallel
    "tp": Plan(batch=B, params={"0.weight": S(0), "0.bias": S(0), "2.weight": S(1), "2.bias": B}),
}


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))


def apply_plan(model: nn.Module, plan: Plan, mesh: Mesh) -> nn.Module:
    """Replace every parameter of ``model`` in place by a GlobalTensor parameter laid out per ``plan``."""
    for name, p in list(model.named_parameters()):
        sbp = next((s for pat, s in plan.params.items() if fnmatch.fnmatchcase(name, pat)), None)
        if sbp is None:
            raise ValueError(f"apply_plan: parameter {name!r} matches no pattern of {list(plan.params)}")
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        setattr(module, attr, nn.Parameter(shoal.to_global(p.detach(), mesh, sbp)))
    return model


def make_data(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic regression task: targets from a fixed random teacher network plus noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, IN, generator=g)
    w1 = torch.randn(IN, 32, generator=g) / IN**0.5
    w2 = torch.randn(32, OUT, generator=g) / 32**0.5
    y = torch.tanh(x @ w1) @ w2 + 0.05 * torch.randn(SAMPLES, OUT, generator=g)
    return x, y


def mse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # Written out rather than F.mse_loss: aten.mse_loss has no SBP rule yet (loss rules are
    # issue 3), so it would run replicated through the fallback. The value is the same.
    return ((pred - target) ** 2).mean()


@dataclass
class Run:
    losses: list[float]
    comms: Counter  # collectives per training step (forward, backward, optimizer step), averaged


def train(steps: int, plan: Plan | None = None, mesh: Mesh | None = None) -> Run:
    """Train a fresh model; plain torch if ``plan`` is None."""
    model = make_model()
    if plan is not None:
        apply_plan(model, plan, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    x, y = make_data()
    losses: list[float] = []
    comms: Counter = Counter()
    for step in range(steps):
        i = (step * BATCH) % SAMPLES
        xb, yb = x[i : i + BATCH], y[i : i + BATCH]
        if plan is not None:
            xb, yb = shoal.to_global(xb, mesh, plan.batch), shoal.to_global(yb, mesh, plan.batch)
        with shoal.CommCounter() as cc:
            opt.zero_grad()
            loss = mse(model(xb), yb)
            loss.backward()
            opt.step()
        comms.update(cc.counts)
        losses.append(loss.item())
    return Run(losses, Counter({k: v / steps for k, v in comms.items()}))


def _comm_str(c: Counter) -> str:
    if not c:
        return "none"
    total = sum(c.values())
    parts = ", ".join(f"{k} {v:g}" for k, v in sorted(c.items()))
    return f"{total:g} ({parts})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shoal.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=25, help="print a row every N steps")
    ap.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance against single-device")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    shoal.init(devices=DEVICES)
    mesh = Mesh(list(range(DEVICES)), axes=("d",))
    print(
        f"shoal demo: MLP {IN}-{HIDDEN}-{OUT}, MSE, SGD(lr={LR}, momentum={MOMENTUM}), batch {BATCH}, "
        f"{args.steps} steps, {DEVICES} virtual CPU devices"
    )
    for name, plan in PLANS.items():
        params = ", ".join(f"{k}: {v}" for k, v in plan.params.items())
        print(f"  {name}: batch {plan.batch}; params {params}")

    t0 = time.perf_counter()
    shoal.coverage(reset=True)
    ref = train(args.steps)
    runs = {name: train(args.steps, plan, mesh) for name, plan in PLANS.items()}
    cov = shoal.coverage()

    names = list(runs)
    print()
    print(f"{'step':>5}  {'single':>10}" + "".join(f"  {n:>10}" for n in names) + f"  {'max abs diff':>12}")
    rows = sorted({*range(0, args.steps, args.every), args.steps - 1})
    for s in rows:
        r = ref.losses[s]
        diff = max(abs(runs[n].losses[s] - r) for n in names)
        print(f"{s:>5}  {r:>10.6f}" + "".join(f"  {runs[n].losses[s]:>10.6f}" for n in names) + f"  {diff:>12.2e}")

    print()
    ok = True
    for n in names:
        # worst relative difference over every step, not only the printed ones
        rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(runs[n].losses, ref.losses))
        match = rel <= args.rtol
        ok &= match
        print(
            f"{n}: {'matches' if match else 'DOES NOT MATCH'} single-device (max rel diff {rel:.1e}, "
            f"rtol {args.rtol:g}); collectives/step: {_comm_str(runs[n].comms)}"
        )
    print(f"fallback ops: {sum(cov.by_fallback.values())} calls of {len(cov.by_fallback)} op(s) ", end="")
    print(f"({len(cov.by_rule)} op(s) served by rules)")
    if cov.by_fallback:
        print(cov)
    verdict = "OK: every parallel run matches single-device" if ok else "FAIL: a parallel run does not match"
    print(f"{verdict} ({time.perf_counter() - t0:.0f}s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
