"""Graph mode: a compiled step gives what the eager step gives, and the compiler's parts do their job.

Parity: each bundled model, from the same initial weights, takes 5 AdamW steps eagerly and 5
compiled under every plan (one device, DP, TP, DP x TP, ZeRO): losses and final parameters and
buffers agree to 1e-5 relative. The compiled optimizer runs torch's capturable path (step counts
and bias corrections as tensors) where eager runs the float path: the same arithmetic, rounded
differently, hence a small absolute floor as in test_models.
"""

import copy
import dataclasses
import json
import re
import time
import types
from collections import Counter

import pytest
import torch

import shoal
from shoal.graph.passes import PASSES
from shoal.graph.trace import TraceError
from shoal.graph.verify import VerifyError, verify
from shoal.models import bert, gpt, resnet
from shoal.testing import assert_same_value
from shoal.train import train_step as step
from test_models import MODELS, batches, initial, mesh_for

STEPS = 5
KINDS = ("one", "dp", "tp", "dp,tp", "zero")


def build(name: str, kind: str):
    module, _ = MODELS[name]
    mesh = shoal.Mesh([0]) if kind == "one" else mesh_for(kind)
    plan = None if kind == "one" else module.plans(mesh, kind)
    model = shoal.distribute_module(initial(name), mesh, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if kind == "zero":
        shoal.shard_optimizer_state(opt, mesh, "dp")
    return model, opt


def train(name, kind, fn):
    model, opt = build(name, kind)
    losses = [fn(model, opt, x, y).item() for x, y in batches(name)[:STEPS]]
    return model, losses


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(MODELS))
def test_compiled_steps_match_eager(name, kind):
    eager, eager_losses = train(name, kind, step)
    compiled = shoal.compile(step)
    model, losses = train(name, kind, compiled)
    # the first step creates the optimizer state, eagerly; the step is traced once, with the state in place
    assert compiled.traces == 1
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=1e-5, atol=1e-6)
    want = eager.state_dict()
    got = model.state_dict()
    assert got.keys() == want.keys()
    for k, v in got.items():
        assert isinstance(v, shoal.GlobalTensor) and v.sbp == want[k].sbp, k
        assert_same_value(v.detach(), want[k].detach().full(), f"{name} {kind}: {k}", rtol=1e-5, atol=5e-6)


def test_no_collective_hands_one_tensor_to_devices_that_write_it():
    """Gradients kept between steps (zero_grad(set_to_none=False)) are zeroed in place after the
    collective that made them: each device must own its copy, else zeroing one device's gradient
    races another device still reading its own for the update. (The GPT's dp,tp plan without its
    output layouts: dispatch then boxes weight gradients into their parameters' layouts by
    all-to-alls, whose results are those gradients.)"""

    def build_greedy():
        mesh = mesh_for("dp,tp")
        plan = dataclasses.replace(gpt.plans(mesh, "dp,tp"), outputs={})
        return shoal.distribute_module(initial("gpt"), mesh, plan)

    model = build_greedy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def keep_grads(model, opt, x, y):
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss

    compiled = shoal.compile(keep_grads)
    x, y = batches("gpt")[0]
    compiled(model, opt, x, y)  # the optimizer's first step, eagerly
    compiled(model, opt, x, y)
    g = compiled.graph

    def root(x):
        while g.locals[x].base != x:
            x = g.locals[x].base
        return x

    written = {root(x) for op in g.ops for x in op.writes}
    shared = [op for op in g.ops if op.kind == "comm" and op.share_out]
    assert any(op.kind == "comm" and not op.share_out for op in g.ops)
    for op in shared:
        assert not {root(x) for x in (*op.out_ids, *op.reads)} & written, op.name()
    # and the steps match eager
    eager = build_greedy()
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    keep_grads(eager, eager_opt, *batches("gpt")[0])
    keep_grads(eager, eager_opt, *batches("gpt")[0])
    for x, y in batches("gpt")[1:3]:
        assert_same_value(compiled(model, opt, x, y), keep_grads(eager, eager_opt, x, y), rtol=1e-5, atol=1e-6)
    for (k, p), q in zip(eager.named_parameters(), model.parameters()):
        assert_same_value(q, p, k, rtol=1e-5, atol=1e-6)


