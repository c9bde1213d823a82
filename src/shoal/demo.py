"""``python -m shoal.demo`` (``make demo``): a GPT trained on 4 virtual devices, data x tensor parallel.

The same run as ``shoal train gpt --devices 4 --mesh 2x2 --plan dp,tp --compile``, sized for about
three minutes on 2 CPU threads: each step is a compiled graph run by the actor runtime, on the
characters of Python's own standard library, Megatron tensor parallel inside each pair of devices,
data parallel across the pairs. Then the first steps are trained again in plain single-device torch:
their losses must be the same (a plan changes cost, never values), and the loss must have clearly
fallen. Exits 1 otherwise."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from .train import TrainConfig, train

DEMO = TrainConfig(
    model="gpt",
    plan="dp,tp",
    devices=4,
    mesh=(2, 2),
    steps=350,
    batch=16,
    threads=2,
    every=25,
    model_args={"block_size": 64},
    compile=True,
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m shoal.demo",
        description="make demo: a GPT trained on 4 virtual devices as a 2x2 mesh (data x tensor parallel), each "
        "step a compiled graph; then its first steps retrained in plain single-device torch. Exits 1 unless "
        "their losses agree and the loss fell.",
    )
    ap.add_argument("--steps", type=int, default=DEMO.steps, help="training steps (default %(default)s)")
    ap.add_argument("--threads", type=int, default=DEMO.threads, help="torch CPU threads (default %(default)s)")
    ap.add_argument("--check", type=int, default=3,
                    help="steps retrained in plain torch and compared (default %(default)s)")
    ap.add_argument("--rtol", type=float, default=1e-4,
                    help="relative tolerance against single-device (default %(default)s)")
    ap.add_argument("--eager", action="store_true", help="run the steps eagerly instead of as a compiled graph")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    cfg = dataclasses.replace(DEMO, steps=args.steps, threads=args.threads, compile=not args.eager)
    run = train(cfg)
    check = min(args.check, args.steps)
    plain = dataclasses.replace(cfg, plan="none", stop_after=check, save=False, progress=False, sample=0, verbose=False,
                                compile=False)
    ref = train(plain)

    print()
    rel = max(abs(a - b) / abs(b) for a, b in zip(run.losses, ref.losses))
    same = rel <= args.rtol
    print(
        f"same as one device: the first {check} losses of plain torch ({_losses(ref.losses)}) "
        f"{'match' if same else 'DO NOT MATCH'} the 2x2 run's ({_losses(run.losses[:check])}); "
        f"max rel diff {rel:.1e}"
    )
    tail = run.losses[-10:]
    last = sum(tail) / len(tail)
    fell = last < 0.75 * run.losses[0]
    print(
        f"loss: first {run.losses[0]:.3f} -> last {run.losses[-1]:.3f} (mean of the last {len(tail)} steps "
        f"{last:.3f}): {'falling' if fell else 'NOT FALLING'}"
    )
    ok = same and fell
    print(f"{'OK' if ok else 'FAIL'} ({time.perf_counter() - t0:.0f}s)")
    return 0 if ok else 1


def _losses(xs: list[float]) -> str:
    return " ".join(f"{x:.4f}" for x in xs)


if __name__ == "__main__":
    sys.exit(main())
