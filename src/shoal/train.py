"""The training loop behind ``shoal train`` and ``make demo``: a bundled model, its data, a plan.

``TrainConfig`` says what to train and how it is laid out; ``train(cfg)`` builds the model (plain
torch, seeded), its data and optimizer, lays the model out with its plan, trains, and writes
``loss.png`` and ``losses.json`` into a run directory. ``Result`` holds what came out.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn
from tqdm import tqdm

from . import checkpoint
from .auto.config import Parallel
from .auto.config import check as fits
from .data import CharData, Stripes
from .dispatch import coverage
from .graph.api import compile as compile_step
from .mesh import Mesh
from .models import bert, gpt, kinds, resnet
from .parallel import Plan, distribute_module, memory_per_device
from .tensor import GlobalTensor
from .world import init, is_initialized, world

__all__ = ["TrainConfig", "Result", "train", "check", "build", "gather", "MODELS", "PLANS", "OPTIMIZERS"]


class Bundled(NamedTuple):
    model: type[nn.Module]
    config: type
    plans: Callable  # (mesh, kind) -> Plan


MODELS = {
    "gpt": Bundled(gpt.GPT, gpt.GPTConfig, gpt.plans),
    "bert": Bundled(bert.BERT, bert.BERTConfig, bert.plans),
    "resnet": Bundled(resnet.ResNet, resnet.ResNetConfig, resnet.plans),
}
PIPELINED = ("pp,dp", "pp,dp,tp")  # a pipeline axis first, then a plan kind on each stage's sub-mesh
PLANS = (*kinds.KINDS, *PIPELINED, "none")  # none: plain torch on one device, the reference
OPTIMIZERS = ("adamw", "sgd")
DEFAULT_LR = {"adamw": 1e-3, "sgd": 0.05}


@dataclass
class TrainConfig:
    model: str = "gpt"  # gpt | bert | resnet
    plan: str = "dp"  # dp | tp | dp,tp | zero | none, or auto.Parallel's "tp=2,dp=2,sp=true,..." (gpt)
    devices: int = 4
    mesh: tuple[int, ...] | None = None  # default (devices,), and (2, devices // 2) for dp,tp
    steps: int = 100
    stop_after: int | None = None  # end after this many steps; the lr schedule still spans ``steps``
    batch: int = 16
    lr: float | None = None  # peak learning rate; default DEFAULT_LR[optimizer]
    warmup: int | None = None  # steps of linear warmup before the cosine decay to lr/10; default steps // 10
    optimizer: str = "adamw"  # adamw | sgd (momentum 0.9)
    seed: int = 0
    threads: int | None = None  # torch CPU threads; None leaves torch's choice
    every: int = 10  # print the loss every N steps (0: never)
    out: str | None = None  # run directory; default runs/<model>-<plan>-<time>/
    save: bool = True  # write loss.png and losses.json
    model_args: dict = field(default_factory=dict)  # model config overrides, e.g. {"n_layer": 2}
    sample: int = 300  # GPT: characters generated at the end (0: none)
    progress: bool = True  # a tqdm progress bar
    verbose: bool = True  # print the plan, the loss every ``every`` steps and a summary
    compile: bool = False  # run the step as a compiled graph (shoal.compile) instead of eagerly
    micro_batches: int = 1  # > 1: a compiled pipelined step over that many micro-batches (pp plans need it)
    schedule: str = "1f1b"  # the pipeline schedule: gpipe | 1f1b | interleaved | zb
    checkpoint: tuple = ()  # module name patterns whose activations are recomputed in backward
    precision: str | None = None  # None (fp32) | "bf16" | "fp16": low-precision parameters, fp32 masters and state
    checkpoint_every: int = 0  # save a checkpoint every N steps and after the last (0: never)
    checkpoint_dir: str | None = None  # where checkpoints go; a run resumes from the latest one there


@dataclass
class Result:
    losses: list[float]
    val_loss: float
    seconds: float
    params: int
    memory: dict[int, int]  # bytes per device: parameters, gradients, buffers, optimizer state
    fallback: dict[str, int]  # ops that ran replicated through the fallback, with call counts
    sample: str
    run_dir: Path | None


def parallel(cfg: TrainConfig) -> Parallel | None:
    """``cfg.plan`` given as ``auto.Parallel``'s keys (``"tp=2,dp=2,sp=true"``, as ``shoal plan --plan``
    takes them), every field set: left out, dp takes the rest of ``cfg.devices``, the schedule and
    precision are ``cfg``'s (fp32 unless ``cfg.precision``), and a micro-batch holds ``batch / (dp x
    cfg.micro_batches)`` sequences (two micro-batches per stage when pipelined and ``cfg`` gives
    none). None for a plan name."""
    if "=" not in cfg.plan:
        return None
    given = Parallel.parse(cfg.plan)
    default = TrainConfig()
    flags = {"schedule": ("--schedule", cfg.schedule, given.schedule),
             "precision": ("--precision", cfg.precision, given.precision),
             "micro_batches": ("--micro-batches", cfg.micro_batches,
                               None if given.micro_batch is None or given.dp is None
                               else cfg.batch // (given.dp * given.micro_batch))}
    for name, (flag, value, planned) in flags.items():
        if value != getattr(default, name) and planned is not None and value != planned:
            raise ValueError(f"{flag} {value} disagrees with --plan {cfg.plan} ({planned}); give it in one place")
    fill = {"schedule": cfg.schedule, "precision": cfg.precision or "fp32"}
    p = dataclasses.replace(given, **{k: v for k, v in fill.items() if getattr(given, k) is None})
    p = p.resolved(cfg.devices)
    if given.micro_batch is None:
        m = cfg.micro_batches if cfg.micro_batches > 1 or p.pp == 1 else 2 * p.pp
        if cfg.batch % (p.dp * m):
            raise ValueError(f"--plan {cfg.plan}: batch {cfg.batch} does not split into {p.dp} data-parallel "
                             f"ranks x {m} micro-batches; give a batch that does, or mb=")
        p = dataclasses.replace(p, micro_batch=cfg.batch // (p.dp * m))
    return p


def mesh_shape(cfg: TrainConfig) -> tuple[int, ...]:
    p = parallel(cfg)
    if p is not None:
        if cfg.mesh is not None and tuple(cfg.mesh) != p.mesh_shape():
            raise ValueError(f"--plan {cfg.plan} runs on a {'x'.join(map(str, p.mesh_shape()))} mesh {p.axes()}; "
                             f"--mesh {'x'.join(map(str, cfg.mesh))} disagrees (leave --mesh out)")
        return p.mesh_shape()
    if cfg.mesh is not None:
        return tuple(cfg.mesh)
    if cfg.plan in PIPELINED:
        raise ValueError(f"plan {cfg.plan!r} needs --mesh: pipeline stages first, e.g. "
                         f"{'2x2' if cfg.plan == 'pp,dp' else '2x2x2'}")
    if cfg.plan == "dp,tp":
        if cfg.devices < 4 or cfg.devices % 2:
            raise ValueError(f"plan 'dp,tp' needs a 2-D mesh: give --mesh, e.g. 2x{max(cfg.devices // 2, 1)}")
        return (2, cfg.devices // 2)
    return (cfg.devices,)


def check(cfg: TrainConfig) -> None:
    """Raise ValueError, saying what to change, if ``cfg`` cannot run."""
    if cfg.model not in MODELS:
        raise ValueError(f"unknown model {cfg.model!r}; choose one of {', '.join(MODELS)}")
    if cfg.plan not in PLANS and "=" not in cfg.plan:
        raise ValueError(f"unknown plan {cfg.plan!r}; choose one of {', '.join(PLANS)}, or give auto.Parallel's "
                         f"keys (e.g. tp=2,dp=2,sp=true: gpt only)")
    if "=" in cfg.plan and cfg.model != "gpt":
        raise ValueError(f"--plan {cfg.plan}: plans given by their keys lay out a GPT (auto.Parallel.to_plan); "
                         f"for {cfg.model} give a plan name ({', '.join(PLANS)})")
    if cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {cfg.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    for name in ("devices", "steps", "batch"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be at least 1, got {getattr(cfg, name)}")
    if cfg.warmup is not None and cfg.warmup < 0:
        raise ValueError(f"warmup must not be negative, got {cfg.warmup}")
    if cfg.checkpoint_every < 0 or (cfg.checkpoint_every and not cfg.checkpoint_dir):
        raise ValueError("--checkpoint-every N saves every N steps (N >= 1) into --checkpoint-dir DIR, which a "
                         "restarted run resumes from: give both")
    with torch.device("meta"):  # the model checks its config (e.g. heads dividing the width); nothing allocated
        MODELS[cfg.model].model(_model_config(cfg))
    if cfg.plan == "none":
        return
    p = parallel(cfg)
    if p is not None:
        fits(p, _model_config(cfg), cfg.batch)
        mesh_shape(cfg)
        return
    shape = mesh_shape(cfg)
    if any(n < 1 for n in shape) or math.prod(shape) != cfg.devices:
        raise ValueError(
            f"mesh {'x'.join(map(str, shape))} has {math.prod(shape)} devices but devices is {cfg.devices}; "
            f"make them agree (e.g. --devices {math.prod(shape)})"
        )
    if cfg.plan in PIPELINED:
        if cfg.micro_batches < 2:
            raise ValueError(f"plan {cfg.plan!r} trains in micro-batches: give --micro-batches, e.g. {2 * shape[0]}")
        shape = shape[1:]
    if cfg.micro_batches < 1:
        raise ValueError(f"micro_batches must be at least 1, got {cfg.micro_batches}")
    ax = kinds.axes(shape, _stage_kind(cfg.plan))
    if ax.dp is not None and cfg.batch < shape[ax.dp] * cfg.micro_batches:
        raise ValueError(f"batch {cfg.batch} is smaller than the {shape[ax.dp]} data-parallel devices x "
                         f"{cfg.micro_batches} micro-batches")


def _stage_kind(plan: str) -> str:
    """The plan kind each pipeline stage's sub-mesh takes (the plan itself when not pipelined)."""
    return plan.removeprefix("pp,")


