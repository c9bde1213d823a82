"""The ``shoal`` command (also ``python -m shoal``).

``shoal train gpt|bert|resnet --devices 4 --mesh 2x2 --plan dp,tp --steps 100`` trains a bundled
model on data made in code, laid out by the model's plan; see ``shoal train --help``.
``shoal run`` launches a script, or ``-m shoal train ...``, on several processes (``launch``).
``shoal checkpoint info|export`` lists a checkpoint or writes its model as a plain state dict.
``shoal plan gpt --set ... --devices 1024 --batch 1536 [--plan tp=8,...]`` predicts or searches a plan.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from importlib.metadata import PackageNotFoundError, version

import torch

from . import auto, checkpoint, launch
from . import train as training

__all__ = ["main"]


def _mesh(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(n) for n in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"mesh {text!r}: expected sizes joined by 'x', e.g. 4 or 2x2") from None
    if not 1 <= len(shape) <= 3 or any(n < 1 for n in shape):
        raise argparse.ArgumentTypeError(f"mesh {text!r}: expected a 1-D, 2-D or 3-D shape of positive sizes, e.g. "
                                         "2x2")
    return shape


def _devices(text: str) -> int:
    """A positive device count, or ``auto`` (0): every device of the processes ``shoal run`` starts,
    whose number an elastic world (``--nnodes min:max``) knows only when it starts."""
    if text == "auto":
        return 0
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"devices {text!r}: expected a positive number or 'auto'")
    return n


def _setting(text: str) -> tuple[str, str]:
    key, eq, value = text.partition("=")
    if not eq or not key:
        raise argparse.ArgumentTypeError(f"--set {text!r}: expected KEY=VALUE, e.g. n_layer=2")
    return key, value


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="shoal", description="Train on many devices as if they were one.")
    ap.add_argument("--version", action="version", version=f"shoal {_version()}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    d = training.TrainConfig()
    t = sub.add_parser(
        "train",
        help="train a bundled model (gpt, bert, resnet) with a parallel plan",
        description="Train a bundled model on data made in code (Python's own source for gpt and bert, "
        "synthetic stripes for resnet), laid out on virtual devices by the model's plan. Writes loss.png "
        "and losses.json into the run directory.",
    )
    t.add_argument("model", choices=list(training.MODELS), metavar="MODEL", help="gpt, bert or resnet")
    t.add_argument("--devices", type=_devices, default=d.devices, help="virtual devices, or auto: every device of "
                   "the processes shoal run starts, as an elastic world (--nnodes min:max) needs (default %(default)s)")
    t.add_argument("--mesh", type=_mesh, help="mesh shape, e.g. 4 or 2x2 (default: --devices, 2xN for dp,tp)")
    t.add_argument(
        "--plan",
        default=d.plan,
        metavar="PLAN",
        help="dp: data parallel; tp: Megatron tensor parallel; dp,tp: both on a 2-D mesh; zero, zero2, zero3: dp "
        "with ZeRO-1 (optimizer state split over the devices), -2 (and gradients), -3 (and parameters); pp,dp "
        "and pp,dp,tp: pipeline stages first (--mesh 2x2, 2x2x2; with --micro-batches); "
        "none: plain torch on one device (default %(default)s); or, for gpt, the keys shoal plan takes: "
        "tp=2,dp=2,sp=true or pp=2,tp=2,mb=2,schedule=interleaved,v=2,zero=1,recompute=full,precision=bf16 "
        "(the mesh follows; what is left out: dp the rest, --micro-batches, --schedule, --precision)",
    )
    t.add_argument("--steps", type=int, default=d.steps, help="training steps (default %(default)s)")
    t.add_argument("--batch", type=int, default=d.batch, help="global batch size (default %(default)s)")
    lrs = ", ".join(f"{v:g} for {k}" for k, v in training.DEFAULT_LR.items())
    t.add_argument("--lr", type=float, help=f"peak learning rate (default {lrs})")
    t.add_argument("--warmup", type=int, help="linear warmup steps before cosine decay (default: steps // 10)")
    t.add_argument("--optimizer", default=d.optimizer, choices=training.OPTIMIZERS, help="(default %(default)s)")
    t.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    t.add_argument("--seed", type=int, default=d.seed, help="(default %(default)s)")
    t.add_argument("--every", type=int, default=d.every, help="print the loss every N steps (default %(default)s)")
    t.add_argument("--out", help="run directory (default runs/<model>-<plan>-<time>/)")
    t.add_argument("--sample", type=int, default=d.sample, help="gpt: characters to generate (default %(default)s)")
    t.add_argument(
        "--set",
        dest="model_args",
        type=_setting,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a model config field, e.g. --set n_layer=2 --set n_embd=64 (repeatable)",
    )
    t.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    t.add_argument("--compile", action="store_true", help="run each step as a compiled graph (shoal.compile)")
    t.add_argument("--micro-batches", type=int, default=d.micro_batches,
                   help="train each step in this many micro-batches, compiled (pp plans need it; default %(default)s)")
    t.add_argument("--schedule", default=d.schedule, choices=("gpipe", "1f1b", "interleaved", "zb"),
                   help="pipeline schedule for pp plans (default %(default)s)")
    t.add_argument("--checkpoint", action="append", default=[], metavar="PATTERN",
                   help="recompute the activations of the modules matching PATTERN in backward (e.g. 'blocks.*'; "
                        "repeat for more)")
    t.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                   help="save a checkpoint every N steps and after the last, into --checkpoint-dir")
    t.add_argument("--checkpoint-dir", metavar="DIR",
                   help="where checkpoints go; a run (or a restart under shoal run --max-restarts) resumes from "
                        "the latest one there")
    t.add_argument("--precision", default=None, choices=("bf16", "fp16"),
                   help="bf16 or fp16 parameters and compute, fp32 master weights and optimizer state; fp16 scales "
                        "the loss dynamically (default: fp32)")
    sub.add_parser(
        "run",
        help="run a script on P processes (torchrun): shoal run -n P [--devices-per-process K] script.py ...",
        add_help=False,
    )
    _checkpoint_parser(sub)
    _plan_parser(sub)
    return ap


def _checkpoint_parser(sub) -> None:
    c = sub.add_parser("checkpoint", help="list a checkpoint (info) or write its model as one safetensors file "
                       "(export)", description="Inspect a checkpoint that shoal.checkpoint.save wrote.")
    actions = c.add_subparsers(dest="action", metavar="ACTION", required=True)
    i = actions.add_parser("info", help="tensors, global shapes, dtypes, saved layouts, sizes, files and values")
    i.add_argument("path", help="checkpoint directory (or a safetensors file)")
    i.add_argument("--verify", action="store_true", help="also check every file against its sha256")
    e = actions.add_parser("export", help="write the model as one plain safetensors state dict (its own names)")
    e.add_argument("path", help="checkpoint directory")
    e.add_argument("out", help="the .safetensors file to write")
    e.add_argument("--prefix", help="which saved module (default: the only one)")


def _checkpoint(args: argparse.Namespace) -> int:
    """``shoal checkpoint info|export``: a mistake is one line on stderr and exit status 2."""
    try:
        if args.action == "info":
            print(checkpoint.describe(args.path, verify=args.verify))
        else:
            print(f"wrote {checkpoint.export(args.path, args.out, args.prefix)}")
    except (OSError, ValueError) as e:
        print(f"shoal checkpoint {args.action}: error: {e}", file=sys.stderr)
        return 2
    return 0


def _plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="predict a plan's step time and memory on a described cluster, or search the "
                       "best one", description="Simulate a bundled model's training step on a described cluster "
                       "(built on meta tensors: nothing is allocated). Without --plan, search every plan; keys "
                       "given in --plan are kept and the others searched.")
    p.add_argument("model", choices=["gpt"], metavar="MODEL", help="gpt")
    p.add_argument("--set", dest="model_args", type=_setting, action="append", default=[], metavar="KEY=VALUE",
                   help="a model config field, e.g. --set n_layer=96 (repeatable)")
    p.add_argument("--cluster", default="a100-80gb", help="cluster preset: a100-80gb or local (default %(default)s)")
    p.add_argument("--devices", type=int, required=True, help="devices in the cluster")
    p.add_argument("--batch", type=int, required=True, help="global batch size, in sequences")
    p.add_argument("--seq", type=int, help="sequence length (default: the model's block_size)")
    p.add_argument("--plan", default="", metavar="K=V,...",
                   help="tp, pp, dp, mb, schedule, zero, recompute, sp, v, precision; e.g. tp=8,pp=8,dp=16,mb=1")
    p.add_argument("--schedules", default=",".join(auto.SCHEDULES), metavar="NAME,...",
                   help="the pipeline schedules to weigh, those a runtime has (e.g. 1f1b,interleaved for "
                        "Megatron-LM's; default %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _plan(args: argparse.Namespace) -> int:
    """``shoal plan``: a mistake is one line on stderr and exit status 2."""
    try:
        mcfg = training._model_config(training.TrainConfig(model=args.model, model_args=dict(args.model_args)))
        with torch.device("meta"):
            model = training.MODELS[args.model].model(mcfg)
        cluster = auto.Cluster.preset(args.cluster, devices=args.devices)
        fixed = auto.Parallel.parse(args.plan)
        t0 = time.perf_counter()
        if len(fixed.given()) == len(dataclasses.fields(auto.Parallel)):  # all given: simulate it, fit or not
            est = auto.simulate(model, cluster, fixed, batch=args.batch, seq=args.seq)
        else:
            schedules = tuple(filter(None, (n.strip() for n in args.schedules.split(","))))
            unknown = [n for n in schedules if n not in auto.SCHEDULES]
            if unknown or not schedules:
                raise ValueError(f"--schedules {args.schedules!r}: give some of {', '.join(auto.SCHEDULES)}")
            _, est = auto.search(model, cluster, batch=args.batch, seq=args.seq, fixed=fixed, schedules=schedules)
        seconds = time.perf_counter() - t0
    except ValueError as e:
        print(f"shoal plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**est.summary(), "search_seconds": seconds}))
    else:
        print(est.explain())
        print(f"({seconds:.1f} s)")
    return 0


def _version() -> str:
    try:
        return version("shoal")
    except PackageNotFoundError:  # run from a source tree that was never installed (PYTHONPATH=src)
        return "unknown (not installed)"


def _config(args: argparse.Namespace) -> training.TrainConfig:
    # the train options are named as TrainConfig's fields
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(training.TrainConfig) if hasattr(args, f.name)}
    return training.TrainConfig(**{**given, "model_args": dict(args.model_args)})


def world_error(cfg: training.TrainConfig, processes: int | None, per_process: int | None) -> str | None:
    """What is wrong with training ``cfg`` on ``processes`` processes of ``per_process`` devices each
    (None: as many as divide ``cfg.devices`` evenly, plain torchrun; processes None: a number known
    only when they start), or None if nothing is."""
    if processes is None:
        return None if cfg.devices == 0 else (
            f"--devices {cfg.devices} is fixed, but an elastic world (--nnodes min:max) may come back with fewer or "
            f"more processes; give --devices auto")
    if cfg.plan == "none" or processes <= 1:
        return None
    if per_process is not None and cfg.devices != processes * per_process:
        other = "" if cfg.devices % processes else f" (or shoal run --devices-per-process {cfg.devices // processes})"
        return (
            f"--devices {cfg.devices}, but {processes} processes x {per_process} device(s) per process make "
            f"{processes * per_process}; give --devices {processes * per_process}{other}"
        )
    if per_process is None and cfg.devices % processes:
        return f"--devices {cfg.devices} do not divide over {processes} processes; give a multiple of {processes}"
    return None


def check_launch(script: str, module: bool, args: list[str], processes: int | None, per_process: int) -> str | None:
    """``shoal run``'s check before it starts any process: for ``-m shoal train ...``, the arguments
    and the number of devices; None if fine or not a shoal command. ``processes`` None: not known."""
    if not (module and script in ("shoal", "shoal.cli") and args[:1] == ["train"]):
        return None
    ns = parser().parse_args(args)  # a usage error exits here, with argparse's message
    cfg = _config(ns)
    if processes is None:
        return world_error(cfg, None, per_process)
    cfg = _resolved(cfg, processes, per_process)
    try:
        training.check(cfg)
    except ValueError as e:
        return str(e)
    return world_error(cfg, processes, per_process)


def _resolved(cfg: training.TrainConfig, processes: int, per_process: int | None) -> training.TrainConfig:
    """``cfg`` with ``--devices auto`` made the devices of ``processes`` processes."""
    return dataclasses.replace(cfg, devices=processes * (per_process or 1)) if cfg.devices == 0 else cfg


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "run":  # shoal run -n P [--devices-per-process K] script.py args...
        return launch.main(argv[1:], check=check_launch)
    ap = parser()
    args = ap.parse_args(argv)
    if args.command is None:
        ap.print_help()
        return 2
    if args.command == "checkpoint":
        return _checkpoint(args)
    if args.command == "plan":
        return _plan(args)
    cfg = _config(args)
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:  # under shoal run / torchrun: rank 0 reports and writes the run directory
        cfg = dataclasses.replace(cfg, progress=False, save=False)
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of this process
    try:
        if "RANK" in os.environ:  # under shoal run / torchrun: the devices must fit the processes
            per_process = int(os.environ.get("SHOAL_DEVICES_PER_PROCESS", "0")) or None
            cfg = _resolved(cfg, int(os.environ.get("WORLD_SIZE", "1")), per_process)
            problem = world_error(cfg, int(os.environ.get("WORLD_SIZE", "1")), per_process)
            if problem:
                raise ValueError(problem)
        elif cfg.devices == 0:
            raise ValueError("--devices auto counts the devices of the processes shoal run starts; give a number "
                             "to train in this process")
        training.check(cfg)
    except ValueError as e:
        if rank == 0:  # every rank finds the same mistake: say it once
            print(f"shoal train: error: {e}", file=sys.stderr)
        return 2
    training.train(cfg)
    return 0
