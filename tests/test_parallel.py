"""Parallel plans as data and ZeRO: the same training as one device, less memory per device."""

import pytest
import torch

import shoal
from shoal import B, S
from shoal.testing import assert_same_value


def make_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


X, Y = torch.randn(30, 8), torch.randn(30, 4)

PLANS = {
    "dp": ((4,), shoal.Plan(inputs={"": S(0)})),
    "tp": ((4,), shoal.Plan(params={"0.*": S(0), "2.weight": S(1)})),
    "dp,tp": ((2, 2), shoal.Plan(params={"0.*": (B, S(0)), "2.weight": (B, S(1))}, inputs={"": (S(0), B)})),
}


def train(model, opt, x, y, steps=3):
    losses = []
    for _ in range(steps):
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _mesh(shape):
    return shoal.Mesh([0, 1, 2, 3], axes=("dp",)) if shape == (4,) else shoal.Mesh([[0, 1], [2, 3]], axes=("dp", "tp"))


@pytest.mark.parametrize("zero", [False, True])
@pytest.mark.parametrize("name", list(PLANS))
def test_plan_trains_like_one_device(name, zero):
    shape, plan = PLANS[name]
    mesh = _mesh(shape)
    ref = make_mlp()
    ref_losses = train(ref, torch.optim.AdamW(ref.parameters(), lr=0.01), X, Y)
    m = shoal.distribute_module(make_mlp(), mesh, plan)
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    if zero:
        shoal.shard_optimizer_state(opt, mesh, "dp")
    losses = train(m, opt, X, Y)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for (n, p), q in zip(m.named_parameters(), ref.parameters()):
        assert_same_value(p, q.detach(), n)
    if zero:
        states = [v for st in opt.state.values() for v in st.values() if isinstance(v, shoal.GlobalTensor)]
        assert states and all(any(isinstance(s, shoal.Split) for s in v.sbp) or v.shape[0] < 2 for v in states)


def test_zero_saves_optimizer_memory():
    mesh = _mesh((4,))
    sizes = {}
    for zero in (False, True):
        m = shoal.distribute_module(make_mlp(), mesh, shoal.data_parallel(mesh))
        opt = torch.optim.Adam(m.parameters(), lr=0.01)
        if zero:
            shoal.shard_optimizer_state(opt, mesh, "dp")
        train(m, opt, X, Y, steps=1)
        sizes[zero] = shoal.memory_per_device(opt)
    full, sharded = sizes[False][0], sizes[True][0]
    # Adam keeps two states per parameter; all four weights/biases here split over 4 devices
    assert sharded * 4 == full, (full, sharded)


def test_plan_errors():
    mesh = _mesh((4,))
    with pytest.raises(ValueError, match="match no parameter"):
        shoal.distribute_module(make_mlp(), mesh, shoal.Plan(params={"nope.*": S(0)}))
    with pytest.raises(ValueError, match="one SBP per mesh axis"):
        shoal.distribute_module(make_mlp(), mesh, shoal.Plan(params={"0.weight": (S(0), B)}))
    with pytest.raises(ValueError, match="out of range"):
        shoal.distribute_module(make_mlp(), mesh, shoal.Plan(params={"0.bias": S(1)}))
    with pytest.raises(ValueError, match="does not exist"):
        shoal.distribute_module(make_mlp(), mesh, shoal.Plan(inputs={"9": S(0)}))