def _lay_out(cfg: TrainConfig, model: nn.Module, shape: tuple[int, ...]) -> tuple[Mesh, Plan]:
    """The mesh and the model's plan for ``cfg.plan``; a pipelined plan is the stage kind's plan on
    each stage's sub-mesh, stages cut by parameter count (``Plan(stages="auto")``)."""
    ids = torch.arange(cfg.devices).reshape(shape).tolist()
    p = parallel(cfg)
    if p is not None:
        mesh = Mesh(ids, axes=p.axes())
        plan, _ = p.to_plan(mesh, batch=cfg.batch, model=model)
        return mesh, dataclasses.replace(plan, checkpoint=(*plan.checkpoint, *cfg.checkpoint))
    if cfg.plan in PIPELINED:
        mesh = Mesh(ids, axes=cfg.plan.split(","))
        plan = MODELS[cfg.model].plans(mesh.submesh(pp=0), _stage_kind(cfg.plan)).staged("auto")
        return mesh, dataclasses.replace(plan, checkpoint=tuple(cfg.checkpoint), precision=cfg.precision)
    names = ("dp", "tp") if len(shape) == 2 else ("tp",) if cfg.plan == "tp" else ("dp",)
    mesh = Mesh(ids, axes=names)
    plan = MODELS[cfg.model].plans(mesh, cfg.plan)
    return mesh, dataclasses.replace(plan, checkpoint=tuple(cfg.checkpoint), precision=cfg.precision)


