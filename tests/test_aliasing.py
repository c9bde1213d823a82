"""Writes through views keep torch's meaning for every view chain, in-place op and layout: the base
and every live view see the write, eagerly and compiled (issue 15)."""

import random

import pytest
import torch

import shoal
from shoal import B, Mesh, S
from shoal.testing import assert_same_value, layouts, make_global

_G = torch.Generator().manual_seed(0)
X2 = torch.randn(5, 7, generator=_G)  # uneven on 2 and 3 devices
X3 = torch.randn(4, 5, 3, generator=_G)

# view chains: base -> the view written through (every one aliases its base in torch)
CHAINS = {
    "slice": lambda x: x[1:],
    "slice_cols": lambda x: x[:, 2:],
    "slice_step": lambda x: x[::2, 1:6:2],
    "slice2": lambda x: x[1:, 1:],
    "slice_slice": lambda x: x[1:][:, 1:],
    "select": lambda x: x[2],
    "select_col": lambda x: x[:, 0],
    "narrow2": lambda x: x.narrow(0, 1, 3).narrow(1, 2, 2),
    "diagonal": lambda x: x.diagonal(),
    "diagonal_off": lambda x: x.diagonal(1),
    "t_slice": lambda x: x.t()[1:],
    "transpose": lambda x: x.transpose(0, 1),
    "unsqueeze_slice": lambda x: x.unsqueeze(0)[:, 1:3],
    "squeeze": lambda x: x[1:2].squeeze(0),
    "view": lambda x: x.view(35),
    "view_slice": lambda x: x.view(35)[3:20],
    "reshape_t": lambda x: x.t().reshape(7, 5)[2],  # reshape of a transpose copies: not a view in torch either
    "split": lambda x: x.split(2, dim=1)[1],
    "unbind": lambda x: x.unbind(0)[3],
    "chunk_rows": lambda x: x.chunk(2, dim=0)[1],
    "detach": lambda x: x.detach()[2:4],
}
CHAINS3 = {
    "select_mid": lambda x: x[:, 2],
    "permute_slice": lambda x: x.permute(2, 0, 1)[1:, :, 1:4],
    "diag_3d": lambda x: x.diagonal(dim1=0, dim2=1),
    "flatten_slice": lambda x: x.flatten(1)[1:3],
    "movedim_select": lambda x: x.movedim(2, 0)[1],
}


def _operand(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) if shape else torch.tensor(0.5)


# in-place writes through a view v; y is a plain tensor of v's shape (made Broadcast where v is global)
WRITES = {
    "copy_": lambda v, y: v.copy_(y),
    "fill_": lambda v, y: v.fill_(1.25),
    "sub_": lambda v, y: v.sub_(y),
    "mul_": lambda v, y: v.mul_(2.0),
    "add_alpha": lambda v, y: v.add_(y, alpha=-0.5),
    "setitem": lambda v, y: v.__setitem__(..., y),
    "setitem_part": lambda v, y: v.__setitem__((slice(None, None, 2),) if v.dim() else (), 3.5),
    "index_put_": lambda v, y: v.index_put_((torch.tensor([0]),), y[0:1]) if v.dim() else v.fill_(2.0),
    "iadd": lambda v, y: v.__iadd__(1.0),
}

# views made before the write, read after it (torch's aliases: all see the write)
OBSERVERS2 = [lambda x: x.t(), lambda x: x[1:4], lambda x: x[:, 3], lambda x: x.view(7, 5)]
OBSERVERS3 = [lambda x: x[1:], lambda x: x[:, :, 0], lambda x: x.transpose(0, 2)]


def _program(chain, write, observers, x, make_y):
    obs = [o(x) for o in observers]
    v = chain(x)
    write(v, make_y(tuple(v.shape)))
    return [x, v, *obs]


def _run_plain(chain, write, base, observers, seed):
    return _program(chain, write, observers, base.clone(), lambda s: _operand(s, seed))


def _run_global(chain, write, base, sbp, mesh, observers, seed):
    x = make_global(base, mesh, sbp, seed=seed)
    return _program(chain, write, observers, x, lambda s: shoal.to_global(_operand(s, seed), mesh, [B] * mesh.ndim))


@pytest.mark.parametrize("mesh_shape", [(2,), (3,), (2, 2)])
@pytest.mark.parametrize("chain", list(CHAINS))
def test_writes_through_views_2d(chain, mesh_shape, meshes):
    _sweep(CHAINS[chain], chain, X2, OBSERVERS2, meshes[mesh_shape])


@pytest.mark.parametrize("mesh_shape", [(2,), (3,), (2, 2)])
@pytest.mark.parametrize("chain", list(CHAINS3))
def test_writes_through_views_3d(chain, mesh_shape, meshes):
    _sweep(CHAINS3[chain], chain, X3, OBSERVERS3, meshes[mesh_shape])


