"""Pipeline schedules: every order is complete and deadlock-free, has its schedule's shape (GPipe's
forwards first, 1F1B's bounded activations, ZB-H1's deferred W), and its bubble on the virtual clock
is the textbook value; broken orders are caught.

With uniform F = B = W = 1 (an unsplit B lasting 2) the virtual clock has no rounding to hide
behind, so the bubbles are compared exactly (to 1e-9), which is within the 1% the formulas promise.
"""

from collections import Counter

import pytest

from shoal.runtime.schedules import (
    DeadlockError,
    Item,
    bubble,
    check,
    peak_in_flight,
    schedule,
    simulate,
)

PS = [1, 2, 3, 4]
MS = [1, 2, 3, 4, 5, 8]  # includes m < p for every p > 1
CASES = [(name, p, m, 1) for name in ("gpipe", "1f1b", "zb") for p in PS for m in MS] + [
    ("interleaved", p, m, v) for p in PS for v in (1, 2, 3) for m in (p, 2 * p, 3 * p)
]


def expected_items(m: int, v: int, kinds: str) -> Counter:
    return Counter(Item(kind, k, c) for kind in kinds for c in range(v) for k in range(m))


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_orders_are_complete_and_deadlock_free(name, p, m, v):
    orders = schedule(name, p, m, v)
    assert len(orders) == p
    kinds = "FBW" if name == "zb" else "FB"
    for order in orders:
        assert Counter(order) == expected_items(m, v, kinds)
    check(orders, p, m, v)


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_timeline_respects_dependencies(name, p, m, v):
    """Re-derive the rule independently of ``schedule``'s helpers: no device runs two items at once,
    and every item starts after what it needs has ended."""
    comm = 0.25
    timeline = simulate(schedule(name, p, m, v), p, v, comm=comm)
    assert len(timeline) == sum(len(o) for o in schedule(name, p, m, v))
    end = {(f.item.kind, f.item.chunk * p + f.device, f.item.micro_batch): (f.device, f.end) for f in timeline}
    last = p * v - 1
    for d in range(p):
        mine = sorted((f for f in timeline if f.device == d), key=lambda f: f.start)
        assert all(a.end <= b.start for a, b in zip(mine, mine[1:]))
    for f in timeline:
        kind, i, k = f.item.kind, f.item.chunk * p + f.device, f.item.micro_batch
        if kind == "F":
            needs = [("F", i - 1, k)] if i else []
        elif kind == "W":
            needs = [("B", i, k)]
        else:
            needs = [("F", i, k)] + ([("B", i + 1, k)] if i < last else [])
        for dep in needs:
            dev, t = end[dep]
            assert f.start >= t + (comm if dev != f.device else 0) - 1e-12, (f, dep)


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("m", MS)
def test_gpipe_runs_every_forward_before_any_backward(p, m):
    for order in schedule("gpipe", p, m):
        kinds = "".join(item.kind for item in order)
        assert kinds == "F" * m + "B" * m
        assert peak_in_flight(order) == m


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("m", MS)
def test_1f1b_holds_at_most_p_minus_s_activations(p, m):
    for s, order in enumerate(schedule("1f1b", p, m)):
        assert peak_in_flight(order) == min(p - s, m)


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("m", MS)
def test_zb_defers_w_with_the_memory_of_1f1b(p, m):
    zb, f1b = schedule("zb", p, m), schedule("1f1b", p, m)
    assert [peak_in_flight(o) for o in zb] == [peak_in_flight(o) for o in f1b]
    # Without its W's, ZB-H1 is 1F1B's order.
    assert [[it for it in o if it.kind != "W"] for o in zb] == f1b
    deferred = set()
    for d, order in enumerate(zb):
        pos = {item: i for i, item in enumerate(order)}
        for k in range(m - 1):
            if pos[Item("W", k)] > pos[Item("B", k + 1)]:
                deferred.add(d)
    if m > 1:
        # Device d defers each W past the B's of the next d micro-batches; device 0 runs W at once.
        assert deferred == set(range(1, p))


def test_peak_in_flight_counts_chunks():
    order = [Item("F", 0), Item("F", 0, 1), Item("F", 1), Item("B", 0, 1), Item("W", 0, 1), Item("B", 0)]
    assert peak_in_flight(order) == 3
    # Megatron's interleaved warm-up on device 0: 2 (p - 1) + (v - 1) p forwards, plus one.
    assert peak_in_flight(schedule("interleaved", 4, 8, 2)[0]) == 2 * 3 + 4 + 1


def ideal(name: str, p: int, m: int, v: int) -> float:
    """The idle fraction each device should see with F = B = W = 1.

    GPipe and 1F1B: (p-1)/(m+p-1), exactly: a device idles (p-1)(F+B) out of m(F+B) + (p-1)(F+B).
    Interleaved: Megatron's bubble *time* is (p-1)(F+B)/v against m(F+B) of work, so the idle
    *fraction* of the makespan is (p-1)/(v m + p-1), exactly (every chunk item lasts the same, so
    chunk items being 1/v of a stage only rescales the clock).
    ZB-H1: the idle time is (p-1)(F+B-W) = p-1 against 3m of work: (p-1)/(3m+p-1) for m >= p.
    """
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if name == "zb":
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (m + p - 1)