def _model_config(cfg: TrainConfig, **decided):
    """The model's config: its defaults, what the data decides (``decided``), then ``cfg.model_args``
    (strings, e.g. from the command line, are converted to the type of the field's default)."""
    cls = MODELS[cfg.model].config
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = dict(decided)
    for k, v in cfg.model_args.items():
        if k not in fields:
            raise ValueError(f"{cls.__name__} has no field {k!r}; its fields are {', '.join(fields)}")
        values[k] = _convert(v, fields[k].default, k) if isinstance(v, str) else v
    return cls(**values)


def _convert(text: str, default, name: str):
    try:
        if isinstance(default, bool):
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(text)
            return text.lower() in ("true", "1")
        if isinstance(default, tuple):
            return tuple(int(x) for x in text.split(","))
        return type(default)(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected a value like {default!r}") from None


Batches = Callable[[str, torch.Generator], tuple[torch.Tensor, torch.Tensor]]


def build(cfg: TrainConfig) -> tuple[nn.Module, Batches, object]:
    """The model (plain single-device torch, initialised from ``cfg.seed``), a function
    (split, generator) -> (inputs, targets), and the dataset."""
    if cfg.model == "resnet":
        mcfg = _model_config(cfg)
        data = Stripes(classes=mcfg.num_classes, channels=mcfg.in_channels)
        batches = lambda split, gen: data.batch(cfg.batch, gen)
    else:
        data = CharData()
        vocab = data.vocab_size + (cfg.model == "bert")  # BERT: + [MASK]
        mcfg = _model_config(cfg, vocab_size=vocab)
        if mcfg.vocab_size < vocab:
            raise ValueError(f"vocab_size {mcfg.vocab_size} is smaller than the data's {vocab} tokens")
        get = data.batch if cfg.model == "gpt" else data.masked_batch
        batches = lambda split, gen: get(split, cfg.batch, mcfg.block_size, gen)
    torch.manual_seed(cfg.seed)
    model = MODELS[cfg.model].model(mcfg)
    return model, batches, data


def make_optimizer(cfg: TrainConfig, params) -> torch.optim.Optimizer:
    lr = cfg.lr if cfg.lr is not None else DEFAULT_LR[cfg.optimizer]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99))


