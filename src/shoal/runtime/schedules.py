"""Pipeline-parallel schedules as data: per device, the order of its forward/backward work items.

``schedule(name, p, m, v)`` gives one ``list[Item]`` per device (GPipe, 1F1B, Megatron's interleaved
1F1B, ZB-H1); ``check`` proves an order complete and deadlock-free under the runtime's dependency
rule; ``simulate`` runs it on a virtual clock (``Firing`` timeline), ``bubble`` and
``peak_in_flight`` measure it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

__all__ = [
    "Item",
    "Firing",
    "gpipe",
    "one_f_one_b",
    "interleaved",
    "zero_bubble_h1",
    "schedule",
    "check",
    "simulate",
    "bubble",
    "peak_in_flight",
    "DeadlockError",
]

KINDS = ("F", "B", "W")


@dataclass(frozen=True, slots=True)
class Item:
    """One unit of work on a device. ``kind``: "F" forward; "B" backward (the whole backward, or
    only its input-gradient part when the schedule also has "W"); "W" the weight-gradient part.
    ``chunk``: which of the device's virtual stages (0 unless interleaved); model stage =
    ``chunk * p + device``."""

    kind: str
    micro_batch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Item kind must be one of {KINDS}, got {self.kind!r}")

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}" + (f".{self.chunk}" if self.chunk else "")


@dataclass(frozen=True, slots=True)
class Firing:
    """One item's run on the virtual clock."""

    device: int
    item: Item
    start: float
    end: float


class DeadlockError(RuntimeError):
    """An order that stalls: every unfinished device waits on an item that can never run."""


Orders = list[list[Item]]


def _check_sizes(name: str, p: int, m: int) -> None:
    if p < 1 or m < 1:
        raise ValueError(f"schedule {name!r}: need p >= 1 stages and m >= 1 micro-batches, got p={p}, m={m}")


def gpipe(p: int, m: int) -> Orders:
    """Every forward, then every backward (GPipe): ``m`` activations held on each device."""
    _check_sizes("gpipe", p, m)
    return [[Item("F", k) for k in range(m)] + [Item("B", k) for k in range(m)] for _ in range(p)]


def _one_f_one_b_device(p: int, m: int, d: int, deferred_w: int | None) -> list[Item]:
    """1F1B on device ``d``: ``p - d - 1`` warm-up forwards, then forward/backward pairs, then the
    remaining backwards. With ``deferred_w`` set, B is the input gradient and each W runs
    ``deferred_w`` backwards after its own B (the rest at the end), as ZB-H1 and PyTorch's ZB1P."""
    warmup = min(p - d - 1, m)
    order = [Item("F", k) for k in range(warmup)]
    next_b = next_w = 0

    def backward() -> None:
        nonlocal next_b, next_w
        order.append(Item("B", next_b))
        next_b += 1
        if deferred_w is not None and next_b - next_w > deferred_w:
            order.append(Item("W", next_w))
            next_w += 1

    for k in range(warmup, m):
        order.append(Item("F", k))
        backward()
    while next_b < m:
        backward()
    if deferred_w is not None:
        order += [Item("W", k) for k in range(next_w, m)]
    return order


def one_f_one_b(p: int, m: int) -> Orders:
    """1F1B (PipeDream-flush): device ``d`` holds at most ``p - d`` activations."""
    _check_sizes("1f1b", p, m)
    return [_one_f_one_b_device(p, m, d, None) for d in range(p)]


def zero_bubble_h1(p: int, m: int) -> Orders:
    """ZB-H1 (Qi et al. 2023): 1F1B's F/B order with the backward split into B (input gradient)
    and W (weight gradient); device ``d`` defers each W by ``d`` backwards, so the W's fill the
    bubbles 1F1B leaves while the activations in flight (F run, B not) stay those of 1F1B. With
    uniform F = B = W its idle time per device is (p - 1)(F + B - W), a third of 1F1B's."""
    _check_sizes("zb", p, m)
    return [_one_f_one_b_device(p, m, d, d) for d in range(p)]


