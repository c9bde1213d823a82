"""The parallelism search: every configuration ``Parallel`` can describe for a model on a cluster,
pruned by memory first, priced by the closed forms of ``simulate``; the fastest that fits wins.

Tensor parallelism stays inside a node (divisors of the node size that divide the heads), pipeline
stages divide the layers, data parallelism takes the rest; micro-batch sizes, schedules (virtual
stages for the interleaved one), ZeRO 0-3, recomputation and sequence parallelism are enumerated.
Fields set in ``fixed`` are kept. The ``TRACED`` fastest that fit are priced again with the
tensor-parallel collectives of shoal's own traced step (``census``: a tp group of meta devices,
any width) and their pipelines run on the virtual clock (the schedule's orders, the first and last
stages as they differ), and ranked by that. Where the winner has tensor parallelism, per-op layouts for its
tp group are chosen by the integer program (``layouts.gpt_layouts``) beside Megatron-LM's pattern,
and ``Estimate.layouts`` / ``explain()`` report both.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

from torch import nn

from .cluster import Cluster
from .config import RECOMPUTE, SCHEDULES, Parallel, check
from .layouts import gpt_layouts
from .profile import gpt_config, profile
from .simulate import DTYPES, Estimate, estimate

__all__ = ["search", "candidates", "MICRO_BATCHES"]

MICRO_BATCHES = (1, 2, 4, 8)
TRACED = 8  # the closed forms' fastest configurations priced again on shoal's traced step
VIRTUAL = (2, 4)


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def candidates(model: nn.Module, cluster: Cluster, batch: int, fixed: Parallel | None = None,
               schedules: tuple[str, ...] = SCHEDULES) -> Iterator[Parallel]:
    """Every complete configuration agreeing with ``fixed`` that the model and batch allow (each one
    ``Parallel.to_plan`` lays out), pipelines with one of ``schedules``."""
    mcfg = gpt_config(model)
    f = (fixed or Parallel()).given()
    node = cluster.links[0].size or cluster.devices
    pick = lambda key, options: [f[key]] if key in f else list(options)  # noqa: E731
    for tp in pick("tp", [d for d in _divisors(mcfg.n_head, node) if cluster.devices % d == 0]):
        for pp in pick("pp", [d for d in _divisors(mcfg.n_layer, cluster.devices // tp)]):
            dp = cluster.devices // (tp * pp)
            if "dp" in f and f["dp"] != dp or tp * pp * dp != cluster.devices:
                continue
            for mb, sched, zero, rec, sp, prec in itertools.product(
                    pick("micro_batch", MICRO_BATCHES), pick("schedule", schedules if pp > 1 else ("1f1b",)),
                    pick("zero", (0, 1, 2, 3) if dp > 1 else (0,)), pick("recompute", RECOMPUTE),
                    pick("sequence_parallel", (False, True) if tp > 1 else (False,)),
                    pick("precision", ("bf16",))):
                for v in pick("virtual_stages", VIRTUAL if sched == "interleaved" else (1,)):
                    cfg = Parallel(tp, pp, dp, mb, sched, zero, rec, sp, v, prec)
                    try:
                        check(cfg, mcfg, batch)
                    except ValueError:
                        continue
                    yield cfg


def search(model: nn.Module, cluster: Cluster, *, batch: int, seq: int | None = None,
           fixed: Parallel | None = None, layouts: bool = True, traced: bool = True,
           schedules: tuple[str, ...] = SCHEDULES) -> tuple[Parallel, Estimate]:
    """The fastest configuration that fits (``Estimate.runner_up``: the second); a clear error if none
    fits, naming the closest. ``layouts``: a winner with tp > 1 gets per-op layouts for its tp group
    (``Estimate.layouts``). The ``TRACED`` fastest are priced again with their schedule on the virtual
    clock, and (``traced``) with the tensor-parallel collectives of shoal's traced step (``census``:
    what shoal runs, sums of bf16 crossing in fp32), else with Megatron-LM's (how the published runs
    ran). ``schedules``: the pipeline schedules to weigh (a runtime's, e.g. Megatron-LM's 1f1b and
    interleaved)."""
    mcfg = gpt_config(model)
    seq = seq or mcfg.block_size
    def price(cfg: Parallel, on: Cluster, clock: bool = False) -> Estimate:
        prof = profile(model, cfg.micro_batch, seq, DTYPES[cfg.precision])
        return estimate(prof, mcfg, on, cfg, batch, seq, batch // (cfg.dp * cfg.micro_batch), clock)

    best: list[Estimate] = []
    closest = None
    for cfg in candidates(model, cluster, batch, fixed, schedules):
        est = price(cfg, cluster)
        if not est.fits:
            if closest is None or est.memory_per_device < closest.memory_per_device:
                closest = est
            continue
        best = sorted([*best, est], key=lambda e: e.step_seconds)[:TRACED]
    if not best:
        if closest is None:
            raise ValueError(f"auto.search: no configuration agrees with {fixed} for batch {batch} on "
                             f"{cluster.devices} devices; free more of its fields")
        raise ValueError(f"auto.search: nothing fits in {cluster.memory / 1e9:.0f} GB per device; the closest, "
                         f"{closest.cfg}, needs {closest.memory_per_device / 1e9:.1f} GB; add devices")
    # the finalists again: pipelines on the virtual clock, and shoal's traced tp collectives if ``traced``
    counted = dataclasses.replace(cluster, census=True) if traced and not cluster.census else cluster
    best = sorted((price(e.cfg, counted, clock=True) for e in best), key=lambda e: e.step_seconds)
    winner = best[0]
    winner.runner_up = best[1] if len(best) > 1 else None
    if layouts and winner.cfg.tp > 1:
        winner.layouts = gpt_layouts(model, cluster, winner.cfg.tp, batch=winner.cfg.micro_batch, seq=seq,
                                     precision=winner.cfg.precision, layers=min(3, mcfg.n_layer))
    return winner.cfg, winner
