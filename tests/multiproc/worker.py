"""Run under torchrun by tests/test_multiprocess.py: a representative subset of the core and model
equivalence checks, on whatever world torchrun made (2 processes x 2 devices, 4 x 1, ...)."""

import itertools
import sys

import torch
import torch.nn.functional as F

import shoal
from shoal import B, P, S
from shoal.testing import assert_same_value, check, layouts, make_global

w = shoal.init()
torch.set_num_threads(1)
assert w.size == 4, w
meshes = {
    (1,): shoal.Mesh([0]),
    (2,): shoal.Mesh([1, 2]),  # spans processes when each owns one or two devices
    (3,): shoal.Mesh([0, 1, 3]),
    (2, 2): shoal.Mesh([[0, 1], [2, 3]], axes=("dp", "tp")),
    (4,): shoal.Mesh([0, 1, 2, 3], axes=("dp",)),
}
g = torch.Generator().manual_seed(0)


def r(*shape):
    return torch.randn(shape, generator=g)


# 1. boxing: every layout pair is identity on the global value, on every rank
for shape in [(1,), (2,), (3,), (2, 2)]:
    mesh = meshes[shape]
    v = r(5, 3)
    lays = layouts(2, mesh, ("sum", "max"))
    for a, b in itertools.islice(itertools.product(lays, lays), 0, None, 3 if shape == (2, 2) else 1):
        x = make_global(v, mesh, a, seed=1)
        assert_same_value(x.to_global(mesh, b), v, f"{a} -> {b} on {shape}")
# across meshes
v = r(7, 4)
for src, dst, sa, sb in [((2,), (3,), S(0), S(1)), ((3,), (2, 2), P, [S(1), B]), ((2, 2), (2,), [S(0), P], B)]:
    x = make_global(v, meshes[src], sa)
    assert_same_value(x.to_global(meshes[dst], sb), v, f"{src} {sa} -> {dst} {sb}")

# a split across processes gathers and reduce-scatters as one collective of blocks (comm.dist's
# all_gather_blocks / reduce_scatter_blocks; uneven ones padded to the longest), the same value as the
# general path
from shoal.comm import dist as comm_dist  # noqa: E402

used = {"all_gather_blocks": 0, "reduce_scatter_blocks": 0}
for name in used:
    real = getattr(comm_dist, name)
    setattr(comm_dist, name, lambda *a, name=name, real=real: used.__setitem__(name, used[name] + 1) or real(*a))
for rows in (8, 7, 5):  # even over 4 devices, and uneven (2 processes: 4 + 3 and 3 + 2 rows)
    for dim in (0, 1):
        v = r(rows, 4) if dim == 0 else r(4, rows)
        assert_same_value(make_global(v, meshes[(4,)], S(dim)).to_global(meshes[(4,)], B), v, f"{rows} S({dim}) -> B")
        assert_same_value(make_global(v, meshes[(4,)], P).to_global(meshes[(4,)], S(dim)), v, f"{rows} P -> S({dim})")
assert used["all_gather_blocks"] >= 6 and used["reduce_scatter_blocks"] >= 6, used

# 2. oracle: outputs and gradients on every mesh
cases = [
    (lambda x, w, b: F.linear(x, w, b), [r(5, 7), r(3, 7), r(3)]),
    (lambda x: x.sum(1, keepdim=True) + x.mean() - x.amax(0), [r(5, 7)]),
    (lambda a, b: torch.cat([a, b]).split(2), [r(5, 3), r(2, 3)]),
    (lambda x: x.reshape(3, 2, 7).permute(2, 0, 1).reshape(7, 6).t(), [r(6, 7)]),
]
for mesh in meshes.values():
    for fn, inputs in cases:
        check(fn, inputs, mesh, max_combos=6)

# 3. random ops draw the same values as one device
x = shoal.to_global(r(6, 5), meshes[(2, 2)], [S(0), S(1)])
torch.manual_seed(3)
ref = F.dropout(x.full(), 0.3, True)
torch.manual_seed(3)
assert_same_value(F.dropout(x, 0.3, True), ref, "dropout")

# 4. a small model trains like one device under dp, tp, dp x tp and ZeRO
X, Y = r(10, 8), r(10, 4)


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def train(model, x, y, zero_mesh=None):
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    if zero_mesh is not None:
        shoal.shard_optimizer_state(opt, zero_mesh, "dp")
    out = []
    for _ in range(3):
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out, model


ref_losses, ref = train(mlp(), X, Y)
m4, m22 = meshes[(4,)], meshes[(2, 2)]
plans = {
    "dp": (m4, shoal.Plan(inputs={"": S(0)}), False),
    "tp": (m4, shoal.Plan(params={"0.*": S(0), "2.weight": S(1)}), False),
    "dp,tp": (m22, shoal.Plan(params={"0.*": (B, S(0)), "2.weight": (B, S(1))}, inputs={"": (S(0), B)}), False),
    "zero": (m4, shoal.Plan(inputs={"": S(0)}), True),
}
for name, (mesh, plan, zero) in plans.items():
    model = shoal.distribute_module(mlp(), mesh, plan)
    losses, model = train(model, X, Y, mesh if zero else None)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_same_value(p, q.detach(), f"{name}: {n}")

# 5. each process loads only its part of the batch
full_batch = torch.arange(30.0).view(10, 3)
m4 = meshes[(4,)]
spec_rows = [shoal.TensorSpec((10, 3), torch.float32, m4, (S(0),)).local_region(p)[0] for p in m4.local_positions]
mine = full_batch[min(s.start for s in spec_rows) : max(s.stop for s in spec_rows)]
xb = shoal.from_local_batch(mine, m4)
assert_same_value(xb, full_batch, "from_local_batch")

# 6. local views need no communication and printing works on every rank
with shoal.CommCounter() as cc:
    repr(x)
    local = x.to_local()  # {device: shard}, one device per process or several
    assert list(local) == [d for d in x.mesh.devices if w.owns(d)], local
    if len(local) == 1:
        assert x.local_shard() is next(iter(local.values()))
assert cc.total == 0
print(f"OK rank {w.rank} of {w.processes} x {w.devices_per_process} devices", flush=True)
sys.exit(0)