def interleaved(p: int, m: int, v: int) -> Orders:
    """Megatron-LM's interleaved 1F1B (``forward_backward_pipelining_with_interleaving``): device
    ``d`` holds chunks ``c`` = model stages ``c * p + d``. Work goes in groups of ``p`` micro-batches:
    forwards run a group through chunk 0, then chunk 1, ...; backwards run groups through chunk
    ``v - 1`` down to 0. Device ``d`` warms up with ``2 (p - d - 1) + (v - 1) p`` forwards, then
    alternates one forward and one backward. Requires ``m % p == 0`` (Megatron's original rule).
    Megatron also runs every forward first when ``m == p``; the warm-up rule alone is kept here, as
    it is deadlock-free (``check``) and has the same bubble on the virtual clock."""
    _check_sizes("interleaved", p, m)
    if v < 1:
        raise ValueError(f"interleaved: need v >= 1 virtual stages per device, got v={v}")
    if m % p:
        raise ValueError(
            f"interleaved: the number of micro-batches must be a multiple of the number of devices "
            f"(m={m}, p={p}); use m={-(-m // p) * p}, or the '1f1b'/'zb' schedule"
        )
    total = m * v  # one (micro-batch, chunk) pair per virtual step

    def at(step: int, kind: str) -> Item:
        group, within = divmod(step, p * v)
        chunk = within // p
        return Item(kind, group * p + within % p, v - 1 - chunk if kind == "B" else chunk)

    orders = []
    for d in range(p):
        warmup = min(2 * (p - d - 1) + (v - 1) * p, total)
        order = [at(k, "F") for k in range(warmup)]
        for k in range(total - warmup):
            order += [at(warmup + k, "F"), at(k, "B")]
        order += [at(k, "B") for k in range(total - warmup, total)]
        orders.append(order)
    return orders


_SCHEDULES: dict[str, Callable[[int, int, int], Orders]] = {
    "gpipe": lambda p, m, v: gpipe(p, m),
    "1f1b": lambda p, m, v: one_f_one_b(p, m),
    "interleaved": interleaved,
    "zb": lambda p, m, v: zero_bubble_h1(p, m),
}


def schedule(name: str, p: int, m: int, v: int = 1) -> Orders:
    """Per device, the order of its items for schedule ``name`` ("gpipe", "1f1b", "interleaved",
    "zb") over ``p`` devices, ``m`` micro-batches and ``v`` virtual stages per device."""
    if name not in _SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {sorted(_SCHEDULES)}")
    if v != 1 and name != "interleaved":
        raise ValueError(f"schedule {name!r} has one stage per device (v=1), got v={v}; use 'interleaved'")
    return _SCHEDULES[name](p, m, v)


# -- dependencies ----------------------------------------------------------------------------------

Key = tuple[str, int, int]  # (kind, model stage, micro-batch)


def _key(item: Item, device: int, p: int) -> Key:
    return item.kind, item.chunk * p + device, item.micro_batch


def _deps(key: Key, stages: int) -> list[Key]:
    """What an item waits for: F(i, k) on F(i-1, k); B(i, k) on F(i, k) and B(i+1, k); W(i, k) on
    B(i, k). At the last stage B(i, k) needs only F(i, k) (the loss)."""
    kind, i, k = key
    if kind == "F":
        return [("F", i - 1, k)] if i > 0 else []
    if kind == "B":
        return [("F", i, k)] + ([("B", i + 1, k)] if i + 1 < stages else [])
    return [("B", i, k)]


def _fire_order(orders: Orders, p: int, v: int) -> Iterator[tuple[int, Item, list[Key]]]:
    """Run every device's order in sequence, a head firing once its dependencies have fired; yields
    (device, item, its dependencies) in a valid firing order, or raises ``DeadlockError``."""
    stages = p * v
    heads = [0] * len(orders)
    done: set[Key] = set()
    while True:
        progressed = False
        for d, order in enumerate(orders):
            while heads[d] < len(order):
                item = order[heads[d]]
                key = _key(item, d, p)
                deps = _deps(key, stages)
                if not all(dep in done for dep in deps):
                    break
                done.add(key)
                heads[d] += 1
                progressed = True
                yield d, item, deps
        if all(h == len(o) for h, o in zip(heads, orders)):
            return
        if not progressed:
            blocked = []
            for d, order in enumerate(orders):
                if heads[d] < len(order):
                    key = _key(order[heads[d]], d, p)
                    missing = [f"{k}(stage {i}, mb {mb})" for k, i, mb in _deps(key, stages) if (k, i, mb) not in done]
                    blocked.append(f"device {d} at {order[heads[d]]} waits for {', '.join(missing)}")
            raise DeadlockError("pipeline order deadlocks: " + "; ".join(blocked))


