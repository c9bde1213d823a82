"""Cut a module into contiguous pipeline stages of balanced cost.

The units are the module's children in order, a ``ModuleList``/``Sequential`` child counting as its
items (``stage_units``). Each unit gets a cost (``unit_costs``: FLOPs counted on meta tensors,
parameter count, or measured time) and ``balance`` cuts the units into contiguous stages minimising
the costliest stage, exactly (the linear partition problem, a dynamic program over prefix sums).
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn
from torch.func import functional_call
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["stage_units", "unit_costs", "balance", "describe"]

COSTS = ("flops", "params", "time")


def stage_units(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The pieces a pipeline may cut ``module`` between, in order, as (qualified name, module): its
    children, a ``ModuleList``/``Sequential`` child counting as its items ("blocks.0", "blocks.1",
    ...) since those are where a model's depth is. Parameters held directly by ``module`` (not in a
    child) are no unit: they join stage 0."""
    units = []
    for name, child in module.named_children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)):
            units += [(f"{name}.{i}", item) for i, item in child.named_children()]
        else:
            units.append((name, child))
    return units


def unit_costs(module: nn.Module, example_args=(), example_kwargs=None, cost: str = "flops") -> dict[str, float]:
    """Each unit's cost, by ``stage_units`` name. ``cost="flops"``: the forward's FLOPs on
    ``example_args``, counted on meta tensors of their shapes (nothing is computed, ``module`` is not
    changed); a unit doing no FLOPs (or every unit, without example args) costs its parameter count.
    ``"params"``: parameter count. ``"time"``: seconds in the unit, the median of 3 real forwards."""
    if cost not in COSTS:
        raise ValueError(f"balance: cost must be one of {COSTS}, got {cost!r}")
    units = stage_units(module)
    params = {name: float(sum(p.numel() for p in unit.parameters())) for name, unit in units}
    if isinstance(example_args, torch.Tensor):
        example_args = (example_args,)
    example_kwargs = example_kwargs or {}
    if cost == "params" or (cost == "flops" and not example_args and not example_kwargs):
        return params
    if cost == "time":
        if not example_args and not example_kwargs:
            raise ValueError("balance: cost='time' runs the module, so it needs example_args")
        return _timed(module, units, example_args, example_kwargs)
    flops = _flops(module, units, example_args, example_kwargs)
    return {name: float(flops[name]) or params[name] for name, _ in units}


def balance(
    module: nn.Module, stages: int, example_args=(), example_kwargs=None, cost: str = "flops", verbose: bool = False
) -> dict[str, int]:
    """{unit name: stage index} cutting ``stage_units(module)`` into ``stages`` contiguous,
    non-empty stages with the smallest possible cost of the costliest stage (costs: ``unit_costs``).
    ``verbose`` prints the cut (``describe``)."""
    units = [name for name, _ in stage_units(module)]
    if not 1 <= stages <= len(units):
        raise ValueError(
            f"balance: cannot cut {type(module).__name__} into {stages} stage(s): it has "
            f"{len(units)} unit(s) and each stage needs at least one; the units are {units}"
        )
    costs = unit_costs(module, example_args, example_kwargs, cost)
    cut = dict(zip(units, partition([costs[u] for u in units], stages)))
    if verbose:
        print(describe(cut, costs))
    return cut


def partition(costs: list[float], stages: int) -> list[int]:
    """The stage of each cost, cutting ``costs`` into ``stages`` contiguous non-empty runs whose
    largest sum is the smallest possible: ``best[j][i]``, the best for the first ``i`` costs in ``j``
    runs, is the least over the last run's start ``s`` of max(best[j-1][s], sum(costs[s:i]))."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    best = [[float("inf")] * (n + 1) for _ in range(stages + 1)]
    start = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for j in range(1, stages + 1):
        for i in range(j, n - (stages - j) + 1):
            for s in range(j - 1, i):
                worst = max(best[j - 1][s], prefix[i] - prefix[s])
                if worst < best[j][i]:
                    best[j][i], start[j][i] = worst, s
    out, i = [0] * n, n
    for j in range(stages, 0, -1):
        s = start[j][i]
        out[s:i] = [j - 1] * (i - s)
        i = s
    return out


def describe(cut: dict[str, int], costs: dict[str, float]) -> str:
    """One line per stage: its index, first..last unit, and its share of the total cost."""
    total = sum(costs[u] for u in cut)
    lines = []
    for stage in sorted(set(cut.values())):
        units = [u for u, s in cut.items() if s == stage]
        span = units[0] if len(units) == 1 else f"{units[0]}..{units[-1]}"
        share = 100 * sum(costs[u] for u in units) / total if total else 0.0
        lines.append(f"stage {stage}: {span} ({len(units)} unit{'s' * (len(units) > 1)}, {share:.1f}%)")
    return "\n".join(lines)


def _flops(module, units, args, kwargs) -> dict[str, float]:
    """FLOPs per unit of one forward on meta stand-ins for the parameters, buffers and arguments
    (``functional_call`` swaps them in for the call only), read off the counter's running total in
    forward pre/post hooks on the units."""
    meta = lambda t: torch.empty_like(t, device="meta") if isinstance(t, torch.Tensor) else t
    state = {n: meta(t) for n, t in [*module.named_parameters(), *module.named_buffers()]}
    args, kwargs = tree_map(meta, (tuple(args), kwargs))
    counter = FlopCounterMode(display=False)
    try:
        with counter, torch.no_grad():
            flops = _around_units(units, counter.get_total_flops, lambda: functional_call(module, state, args, kwargs))
    except Exception as e:
        raise RuntimeError(
            f"balance: counting FLOPs ran {type(module).__name__} on meta tensors, which failed "
            f"({type(e).__name__}: {e}); use cost='params' or cost='time'"
        ) from e
    return flops


def _timed(module, units, args, kwargs) -> dict[str, float]:
    """Seconds per unit, the median of 3 real forwards. The RNG state and the buffers (batch norm
    statistics) are put back afterwards, so that ``module`` and training are as if it had not run."""
    buffers = [(b, b.clone()) for b in module.buffers()]
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    sync = torch.cuda.synchronize if cuda else lambda: None

    def clock():
        sync()
        return time.perf_counter()

    devices = list(range(torch.cuda.device_count())) if cuda else []
    try:
        with torch.random.fork_rng(devices), torch.no_grad():
            runs = [_around_units(units, clock, lambda: module(*args, **kwargs)) for _ in range(3)]
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
    return {name: statistics.median(run[name] for run in runs) for name, _ in units}


def _around_units(units, read, run) -> dict[str, float]:
    """Call ``run()`` with hooks adding to each unit the change of ``read()`` across its forwards
    (a unit called twice adds both), and return the totals; the hooks are removed afterwards."""
    totals = {name: 0.0 for name, _ in units}
    handles = []

    def hooks(name, mod):
        at = []
        handles.append(mod.register_forward_pre_hook(lambda *_: at.append(read())))
        handles.append(mod.register_forward_hook(lambda *_: totals.__setitem__(name, totals[name] + read() - at.pop())))

    for name, mod in units:
        hooks(name, mod)
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return totals