def test_listing_shows_values_ops_and_boxing():
    model, opt = build("gpt", "dp")
    compiled = shoal.compile(step)
    x, y = batches("gpt")[0]
    for _ in range(2):  # the first call steps the optimizer eagerly (it creates the state); the second traces
        compiled(model, opt, x, y)
    text = str(compiled.graph)
    assert "input args[2]: host int64[6, 8]" in text  # token ids as given, laid out by the model's input hook
    assert "state blocks.0.attn.q.weight: %" in text and "float32[32, 32] [B]" in text
    assert "addmm.default(" in text and "box " in text
    assert "comm.all_reduce over devices [0, 1, 2, 3]" in text  # the gradient buckets
    assert "state opt[tok_emb.weight].exp_avg: %" in text  # optimizer state named by its parameter
    assert "planned peak bytes per device" in text


def test_data_dependent_python_is_an_error_naming_the_line():
    model, opt = build("gpt", "one")

    def branchy(model, x, y):
        _, loss = model(x, y)
        if loss.item() > 100:  # reads a value into Python
            loss = loss * 0
        return loss

    x, y = batches("gpt")[0]
    with pytest.raises(TraceError, match=r"test_graph.py:\d+: +if loss.item\(\) > 100"):
        shoal.compile(branchy)(model, x, y)
    # nothing is left half-traced: the model still runs eagerly with real values
    assert torch.isfinite(step(model, opt, x, y).full())

    def logs(model, x, y):
        _, loss = model(x, y)
        print(f"{loss:.2f}", loss.tolist(), loss.numpy())  # each reads a value into Python
        return loss

    with pytest.raises(TraceError, match=r"test_graph.py:\d+: +print\(f\"\{loss:.2f\}\""):
        shoal.compile(logs)(model, x, y)
    for read in ("tolist", "numpy"):  # the f-string reads through .item(); these gather the whole value
        with pytest.raises(TraceError, match=rf"GlobalTensor.{read}\(\)"):
            shoal.compile(lambda m, a, b, r=read: getattr(m(a, b)[1], r)())(model, x, y)


def test_an_error_while_tracing_keeps_its_type_and_names_the_line():
    mesh = shoal.Mesh([0, 1])
    lin = shoal.distribute_module(torch.nn.Linear(4, 3), mesh)

    def step(model, x):
        return (model(x) @ torch.ones(2, 2)).sum()  # 3 features against 2 rows

    with pytest.raises(RuntimeError) as err:
        shoal.compile(step)(lin, shoal.to_global(torch.randn(2, 4), mesh, shoal.S(0)))
    note = "\n".join(err.value.__notes__)
    assert "while tracing" in note and "@ torch.ones(2, 2)" in note, note


def test_an_error_in_shoals_own_model_names_its_line():
    """``shoal train`` runs shoal's step on shoal's models: no frame of the user's is on the stack,
    so the error names the model's line."""
    model, opt = build("gpt", "tp")
    x, y = batches("gpt")[0]
    compiled = shoal.compile(step)
    compiled(model, opt, x, y)  # the optimizer's first step runs eagerly
    with pytest.raises(ValueError, match="batch_size") as err:
        compiled(model, opt, x, y[:, :-1])  # targets one position short
    note = "\n".join(err.value.__notes__)
    assert re.search(r"models/gpt.py:\d+: +return logits, F.cross_entropy", note), note


@pytest.mark.parametrize("sbp", [shoal.B, shoal.S(0), shoal.S(1)])
def test_inputs_strided_otherwise_than_contiguous_compile_as_eager(sbp):
    """Batches are often slices of wider windows (``w[:, :-1]``, as CharData makes them): plain
    tensors whose strides are not contiguous, laid out inside the step (as a plan's input hook
    does), GlobalTensors sliced so, or made from such pieces. The compiled step gives eager's
    values, for every layout."""
    mesh = shoal.Mesh([0, 1])
    spec = shoal.to_global(torch.zeros(6, 12), mesh, sbp).spec

    def f(x, w):
        if not isinstance(x, shoal.GlobalTensor):
            x = shoal.to_global(x, mesh, sbp)
        return (x.reshape(-1) * 2).view(-1, 3) @ w

    w = shoal.to_global(torch.randn(3, 2), mesh, shoal.B)
    compiled = shoal.compile(f)
    for _ in range(2):  # traced on the first, run on the second
        wide = torch.randn(6, 13)
        pieces = {d: wide[:, :-1][spec.local_region(p)] for p, d in enumerate(mesh.devices)}
        for x in (wide[:, :-1], wide[:, 1:], wide[:, :12].t(), shoal.to_global(wide, mesh, sbp)[:, :-1],
                  shoal.from_local(pieces, mesh, sbp)):
            assert_same_value(compiled(x, w), f(x, w).full())
    assert compiled.traces == 4  # w[:, 1:] is strided as w[:, :-1]: the same graph reads it at its offset