def _sweep(chain, name, base, observers, mesh):
    all_layouts = layouts(base.dim(), mesh)
    if mesh.ndim == 2:  # 25 (3-D: 36) layouts: every write on a third of them, each layout seen
        picks = {w: all_layouts[k % 3::3] for k, w in enumerate(WRITES)}
    else:
        picks = {w: all_layouts for w in WRITES}
    for wname, write in WRITES.items():
        for sbp in picks[wname]:
            what = f"{name} then {wname} on {mesh.shape}, base {shoal.sbp.sbp_str(sbp)}"
            try:
                ref = _run_plain(chain, write, base, observers, seed=1)
            except RuntimeError as e:  # torch refuses the write (e.g. through an expanded view)
                assert "memory location" in str(e), what
                with pytest.raises(RuntimeError, match="memory location"):
                    _run_global(chain, write, base, sbp, mesh, observers, seed=1)
                continue
            got = _run_global(chain, write, base, sbp, mesh, observers, seed=1)
            for k, (g, r) in enumerate(zip(got, ref)):
                assert_same_value(g, r, f"{what}: value {k} (0 base, 1 view, then observers)")


# -- the issue's examples, one by one ---------------------------------------------------------------


def test_issue_examples_on_a_split_base():
    mesh = Mesh([0, 1], axes=("a",))
    g = shoal.to_global(torch.arange(16.0).reshape(4, 4), mesh, S(0))
    ref = torch.arange(16.0).reshape(4, 4)
    g[2] = -1.0
    ref[2] = -1.0
    assert_same_value(g, ref, "g[2] = -1.0")
    g[1:].sub_(100)
    ref[1:].sub_(100)
    assert_same_value(g, ref, "g[1:].sub_(100)")


ISSUE_WRITES = {
    "x[1:, 1:].sub_(y[1:, 1:])": lambda x, y: x[1:, 1:].sub_(y[1:, 1:]),
    "x[:, 2:].mul_(2)": lambda x, y: x[:, 2:].mul_(2),
    "x.diagonal().fill_(1.0)": lambda x, y: x.diagonal().fill_(1.0),
    "x[1:][:, 1:].sub_(y[1:][:, 1:])": lambda x, y: x[1:][:, 1:].sub_(y[1:][:, 1:]),
    "x.narrow(0, 1, 3).narrow(1, 2, 2).sub_(1.0)": lambda x, y: x.narrow(0, 1, 3).narrow(1, 2, 2).sub_(1.0),
    "x.t()[1:].sub_(y.t()[1:])": lambda x, y: x.t()[1:].sub_(y.t()[1:]),
    "x[2].sub_(y[2])": lambda x, y: x[2].sub_(y[2]),
    "x[1:, 1:] = y[1:, 1:]": lambda x, y: x.__setitem__((slice(1, None), slice(1, None)), y[1:, 1:]),
    "x[:, 0] = 0.0": lambda x, y: x.__setitem__((slice(None), 0), 0.0),
    "x[2] = y[3]": lambda x, y: x.__setitem__(2, y[3]),
    "x[1:3].copy_(y[:2])": lambda x, y: x[1:3].copy_(y[:2]),
    "x[:, 1:4] += 1.0": lambda x, y: x[:, 1:4].__iadd__(1.0),
}


@pytest.mark.parametrize("example", list(ISSUE_WRITES))
@pytest.mark.parametrize("sx", [B, S(0), S(1)], ids=str)
def test_issue_write_examples(example, sx):
    mesh = Mesh([0, 1], axes=("a",))
    gen = torch.Generator().manual_seed(3)
    xs, ys = torch.randn(5, 5, generator=gen), torch.randn(5, 5, generator=gen)
    ref = xs.clone()
    ISSUE_WRITES[example](ref, ys)
    x, y = shoal.to_global(xs, mesh, sx), shoal.to_global(ys, mesh, B)
    ISSUE_WRITES[example](x, y)
    assert_same_value(x, ref, f"{example} with x {sx}")
    assert_same_value(y, ys, "y is not written")


# -- overlapping operands, autograd's version counter, in-place views --------------------------------


OVERLAPS = {
    "add_t": lambda x: x.add_(x.t()),
    "copy_t": lambda x: x.copy_(x.t()),
    "sub_shifted": lambda x: x[1:].sub_(x[:-1]),
    "add_self": lambda x: x.add_(x),
    "add_full_slice": lambda x: x.add_(x[:]),
    "mul_disjoint": lambda x: x[:2].mul_(x[3:]),
}


@pytest.mark.parametrize("mesh_shape", [(2,), (3,), (2, 2)])
@pytest.mark.parametrize("op", list(OVERLAPS))
def test_overlapping_operands_like_torch(op, mesh_shape, meshes):
    mesh = meshes[mesh_shape]
    base = torch.randn(5, 5, generator=torch.Generator().manual_seed(4))
    try:
        ref = base.clone()
        OVERLAPS[op](ref)
        err = None
    except RuntimeError as e:
        err = e
    for sbp in layouts(2, mesh):
        x = make_global(base, mesh, sbp, seed=2)
        if err is not None:
            with pytest.raises(RuntimeError, match="single memory location"):
                OVERLAPS[op](x)
            continue
        OVERLAPS[op](x)
        assert_same_value(x, ref, f"{op} with x {shoal.sbp.sbp_str(sbp)}")