def lr_factor(cfg: TrainConfig) -> Callable[[int], float]:
    """The schedule, as a factor of the peak lr: linear warmup, then cosine decay to a tenth."""
    warm = cfg.warmup if cfg.warmup is not None else cfg.steps // 10

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        done = (step - warm) / max(cfg.steps - warm, 1)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done))

    return factor


def gather(model: nn.Module) -> nn.Module:
    """A plain single-device copy of a laid-out bundled model (every GlobalTensor gathered)."""
    plain = type(model)(model.cfg)
    with torch.no_grad():
        state = {k: v.full() if isinstance(v, GlobalTensor) else v for k, v in model.state_dict().items()}
    plain.load_state_dict(state)
    return plain


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x, y):
    """One training step: forward, backward, update. The loop runs it eagerly, or compiled."""
    _, loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def train(cfg: TrainConfig) -> Result:
    check(cfg)
    p = parallel(cfg)
    if p is not None:  # the step as the plan says: its micro-batches, schedule and precision
        cfg = dataclasses.replace(cfg, micro_batches=cfg.batch // (p.dp * p.micro_batch), schedule=p.schedule,
                                  precision=None if p.precision == "fp32" else p.precision)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model, batches, data = build(cfg)
    params = sum(p.numel() for p in model.parameters())
    shape = None if cfg.plan == "none" else mesh_shape(cfg)
    mesh, plan = None, None
    if shape is not None:
        if not is_initialized() or world().size != cfg.devices:
            init(devices=cfg.devices)
        mesh, plan = _lay_out(cfg, model, shape)
        distribute_module(model, mesh, plan)
    opt = make_optimizer(cfg, model.parameters())
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(cfg))
    if cfg.verbose:
        _print_header(cfg, model, params, shape, plan)

    gen = torch.Generator().manual_seed(cfg.seed)
    start, losses = _resume(cfg, model, opt, schedule, gen) if cfg.checkpoint_dir else (0, [])
    coverage(reset=True)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        # each fallback op warns once; the summary at the end lists them all
        warnings.filterwarnings("ignore", message="shoal: no SBP rule")
        n = cfg.steps if cfg.stop_after is None else min(cfg.stop_after, cfg.steps)
        # disable=None: no bar when the output is not a terminal (logs, CI)
        bar = tqdm(range(start, n), desc=f"{cfg.model} {cfg.plan}", unit="step", initial=start, total=n,
                   disable=None if cfg.progress else True)
        run_step = train_step
        if cfg.compile or cfg.micro_batches > 1:
            if shape is None:
                raise ValueError("shoal train: --compile and --micro-batches need a plan (graph mode runs "
                                 "GlobalTensors); not --plan none")
            run_step = compile_step(train_step, micro_batches=cfg.micro_batches, schedule=cfg.schedule)
        for step in bar:
            _injected_fault(step)
            model.train()
            x, y = batches("train", gen)
            loss = run_step(model, opt, x, y)
            schedule.step()
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
            if cfg.verbose and cfg.every and (step % cfg.every == 0 or step == n - 1):
                tqdm.write(f"step {step:>5}  loss {losses[-1]:.4f}  ({time.perf_counter() - t0:.1f}s)")
            if cfg.checkpoint_every and ((step + 1) % cfg.checkpoint_every == 0 or step == n - 1):
                checkpoint.save(Path(cfg.checkpoint_dir) / f"step-{step + 1}",
                                {"model": model, "optim": opt, "step": step + 1, "losses": losses,
                                 "schedule": schedule.state_dict(), "data": gen.get_state(),
                                 "rng": torch.get_rng_state()}, keep=2)
        bar.close()
        seconds = time.perf_counter() - t0
        val_loss = _validate(model, batches, cfg.seed)
        cov = coverage()
        memory = _memory_with_gradients(model, opt, batches, cfg.seed) if shape is not None else {}
    sample = _sample(model, data, cfg) if cfg.model == "gpt" and cfg.sample > 0 else ""
    result = Result(
        losses, val_loss, seconds, params, memory, {str(k): v for k, v in cov.by_fallback.items()}, sample, None
    )
    if cfg.verbose:
        _print_summary(cfg, result, cov)
    if cfg.save:
        result.run_dir = _save(cfg, result, shape)
        if cfg.verbose:
            print(f"wrote {result.run_dir / 'loss.png'} and {result.run_dir / 'losses.json'}")
    return result