@pytest.mark.parametrize(
    "name,p,m,v",
    [(n, p, m, 1) for n in ("gpipe", "1f1b") for p in PS for m in MS]
    + [("interleaved", p, m, v) for p in PS for v in (2, 3) for m in (p, 2 * p, 4 * p)]
    + [("zb", p, m, 1) for p in PS for m in MS if m >= p],
)
def test_bubble_matches_formula(name, p, m, v):
    got = bubble(simulate(schedule(name, p, m, v), p, v))
    assert got == pytest.approx([ideal(name, p, m, v)] * p, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("m", MS)
def test_zb_never_idles_more_than_1f1b(p, m):
    zb = bubble(simulate(schedule("zb", p, m), p))
    f1b = bubble(simulate(schedule("1f1b", p, m), p))
    assert all(z <= f + 1e-12 for z, f in zip(zb, f1b))


def idle_time(name: str, p: int, m: int) -> float:
    timeline = simulate(schedule(name, p, m), p)
    makespan = max(f.end for f in timeline)
    return makespan - sum(f.end - f.start for f in timeline if f.device == 0)


def test_zb_bubble_is_a_third_of_1f1b():
    """The paper's claim is about bubble *time*: (p-1)(F+B-W) against 1F1B's (p-1)(F+B+W), a third
    already at p=4, m=8. As a *fraction* of each makespan the ratio is (m+p-1)/(3m+p-1) (0.41 at
    p=4, m=8), which drops to 0.36 or below only from m = 24 on (p=4)."""
    assert idle_time("zb", 4, 8) / idle_time("1f1b", 4, 8) == pytest.approx(1 / 3)
    assert idle_time("zb", 4, 8) / idle_time("1f1b", 4, 8) <= 0.36
    for m, fraction_ratio in [(8, 11 / 27), (24, 27 / 75), (32, 35 / 99)]:
        ratio = bubble(simulate(schedule("zb", 4, m), 4))[0] / bubble(simulate(schedule("1f1b", 4, m), 4))[0]
        assert ratio == pytest.approx(fraction_ratio)
    assert ratio <= 0.36


def test_unsplit_backward_lasts_b_plus_w():
    durations = {"F": 1.0, "B": 2.0, "W": 3.0}
    (f, b), (zf, zb, zw) = (
        simulate(schedule("1f1b", 1, 1), 1, durations=durations),
        simulate(schedule("zb", 1, 1), 1, durations=durations),
    )
    assert (f.end - f.start, b.end - b.start) == (1.0, 5.0)
    assert (zf.end - zf.start, zb.end - zb.start, zw.end - zw.start) == (1.0, 2.0, 3.0)


def test_comm_is_paid_only_between_devices():
    # Two devices, one micro-batch: F, hop, F, B (whole: 2), hop, B.
    assert max(f.end for f in simulate(schedule("1f1b", 2, 1), 2, comm=0.5)) == 1 + 0.5 + 1 + 2 + 0.5 + 2
    # One device, two chunks: the hop between chunks stays on the device.
    assert max(f.end for f in simulate(schedule("interleaved", 1, 1, 2), 1, 2, comm=0.5)) == 6


def test_swapped_items_deadlock():
    orders = schedule("gpipe", 2, 2)
    check(orders, 2, 2)
    # Device 0 now waits for B0 before sending F1, but device 1 needs F1 before it runs B0.
    orders[0][1], orders[0][2] = orders[0][2], orders[0][1]
    with pytest.raises(DeadlockError, match=r"device 0 at B0 waits for B\(stage 1, mb 0\).*device 1 at F1"):
        check(orders, 2, 2)
    with pytest.raises(DeadlockError):
        simulate(orders, 2)


def test_backward_before_its_forward_deadlocks():
    orders = schedule("1f1b", 2, 2)
    orders[1][0], orders[1][1] = orders[1][1], orders[1][0]  # B0 before F0 on the last stage
    with pytest.raises(DeadlockError, match=r"device 1 at B0 waits for F\(stage 1, mb 0\)"):
        check(orders, 2, 2)


def test_weight_gradient_before_its_backward_deadlocks():
    orders = [[Item("F", 0), Item("W", 0), Item("B", 0)]]
    with pytest.raises(DeadlockError, match=r"device 0 at W0 waits for B\(stage 0, mb 0\)"):
        check(orders, 1, 1)


def test_incomplete_orders_are_rejected():
    orders = schedule("zb", 2, 3)
    orders[1].remove(Item("W", 2))
    with pytest.raises(ValueError, match=r"device 1.*missing \[\('W', 0, 2\)\]"):
        check(orders, 2, 3)
    orders = schedule("1f1b", 2, 3)
    orders[0].append(Item("F", 0))
    with pytest.raises(ValueError, match=r"device 0.*repeated \[\('F', 0, 0\)\]"):
        check(orders, 2, 3)
    with pytest.raises(ValueError, match="one order per device"):
        check(schedule("1f1b", 2, 3), 3, 3)


def test_bad_arguments_say_what_to_do():
    with pytest.raises(ValueError, match=r"multiple of the number of devices \(m=6, p=4\); use m=8"):
        schedule("interleaved", 4, 6, 2)
    with pytest.raises(ValueError, match=r"m=2, p=4"):
        schedule("interleaved", 4, 2, 2)  # fewer micro-batches than devices
    with pytest.raises(ValueError, match="unknown pipeline schedule 'pipedream'"):
        schedule("pipedream", 2, 2)
    with pytest.raises(ValueError, match="use 'interleaved'"):
        schedule("1f1b", 2, 2, v=2)
    with pytest.raises(ValueError, match="m >= 1"):
        schedule("gpipe", 2, 0)
    with pytest.raises(ValueError, match="kind"):
        Item("X", 0)