def test_arguments_whose_shards_are_strided_otherwise_retrace():
    """Two GlobalTensors of one layout and strides can hold shards strided differently (a split's
    shards sliced out of the whole, or made contiguous): inductor's kernels assume the strides they
    were compiled for, so such an argument is traced anew."""
    mesh = shoal.Mesh([0, 1])
    a = torch.arange(12.0).reshape(3, 4)
    sliced = shoal.to_global(a, mesh, shoal.S(1))
    own = shoal.from_local({0: a[:, :2].clone(), 1: a[:, 2:].clone()}, mesh, shoal.S(1))
    assert sliced.stride() == own.stride() and sliced._shards[0].stride() != own._shards[0].stride()
    f = shoal.compile(lambda x: x * 2 + 1, backend="inductor")
    for x in (sliced, own):
        assert_same_value(f(x), a * 2 + 1)
    assert f.traces == 2


def test_guards_retrace_on_new_shapes_layouts_and_meshes():
    mesh2, mesh4 = shoal.Mesh([0, 1]), shoal.Mesh([0, 1, 2, 3])
    f = shoal.compile(lambda a, b: (a @ b).relu().sum(0))
    a, b = torch.randn(6, 5), torch.randn(5, 3)
    ga, gb = shoal.to_global(a, mesh2, shoal.S(0)), shoal.to_global(b, mesh2, shoal.B)
    for _ in range(2):
        assert_same_value(f(ga, gb), (a @ b).relu().sum(0))
    assert f.traces == 1
    assert_same_value(f(shoal.to_global(a, mesh2, shoal.S(1)), gb), (a @ b).relu().sum(0))
    assert f.traces == 2
    a4, b4 = shoal.to_global(a, mesh4, shoal.S(0)), shoal.to_global(b, mesh4, shoal.B)
    assert_same_value(f(a4, b4), (a @ b).relu().sum(0))
    assert f.traces == 3
    a2 = torch.randn(7, 5)
    assert_same_value(f(shoal.to_global(a2, mesh2, shoal.S(0)), gb), (a2 @ b).relu().sum(0))
    assert f.traces == 4


def test_state_objects_are_guarded_by_identity():
    mesh = shoal.Mesh([0, 1])

    def sgd(model, x):
        loss = model(x).square().sum()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
                p.grad = None
        return loss

    def fresh():
        torch.manual_seed(0)
        return torch.nn.Linear(4, 3)

    x = torch.randn(6, 4)
    ref = fresh()
    sgd(ref, x)
    f = shoal.compile(sgd)
    gx = shoal.to_global(x, mesh, shoal.S(0))
    a, b = (shoal.distribute_module(fresh(), mesh) for _ in range(2))
    f(a, gx)
    before = a.weight.full().clone()
    f(b, gx)  # another model of the same layout: it trains b and leaves a as it was
    assert_same_value(b.weight, ref.weight)
    assert torch.equal(a.weight.full(), before)
    assert f.traces == 2
    # parameters replaced by new tensors: the step updates the new ones
    b.weight, b.bias = (torch.nn.Parameter(shoal.to_global(p.detach(), mesh, shoal.B)) for p in fresh().parameters())
    f(b, gx)
    assert_same_value(b.weight, ref.weight)
    assert f.traces == 3
    # written eagerly between steps, in place and by a new layout: the next step reads what is there
    with torch.no_grad():
        b.weight.mul_(0.5)
        ref.weight.mul_(0.5)
    b.bias.data = shoal.to_global(ref.bias.detach().clone(), mesh, shoal.S(0))
    sgd(ref, x)
    f(b, gx)
    assert_same_value(b.weight, ref.weight)
    assert_same_value(b.bias, ref.bias)


def test_a_plain_tensor_argument_written_in_place_is_written_once_per_call():
    """The trace runs host work for real: on a copy of a plain tensor argument, not on the caller's
    tensor, which the step itself then writes."""
    mesh = shoal.Mesh([0, 1])
    f = shoal.compile(lambda x, seen: (seen.add_(1), x * seen)[1])
    counts = torch.zeros(3, 2)
    seen = counts[:, 1]  # strided: the copy keeps the layout, views recorded against it stay valid
    for n, rows in enumerate((4, 4, 6), start=1):  # the third call retraces
        x = torch.randn(rows, 3)
        assert_same_value(f(shoal.to_global(x, mesh, shoal.S(0)), seen), x * n)
        assert counts.tolist() == [[0, n]] * 3
    assert f.traces == 2