def _resume(cfg: TrainConfig, model: nn.Module, opt, schedule, gen: torch.Generator) -> tuple[int, list[float]]:
    """The step to start at and the losses so far: from the latest checkpoint in ``cfg.checkpoint_dir``
    (model, optimizer, LR schedule, the data generator and torch's RNG restored), else (0, [])."""
    last = checkpoint.latest(cfg.checkpoint_dir)
    if last is None:
        return 0, []
    data, rng = gen.get_state(), torch.get_rng_state()
    r = checkpoint.load(last, {"model": model, "optim": opt, "data": data, "rng": rng})
    gen.set_state(data)
    torch.set_rng_state(rng)
    schedule.load_state_dict(r.values["schedule"])
    if cfg.verbose:
        print(f"resumed from {last}: step {r.values['step']} of {cfg.steps}")
    return r.values["step"], list(r.values["losses"])


def _injected_fault(step: int) -> None:
    """For tests of restarts: ``SHOAL_FAULT_AT=<step>:<rank>`` kills that rank (SIGKILL, as ``kill -9``)
    when it reaches that step in a run's first attempt (torchrun's restart count 0);
    ``<step>:<rank>:node`` kills its torchrun agent first, as a node lost whole; ``<step>:<rank>:hold``
    holds that rank there while its world has one process (until a node joins and torchrun restarts it)."""
    spec = os.environ.get("SHOAL_FAULT_AT")
    if spec and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        at, rank, *how = spec.split(":")
        if step == int(at) and world().rank == int(rank):
            if how == ["hold"]:
                while world().processes == 1:
                    time.sleep(1)
                return
            if how == ["node"]:
                os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)


@torch.no_grad()
def _validate(model: nn.Module, batches: Batches, seed: int) -> float:
    """The loss on one held-out batch, in eval mode (BatchNorm uses its running statistics)."""
    model.eval()
    x, y = batches("val", torch.Generator().manual_seed(seed + 10_000))
    return model(x, y)[1].item()


def _memory_with_gradients(model: nn.Module, opt: torch.optim.Optimizer, batches: Batches, seed: int) -> dict[int, int]:
    """Bytes per device of the parameters, gradients, buffers and optimizer state, all held at once
    as right after a step's backward (a step's own ``zero_grad(set_to_none=True)`` frees the
    gradients, and a compiled step never shows them): one more forward and backward, in eval mode
    (no dropout draws, no BatchNorm statistics), no update; the gradients are dropped after."""
    model.eval()
    x, y = batches("val", torch.Generator().manual_seed(seed + 20_000))
    model(x, y)[1].backward()
    memory = memory_per_device(model, opt)
    opt.zero_grad(set_to_none=True)
    return memory


def _sample(model: nn.Module, data: CharData, cfg: TrainConfig) -> str:
    """GPT text continuing a prompt, sampled (temperature 0.8, seeded) on a gathered single-device copy."""
    plain = gather(model).eval()
    prompt = data.encode("def ")[None]
    out = plain.generate(prompt, cfg.sample, temperature=0.8, generator=torch.Generator().manual_seed(cfg.seed))
    return data.decode(out[0])


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.2f} GiB"


