"""``Parallel``: the one description of a whole parallel configuration, and its ``k=v,...`` form.

Fields left None are free: ``search`` chooses them, ``resolved`` fills defaults. ``to_plan(mesh)``
turns a configuration into the ``shoal.Plan`` and ``shoal.compile`` options of the bundled GPT,
from the GPT's own plans (``models.gpt.plans``) on each pipeline stage's sub-mesh.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields

from torch import nn

from ..mesh import Mesh
from ..models import gpt
from ..parallel import Plan, _is_layout
from ..parallel.balance import balance
from ..sbp import Broadcast, Split

__all__ = ["Parallel", "SCHEDULES", "RECOMPUTE", "PRECISIONS", "check"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")
RECOMPUTE = ("none", "selective", "full")
# the modules each recomputation checkpoints (``Plan(checkpoint=...)``)
CHECKPOINTED = {"none": (), "selective": ("blocks.*.attn.core",), "full": ("blocks.*",)}
PRECISIONS = ("bf16", "fp16", "fp32")
_SHORT = {"mb": "micro_batch", "sp": "sequence_parallel", "v": "virtual_stages"}  # --plan key -> field
_LONG = {v: k for k, v in _SHORT.items()}


@dataclass(frozen=True, slots=True)
class Parallel:
    """Tensor (``tp``), pipeline (``pp``) and data (``dp``) parallel degrees; ``micro_batch``
    sequences per micro-batch; the pipeline ``schedule`` with ``virtual_stages`` per device
    (interleaved); ZeRO stage ``zero``; ``recompute`` "none", "selective" (attention's core
    recomputed in backward: Megatron-LM's selective recomputation) or "full" (every layer's
    activations recomputed in backward); ``sequence_parallel`` (the replicated parts of a layer split over tp);
    ``precision`` of parameters and compute. None: not chosen (searched, or a default)."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    micro_batch: int | None = None
    schedule: str | None = None
    zero: int | None = None
    recompute: str | None = None
    sequence_parallel: bool | None = None
    virtual_stages: int | None = None
    precision: str | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "micro_batch", "virtual_stages"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"Parallel: {name} must be a positive integer, got {v!r}")
        for name, allowed in (("schedule", SCHEDULES), ("recompute", RECOMPUTE), ("precision", PRECISIONS),
                              ("zero", (0, 1, 2, 3)), ("sequence_parallel", (True, False))):
            v = getattr(self, name)
            if v is not None and v not in allowed:
                raise ValueError(f"Parallel: {name}={v!r}; choose one of {', '.join(map(str, allowed))}")

    @staticmethod
    def parse(text: str) -> Parallel:
        """``"tp=8,pp=8,dp=16,mb=1,schedule=1f1b,zero=1,recompute=full"`` (the fields, or their short
        names mb, sp, v) -> Parallel."""
        names = {f.name: f for f in fields(Parallel)}
        values: dict = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, eq, value = part.partition("=")
            key = _SHORT.get(key.strip(), key.strip())
            if not eq or key not in names:
                known = ", ".join(_LONG.get(n, n) for n in names)
                raise ValueError(f"--plan {text!r}: {part!r} is not KEY=VALUE with KEY one of {known}")
            if key in values:
                raise ValueError(f"--plan {text!r}: {key} given twice")
            values[key] = _value(key, value.strip(), text)
        return Parallel(**values)

    def __str__(self) -> str:
        out = []
        for f in fields(self):
            v = getattr(self, f.name)
            if v is not None:
                out.append(f"{_LONG.get(f.name, f.name)}={str(v).lower() if isinstance(v, bool) else v}")
        return ",".join(out)

    def given(self) -> dict:
        """The fields that are set."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def resolved(self, devices: int) -> Parallel:
        """Every field set: tp, pp 1, dp the rest of ``devices``, one sequence per micro-batch, 1F1B, no
        ZeRO, no recomputation, no sequence parallelism, one stage per device, bf16; a clear error if
        the degrees do not multiply to ``devices``."""
        tp, pp = self.tp or 1, self.pp or 1
        dp = self.dp if self.dp is not None else max(devices // (tp * pp), 1)
        if tp * pp * dp != devices:
            raise ValueError(f"Parallel {self}: tp x pp x dp = {tp} x {pp} x {dp} = {tp * pp * dp}, but the cluster "
                             f"has {devices} devices; make the product {devices}")
        schedule = self.schedule or "1f1b"
        return Parallel(tp, pp, dp, self.micro_batch or 1, schedule, self.zero or 0, self.recompute or "none",
                        bool(self.sequence_parallel), self.virtual_stages or (2 if schedule == "interleaved" and pp > 1
                                                                              else 1), self.precision or "bf16")

    def mesh_shape(self) -> tuple[int, ...]:
        """The mesh this configuration runs on, by the axes it uses: (pp, dp, tp) with unit axes dropped
        (dp kept when nothing else is)."""
        sizes = {"pp": self.pp or 1, "dp": self.dp or 1, "tp": self.tp or 1}
        return tuple(sizes[a] for a in self.axes())

    def axes(self) -> tuple[str, ...]:
        """The names of ``mesh_shape``'s axes."""
        sizes = [("pp", self.pp or 1), ("dp", self.dp or 1), ("tp", self.tp or 1)]
        return tuple(name for name, n in sizes if n > 1) or ("dp",)

    def to_plan(self, mesh: Mesh, batch: int | None = None, model: nn.Module | None = None,
                layouts=None) -> tuple[Plan, dict]:
        """The bundled GPT's ``shoal.Plan`` for this configuration on ``mesh`` (shaped as ``mesh_shape``,
        axes ``axes()``), and the ``shoal.compile`` options (micro-batches of a global ``batch``,
        default two per stage; the schedule). Each pipeline stage's sub-mesh gets the GPT's plan for
        the axes left (dp, tp, both, or none: replicated); ``pp`` stages are cut by parameter count
        (``stages="auto"``), ``pp x virtual_stages`` ones (interleaved) by ``shoal.parallel.balance``
        of ``model``. ``sequence_parallel``: the activations between sub-blocks split on the sequence
        over tp (``gpt.plans(..., sequence_parallel=True)``). ``layouts``: the integer program's
        ``auto.Layouts`` for a tp group (``Estimate.layouts[0]``): its parameter layouts on the tp axis
        (Broadcast on the others) and, without sequence parallelism, its output pins, in place of
        Megatron-LM's pattern."""
        cfg = self.resolved(math.prod(mesh.shape))
        want, axes = cfg.mesh_shape(), cfg.axes()
        if tuple(mesh.shape) != want or tuple(mesh.axes) != axes:
            raise ValueError(f"Parallel {cfg}: needs a {'x'.join(map(str, want))} mesh with axes {axes}, got "
                             f"{'x'.join(map(str, mesh.shape))} with axes {tuple(mesh.axes)}")
        if cfg.sequence_parallel and cfg.tp == 1:
            raise ValueError(f"Parallel {cfg}: sequence parallelism splits the activations over tp; this plan "
                             f"has tp=1 (give tp > 1, or sp=false)")
        if layouts is not None and cfg.tp == 1:
            raise ValueError(f"Parallel {cfg}: per-op layouts are for the tp axis; this plan has none")
        if cfg.pp == 1:
            plan = _tp_layouts(gpt.plans(mesh, ",".join(axes), cfg.sequence_parallel), axes, layouts,
                               cfg.sequence_parallel)
        else:
            inner = Plan()  # a stage's sub-mesh: the GPT's plan for the axes left, or replicated
            if len(axes) > 1:
                inner = _tp_layouts(gpt.plans(mesh.submesh(pp=0), ",".join(axes[1:]), cfg.sequence_parallel),
                                    axes[1:], layouts, cfg.sequence_parallel)
            stages = "auto"
            if cfg.virtual_stages > 1:
                if model is None:
                    raise ValueError(f"Parallel {cfg}: cutting {cfg.pp} x {cfg.virtual_stages} virtual stages "
                                     f"needs the model; pass to_plan(mesh, model=...)")
                stages = balance(model, cfg.pp * cfg.virtual_stages, cost="params")
            plan = inner.staged(stages)
        plan = dataclasses.replace(plan, checkpoint=CHECKPOINTED[cfg.recompute],
                                   precision=None if cfg.precision == "fp32" else cfg.precision,
                                   zero=cfg.zero if cfg.dp > 1 else 0)
        micro_batches = batch // (cfg.dp * cfg.micro_batch) if batch else 2 * cfg.pp if cfg.pp > 1 else 1
        return plan, {"micro_batches": max(micro_batches, 1), "schedule": cfg.schedule}


