"""The collectives shoal's own dispatch runs for a plan, read off its compiled step.

A plan's ``tp`` layouts do not pin every op's layout: dispatch picks each op's signature and the
boxings around it (``dispatch.decide``) by the cost of its own inputs. The GPT's plans pin each
sub-block's output (``layers.megatron_outputs``), so its step runs Megatron-LM's all-reduces; without
them dispatch reduce-scatters each partial sum and then runs each layer batch-split with its split
weights moved to it, which at GPT-3's width costs about 18x the collective time per layer.
``census(mcfg, tp, micro_batch, seq)`` compiles a training step of one- and two-layer twins of the
GPT under its tp plan and counts each collective (``Collective``: kind, bytes, group size), so the
cost model prices the collectives of the step shoal runs. The twins are traced in a world of ``tp``
meta devices (``world.meta_world``): parameters, activations and optimizer state are shapes, not
memory, so a twin of GPT-3's width (hidden 12288, two layers, 4 billion parameters) is traced in
seconds on this machine. One tensor-parallel group stands for every data-parallel replica and
pipeline stage (they run the same code), and two layers for all of a stage's (identical) layers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cache

import torch

from ..mesh import Mesh
from ..models import gpt
from ..world import meta_world, world
from .config import Parallel

__all__ = ["Collective", "Census", "census", "count"]

@dataclass(frozen=True, slots=True)
class Collective:
    """One collective of a step: ``kind`` (``comm``'s name: all_reduce, all_gather, reduce_scatter,
    all_to_all, transfer), ``nbytes`` of the whole tensor (the gathered / reduced one), ``n`` devices."""

    kind: str
    nbytes: int
    n: int


@dataclass(frozen=True, slots=True)
class Census:
    """The collectives of the steps of a one-layer (``one``) and a two-layer (``two``) twin: a step of
    l layers costs ``one``'s time plus l - 1 times the difference (gradient buckets need not line up
    one to one, their bytes do)."""

    one: tuple[Collective, ...]
    two: tuple[Collective, ...]

    def seconds(self, price, layers: int) -> float:
        """The step's collectives' time for ``layers`` layers, ``price(collective)`` seconds each."""
        one, two = (sum(map(price, cs)) for cs in (self.one, self.two))
        return one + (layers - 1) * (two - one)


def count(graph) -> list[Collective]:
    """The collectives of a traced step (``shoal.compile``'s ``graph``), in program order."""
    out = []
    for op in graph.ops:
        if op.kind != "comm":
            continue
        sizes = [graph.locals[i].size_bytes for i in op.reads]
        part = max(sizes, default=0)
        whole = part if op.fn.name in ("all_reduce", "reduce_scatter", "transfer") else part * len(op.devices)
        out.append(Collective(op.fn.name, int(whole), len(op.devices)))
    return out


def census(mcfg: gpt.GPTConfig, tp: int, micro_batch: int, seq: int, recompute: str = "none",
           precision: str = "fp32") -> Census | None:
    """The tensor-parallel collectives of a micro-batch of ``micro_batch`` sequences of ``seq`` tokens
    through a bundled GPT of config ``mcfg`` laid out on ``tp`` devices (``Parallel.to_plan``), as
    shoal compiles its training step (None for tp 1: no collectives). With dp or pp beside tp, each
    tp group runs this; the data-parallel gradient reduction and the stages' send/recv are not in it."""
    if tp < 2:
        return None
    twin = dataclasses.replace(mcfg, n_layer=2, block_size=seq, dropout=0.0)
    cfg = Parallel(tp=tp, pp=1, dp=1, micro_batch=micro_batch, recompute=recompute, precision=precision)
    return _census(twin, cfg)


@cache
def _census(twin: gpt.GPTConfig, cfg: Parallel) -> Census:
    with meta_world(cfg.tp):
        return Census(*(tuple(traced_step(dataclasses.replace(twin, n_layer=k), cfg)) for k in (1, 2)))


def traced_step(mcfg: gpt.GPTConfig, cfg: Parallel) -> list[Collective]:
    """The collectives of a training step of a bundled GPT of config ``mcfg`` under ``cfg``'s tp plan
    on the world's first ``cfg.tp`` devices (built on the meta device in a meta world)."""
    from ..graph.api import compile as compile_step  # the compiler, as the step would run
    from ..parallel import distribute_module
    from ..train import train_step

    mesh = Mesh(list(range(cfg.tp)), axes=("tp",))
    with torch.random.fork_rng():
        torch.manual_seed(0)
        with torch.device("meta" if world().device_type == "meta" else "cpu"):
            base = gpt.GPT(mcfg)
    plan, options = cfg.to_plan(mesh, batch=cfg.micro_batch)
    model = distribute_module(base, mesh, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = compile_step(train_step, **options)
    x = torch.zeros(cfg.micro_batch, mcfg.block_size, dtype=torch.long)
    for _ in range(2):  # the first call makes the optimizer's state eagerly, the second is traced
        step(model, opt, x, x)
    return count(step.graph)
