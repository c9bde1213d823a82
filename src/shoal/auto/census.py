"""The collectives and kernels shoal's own dispatch runs for a plan, read off its compiled step.

A plan's ``tp`` layouts do not pin every op's layout: dispatch picks each op's signature and the
boxings around it (``dispatch.decide``) by the cost of its own inputs. The GPT's plans pin each
sub-block's output (``layers.megatron_plan``), so its step runs Megatron-LM's all-reduces; without
them dispatch reduce-scatters each partial sum and then runs each layer batch-split with its split
weights moved to it, which at GPT-3's width costs about 18x the collective time per layer.
``census(mcfg, tp, micro_batch, seq)`` compiles a training step of one- and two-layer twins of the
GPT under its tp plan and counts each collective (``Collective``: kind, bytes, group size), so the
cost model prices the collectives of the step shoal runs. The twins are traced in a world of ``tp``
meta devices (``world.meta_world``): parameters, activations and optimizer state are shapes, not
memory, so a twin of GPT-3's width (hidden 12288, two layers, 4 billion parameters) is traced in
seconds on this machine. One tensor-parallel group stands for every data-parallel replica and
pipeline stage (they run the same code), and two layers for all of a stage's (identical) layers.
``kernels(graph)`` lists one device's ops of the same traced step at its shards' shapes (FLOPs and
bytes by ``profile.op_cost``), so a cluster whose devices run what the trace runs (``Cluster.
traced_kernels``: shoal's CPU runtime) prices compute from them too: dispatch's copies and slices and
the kernels the device type picks (CPU's fused attention) included.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cache

import torch

from ..comm import reduced_dtype
from ..graph.ir import Ref
from ..mesh import Mesh
from ..models import gpt
from ..world import meta_world, world
from .config import Parallel
from .profile import _FREE, OpCost, op_cost

__all__ = ["Collective", "Census", "census", "count", "kernels"]

@dataclass(frozen=True, slots=True)
class Collective:
    """One collective of a step: ``kind`` (``comm``'s name: all_reduce, all_gather, reduce_scatter,
    all_to_all, transfer), ``nbytes`` of the whole tensor (the gathered / reduced one) as it crosses
    between processes (a sum of bf16 or fp16 crosses in fp32: ``shoal.comm``), ``n`` devices."""

    kind: str
    nbytes: int
    n: int


@dataclass(frozen=True, slots=True)
class Census:
    """The collectives (``one``, ``two``) and one device's kernels (``kernels_one``, ``kernels_two``)
    of the steps of a one-layer and a two-layer twin: a step of l layers costs ``one``'s time plus
    l - 1 times the difference (gradient buckets need not line up one to one, their bytes do)."""

    one: tuple[Collective, ...]
    two: tuple[Collective, ...]
    kernels_one: tuple[OpCost, ...]
    kernels_two: tuple[OpCost, ...]

    def seconds(self, price, layers: int) -> float:
        """The step's collectives' time for ``layers`` layers, ``price(collective)`` seconds each."""
        one, two = (sum(map(price, cs)) for cs in (self.one, self.two))
        return one + (layers - 1) * (two - one)

    def compute(self, price) -> tuple[float, float]:
        """(a layer's, the rest of the model's) seconds of one device's kernels, ``price(ops)`` seconds
        for a program's ops in order."""
        one, two = price(self.kernels_one), price(self.kernels_two)
        return two - one, 2 * one - two


def count(graph) -> list[Collective]:
    """The collectives of a traced step (``shoal.compile``'s ``graph``), in program order."""
    out = []
    for op in graph.ops:
        if op.kind != "comm":
            continue
        ids = op.reads or op.out_ids  # or what lands: from an absent process
        sizes = [graph.locals[i].size_bytes for i in ids]
        part = max(sizes, default=0)
        whole = part if op.fn.name in ("all_reduce", "reduce_scatter", "transfer") else (
            sum(sizes) if len(sizes) == len(op.devices) else part * len(op.devices))  # pieces all here, or alike
        if op.fn.name in ("all_reduce", "reduce_scatter") and ids:  # as the reduction crosses processes
            dtype = graph.locals[ids[0]].dtype
            reduction = next((a for a in op.args[2:] if isinstance(a, str)), "sum")
            whole = whole * reduced_dtype(dtype, reduction).itemsize // dtype.itemsize
        out.append(Collective(op.fn.name, int(whole), len(op.devices)))
    return out


