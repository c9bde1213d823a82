"""Indexing and selection on GlobalTensors equal plain torch: advanced indexing, gather, scatter_add,
topk, sort, order statistics, diagonals, var/std (and with the mean), prod, triangular masks, scans,
padding and where with a number. Outputs and gradients in sampled layouts on the oracle
meshes; the data-parallel uses of them leave no op to the replicated fallback."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import shoal
from shoal import B, S
from shoal.testing import check, make_global

_G = torch.Generator().manual_seed(0)
MESHES = [(2,), (3,), (2, 2)]


def r(*shape):
    return torch.randn(shape, generator=_G)


def i(high, *shape):
    return torch.randint(0, high, shape, generator=_G)


@pytest.mark.parametrize("shape", MESHES, ids=str)
def test_advanced_indexing(meshes, shape):
    def pick(x, rows, cols):
        return x[rows].sum(1) + x[:, cols].sum(0) + x[rows, cols]  # each [4, 3]

    check(pick, [r(5, 7, 3), i(5, 4), i(7, 4)], meshes[shape], max_combos=24)


@pytest.mark.parametrize("shape", MESHES, ids=str)
def test_gather_and_scatter_add(meshes, shape):
    def gather_scatter(x, index, src):
        picked = x.gather(1, index)
        return picked.sum(1, keepdim=True) + x.scatter_add(1, index, src * 2)

    check(gather_scatter, [r(5, 7), i(7, 5, 4), r(5, 4)], meshes[shape], max_combos=24)


@pytest.mark.parametrize("shape", MESHES, ids=str)
def test_topk_sort(meshes, shape):
    def select(x):
        top = x.topk(3, dim=1)
        srt = x.sort(dim=0, descending=True)
        return top.values.sum() + srt.values[:2].sum() + top.indices.float().mean() + x.argsort(1).float().sum()

    check(select, [r(5, 7)], meshes[shape], max_combos=24)


@pytest.mark.parametrize("shape", MESHES, ids=str)
def test_var_std_tril(meshes, shape):
    def moments(x):
        return x.var(-1, keepdim=True) + x.std(0) + x.var() + x.tril(1) - x.triu()

    check(moments, [r(3, 5, 7)], meshes[shape], max_combos=24, rtol=1e-4)


@pytest.mark.parametrize("shape", MESHES, ids=str)
def test_cumsum_pad_where(meshes, shape):
    def scan(x):
        return F.pad(x.cumsum(1), (1, 2)) + torch.where(F.pad(x, (2, 1)) > 0, 0.5, F.pad(x, (2, 1), value=-1.0))

    check(scan, [r(3, 5, 7)], meshes[shape], max_combos=24)


@pytest.mark.parametrize("shape", MESHES, ids=str)
def test_order_statistics_and_scans(meshes, shape):
    def stats(x):
        var, mean = torch.var_mean(x, -1)
        std, _ = torch.std_mean(x, (0, 2), keepdim=True)
        return (var + mean + x.median(-1).values + x.kthvalue(2, 1).values.sum(-1, keepdim=True)
                + x.prod(-1) + x.cumprod(1).sum(-1) + x.cummax(2).values.sum(-1) + std.sum())

    check(stats, [r(3, 5, 7) * 0.5 + 1], meshes[shape], max_combos=24, rtol=1e-4)


@pytest.mark.parametrize("shape", MESHES, ids=str)
def test_diagonal(meshes, shape):
    def diagonals(x):
        return x.diagonal(dim1=1, dim2=2) + x[:, :, 1:6].diagonal(dim1=1, dim2=2) + x.diagonal(-1, 2, 1)

    check(diagonals, [r(3, 5, 7)], meshes[shape], max_combos=24)


@pytest.mark.parametrize("shape", MESHES, ids=str)
def test_as_strided_addresses_the_global_strides(meshes, shape):
    """as_strided reads the storage under the tensor's own strides (here of a transposed view), as
    torch does; unfold's backward runs through it."""

    def strided(x):
        t = x.transpose(1, 2)
        return t.as_strided([3, 4], [35, 8], 1) + x.unfold(2, 3, 2).sum((1, 3))[:, :3].sum(-1, keepdim=True)

    check(strided, [r(3, 5, 7)], meshes[shape], max_combos=24)


def test_no_fallback_for_indexing_under_data_parallel(meshes):
    """Batch-split data with replicated indices and weights (and the other way round): each op runs
    on its shards, forward and backward."""
    mesh = meshes[(2,)]

    def g(t, sbp):
        return make_global(t, mesh, (sbp,), requires_grad=t.dtype.is_floating_point)

    shoal.coverage(reset=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback warns
        x = g(r(6, 7, 3), S(0))
        table = g(r(9, 3), B)
        rows = g(i(9, 6, 4), S(0))
        losses = [
            x[:, g(i(7, 5), B)].sum(),
            x[:, g(i(7, 5), B), g(i(3, 5), B)].sum(),
            table[rows].sum(),  # a lookup: the indices split, the table replicated
            x.gather(1, g(i(7, 6, 2, 3), S(0))).sum(),
            x.topk(2, dim=1).values.sum() + x.sort(dim=-1).values[..., 0].sum(),
            x.var(-1).sum() + x.std((1, 2)).sum(),
            F.softmax(x.tril(), -1).sum(),
            F.pad(x.cumsum(1), (1, 1)).sum() + torch.where(x > 0, x, 0.0).sum(),
            x[:, :3].diagonal(dim1=1, dim2=2).sum() + x.prod(-1).sum() + torch.var_mean(x, 1)[0].sum(),
            x.median(-1).values.sum() + x.kthvalue(2, 1).values.sum() + x.cummax(1).values.sum(),
        ]
        sum(losses).backward()
    cov = shoal.coverage()
    assert not cov.by_fallback, str(cov)