@pytest.mark.parametrize("sx", [B, S(0), S(1)], ids=str)
@pytest.mark.parametrize("where", ["view", "base"])
def test_version_counter_sees_writes_through_views(where, sx):
    """A backward that needs a value a later write changed raises torch's error, whether the write
    went through a view or the base (the view crossing the split or not)."""
    mesh = Mesh([0, 1], axes=("a",))
    leaf = shoal.to_global(torch.randn(5, 4), mesh, sx, requires_grad=True)
    x = leaf * 1.0
    y = x.sin()  # saves x
    v = x[1:, 1:]
    if where == "view":
        v.mul_(2)
    else:
        x.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("sx", [B, S(0), S(1)], ids=str)
def test_gradients_through_writes_into_views(sx):
    """Autograd's own bookkeeping for in-place ops on views (CopySlices) gives torch's gradients."""
    mesh = Mesh([0, 1], axes=("a",))
    a0, b0 = torch.randn(5, 4), torch.randn(3, 2)

    def f(a, b):
        x = a * 2
        x[1:4, 2:].mul_(b)
        x[:, 0] = b.sum()
        return (x.exp() * torch.arange(20.0).reshape(5, 4)).sum()

    ra, rb = a0.clone().requires_grad_(), b0.clone().requires_grad_()
    f(ra, rb).backward()
    ga = shoal.to_global(a0, mesh, sx, requires_grad=True)
    gb = shoal.to_global(b0, mesh, B, requires_grad=True)
    loss = f(ga, gb)
    loss.backward()
    assert_same_value(loss, f(a0, b0), "loss")
    assert_same_value(ga.grad, ra.grad, "grad a")
    assert_same_value(gb.grad, rb.grad, "grad b")


def test_inplace_view_op_keeps_other_views(meshes):
    """x.t_() turns x into a view of its old memory: views made before still alias it."""
    mesh = meshes[(2,)]
    base = torch.randn(5, 4)
    for sbp in layouts(2, mesh):
        ref = base.clone()
        rv = ref[1:]
        ref.t_()
        ref[0].fill_(7.0)
        rv[:, 2].mul_(3)
        x = make_global(base, mesh, sbp)
        v = x[1:]
        x.t_()
        x[0].fill_(7.0)
        v[:, 2].mul_(3)
        assert_same_value(x, ref, f"x after t_ with {sbp}")
        assert_same_value(v, rv, f"view made before t_ with {sbp}")


# -- compiled: the same writes inside a traced step ---------------------------------------------------


def _compiled_cases():
    rng = random.Random(5)
    cases = []
    for chain in CHAINS:
        for write in rng.sample(list(WRITES), 2):
            cases.append((chain, write, rng.choice([(2,), (3,), (2, 2)])))
    return cases


@pytest.mark.parametrize(("chain", "write", "mesh_shape"), _compiled_cases())
def test_writes_through_views_compiled(chain, write, mesh_shape, meshes):
    mesh = meshes[mesh_shape]
    rng = random.Random(hash((chain, write)) % 1000)
    sbp = rng.choice(layouts(2, mesh))
    y0 = _operand(tuple(CHAINS[chain](X2.clone()).shape), 1)

    def step(x, y):
        v = CHAINS[chain](x)
        WRITES[write](v, y)
        return x * 1.0, v * 1.0

    ref = step(X2.clone(), y0)
    for _ in range(2):  # the first call traces; the second runs the plan again
        x = make_global(X2, mesh, sbp)
        got = shoal.compile(step)(x, shoal.to_global(y0, mesh, [B] * mesh.ndim))
        assert_same_value(got, ref, f"compiled {chain} then {write} with {sbp}")
        assert_same_value(x, ref[0], f"compiled {chain} then {write} with {sbp}: the argument written")


def test_views_of_state_after_compiled_steps(meshes):
    """A compiled step writes a parameter's new shards back; a write through a view of it made
    afterwards, across its split, still reaches it, and views made before see the update."""
    mesh = meshes[(2,)]
    ref = torch.nn.Linear(4, 5)
    m = torch.nn.Linear(4, 5)
    m.load_state_dict(ref.state_dict())
    m.weight = torch.nn.Parameter(shoal.to_global(m.weight.detach(), mesh, S(0)))
    m.bias = torch.nn.Parameter(shoal.to_global(m.bias.detach(), mesh, B))
    before = m.weight.detach()[:, 1:]
    rbefore = ref.weight.detach()[:, 1:]
    x = torch.randn(3, 4)

    def step(model, opt, inp):
        loss = model(inp).square().sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    ropt, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(m.parameters(), lr=0.1)
    compiled = shoal.compile(step)
    for _ in range(2):
        step(ref, ropt, x)
        compiled(m, opt, shoal.to_global(x, mesh, B))
    assert_same_value(m.weight, ref.weight.detach(), "weight after compiled steps")
    assert_same_value(before, rbefore, "a view made before the steps")
    with torch.no_grad():
        ref.weight[1:, 2] = -3.0
        m.weight[1:, 2] = -3.0
    assert_same_value(m.weight, ref.weight.detach(), "weight written through a view across its split")