def kernels(graph) -> tuple[OpCost, ...]:
    """One device's kernels in a traced step (``shoal.compile``'s ``graph``), in program order, at its
    shards' shapes: what it computes after dispatch's choices (the copies and slices of its boxings
    included), less the optimizer's update (``simulate`` prices it) and the ops that move nothing."""
    calls = [op for op in graph.ops if op.kind == "call"]
    first = min((op.device for op in calls), default=None)
    locs = graph.locals

    def meta(x):
        if isinstance(x, Ref):
            local = locs[x.id]
            return torch.empty_strided(local.shape, local.stride, dtype=local.dtype, device="meta")
        return x

    out = []
    for op in calls:
        name = getattr(op.fn, "overloadpacket", op.fn).__name__
        if op.device != first or name in _FREE or name.startswith("_fused_adam"):
            continue
        if getattr(op.fn, "is_view", False):
            out.append(OpCost(name, "F", "", False, 0.0, 0.0, None, view=True))
            continue
        args, kwargs, result = torch.utils._pytree.tree_map(meta, (op.args, op.kwargs, op.outs))
        out.append(OpCost(name, "F", "", False, *op_cost(op.fn, args, kwargs, result)))
    return tuple(out)


def census(mcfg: gpt.GPTConfig, tp: int, micro_batch: int, seq: int, recompute: str = "none",
           precision: str = "fp32", sequence_parallel: bool = False) -> Census:
    """The tensor-parallel collectives and one device's kernels of a micro-batch of ``micro_batch``
    sequences of ``seq`` tokens through a bundled GPT of config ``mcfg`` laid out on ``tp`` devices
    (``Parallel.to_plan``; tp 1: one device, no collectives), as shoal compiles its training step. With
    dp or pp beside tp, each tp group runs this; the data-parallel gradient reduction and the stages'
    send/recv are not in it."""
    twin = dataclasses.replace(mcfg, n_layer=2, block_size=seq, dropout=0.0)
    cfg = Parallel(tp=tp, pp=1, dp=1, micro_batch=micro_batch, recompute=recompute, precision=precision,
                   sequence_parallel=sequence_parallel and tp > 1)
    return _census(twin, cfg)


@cache
def _census(twin: gpt.GPTConfig, cfg: Parallel) -> Census:
    with meta_world(cfg.tp):
        graphs = [traced_step(dataclasses.replace(twin, n_layer=k), cfg) for k in (1, 2)]
    return Census(*(tuple(count(g)) for g in graphs), *(kernels(g) for g in graphs))


def traced_step(mcfg: gpt.GPTConfig, cfg: Parallel, micro_batches: int = 1, layouts=None):
    """The traced graph of a training step of ``micro_batches`` micro-batches per data-parallel rank
    through a bundled GPT of config ``mcfg`` under ``cfg``'s plan (degrees given: tp, pp, dp; the
    integer program's ``layouts`` on tp, as ``to_plan`` takes them) on the world's first tp x pp x dp
    devices (built on the meta device in a meta world)."""
    from ..graph.api import compile as compile_step  # the compiler, as the step would run
    from ..parallel import distribute_module
    from ..train import train_step

    shape = cfg.mesh_shape()
    mesh = Mesh(torch.arange(math.prod(shape)).reshape(shape).tolist(), axes=cfg.axes())
    with torch.random.fork_rng():
        torch.manual_seed(0)
        with torch.device("meta" if world().device_type == "meta" else "cpu"):
            base = gpt.GPT(mcfg)
    batch = cfg.micro_batch * (cfg.dp or 1) * micro_batches
    plan, options = cfg.to_plan(mesh, batch=batch, model=base, layouts=layouts)
    model = distribute_module(base, mesh, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = compile_step(train_step, **options)
    x = torch.zeros(batch, mcfg.block_size, dtype=torch.long)
    for _ in range(2):  # the first call makes the optimizer's state eagerly, the second is traced
        step(model, opt, x, x)
    return step.graph
