"""In-place ops write each global element once, however the shards share memory."""

import pytest
import torch

import shoal
from shoal.testing import assert_same_value, layouts, make_global

_G = torch.Generator().manual_seed(0)
X, Y = torch.randn(5, 3, generator=_G), torch.randn(5, 3, generator=_G)

OPS = {
    "add_": lambda x, y: x.add_(y),
    "mul_": lambda x, y: x.mul_(y),
    "copy_": lambda x, y: x.copy_(y),
    "add_scalar": lambda x, y: x.add_(1.5),
    "zero_": lambda x, y: x.zero_(),
    "chain": lambda x, y: x.mul_(2).sub_(y).div_(3),
}


@pytest.mark.parametrize("build", ["to_global", "make_global"])
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("mesh_shape", [(3,), (2, 2)])
def test_inplace_every_layout(op, mesh_shape, build, meshes):
    mesh = meshes[mesh_shape]
    make = shoal.to_global if build == "to_global" else make_global
    for sx in layouts(2, mesh):
        for sy in layouts(2, mesh)[:: 3 if mesh_shape == (2, 2) else 1]:
            x, y = make(X, mesh, sx), make(Y, mesh, sy)
            ref = OPS[op](X.clone(), Y.clone())
            out = OPS[op](x, y)
            assert out is x
            assert_same_value(x, ref, f"{op} on {mesh_shape} with x {sx}, y {sy}")
            assert_same_value(y, Y, "the other operand is untouched")


def test_optimizer_step_on_2d_mesh(meshes):
    """The dp x tp demo bug: parameters laid out (B, S(0)) share memory across the dp axis."""
    mesh = meshes[(2, 2)]
    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 6)
    m = torch.nn.Linear(4, 6)
    m.load_state_dict(ref.state_dict())
    m.weight = torch.nn.Parameter(shoal.to_global(m.weight.detach(), mesh, [shoal.B, shoal.S(0)]))
    m.bias = torch.nn.Parameter(shoal.to_global(m.bias.detach(), mesh, [shoal.B, shoal.S(0)]))
    x = torch.randn(7, 4)
    gx = shoal.to_global(x, mesh, [shoal.S(0), shoal.B])
    for model, inp in ((ref, x), (m, gx)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for _ in range(3):
            opt.zero_grad()
            (model(inp) ** 2).mean().backward()
            opt.step()
    assert_same_value(m.weight, ref.weight.detach(), "weight after 3 SGD steps")
    assert_same_value(m.bias, ref.bias.detach(), "bias after 3 SGD steps")


VIEWS = {
    "transpose_": lambda x: x.transpose_(0, 1),
    "t_": lambda x: x.t_(),
    "unsqueeze_": lambda x: x.unsqueeze_(1),
    "squeeze_": lambda x: x.unsqueeze_(0).squeeze_(0),
    "chain": lambda x: x.t_().unsqueeze_(-1).transpose_(0, 2).squeeze_(),
}


@pytest.mark.parametrize("op", list(VIEWS))
@pytest.mark.parametrize("mesh_shape", [(3,), (2, 2)])
def test_inplace_views_change_the_tensor_itself(op, mesh_shape, meshes):
    """transpose_, t_, (un)squeeze_ give the tensor a new shape: its own (sizes, strides, layout and
    shards agree), and autograd sees the view."""
    mesh = meshes[mesh_shape]
    for sx in layouts(2, mesh):
        ref = X.clone().requires_grad_()
        x = make_global(X, mesh, sx, requires_grad=True)
        want, got = VIEWS[op](ref * 2), VIEWS[op](x * 2)
        what = f"{op} on {mesh_shape} with x {sx}"
        assert got.shape == want.shape and got.stride() == want.stride(), what
        assert_same_value(got, want.detach(), what)
        for out in (want, got):
            (out * torch.arange(out.numel(), dtype=out.dtype).view(out.shape)).sum().backward()
        assert_same_value(x.grad, ref.grad, f"{what}: gradient")


def test_gru_on_a_split_batch(meshes):
    """nn.GRU(batch_first=True) turns its input around with transpose_: forward and backward under
    data parallelism equal plain torch."""
    mesh = meshes[(2, 2)]
    torch.manual_seed(0)
    ref = torch.nn.GRU(4, 3, batch_first=True)
    model = shoal.distribute_module(torch.nn.GRU(4, 3, batch_first=True), mesh)
    model.load_state_dict(ref.state_dict())
    x = torch.randn(5, 6, 4, generator=_G)
    want, got = ref(x)[0], model(make_global(x, mesh, [shoal.S(0), shoal.B]))[0]
    assert_same_value(got, want.detach())
    want.square().sum().backward()
    got.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_same_value(p.grad, q.grad, name, rtol=1e-4, atol=1e-6)
