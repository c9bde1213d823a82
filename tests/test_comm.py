"""Collectives (``shoal.comm``) on one process with several virtual devices, against plain torch.

Each collective takes the group's device ids and one shard per device: all_gather must give
``torch.cat`` of the shards, all_reduce their sum / maximum / minimum, reduce_scatter the
``tensor_split`` of that reduction, all_to_all the ``tensor_split`` of the concatenation along
another dim, transfer the tensor itself. Shards are uneven and some empty; groups are given in any
device order. ``None`` stands for a device another process owns: it stays ``None``, and a
reduction's part inside this process covers the shards it holds (what other processes add is
tests/test_multiprocess.py's). Every test counts the collectives and the bytes recorded.
"""

import pytest
import torch

from shoal import comm

REDUCE = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}
GROUPS = [[0, 1], [2, 0, 3], [0, 1, 2, 3], [3, 1]]
SIZES = {2: [3, 0], 3: [1, 4, 2], 4: [2, 0, 3, 1]}  # uneven, one empty shard in most


def _ids(v):
    if isinstance(v, list):
        return "d" + "".join(map(str, v))
    return None


def split_shards(devices, dim, other=(3, 2), dtype=torch.float32, seed=0):
    """One shard per device, of uneven sizes along ``dim``; integer-valued, so sums are exact."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in SIZES[len(devices)]:
        shape = list(other)
        shape.insert(dim, n)
        out.append(torch.randint(-9, 10, shape, generator=g).to(dtype))
    return out


def same_shards(devices, shape=(5, 3), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-9, 10, shape, generator=g).to(dtype) for _ in devices]


def reduce(xs, op):
    acc = xs[0]
    for x in xs[1:]:
        acc = REDUCE[op](acc, x)
    return acc


def nbytes(t):
    return t.numel() * t.element_size()


def check_untouched(xs, before):
    for x, b in zip(xs, before):
        if x is not None:
            assert torch.equal(x, b), "a collective wrote into its input"


@pytest.mark.parametrize("dim", [0, 1, 2])
@pytest.mark.parametrize("devices", GROUPS, ids=_ids)
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool], ids=str)
def test_all_gather_is_cat(devices, dim, dtype):
    xs = split_shards(devices, dim, dtype=dtype)
    before = [x.clone() for x in xs]
    with comm.CommCounter() as cc:
        ys = comm.all_gather(devices, xs, dim)
    want = torch.cat(before, dim)
    assert len(ys) == len(devices)
    for y in ys:
        assert y.dtype == dtype and torch.equal(y, want)
    assert all(y is ys[0] for y in ys)  # equal on every device: one tensor on CPU
    assert dict(cc.counts) == {"all_gather": 1} and dict(cc.bytes) == {"all_gather": nbytes(want)}
    check_untouched(xs, before)


@pytest.mark.parametrize("op", ["sum", "max", "min"])
@pytest.mark.parametrize("devices", GROUPS, ids=_ids)
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64], ids=str)
def test_all_reduce_is_the_reduction(devices, op, dtype):
    xs = same_shards(devices, dtype=dtype)
    before = [x.clone() for x in xs]
    with comm.CommCounter() as cc:
        ys = comm.all_reduce(devices, xs, op)
    want = {"sum": torch.stack(before).sum(0), "max": torch.stack(before).amax(0),
            "min": torch.stack(before).amin(0)}[op]
    assert len(ys) == len(devices)
    for y in ys:
        assert y.dtype == dtype and torch.equal(y, want)
    assert all(y is ys[0] for y in ys)
    assert dict(cc.counts) == {"all_reduce": 1} and dict(cc.bytes) == {"all_reduce": nbytes(want)}
    check_untouched(xs, before)


@pytest.mark.parametrize("op", ["sum", "max"])
@pytest.mark.parametrize("devices", GROUPS, ids=_ids)
def test_all_reduce_start_gives_all_reduces_result(devices, op):
    xs = same_shards(devices, seed=1)
    with comm.CommCounter() as cc:
        finish = comm.all_reduce_start(devices, xs, op)
        ys = finish()
    want = reduce(xs, op)
    assert len(ys) == len(devices) and all(torch.equal(y, want) for y in ys)
    assert dict(cc.counts) == {"all_reduce": 1}


@pytest.mark.parametrize("rows", [7, 2, 12])  # uneven over 2, 3 and 4 devices; fewer rows than devices
@pytest.mark.parametrize("op", ["sum", "max", "min"])
@pytest.mark.parametrize("devices", GROUPS, ids=_ids)
def test_reduce_scatter_is_the_reductions_split(devices, op, rows):
    for dim in (0, 1):
        shape = (rows, 3) if dim == 0 else (3, rows)
        xs = same_shards(devices, shape, seed=rows)
        before = [x.clone() for x in xs]
        with comm.CommCounter() as cc:
            ys = comm.reduce_scatter(devices, xs, dim, op)
        total = reduce(before, op)
        want = torch.tensor_split(total, len(devices), dim)
        assert len(ys) == len(devices)
        for y, w in zip(ys, want):
            assert y.shape == w.shape and torch.equal(y, w)
        assert dict(cc.counts) == {"reduce_scatter": 1} and dict(cc.bytes) == {"reduce_scatter": nbytes(total)}
        check_untouched(xs, before)


@pytest.mark.parametrize("src_dim, dst_dim", [(0, 1), (1, 0), (0, 2), (2, 1)])
@pytest.mark.parametrize("devices", GROUPS, ids=_ids)
def test_all_to_all_resplits_the_concatenation(devices, src_dim, dst_dim):
    other = (5, 3)  # 5 and 3 split unevenly over every group size here
    xs = split_shards(devices, src_dim, other)
    before = [x.clone() for x in xs]
    with comm.CommCounter() as cc:
        ys = comm.all_to_all(devices, xs, src_dim, dst_dim)
    full = torch.cat(before, src_dim)
    want = torch.tensor_split(full, len(devices), dst_dim)
    assert len(ys) == len(devices)
    for y, w in zip(ys, want):
        assert y.shape == w.shape and torch.equal(y, w)
    assert dict(cc.counts) == {"all_to_all": 1} and dict(cc.bytes) == {"all_to_all": nbytes(full)}
    check_untouched(xs, before)


@pytest.mark.parametrize("src, dst", [(0, 1), (3, 0)])
def test_transfer_hands_the_tensor_over(src, dst):
    t = torch.arange(12.0).reshape(3, 4)[:, 1:]  # not contiguous
    with comm.CommCounter() as cc:
        out = comm.transfer(src, dst, t)
    assert out is t  # one process, one torch device: nothing to copy
    assert dict(cc.counts) == {"send_recv": 1} and dict(cc.bytes) == {"send_recv": nbytes(t)}


@pytest.mark.parametrize("devices", GROUPS, ids=_ids)
def test_a_group_none_of_whose_devices_is_ours_is_left_alone(devices):
    nones = [None] * len(devices)
    with comm.CommCounter() as cc:
        assert comm.all_gather(devices, nones, 0, [(2, 3)] * len(devices)) == nones
        assert comm.all_reduce(devices, nones, "sum") == nones
        assert comm.all_reduce_start(devices, nones, "sum")() == nones
        assert comm.reduce_scatter(devices, nones, 0, "sum") == nones
        assert comm.all_to_all(devices, nones, 0, 1, [(2, 3)] * len(devices)) == nones
    assert cc.total == 0, cc


@pytest.mark.parametrize("op", ["sum", "max", "min"])
@pytest.mark.parametrize("devices, held", [([0, 1, 2], [0, 2]), ([2, 0, 3, 1], [1, 2, 3]), ([3, 1], [1])],
                         ids=["d012", "d2031", "d31"])
def test_reductions_cover_the_shards_this_process_holds(devices, held, op):
    """Positions not in ``held`` stand for devices of other processes (None in, None out); on one
    process the cross-process part has no peer, so the result is the reduction of the shards held."""
    xs = same_shards(devices, (7, 2), seed=3)
    ins = [x if i in held else None for i, x in enumerate(xs)]
    mine = reduce([xs[i] for i in held], op)
    with comm.CommCounter() as cc:
        ar = comm.all_reduce(devices, ins, op)
        ars = comm.all_reduce_start(devices, ins, op)()
        rs = comm.reduce_scatter(devices, ins, 0, op)
    parts = torch.tensor_split(mine, len(devices), 0)
    for i in range(len(devices)):
        if i in held:
            assert torch.equal(ar[i], mine) and torch.equal(ars[i], mine) and torch.equal(rs[i], parts[i])
        else:
            assert ar[i] is None and ars[i] is None and rs[i] is None
    assert dict(cc.counts) == {"all_reduce": 2, "reduce_scatter": 1}
    for i in held:
        assert torch.equal(ins[i], xs[i])
