"""Dispatch: decisions and their cache, the fallback, plain tensors, clear errors, collective counts."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._decomp import decomposition_table

import shoal
from shoal import B, P, S
from shoal import dispatch as D
from shoal.testing import assert_same_value, make_global


def test_decisions_are_cached(meshes, monkeypatch):
    """A decision is computed once per key: ``_DECISIONS`` grows by one on every cache miss (and
    only then), so repeated calls must not grow it. An empty cache for this test: the first call
    must decide, whatever earlier tests decided."""
    mesh = meshes[(2,)]
    x, y = shoal.to_global(torch.randn(5, 3), mesh, S(0)), shoal.to_global(torch.randn(5, 3), mesh, S(0))
    monkeypatch.setattr(D, "_CACHE", {})
    decided = len(D._DECISIONS)
    assert_same_value(x + y, x.full() + y.full())
    assert len(D._DECISIONS) > decided  # the counter counts
    decided = len(D._DECISIONS)
    n = len(D._CACHE)
    for _ in range(3):
        x + y
    assert len(D._CACHE) == n
    assert len(D._DECISIONS) == decided, "a repeated call computed its decision again"


def test_fallback_is_correct_warns_once_and_is_listed(meshes):
    mesh = meshes[(2, 2)]
    aten = torch.ops.aten
    op = aten._embedding_bag.default  # F.embedding_bag; its backward is _embedding_bag_backward
    assert shoal.ops.lookup(op) is None and op not in decomposition_table
    v, rows, offsets = torch.randn(9, 3), torch.tensor([1, 4, 4, 8, 0, 2]), torch.tensor([0, 2, 5])
    shoal.coverage(reset=True)
    x = make_global(v, mesh, [S(0), P], requires_grad=True)
    with pytest.warns(UserWarning, match="no SBP rule for aten._embedding_bag.default"):
        y = F.embedding_bag(rows, x, offsets)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        y2 = F.embedding_bag(rows, x * 2, offsets, mode="sum")
    assert_same_value(y, F.embedding_bag(rows, v, offsets))
    assert_same_value(y2, F.embedding_bag(rows, v * 2, offsets, mode="sum"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the backward falls back too
        (y * torch.arange(3.0)).sum().backward()
    vv = v.clone().requires_grad_()
    (F.embedding_bag(rows, vv, offsets) * torch.arange(3.0)).sum().backward()
    assert_same_value(x.grad, vv.grad)
    cov = shoal.coverage()
    assert cov.by_fallback[op] >= 2
    assert "_embedding_bag" in repr(cov)


def test_decomposed_ops_are_listed(meshes):
    mesh = meshes[(2,)]
    shoal.coverage(reset=True)
    x = shoal.to_global(torch.randn(6, 4), mesh, S(0))
    y = torch.nn.functional.mse_loss(x, x * 0.5)
    assert_same_value(y, torch.nn.functional.mse_loss(x.full(), x.full() * 0.5))
    cov = shoal.coverage()
    assert not cov.by_fallback, cov


def test_plain_tensors_meet_global_tensors_as_broadcast(meshes):
    mesh = meshes[(3,)]
    v = torch.randn(5, 4)
    x = make_global(v, mesh, S(1))
    mask = torch.rand(5, 4) > 0.5
    assert_same_value(x * mask, v * mask)
    assert_same_value(torch.arange(4.0) + x, torch.arange(4.0) + v)
    assert_same_value(x @ torch.ones(4, 2), v @ torch.ones(4, 2))


def test_different_meshes_is_a_clear_error(meshes):
    x = shoal.to_global(torch.randn(4, 4), meshes[(2,)], S(0))
    y = shoal.to_global(torch.randn(4, 4), meshes[(3,)], S(0))
    with pytest.raises(ValueError, match=r"aten.add.Tensor got GlobalTensors on different meshes.*to_global"):
        x + y


def test_bad_layouts_are_clear_errors(meshes):
    mesh = meshes[(2, 2)]
    with pytest.raises(ValueError, match="one SBP per mesh axis"):
        shoal.to_global(torch.randn(4, 4), mesh, [S(0)])
    with pytest.raises(ValueError, match="split dim 2 is out of range"):
        shoal.to_global(torch.randn(4, 4), mesh, [S(2), B])
    with pytest.raises(ValueError, match="not in the world"):
        shoal.Mesh([0, 9])
    with pytest.raises(TypeError, match="not an SBP"):
        shoal.to_global(torch.randn(4, 4), mesh, [S(0), "B"])


def test_user_errors_surface_as_torch_errors(meshes):
    """A shape error is the same error torch gives on one device, not a shoal internal one."""
    x = shoal.to_global(torch.randn(4, 3), meshes[(2,)], S(0))
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
        x @ torch.randn(4, 4)


def test_data_parallel_linear_communicates_only_for_gradients(meshes):
    """Batch S(0), weights B: forward and backward need no collective; the weight gradient is Partial
    and is reduced (one all_reduce per tensor) when the optimizer combines it with the B weight."""
    mesh = shoal.Mesh([0, 1, 2, 3])
    lin = torch.nn.Linear(6, 3)
    lin.weight = torch.nn.Parameter(shoal.to_global(lin.weight.detach(), mesh, B))
    lin.bias = torch.nn.Parameter(shoal.to_global(lin.bias.detach(), mesh, B))
    x = shoal.to_global(torch.randn(10, 6), mesh, S(0))
    with shoal.CommCounter() as cc:
        loss = lin(x).square().sum()
        loss.backward()
    assert cc.total == 0, cc
    assert lin.weight.grad.sbp == (P,) and lin.bias.grad.sbp == (P,)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    with shoal.CommCounter() as cc:
        opt.step()
    assert dict(cc.counts) == {"all_reduce": 2}, cc


@pytest.mark.parametrize("sbp", [(S(0), B), (B, S(1)), (B, B)], ids=str)
def test_a_gradient_arriving_with_other_strides_stays_a_global_tensor(sbp, meshes):
    """The gradient of ``w.sum(0)`` is an expanded (stride 0) tensor: autograd's AccumulateGrad
    makes one with the leaf's strides through ``new_empty_strided`` and copies it in. That must
    give a GlobalTensor holding the value (twice: the second backward accumulates)."""
    v = torch.randn(6, 5)
    w = shoal.to_global(v, meshes[(2, 2)], list(sbp), requires_grad=True)
    ref = v.clone().requires_grad_()
    for _ in range(2):
        for t in (w, ref):
            t.sum(0).pow(2).sum().backward()
        assert isinstance(w.grad, shoal.GlobalTensor)
        assert w.grad.stride() == ref.grad.stride()
        assert_same_value(w.grad, ref.grad)


def test_python_values_of_a_global_tensor(meshes):
    """f-strings, .tolist() and .numpy() read the global value, as on a plain tensor."""
    v = torch.randn(5, 3)
    x = make_global(v, meshes[(2, 2)], [S(0), P], seed=1)
    assert f"{x.sum():.4f}" == f"{v.sum():.4f}"
    assert torch.allclose(torch.tensor(x.tolist()), v, atol=1e-6)
    assert torch.allclose(torch.from_numpy(x.numpy()), v, atol=1e-6)