def _print_header(cfg: TrainConfig, model: nn.Module, params: int, shape, plan: Plan | None) -> None:
    mcfg = ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(model.cfg).items())
    lr = cfg.lr if cfg.lr is not None else DEFAULT_LR[cfg.optimizer]
    warm = cfg.warmup if cfg.warmup is not None else cfg.steps // 10
    if shape is None:
        where = "plain torch on one device"
    else:
        w = world()
        kind = "virtual CPU" if w.device_type == "cpu" else w.device_type.upper()
        k = w.devices_per_process
        if w.processes > 1:
            devices = f"{w.processes} processes x {k} {kind} device{'s' if k > 1 else ''} each"
        else:
            devices = f"{cfg.devices} {kind} device{'s' if cfg.devices > 1 else ''}"
        where = f"plan {cfg.plan} on mesh {'x'.join(map(str, shape))} ({devices})"
        where += ", each step a compiled graph" if cfg.compile or cfg.micro_batches > 1 else ", eager"
        if cfg.micro_batches > 1:
            where += f" of {cfg.micro_batches} micro-batches ({cfg.schedule})"
    print(f"shoal train: {cfg.model} ({params / 1e6:.2f}M parameters; {mcfg})")
    print(f"  {where}; batch {cfg.batch}, {cfg.steps} steps, seed {cfg.seed}, {torch.get_num_threads()} thread(s)")
    print(f"  {cfg.optimizer}, lr {lr:g} after {warm} warmup steps, cosine decay to {lr / 10:g}")
    if plan is not None:
        what = "(images, labels)" if cfg.model == "resnet" else "(token ids, targets)"
        for pat, sbp in plan.params.items():
            print(f"  param  {pat:<28} {_sbp(sbp)}")
        print(f"  input  {what:<28} {_sbp(plan.inputs[''])}")
        for kind, pins in (("input ", plan.inputs), ("output", plan.outputs)):
            for pat, sbp in pins.items():
                if pat:
                    print(f"  {kind} {pat:<28} {_sbp(sbp)}")
        if plan.zero:
            split = ("optimizer state", "optimizer state and gradients", "optimizer state, gradients and parameters")
            print(f"  ZeRO-{plan.zero}: {split[plan.zero - 1]} split over dp")
        if plan.checkpoint:
            print(f"  activations of {', '.join(plan.checkpoint)} recomputed in backward")
        if plan.precision:
            print(f"  {plan.precision} parameters and compute, fp32 master weights and optimizer state"
                  + (", dynamic loss scaling" if plan.precision == "fp16" else ""))


def _sbp(layout) -> str:
    return "(" + ", ".join(map(repr, layout)) + ")" if isinstance(layout, tuple) else repr(layout)


def _print_summary(cfg: TrainConfig, r: Result, cov) -> None:
    n = len(r.losses)
    tail = r.losses[-min(10, n) :]
    print(
        f"loss: first {r.losses[0]:.4f}, last {r.losses[-1]:.4f} (mean of the last {len(tail)}: "
        f"{sum(tail) / len(tail):.4f}); held-out {r.val_loss:.4f}; {r.seconds:.1f}s, {r.seconds / n:.2f}s/step"
    )
    if r.memory:
        mem = ", ".join(f"{d}: {_fmt_bytes(b)}" for d, b in sorted(r.memory.items()))
        print(f"memory per device (parameters, gradients, buffers, optimizer state; activations not counted): {mem}")
    if cfg.plan != "none":
        calls = sum(r.fallback.values())
        print(
            f"fallback ops: {len(r.fallback)} op(s), {calls} call(s) replicated "
            f"({len(cov.by_rule)} op(s) by rule, {len(cov.by_decomposition)} by decomposition)"
        )
        for op, k in sorted(r.fallback.items(), key=lambda kv: -kv[1]):
            print(f"  fallback  {op}  x{k}")
    if r.sample:
        print("sample:\n" + r.sample)


def _save(cfg: TrainConfig, r: Result, shape) -> Path:
    name = f"{cfg.model}-{cfg.plan.replace(',', '+')}-{time.strftime('%Y%m%d-%H%M%S')}"
    d = Path(cfg.out) if cfg.out else Path("runs") / name
    d.mkdir(parents=True, exist_ok=True)
    record = {
        "config": {**dataclasses.asdict(cfg), "mesh": shape},
        "params": r.params,
        "losses": r.losses,
        "val_loss": r.val_loss,
        "seconds": r.seconds,
        "memory_per_device": {str(k): v for k, v in sorted(r.memory.items())},
        "fallback_ops": r.fallback,
        "sample": r.sample,
    }
    (d / "losses.json").write_text(json.dumps(record, indent=1))
    where = "one device" if shape is None else f"{'x'.join(map(str, shape))} mesh"
    _plot(r.losses, d / "loss.png", f"{cfg.model}, plan {cfg.plan}, {where}")
    return d


def _plot(losses: list[float], path: Path, title: str) -> None:
    # the Agg canvas directly: no pyplot, no global backend state
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    steps = range(len(losses))
    ax.plot(steps, losses, lw=1, alpha=0.45, label="loss")
    w = max(len(losses) // 20, 1)
    if w > 1:
        avg = [sum(losses[max(0, i - w + 1) : i + 1]) / (i + 1 - max(0, i - w + 1)) for i in steps]
        ax.plot(steps, avg, lw=2, label=f"mean of {w}")
    ax.set(xlabel="step", ylabel="loss", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