CALLS = torch.zeros(())


def test_tensors_the_step_refers_to_are_written_once_per_call():
    """A plain tensor in a global or a module attribute (not a buffer) that the step writes in place:
    the trace's host work writes it for real, then gives it back its values."""

    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)
            self.calls = torch.zeros(())

        def forward(self, x):
            self.calls.add_(1)
            CALLS.add_(1)
            return self.lin(x)

    mesh = shoal.Mesh([0, 1])
    m = shoal.distribute_module(Counting(), mesh)
    f = shoal.compile(lambda m, x: m(x).sum())
    x = shoal.to_global(torch.randn(4, 3), mesh, shoal.S(0))
    CALLS.zero_()
    for n in (1, 2, 3):
        f(m, x)
        assert (m.calls.item(), CALLS.item()) == (n, n)


SCALE = 2.0


def test_numbers_read_from_globals_and_closures_retrace_when_they_change():
    global SCALE
    mesh = shoal.Mesh([0, 1])
    a = torch.randn(4, 3)
    ga = shoal.to_global(a, mesh, shoal.S(0))
    shift = 1

    f = shoal.compile(lambda t: t * SCALE + shift)
    assert_same_value(f(ga), a * 2 + 1)
    SCALE, shift = 3.0, 5
    assert_same_value(f(ga), a * 3 + 5)
    assert f.traces == 2
    assert_same_value(f(ga), a * 3 + 5)
    assert f.traces == 2
    SCALE = 2.0
    with pytest.warns(UserWarning, match="traced for the 9th time"):
        for k in range(8):
            shift = k
            assert_same_value(f(ga), a * 2 + k)


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)

    def forward(self, t):
        return self.lin(t) * SCALE


def test_numbers_read_by_a_modules_forward_retrace_when_they_change():
    global SCALE
    SCALE = 2.0
    torch.manual_seed(0)
    plain = _Scaled()
    mesh = shoal.Mesh([0, 1])
    model = shoal.distribute_module(copy.deepcopy(plain), mesh)
    a = torch.randn(4, 3)
    ga = shoal.to_global(a, mesh, shoal.S(0))
    f = shoal.compile(lambda m, t: m(t))
    with torch.no_grad():
        assert_same_value(f(model, ga), plain(a))
        SCALE = 3.0
        assert_same_value(f(model, ga), plain(a))
    assert f.traces == 2


def _smoothed(logits, y):  # a helper of the step's: its globals are guarded too
    return torch.nn.functional.cross_entropy(logits, y, label_smoothing=SCALE / 10)


def test_numbers_read_by_helpers_retrace_when_they_change():
    global SCALE
    mesh = shoal.Mesh([0, 1])
    torch.manual_seed(0)
    plain = torch.nn.Linear(4, 3)
    model = shoal.distribute_module(copy.deepcopy(plain), mesh)
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    gx, gy = shoal.to_global(x, mesh, shoal.S(0)), shoal.to_global(y, mesh, shoal.S(0))
    f = shoal.compile(lambda m, a, b: _smoothed(m(a), b))
    for scale, traces in ((0.0, 1), (2.0, 2), (2.0, 2), (0.0, 2)):  # a value seen before: its graph again
        SCALE = scale
        with torch.no_grad():
            assert_same_value(f(model, gx, gy), _smoothed(plain(x), y))
        assert f.traces == traces
    assert [names for _, names in f.graph.globals_read] == [("SCALE", "_smoothed", "torch")]


def test_every_pass_leaves_a_valid_graph_and_the_verifier_catches_a_broken_one():
    from shoal.graph.capture import capture

    model, opt = build("gpt", "tp")
    x, y = batches("gpt")[0]
    g = capture(step, (model, opt, x, y), {})
    verify(g)
    for name, p in PASSES:
        p(g)
        verify(g, name)
    # drop the op making something a later op reads
    i = next(i for i, op in enumerate(g.ops) if op.out_ids and op.kind == "call")
    del g.ops[i]
    with pytest.raises(VerifyError, match="before it is made"):
        verify(g)
    # a view recorded as the view of another view, not of the storage's owner
    views = [loc for loc in g.locals.values() if loc.base != loc.id]
    views[0].base = views[1].id
    with pytest.raises(VerifyError, match="must be the Local that allocated the storage"):
        verify(g)