def _is_split(orders: Orders) -> bool:
    return any(item.kind == "W" for order in orders for item in order)


def check(orders: Orders, p: int, m: int, v: int = 1) -> None:
    """Raise ``ValueError`` unless each device's order holds every item of its chunks exactly once
    (W items either everywhere or nowhere), and ``DeadlockError`` if running the orders can stall."""
    if len(orders) != p:
        raise ValueError(f"expected one order per device ({p}), got {len(orders)}")
    kinds = KINDS if _is_split(orders) else ("F", "B")
    expected = sorted((kind, c, k) for kind in kinds for c in range(v) for k in range(m))
    for d, order in enumerate(orders):
        got = sorted((it.kind, it.chunk, it.micro_batch) for it in order)
        if got != expected:
            missing = sorted(set(expected) - set(got))[:5]
            extra = sorted(set(got) - set(expected))[:5]
            dupes = sorted({x for x in got if got.count(x) > 1})[:5]
            raise ValueError(
                f"device {d}'s order is not every (kind, chunk, micro-batch) once: missing {missing}, "
                f"unexpected {extra}, repeated {dupes}"
            )
    for _ in _fire_order(orders, p, v):
        pass


# -- virtual clock ---------------------------------------------------------------------------------

UNIFORM = {"F": 1.0, "B": 1.0, "W": 1.0}


def simulate(
    orders: Orders, p: int, v: int = 1, durations: Mapping[str, float] | Callable[[str, int], float] = UNIFORM,
    comm: float = 0.0,
) -> list[Firing]:
    """Run the orders on a virtual clock: each device runs its order in sequence, an item starting
    when its device is free and its dependencies have ended (plus ``comm`` when a dependency ran on
    another device). ``durations`` are per item kind, or ``durations(kind, stage)`` per model stage
    (stages that differ: the first holds the embedding, the last the head), and name the *split*
    backward: "B" the input gradient, "W" the weight gradient; in a schedule without W items each B
    is the whole backward and lasts B + W, so split and unsplit schedules compare fairly."""
    split = _is_split(orders)
    per_stage = durations if callable(durations) else (lambda kind, stage: durations[kind])

    def length(kind: str, stage: int) -> float:
        if kind == "B" and not split:
            return per_stage("B", stage) + per_stage("W", stage)
        return per_stage(kind, stage)

    ends: dict[Key, tuple[int, float]] = {}
    free = [0.0] * len(orders)
    timeline = []
    for d, item, deps in _fire_order(orders, p, v):
        start = free[d]
        for dep in deps:
            dep_device, dep_end = ends[dep]
            start = max(start, dep_end + (comm if dep_device != d else 0.0))
        key = _key(item, d, p)
        end = start + length(item.kind, key[1])
        ends[key] = (d, end)
        free[d] = end
        timeline.append(Firing(d, item, start, end))
    return timeline


def bubble(timeline: list[Firing]) -> list[float]:
    """Per device, the idle fraction ``1 - busy / makespan``, the makespan being the whole
    timeline's (first start to last end), so a device that finishes early counts as idle."""
    devices = max(f.device for f in timeline) + 1
    makespan = max(f.end for f in timeline) - min(f.start for f in timeline)
    busy = [0.0] * devices
    for f in timeline:
        busy[f.device] += f.end - f.start
    return [1.0 - b / makespan for b in busy]


def peak_in_flight(order: list[Item]) -> int:
    """The most (micro-batch, chunk) pairs whose F has run and whose B has not, along one device's
    order: the activations it holds at its peak, in units of one chunk's activations."""
    live: set[tuple[int, int]] = set()
    peak = 0
    for item in order:
        if item.kind == "F":
            live.add((item.micro_batch, item.chunk))
            peak = max(peak, len(live))
        elif item.kind == "B":
            live.discard((item.micro_batch, item.chunk))
    return peak