class TiedLM(torch.nn.Module):
    """An embedding and an output layer sharing one weight (GPT-2 style)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(12, 8)
        self.mid = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 12, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.tanh(self.mid(self.emb(x))))


@pytest.mark.parametrize("plan", [None, {"emb.weight": S(0)}, {"emb.weight": S(1), "head.weight": S(1)}])
def test_tied_weights_stay_tied(plan):
    mesh = shoal.Mesh([0, 1, 2, 3])
    x, y = torch.randint(0, 12, (8, 5)), torch.randint(0, 12, (8, 5))
    ref = TiedLM()
    m, c = (shoal.distribute_module(TiedLM(), mesh, plan) for _ in range(2))
    assert m.head.weight is m.emb.weight and len(list(m.parameters())) == len(list(ref.parameters()))

    def step(model, opt, x, y):
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()

    for model, fn in ((ref, step), (m, step), (c, shoal.compile(step))):  # eager and graph mode
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        for _ in range(2):
            fn(model, opt, x, y)
    for model in (m, c):
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_same_value(p, q.detach(), n)
    with pytest.raises(ValueError, match="'head.weight' is the same tensor as 'emb.weight' \\(tied\\)"):
        shoal.distribute_module(TiedLM(), mesh, {"emb.weight": S(0), "head.weight": S(1)})


def test_gradients_on_one_device_are_whole_at_once():
    """A Partial gradient over a one-device axis is the gradient: it is called Broadcast by the hook,
    with no bucket (no copy into one, no reduction)."""
    mesh = shoal.Mesh([0], axes=("dp",))
    ref = make_mlp()
    ((ref(X) - Y) ** 2).mean().backward()
    m = shoal.distribute_module(make_mlp(), mesh, shoal.data_parallel(mesh))
    with shoal.CommCounter() as cc:
        ((m(X) - Y) ** 2).mean().backward()
    assert cc.total == 0, cc
    for p, q in zip(m.parameters(), ref.parameters()):
        assert p.grad.sbp == (B,)
        assert_same_value(p.grad, q.grad, "grad")
    params = list(m.parameters())
    assert len({p.grad._shards[0].untyped_storage().data_ptr() for p in params}) == len(params)  # no bucket


def test_gradient_buckets_fill_to_the_size_for_the_device_type(monkeypatch):
    """Buckets of ``comm.bucket_bytes()`` per device (1 MiB on CPU, DDP's 25 MiB on CUDA): with a
    bucket of one byte each of the MLP's four gradients starts an all-reduce of its own, with the
    default all four share one; the values are the same."""
    from shoal import comm

    mesh = _mesh((4,))
    ref = make_mlp()
    ((ref(X) - Y) ** 2).mean().backward()
    assert comm.bucket_bytes() == comm.BUCKET_BYTES["cpu"] and comm.BUCKET_BYTES["cuda"] == 25 << 20
    counts = []
    for size in (1, None):
        if size is not None:
            monkeypatch.setitem(comm.BUCKET_BYTES, "cpu", size)
        else:
            monkeypatch.undo()
        m = shoal.distribute_module(make_mlp(), mesh, shoal.data_parallel(mesh))
        assert m._shoal_reducer.bucket_bytes == comm.bucket_bytes()
        with shoal.CommCounter() as cc:
            ((m(X) - Y) ** 2).mean().backward()
        counts.append(cc.counts["all_reduce"])
        for p, q in zip(m.parameters(), ref.parameters()):
            assert_same_value(p.grad, q.grad, "grad")
    assert counts[0] >= counts[1] + 3, counts


def test_buckets_count_a_partial_gradient_whole_on_every_device():
    """A data-parallel gradient is a partial sum: every device holds the whole tensor, so four of
    six 257 KiB layers fill a 1 MiB bucket per device, started while backward goes on, and the
    other two a second (counting a device's share as a quarter of each, all six made
    one bucket at the end of backward, and a compiled step's one all-reduce ran after the whole
    backward, overlapping nothing)."""
    mesh = _mesh((4,))
    torch.manual_seed(0)
    make = lambda: torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])  # noqa: E731
    ref = make()
    x = torch.randn(8, 256)
    ref(x).square().mean().backward()
    torch.manual_seed(0)
    m = shoal.distribute_module(make(), mesh, shoal.data_parallel(mesh))
    with shoal.CommCounter() as cc:
        m(x).square().mean().backward()
    assert cc.counts["all_reduce"] == 2, cc
    for p, q in zip(m.parameters(), ref.parameters()):
        assert_same_value(p.grad, q.grad, "grad", rtol=1e-5, atol=1e-7)


def test_data_parallel_gradients_are_reduced_in_one_bucket():
    """Four Partial gradients, one all_reduce at the end of backward, none in the optimizer step."""
    mesh = _mesh((4,))
    ref = make_mlp()
    ((ref(X) - Y) ** 2).mean().backward()
    m = shoal.distribute_module(make_mlp(), mesh, shoal.data_parallel(mesh))
    with shoal.CommCounter() as cc:
        ((m(X) - Y) ** 2).mean().backward()
    assert cc.counts["all_reduce"] <= 2, cc  # the bucket, and the scalar loss's backward at most
    for p, q in zip(m.parameters(), ref.parameters()):
        assert p.grad.sbp == (B,)
        assert_same_value(p.grad, q.grad, "grad")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with shoal.CommCounter() as cc:
        opt.step()
    assert cc.total == 0, cc
