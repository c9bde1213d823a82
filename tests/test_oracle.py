"""User-level functions on GlobalTensors equal plain torch, outputs and gradients, for every input layout."""

import pytest
import torch
import torch.nn.functional as F

import shoal
from shoal.testing import assert_same_value, check

_G = torch.Generator().manual_seed(0)


def r(*shape, dtype=torch.float32):
    if dtype.is_floating_point:
        return torch.randn(shape, generator=_G, dtype=dtype)
    return torch.randint(-4, 5, shape, generator=_G).to(dtype)


def linear(x, w, b):
    return F.linear(x, w, b)


def matmul_3d_2d(a, b):
    return a @ b


def batched_matmul(a, b):
    return torch.matmul(a, b)


def mlp(x, w1, w2):
    return torch.relu(x @ w1) @ w2


def broadcast_add(a, b):
    return a + b


def broadcast_mul_3d(a, b):
    return a * b - b


def scalar_math(x):
    return (x * 2 - 1) / 3 + x**2 - 0.5 * x.tanh()


def reductions(x):
    return x.sum(1, keepdim=True) + x.mean() - x.mean(0) * x.amax(0) + x.amin(1, keepdim=True)


def stable_softmax(x):
    e = (x - x.amax(-1, keepdim=True)).exp()
    return e / e.sum(-1, keepdim=True)


def reshape_permute(x):
    return x.reshape(3, 2, 7).permute(2, 0, 1).reshape(7, 6).t()


def cat_stack_split(a, b):
    c = torch.cat([a, b], dim=0)
    s = torch.stack([a, a * 2], dim=1)
    parts = c.split(2, dim=0)
    return [s.sum(1), parts[0] * parts[-1].sum(), *c.chunk(3, dim=1)]


def indexing(x):
    return x[1:4, ::2] * x[0, ::2] + x[-1].sum()


def transpose_view(x):
    return x.t().contiguous().view(-1) * 2


def expand_unsqueeze(x, v):
    return x.unsqueeze(0).expand(3, -1, -1) * v.unsqueeze(-1).unsqueeze(-1)


def where_mask(x):
    return torch.where(x > 0, x, x * 0.1)


def type_promotion(x, i):
    return x + i * 2


def inplace_chain(x):
    y = x * 1
    y.add_(2).mul_(3)
    y.sub_(x)
    return y


def mse(p, t):
    return ((p - t) ** 2).mean()


def plain_mask_and_positions(x):
    mask = torch.tril(torch.ones(x.shape[0], x.shape[1])).bool()
    pos = torch.arange(x.shape[1], dtype=x.dtype)
    return x.masked_fill(~mask, 0.0) + pos


def squeeze_select(x):
    return x.unsqueeze(1).squeeze(1)[:, 2] + x.select(1, 0)


CASES = [
    (linear, [r(5, 7), r(3, 7), r(3)]),
    (matmul_3d_2d, [r(2, 5, 7), r(7, 3)]),
    (batched_matmul, [r(3, 5, 7), r(3, 7, 2)]),
    (mlp, [r(5, 6), r(6, 7), r(7, 3)]),
    (broadcast_add, [r(5, 7), r(7)]),
    (broadcast_mul_3d, [r(3, 1, 7), r(5, 1)]),
    (scalar_math, [r(5, 7)]),
    (reductions, [r(5, 7)]),
    (stable_softmax, [r(5, 7)]),
    (reshape_permute, [r(6, 7)]),
    (cat_stack_split, [r(5, 3), r(2, 3)]),
    (indexing, [r(5, 7)]),
    (transpose_view, [r(5, 3)]),
    (expand_unsqueeze, [r(5, 3), r(3)]),
    (where_mask, [r(5, 7)]),
    (type_promotion, [r(5, 7), r(5, 7, dtype=torch.int64)]),
    (inplace_chain, [r(5, 7)]),
    (mse, [r(7, 3), r(7, 3)]),
    (squeeze_select, [r(5, 3)]),
]


@pytest.mark.parametrize("mesh_shape", [(1,), (2,), (3,), (2, 2)])
@pytest.mark.parametrize("fn,inputs", CASES, ids=[c[0].__name__ for c in CASES])
def test_oracle(fn, inputs, mesh_shape, meshes):
    n = check(fn, inputs, meshes[mesh_shape], max_combos=24 if mesh_shape == (2, 2) else 48)
    assert n > 0


def test_plain_tensors_are_broadcast(meshes):
    """Masks and position ids made as plain tensors inside an unmodified model just work."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # masked_fill has no rule yet: it falls back, correctly
        check(plain_mask_and_positions, [r(5, 7)], meshes[(2, 2)], max_combos=None)


def test_the_oracle_rejects_copies_that_disagree():
    """A Broadcast value is one value: devices holding different numbers for it fail the oracle even
    when the copy that full() reads is right."""
    mesh = shoal.Mesh([0, 1])
    t = torch.randn(3, 4)
    g = shoal.from_local({0: t.clone(), 1: t + 1e-3}, mesh, shoal.B)
    with pytest.raises(AssertionError, match="the copies on devices 0 and 1 of a \\[B\\] value differ"):
        assert_same_value(g, t)
    assert_same_value(shoal.from_local({0: t.clone(), 1: t.clone()}, mesh, shoal.B), t)
    assert_same_value(shoal.from_local({0: t - 1.0, 1: t.new_ones(3, 4)}, mesh, shoal.P), t)  # pieces of a sum