def check(c: Parallel, mcfg, batch: int) -> None:
    """Raise ValueError naming each way the resolved configuration ``c`` does not fit the model or batch."""
    problems = []
    if mcfg.n_head % c.tp:
        problems.append(f"tp={c.tp} does not divide the {mcfg.n_head} heads")
    if mcfg.n_layer % (c.pp * c.virtual_stages):
        problems.append(f"pp x v = {c.pp} x {c.virtual_stages} does not divide the {mcfg.n_layer} layers")
    if batch % (c.dp * c.micro_batch):
        problems.append(f"batch {batch} is not a multiple of dp x micro_batch = {c.dp} x {c.micro_batch}")
    elif c.schedule == "interleaved" and (batch // (c.dp * c.micro_batch)) % c.pp:
        problems.append("interleaved needs the micro-batches per step to be a multiple of pp")
    if c.sequence_parallel and c.tp == 1:
        problems.append("sequence parallelism splits over tp; it needs tp > 1")
    if c.virtual_stages > 1 and c.schedule != "interleaved":
        problems.append(f"virtual_stages={c.virtual_stages} needs schedule=interleaved")
    if problems:
        raise ValueError(f"auto: plan {c} does not fit the model: " + "; ".join(problems))


def _tp_layouts(plan: Plan, axes: tuple, layouts, sequence_parallel: bool) -> Plan:
    """``plan`` with the integer program's ``layouts`` (an ``auto.Layouts`` for a tp group) on the tp
    axis: its parameter layouts, Broadcast on the other ``axes``, and (without sequence parallelism,
    whose pins ``plan`` keeps) its output pins in place of Megatron-LM's, split on the batch over dp."""
    if layouts is None:
        return plan
    if not hasattr(layouts, "params") or not hasattr(layouts, "outputs"):
        raise TypeError(f"to_plan: layouts={type(layouts).__name__}; give the integer program's auto.Layouts "
                        f"(auto.search's Estimate.layouts[0], or auto.gpt_layouts(...)[0])")

    def on_mesh(lay, name: str, dp):
        if lay is None:
            return None
        if len(lay) != 1:
            raise ValueError(f"to_plan: the layouts' {name} is {lay!r}; give the layouts of a tp group (one SBP)")
        return tuple(lay[0] if a == "tp" else dp if a == "dp" else Broadcast() for a in axes)

    params = {name: on_mesh(lay, f"params[{name!r}]", Broadcast()) for name, lay in layouts.params.items()
              if any(s != Broadcast() for s in lay)}
    if sequence_parallel:
        return dataclasses.replace(plan, params=params)
    outputs = {name: on_mesh(lay, f"outputs[{name!r}]", Split(0)) if _is_layout(lay)
               else tuple(on_mesh(one, f"outputs[{name!r}]", Split(0)) for one in lay)
               for name, lay in layouts.plan().outputs.items()}  # ModuleList items by pattern
    return dataclasses.replace(plan, params=params, outputs=outputs)


def _value(key: str, text: str, whole: str):
    if key in ("schedule", "recompute", "precision"):
        return text
    if key == "sequence_parallel":
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"--plan {whole!r}: sp={text!r}; give true or false")
        return text.lower() in ("true", "1")
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--plan {whole!r}: {key}={text!r} is not an integer") from None