def test_dead_code_and_common_subexpressions():
    mesh = shoal.Mesh([0, 1])

    def f(a, b):
        unused = (a * 3).exp()  # noqa: F841 - dead
        return (a + b) * (a + b)

    a, b = torch.randn(4, 3), torch.randn(4, 3)
    c = shoal.compile(f)
    out = c(shoal.to_global(a, mesh, shoal.S(0)), shoal.to_global(b, mesh, shoal.S(0)))
    assert_same_value(out, (a + b) * (a + b))
    names = [op.name() for op in c.graph.ops]
    assert "exp.default" not in names and "mul.Scalar" not in names
    assert names.count("add.Tensor") == 2  # once per device, not twice


def test_bucketing_fuses_small_gradient_all_reduces():
    """Without the eager bucket reducer, DP gradients are reduced one by one when the optimizer
    reads them; the bucketing pass makes that a few all-reduces."""
    mesh = mesh_for("dp")
    model = shoal.distribute_module(initial("gpt"), mesh, gpt.plans(mesh, "dp"), reduce_gradients=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = shoal.distribute_module(initial("gpt"), mesh, gpt.plans(mesh, "dp"))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    compiled = shoal.compile(step)
    for x, y in batches("gpt")[:2]:
        assert compiled(model, opt, x, y).item() == pytest.approx(step(ref, ref_opt, x, y).item(), rel=1e-6)
    n_params = len(list(model.parameters()))
    comms = [op for op in compiled.graph.ops if op.kind == "comm" and op.name() == "comm.all_reduce"]
    assert 1 <= len(comms) < n_params // 4, [op.name() for op in comms]
    assert any("bucket collectives" in n for n in compiled.graph.notes)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_same_value(p.detach(), q.detach().full(), rtol=1e-5, atol=1e-6)


def test_chrome_trace(tmp_path):
    """The trace of a DP step: every task once, each inside the step's span, on the thread lowering
    gave it (collectives on a comm thread), and one thread's firings one after another."""
    model, opt = build("gpt", "dp")
    compiled = shoal.compile(step)
    x, y = batches("gpt")[0]
    compiled(model, opt, x, y)
    t0 = time.perf_counter()
    compiled(model, opt, x, y)
    span = (time.perf_counter() - t0) * 1e6
    path = tmp_path / "step.json"
    compiled.trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    threads = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    assert {"dev0", "dev1", "dev2", "dev3", "comm0", "host"} <= set(threads.values())
    firings = [e for e in events if e["ph"] == "X"]
    tasks = compiled.plan.tasks
    assert Counter(e["args"]["task"] for e in firings) == Counter(t.name for t in tasks)
    where = {}
    for t in tasks:
        where.setdefault(t.name, set()).add(t.thread.name)
        assert t.thread.name == ("comm0" if t.kind == "comm" else "host" if t.kind == "host" else f"dev{t.device}")
    assert any(t.kind == "comm" for t in tasks)
    rows = {}
    for e in firings:
        assert threads[e["tid"]] in where[e["args"]["task"]], e
        assert e["ts"] >= 0 and e["ts"] + e["dur"] <= span, (e, span)
        rows.setdefault(e["tid"], []).append(e)
    for tid, row in rows.items():
        row.sort(key=lambda e: e["ts"])
        for a, b in zip(row, row[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (threads[tid], a, b)


def test_gradients_left_between_compiled_steps_accumulate_once():
    """A step without ``zero_grad`` leaves its all-reduced gradients, which the fused AdamW only
    reads: the devices' replicas may then be one tensor, and the next step adds to each device's
    gradient once."""

    def step_keeping_grads(model, opt, x, y):
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        return loss

    (a, oa), (b, ob) = build("gpt", "dp"), build("gpt", "dp")
    compiled = shoal.compile(step_keeping_grads)
    for x, y in batches("gpt")[:4]:
        want, got = step_keeping_grads(a, oa, x, y).item(), compiled(b, ob, x, y).item()
        assert got == pytest.approx(want, rel=1e-5)
    for (k, p), q in zip(a.named_parameters(), b.parameters()):
        assert_same_value(q.grad, p.grad.full(), k, rtol=1e-5, atol=1e-6)
        assert_same_value(q.detach(), p.detach().full(), k, rtol=1e-5, atol=1e-6)


def test_pieces_equal_calling_the_step_once_per_piece():
    """State carries from piece to piece as if the step ran M times (here: gradients accumulate)."""
    mesh = shoal.Mesh([0, 1])
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    a = shoal.distribute_module(net, mesh, shoal.data_parallel(mesh))
    torch.manual_seed(0)
    b = shoal.distribute_module(torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)),
                                mesh, shoal.data_parallel(mesh))
    for p in list(a.parameters()) + list(b.parameters()):
        p.grad = torch.zeros_like(p)

    def fwd_bwd(m, x):
        loss = m(x).square().mean()
        loss.backward()
        return loss

    x = torch.randn(8, 6)
    want = [fwd_bwd(b, x[2 * k:2 * k + 2]).item() for k in range(4)]
    got = shoal.compile(fwd_bwd, pieces=4)(a, x)
    assert [t.item() for t in got] == pytest.approx(want, rel=1e-6)
    for p, q in zip(a.parameters(), b.parameters()):
        assert_same_value(p.grad, q.grad.full(), rtol=1e-6, atol=1e-7)


def test_two_stage_pipeline_overlaps_micro_batches(tmp_path):
    """Two sub-meshes, 4 micro-batches, forward and backward (gradients accumulate): stage 0 works on
    micro-batch k+1 while stage 1 works on k, and the gradients are plain torch's."""
    s0, s1 = shoal.Mesh([0]), shoal.Mesh([1])

    def stage(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(256, 256), torch.nn.Tanh())])

    ref0, ref1 = stage(0), stage(1)
    m0 = shoal.distribute_module(stage(0), s0, reduce_gradients=False)
    m1 = shoal.distribute_module(stage(1), s1, reduce_gradients=False)
    for p in [*m0.parameters(), *m1.parameters()]:
        p.grad = torch.zeros_like(p)

    def pipe(m0, m1, x):
        h = m0(x).to_global(s1, shoal.B)  # the stage boundary
        loss = m1(h).square().mean()
        loss.backward()
        return loss

    x = torch.randn(4 * 128, 256)
    compiled = shoal.compile(pipe, pieces=4)
    outs = compiled(m0, m1, shoal.to_global(x, s0, shoal.B))
    for k, o in enumerate(outs):
        want = ref1(ref0(x[128 * k:128 * (k + 1)])).square().mean()
        want.backward()
        assert_same_value(o, want, rtol=1e-5, atol=1e-7)
    for p, q in zip([*m0.parameters(), *m1.parameters()], [*ref0.parameters(), *ref1.parameters()]):
        assert_same_value(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    for _ in range(2):
        compiled(m0, m1, shoal.to_global(x, s0, shoal.B))
    fired = compiled.timeline
    overlaps = [
        (a.task, b.task, b.piece)
        for a in fired if a.thread == "dev0"
        for b in fired if b.thread == "dev1" and a.piece == b.piece + 1 and a.start < b.end and b.start < a.end
    ]
    assert overlaps, f"no overlap in {sorted((f.thread, f.piece, f.start, f.end) for f in fired)}"
    compiled.trace(str(tmp_path / "pipe.json"))


def test_inductor_backend_matches():
    model, opt = build("gpt", "one")
    ref, ref_opt = build("gpt", "one")
    compiled = shoal.compile(step, backend="inductor")
    for x, y in batches("gpt")[:3]:
        assert compiled(model, opt, x, y).item() == pytest.approx(step(ref, ref_opt, x, y).item(), rel=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_same_value(p.detach(), q.detach().full(), rtol=1e-5, atol=5e-6)


_ = (bert, resnet)


def test_learning_rate_schedule_does_not_retrace():
    eager, eager_opt = build("gpt", "dp")
    model, opt = build("gpt", "dp")
    compiled = shoal.compile(step)
    for k, (x, y) in enumerate(batches("gpt")[:4]):
        for o in (eager_opt, opt):
            o.param_groups[0]["lr"] = 1e-3 * (k + 1)
        assert compiled(model, opt, x, y).item() == pytest.approx(step(eager, eager_opt, x, y).item(), rel=1e-5)
        assert isinstance(opt.param_groups[0]["lr"], float)
    assert compiled.traces == 1  # the first step runs eagerly (it creates the optimizer state)
    for p, q in zip(model.parameters(), eager.parameters()):
        assert_same_value(p.detach(), q.detach().full(), rtol=1e-5, atol=5e-6)


@pytest.mark.parametrize("plan, mesh", [("dp,tp", (2, 2)), ("tp", (4,))])
def test_shoal_train_compile_gives_the_eager_losses(plan, mesh):
    """The batches are slices of wider windows; under tp they are laid out Broadcast."""
    from shoal.train import TrainConfig, train

    cfg = TrainConfig(model="gpt", plan=plan, mesh=mesh, steps=4, batch=4, sample=0, save=False, progress=False,
                      verbose=False, model_args={"n_layer": 1, "n_embd": 32, "block_size": 16})
    eager = train(cfg)
    compiled = train(dataclasses.replace(cfg, compile=True))
    torch.testing.assert_close(torch.tensor(compiled.losses), torch.tensor(eager.losses), rtol=1e-5, atol=1e-6)


def test_shoal_train_compile_tp_command_runs(tmp_path, capsys):
    from shoal.cli import main

    small = ["--set", "n_layer=1", "--set", "n_embd=32", "--set", "block_size=16", "--batch", "4", "--sample", "0"]
    assert main(["train", "gpt", "--compile", "--plan", "tp", "--steps", "2", "--no-progress", "--out",
                 str(tmp_path), *small]) == 0
    assert "each step a compiled graph" in capsys.readouterr().out and (tmp_path / "losses.json").exists()


def dropout_gpt():
    """A small GPT with dropout, data parallel, and its AdamW."""
    torch.manual_seed(0)
    m = gpt.GPT(gpt.GPTConfig(vocab_size=13, block_size=8, n_layer=2, n_head=4, n_embd=32, dropout=0.2))
    mesh = mesh_for("dp")
    m = shoal.distribute_module(m, mesh, gpt.plans(mesh, "dp"))
    return m, torch.optim.AdamW(m.parameters(), lr=1e-3)


def test_dropout_draws_the_eager_masks():
    """Random draws are host work, re-run every step in program order; tracing draws nothing the
    step would then miss: with the same seed, the compiled steps equal the eager ones."""

    (a, oa), (b, ob) = dropout_gpt(), dropout_gpt()
    compiled = shoal.compile(step)
    for i, (x, y) in enumerate(batches("gpt")[:3]):
        torch.manual_seed(100 + i)
        want = step(a, oa, x, y).item()
        torch.manual_seed(100 + i)
        assert compiled(b, ob, x, y).item() == pytest.approx(want, rel=1e-5)
    assert any(torch.Tag.nondeterministic_seeded in getattr(op.fn, "tags", ()) for op in compiled.graph.ops)
    for p, q in zip(a.parameters(), b.parameters()):
        assert_same_value(q.detach(), p.detach().full(), rtol=1e-5, atol=5e-6)


def test_pieces_with_the_optimizer_inside_equal_sequential_steps():
    """Each micro-batch updates the parameters the next one reads: M pieces in flight give M eager
    steps. The first piece creates the optimizer state, eagerly; the rest run on the graph traced
    with the state in place."""
    (a, oa), (b, ob) = build("gpt", "dp"), build("gpt", "dp")
    compiled = shoal.compile(step, pieces=3)
    data = batches("gpt")[:3]
    x, y = torch.cat([d[0] for d in data]), torch.cat([d[1] for d in data])
    for _ in range(2):
        want = [step(a, oa, *d).item() for d in data]
        assert [t.item() for t in compiled(b, ob, x, y)] == pytest.approx(want, rel=1e-5)
    assert compiled.traces == 1
    for p, q in zip(a.parameters(), b.parameters()):
        assert_same_value(q.detach(), p.detach().full(), rtol=1e-5, atol=5e-6)


def test_pieces_draw_as_sequential_steps_do():
    """Pieces in flight draw their dropout masks as steps run one after another do (each piece's
    draws replayed in piece order before the run), and leave the generator where they leave it."""

    (a, oa), (b, ob) = dropout_gpt(), dropout_gpt()
    compiled = shoal.compile(step, pieces=3)
    data = batches("gpt")[:3]
    x, y = torch.cat([d[0] for d in data]), torch.cat([d[1] for d in data])
    for i in range(2):
        torch.manual_seed(7 + i)
        want = [step(a, oa, *d).item() for d in data]
        after = torch.get_rng_state()
        torch.manual_seed(7 + i)
        assert [t.item() for t in compiled(b, ob, x, y)] == pytest.approx(want, rel=1e-5)
        assert torch.equal(torch.get_rng_state(), after)
    for p, q in zip(a.parameters(), b.parameters()):
        assert_same_value(q.detach(), p.detach().full(), rtol=1e-5, atol=5e-6)


def test_views_of_views_fold():
    mesh = shoal.Mesh([0, 1])

    def f(a):
        return a.t().t() * 2 + a.view(2, 6).view(12).view(4, 3)

    a = torch.randn(4, 3)
    c = shoal.compile(f)
    assert_same_value(c(shoal.to_global(a, mesh, shoal.B)), a * 2 + a)
    names = [op.name() for op in c.graph.ops]
    assert "t.default" not in names and names.count("view.default") == 2  # one view of a, per device


def test_an_lstm_step_gives_the_eager_numbers():
    """torch's CPU LSTM layer (oneDNN) under data parallelism: its backward reruns the shard's
    forward for the workspace, in the graph as in eager."""

    class Tagger(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = torch.nn.LSTM(6, 8, num_layers=2, batch_first=True)
            self.head = torch.nn.Linear(8, 3)

        def forward(self, x, y):
            return torch.nn.functional.cross_entropy(self.head(self.lstm(x)[0]).sum(1), y)

    def lstm_step(model, opt, x, y):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    def build_tagger():
        torch.manual_seed(0)
        m = shoal.distribute_module(Tagger(), mesh_for("dp"), None)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2)

    (a, oa), (b, ob) = build_tagger(), build_tagger()
    compiled = shoal.compile(lstm_step)
    gen = torch.Generator().manual_seed(0)
    mesh = mesh_for("dp")
    for _ in range(3):
        x = shoal.to_global(torch.randn(5, 7, 6, generator=gen), mesh, shoal.S(0))
        y = shoal.to_global(torch.randint(0, 3, (5,), generator=gen), mesh, shoal.S(0))
        assert compiled(b, ob, x, y).item() == pytest.approx(lstm_step(a, oa, x, y).item(), rel=1e-5)
    assert any("mkldnn_rnn_layer_backward" in str(op.fn) for op in compiled.graph.ops)
    for p, q in zip(a.parameters(), b.parameters()):
        assert_same_value(q.detach(), p.detach().full(), rtol=1e-5, atol=5e-6)


# a step that reads its model and optimizer as globals of its module, as a script would
_GLOBAL_MODEL = _GLOBAL_OPT = None


def _global_step(x, y):
    return step(_GLOBAL_MODEL, _GLOBAL_OPT, x, y)


@pytest.mark.parametrize("style", ["closure", "global"])
def test_steps_that_close_over_their_model_compile(style):
    """``@shoal.compile def step(x, y): loss = model(x, y) ...``: the modules and optimizers the step
    names (closure variables, globals) are traced as if passed, and train as eager does."""
    global _GLOBAL_MODEL, _GLOBAL_OPT
    eager_model, eager_losses = train("gpt", "dp", step)
    model, opt = build("gpt", "dp")
    if style == "closure":
        @shoal.compile
        def compiled(x, y):
            return step(model, opt, x, y)
    else:
        _GLOBAL_MODEL, _GLOBAL_OPT = model, opt
        compiled = shoal.compile(_global_step)
    losses = [compiled(x, y).item() for x, y in batches("gpt")[:STEPS]]
    assert compiled.traces == 1
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=1e-5, atol=1e-6)
    for (k, w), (_, g) in zip(eager_model.state_dict().items(), model.state_dict().items()):
        assert_same_value(g, w.full(), k, rtol=1e-5, atol=1e-6)


def test_a_global_tensor_the_step_cannot_see_is_named():
    """A GlobalTensor reached only through a helper's globals is not found: the error says what to do."""
    model, opt = build("gpt", "dp")
    holder = types.SimpleNamespace(model=model)

    @shoal.compile
    def compiled(x, y):
        _, loss = holder.model(x, y)  # a namespace, not a module: its parameters are not found
        return loss

    x, y = batches("gpt")[0]
    with pytest.raises(TraceError, match="pass this one .or the module holding it. as an argument"):
        compiled(x, y)


def test_compile_is_a_decorator_with_or_without_options():
    mesh = shoal.Mesh([0, 1])

    @shoal.compile(registers=3, passes=False)
    def doubled(t):
        return t * 2

    @shoal.compile
    def tripled(t):
        return t * 3

    v = torch.randn(4, 3)
    x = shoal.to_global(v, mesh, shoal.S(0))
    assert_same_value(doubled(x), v * 2)
    assert_same_value(tripled(x), v * 3)
    assert (doubled.registers, doubled.passes, tripled.registers) == (3, False, 2)
