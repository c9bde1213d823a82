"""Pipeline-parallel training (``Plan(stages=...)``, ``shoal.compile(micro_batches=M, schedule=...)``).

The oracle is plain torch on one device: the same model and AdamW trained for 3 steps on the whole
batch. A pipelined step cuts the batch into micro-batches, runs forward and backward per micro-batch
in its schedule's order per stage, and steps the optimizer once: it must equal that step.
"""

import collections
import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import shoal
from shoal.runtime import bubble
from shoal.runtime.schedules import peak_in_flight
from shoal.runtime.schedules import schedule as orders_of
from shoal.testing import assert_same_value
from test_precision import with_masters

B, S = shoal.B, shoal.S


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, h):
        return self.norm(h + torch.tanh(self.fc(h)))


class Net(nn.Module):
    """An embedding-free stack: stem, blocks, head, and the loss computed outside any submodule
    (its target comes from the whole mesh)."""

    def __init__(self, blocks: int = 4, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, 4)

    def forward(self, x, y):
        h = self.stem(x)
        for b in self.blocks:
            h = b(h)
        return nn.functional.mse_loss(self.head(h), y)


def step_fn(model, opt, x, y):
    """The step as users write it: zero, forward, backward, update."""
    opt.zero_grad()
    loss = model(x, y)
    loss.backward()
    opt.step()
    return loss


def even_stages(n_stages: int, blocks: int = 4) -> dict:
    per = blocks // n_stages
    out = {"stem": 0, "head": n_stages - 1}
    out.update({f"blocks.{i}": i // per for i in range(blocks)})
    return out


def train(mesh, stages, schedule: str, m: int, steps: int = 3, batch: int = 16, plan_params=None, blocks: int = 4,
          closure: bool = False, zero: int = 0):
    """(losses, final parameters) of shoal's pipelined step and of plain torch on one device."""
    torch.manual_seed(0)
    ref = Net(blocks)
    model = copy.deepcopy(ref)
    shoal.distribute_module(model, mesh, shoal.Plan(params=plan_params or {}, stages=stages, zero=zero))
    opt = train.last_optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)

    if closure:
        @shoal.compile(micro_batches=m, schedule=schedule)
        def step(x, y):
            opt.zero_grad()
            loss = model(x, y)
            loss.backward()
            opt.step()
            return loss
    else:
        step = shoal.compile(step_fn, micro_batches=m, schedule=schedule)

    batch_layout = tuple(S(0) if a == "dp" else B for a in mesh.axes)
    got, want = [], []
    for _ in range(steps):
        x, y = torch.randn(batch, 8), torch.randn(batch, 4)
        gx, gy = shoal.to_global(x, mesh, batch_layout), shoal.to_global(y, mesh, batch_layout)
        got.append(step(gx, gy) if closure else step(model, opt, gx, gy))
        ref_opt.zero_grad()
        loss = ref(x, y)
        loss.backward()
        ref_opt.step()
        want.append(loss.detach())
    return got, want, model, ref, step


def assert_trained_alike(got, want, model, ref):
    """Losses, parameters and the last step's gradients (AdamW alone would not notice gradients
    scaled by a constant) equal plain torch's."""
    for g, w in zip(got, want):
        assert_same_value(g, w, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_same_value(p.detach(), q.detach(), rtol=1e-5, atol=1e-5)
        assert_same_value(p.grad, q.grad, rtol=1e-4, atol=1e-6)


PP_DP = ([[0, 1], [2, 3]], ("pp", "dp"))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb", "interleaved"])
def test_each_schedule_on_pp2_dp2_equals_one_device(schedule):
    mesh = shoal.Mesh(*PP_DP)
    stages = even_stages(4 if schedule == "interleaved" else 2)
    got, want, model, ref, step = train(mesh, stages, schedule, m=4)
    assert_trained_alike(got, want, model, ref)
    assert step.traces == 2, "the body and the tail compile once each (the first tail runs eagerly)"


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_four_stages_equal_one_device(schedule):
    mesh = shoal.Mesh([0, 1, 2, 3], axes=("pp",))
    got, want, model, ref, step = train(mesh, even_stages(4), schedule, m=8, batch=16)
    assert_trained_alike(got, want, model, ref)


def test_fewer_micro_batches_than_stages_runs():
    mesh = shoal.Mesh([0, 1, 2, 3], axes=("pp",))
    got, want, model, ref, _ = train(mesh, even_stages(4), "1f1b", m=2, batch=8, steps=2)
    assert_trained_alike(got, want, model, ref)


def test_closure_style_step():
    mesh = shoal.Mesh(*PP_DP)
    got, want, model, ref, _ = train(mesh, even_stages(2), "1f1b", m=4, closure=True)
    assert_trained_alike(got, want, model, ref)


def test_auto_stages():
    mesh = shoal.Mesh(*PP_DP)
    got, want, model, ref, _ = train(mesh, "auto", "1f1b", m=2, steps=2)
    assert_trained_alike(got, want, model, ref)
    stages = model._shoal_stages
    assert {stages.of["stem"], stages.of["head"]} == {0, 1}


def test_parameters_live_on_their_stage():
    mesh = shoal.Mesh(*PP_DP)
    model = shoal.distribute_module(Net(), mesh, shoal.Plan(stages=even_stages(2)))
    assert model.stem.weight.mesh == mesh.submesh(pp=0)
    assert model.blocks[3].fc.weight.mesh == mesh.submesh(pp=1)
    assert model.head.weight.mesh == mesh.submesh(pp=1)


def test_loss_backward_is_the_last_stages():
    """A micro-batch's labels, sliced on the last stage's devices, belong to no stage: the loss's
    backward that reads them is the last stage's (it was tagged the first stage those devices hold,
    so they ran the last stage's backward in that stage's turn; across processes, a hang)."""
    mesh = shoal.Mesh([[0, 1], [2, 3]], axes=("pp", "tp"))
    params = {"blocks.*.fc.weight": (S(0),), "blocks.*.fc.bias": (S(0),)}
    got, want, model, ref, step = train(mesh, even_stages(4), "interleaved", m=4, plan_params=params, steps=1)
    assert_trained_alike(got, want, model, ref)
    ops = [op for op in step.plan.graph.ops if op.phase == "B" and "mse_loss_backward" in str(op.fn)]
    assert ops and {op.stage for op in ops} == {3}


# -- the order each stage follows -----------------------------------------------------------------


def fired(step, device: int):
    return [f for f in sorted(step.timeline, key=lambda f: f.start) if f.thread == f"dev{device}"
            and f.phase in ("F", "B", "W")]


def test_gpipe_runs_every_forward_before_a_backward():
    mesh = shoal.Mesh([0, 1, 2, 3], axes=("pp",))
    *_, step = train(mesh, even_stages(4), "gpipe", m=4, steps=1)
    for d in range(4):
        phases = [f.phase for f in fired(step, d)]
        assert phases == sorted(phases, key=lambda ph: ph != "F"), (d, phases)
        assert phases.count("F") == 4


def test_1f1b_holds_at_most_p_minus_s_micro_batches():
    mesh = shoal.Mesh([0, 1, 2, 3], axes=("pp",))
    *_, step = train(mesh, even_stages(4), "1f1b", m=8, steps=1)
    for s in range(4):
        live, peak = set(), 0
        for f in fired(step, s):
            if f.phase == "F":
                live.add(f.piece)
            else:
                live.discard(f.piece)
            peak = max(peak, len(live))
        assert peak == 4 - s, (s, peak)
    assert step.plan.in_flight == {d: 4 - d for d in range(4)}


def test_zb_defers_weight_gradients_past_later_backwards():
    mesh = shoal.Mesh([0, 1, 2, 3], axes=("pp",))
    *_, step = train(mesh, even_stages(4), "zb", m=8, steps=1)
    late = 0
    for d in range(1, 4):
        seq = fired(step, d)
        assert {f.phase for f in seq} == {"F", "B", "W"}
        for i, f in enumerate(seq):
            if f.phase == "W":
                late += any(g.phase == "B" and g.piece > f.piece for g in seq[:i])
    assert late > 0


def test_memory_plan_follows_the_schedule():
    mesh = shoal.Mesh([0, 1, 2, 3], axes=("pp",))
    *_, gp = train(mesh, even_stages(4), "gpipe", m=8, steps=1)
    *_, ob = train(mesh, even_stages(4), "1f1b", m=8, steps=1)
    assert gp.plan.in_flight == {d: 8 for d in range(4)}
    assert ob.plan.in_flight == {d: 4 - d for d in range(4)}
    assert all(gp.plan.peak_bytes[d] > ob.plan.peak_bytes[d] for d in range(4))


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_inside_pipeline_stages(zero):
    """ZeRO over each stage's data-parallel axis: the same training, the optimizer state (and from
    ZeRO-3 the parameters at rest) split over dp on every stage's sub-mesh."""
    got, want, model, ref, step = train(shoal.Mesh(*PP_DP), even_stages(2), "1f1b", m=4, zero=zero)
    assert_trained_alike(got, want, model, ref)
    opt_states = [v for st in train.last_optimizer.state.values() for v in st.values() if v.ndim]
    assert opt_states and all(isinstance(v.sbp[0], shoal.Split) or v.shape[0] < 2 for v in opt_states)
    weights = [p for p in model.parameters() if p.ndim == 2]
    assert all(isinstance(p.sbp[0], shoal.Split) == (zero == 3) for p in weights)
    assert all(p.mesh.shape == (2,) for p in weights)  # a stage's sub-mesh: dp only
    comms = {part: collections.Counter(op.name() for op in entries[0][0].ops if op.kind == "comm")
             for (tag, *_), entries in step._cache.items() for part in [tag[0]]}
    if zero < 3:  # gradients reduced once, in the tail (reduce-scattered from ZeRO-2): none per micro-batch
        assert set(comms["body"]) == {"comm.transfer"}
        assert ("comm.reduce_scatter" in comms["tail"]) == (zero == 2) != ("comm.all_reduce" in comms["tail"])
    else:  # parameters gathered for each micro-batch, their gradients reduce-scattered by the gather's backward
        assert set(comms["body"]) == {"comm.transfer", "comm.all_gather", "comm.reduce_scatter"}


# -- the virtual clock ----------------------------------------------------------------------------


@pytest.mark.parametrize("precision,zero", [("bf16", 0), ("bf16", 3), ("fp16", 0)])
def test_mixed_precision_inside_pipeline_stages(precision, zero):
    """precision="bf16" or "fp16" on (pp=2, dp=2), 1F1B: equals the recipe by hand on one device (low-precision
    parameters and inputs, fp32 masters stepped by SGD from the bf16 gradients, copied back), within
    bf16's rounding: a tenth of how far training moves the parameters (SGD, unlike Adam, would show a
    gradient scaled wrong). fp16's loss scale, a power of two, changes no value that stays in range."""
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    torch.manual_seed(0)
    ref = Net(4)
    model = copy.deepcopy(ref)
    mesh = shoal.Mesh(*PP_DP)
    shoal.distribute_module(model, mesh, shoal.Plan(stages=even_stages(2), precision=precision, zero=zero))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_step = with_masters(ref, low, lambda ps: torch.optim.SGD(ps, lr=0.1))
    step = shoal.compile(step_fn, micro_batches=4, schedule="1f1b")
    for _ in range(3):
        x, y = torch.randn(16, 8), torch.randn(16, 4)
        got = step(model, opt, shoal.to_global(x, mesh, (B, S(0))), shoal.to_global(y, mesh, (B, S(0))))
        ref.zero_grad()
        want = ref(x.to(low), y.to(low))
        want.backward()
        ref_step()
        assert_same_value(got.detach(), want.detach(), rtol=1e-2, atol=0)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.dtype == low
        assert_same_value(p.detach(), q.detach(), rtol=1e-2, atol=1e-2)


def per_item(step, lengths: dict):
    """Durations for ``step.simulate``: each (phase, micro-batch, stage) of a device lasts
    ``lengths[phase]``, however many tasks it is; communication is free."""
    def duration(task):
        if task.kind != "compute":
            return 0.0
        same = [t for t in step.plan.tasks if t.kind == "compute" and t.device == task.device
                and t.phase == task.phase and t.stage == task.stage]
        return lengths[task.phase] / len(same)
    return duration


def idle_seconds(timeline) -> float:
    """The largest idle time of a compute thread over forward and backward work."""
    work = [f for f in timeline if f.phase in ("F", "B", "W")]
    span = max(f.end for f in work) - min(f.start for f in work)
    return span * max(bubble(timeline).values())


@pytest.mark.parametrize("schedule,m", [("gpipe", 4), ("1f1b", 8), ("interleaved", 8)])
def test_virtual_clock_bubble_matches_theory(schedule, m):
    p = 2 if schedule == "interleaved" else 4
    v = 2 if schedule == "interleaved" else 1
    mesh = shoal.Mesh(list(range(p)), axes=("pp",))
    got, want, model, ref, step = train(mesh, even_stages(p * v), schedule, m=m, steps=1)
    assert_trained_alike(got, want, model, ref)

    timeline = step.simulate(per_item(step, {"F": 1.0, "B": 1.0}))
    want = (p - 1) / (v * m + p - 1)
    for th, idle in bubble(timeline).items():
        assert idle == pytest.approx(want, abs=0.01), (th, idle, want)
    assert max(peak_in_flight(o) for o in orders_of(schedule, p, m, v)) == max(step.plan.in_flight.values())


def test_zero_bubble_idles_a_third_of_1f1b_on_the_virtual_clock():
    """Qi et al.'s claim on a real plan: with F = B = W = 1 (1F1B's unsplit backward lasts B + W = 2),
    ZB-H1's bubble time is (p-1)(F+B-W) against 1F1B's (p-1)(F+B+W): a third, at 1F1B's peak memory
    (later stages hold more micro-batches than under 1F1B, up to the first stage's p).
    The first stage computes no input gradient (its input needs none): its W is its whole backward
    and lasts B + W, so that every stage does the same work in both plans."""
    mesh = shoal.Mesh([0, 1, 2, 3], axes=("pp",))
    *_, zb = train(mesh, even_stages(4), "zb", m=8, steps=1)
    *_, ob = train(mesh, even_stages(4), "1f1b", m=8, steps=1)
    assert not any(t.phase == "B" for t in zb.plan.tasks if t.device == 0)
    zb_len = per_item(zb, {"F": 1.0, "B": 1.0, "W": 1.0})
    zb_idle = idle_seconds(zb.simulate(lambda t: zb_len(t) * (2 if t.device == 0 and t.phase == "W" else 1)))
    ob_idle = idle_seconds(ob.simulate(per_item(ob, {"F": 1.0, "B": 2.0})))
    assert zb_idle / ob_idle <= 0.36, (zb_idle, ob_idle)
    assert max(zb.plan.in_flight.values()) == max(ob.plan.in_flight.values())  # the peak of 1F1B


# -- errors ---------------------------------------------------------------------------------------


def test_micro_batches_must_cut_every_shard_evenly():
    mesh = shoal.Mesh(*PP_DP)
    with pytest.raises(ValueError, match="micro_batches=3"):
        train(mesh, even_stages(2), "1f1b", m=3, steps=1)


def test_stage_count_must_fill_the_axis():
    mesh = shoal.Mesh(*PP_DP)
    with pytest.raises(ValueError, match="multiple of 2"):
        shoal.distribute_module(Net(), mesh, shoal.Plan(stages={"stem": 0, "blocks.*": 1, "head": 2}))


def test_interleaved_needs_virtual_stages():
    mesh = shoal.Mesh(*PP_DP)
    with pytest.raises(ValueError, match="virtual stages"):
        train(mesh, even_stages(2), "interleaved", m=4, steps=1)


@pytest.fixture
def eight_devices():
    shoal.init(devices=8)
    yield
    shoal.init(devices=4)


def test_3d_pipeline_data_tensor_parallel_with_zero_1(eight_devices):
    """1F1B on (pp=2, dp=2, tp=2): the blocks' linear layers split over tp (column-parallel), the
    batch over dp, the optimizer state over dp (ZeRO-1)."""
    mesh = shoal.Mesh([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], axes=("pp", "dp", "tp"))
    col = {"blocks.*.fc.weight": (B, S(0)), "blocks.*.fc.bias": (B, S(0))}
    torch.manual_seed(0)
    ref = Net(4)
    model = shoal.distribute_module(copy.deepcopy(ref), mesh, shoal.Plan(params=col, stages=even_stages(2)))
    assert model.blocks[0].fc.weight.sbp == (B, S(0)) and model.blocks[3].fc.weight.mesh.axes == ("dp", "tp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for sub in {p.mesh for p in model.parameters()}:
        shoal.shard_optimizer_state(opt, sub, "dp")

    step = shoal.compile(step_fn, micro_batches=2, schedule="1f1b")
    got, want = [], []
    for _ in range(3):
        x, y = torch.randn(16, 8), torch.randn(16, 4)
        lay = (B, S(0), B)
        got.append(step(model, opt, shoal.to_global(x, mesh, lay), shoal.to_global(y, mesh, lay)))
        ref_opt.zero_grad()
        loss = ref(x, y)
        loss.backward()
        ref_opt.step()
        want.append(loss.detach())
    assert_trained_alike(got, want, model, ref)
    sharded = [v for st in opt.state.values() for v in st.values() if isinstance(v, shoal.GlobalTensor) and v.ndim]
    assert sharded and all(S(0) in v.sbp or S(1) in v.sbp for v in sharded)


def test_clipping_and_zero_grad_after_step_run_once_over_every_stage():
    """SGD (which, unlike Adam, sees the gradients' scale), clipping by the norm over both stages,
    zero_grad at the end: each once per call, on the accumulated gradients."""
    mesh = shoal.Mesh(*PP_DP)
    torch.manual_seed(0)
    ref = Net(4)
    model = shoal.distribute_module(copy.deepcopy(ref), mesh, shoal.Plan(stages=even_stages(2)))
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)

    def body(model, opt, x, y):
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
        return loss

    step = shoal.compile(body, micro_batches=4, schedule="gpipe")
    for _ in range(3):
        x, y = torch.randn(16, 8), torch.randn(16, 4)
        lay = (B, S(0))
        got = step(model, opt, shoal.to_global(x, mesh, lay), shoal.to_global(y, mesh, lay))
        assert_same_value(got, body(ref, ref_opt, x, y), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_same_value(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
        assert p.grad is None and q.grad is None


def accumulated_step(model, opt, x, y, m: int):
    """Plain torch's gradient accumulation on one device: forward and backward of each of ``m``
    micro-batches (contiguous rows) in turn, the loss scaled by 1/m, then one update."""
    b = x.shape[0] // m
    losses = []
    for k in range(m):
        _, loss = model(x[k * b:(k + 1) * b], y[k * b:(k + 1) * b])
        (loss / m).backward()
        losses.append(loss.detach())
    opt.step()
    opt.zero_grad(set_to_none=True)
    return torch.stack(losses).mean()


def train_accumulating(text: str, micro_batches: int, micro_batch: int = 1, dropout: float = 0.3, steps: int = 4,
                       seed: int = 1, optimizer=torch.optim.AdamW):
    """Train the bundled GPT ``steps`` steps under ``auto.Parallel.parse(text)`` with ``micro_batches``
    micro-batches of ``micro_batch`` rows per data-parallel rank, beside plain torch accumulating
    gradients over the same micro-batches on one device, both seeded alike before each step: the
    losses, and the generator after each step, must agree; then the weights. (Adam normalizes each
    update, so a gradient that is all but zero turns its rounding into an lr-sized step: SGD for
    drawn cases, where a row of a 1-row micro-batch may drop most of a weight's inputs.)"""
    from shoal import auto
    from shoal.models.gpt import GPT, GPTConfig
    from shoal.train import gather, train_step

    cfg = auto.Parallel.parse(f"{text},mb={micro_batch},precision=fp32")
    degrees = {"pp": cfg.pp or 1, "dp": cfg.dp or 1, "tp": cfg.tp or 1}
    shape, axes = zip(*[(n, a) for a, n in degrees.items() if n > 1])
    mesh = shoal.Mesh(torch.arange(4).reshape(shape).tolist(), axes=axes)
    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=4, n_head=2, n_embd=16, dropout=dropout))
    batch = degrees["dp"] * micro_batch * micro_batches
    plan, options = cfg.to_plan(mesh, batch=batch, model=base)
    assert options["micro_batches"] == micro_batches
    ref = copy.deepcopy(base)
    ref_opt = optimizer(ref.parameters(), lr=1e-2)
    model = shoal.distribute_module(copy.deepcopy(base), mesh, plan)
    opt = optimizer(model.parameters(), lr=1e-2)
    step = shoal.compile(train_step, **options)
    gen = torch.Generator().manual_seed(seed)
    for i in range(steps):
        x, y = torch.randint(0, 16, (batch, 8), generator=gen), torch.randint(0, 16, (batch, 8), generator=gen)
        torch.manual_seed(seed + i)
        want = accumulated_step(ref, ref_opt, x, y, micro_batches)
        after = torch.get_rng_state()
        torch.manual_seed(seed + i)
        got = step(model, opt, x, y)
        assert_same_value(got, want, rtol=1e-5, atol=1e-6)
        assert torch.equal(torch.get_rng_state(), after), f"step {i}: the generator is not where one device leaves it"
    got = gather(model).state_dict()
    for name, p in ref.state_dict().items():
        torch.testing.assert_close(got[name], p, rtol=1e-5, atol=1e-5, msg=name)
    return step


@pytest.mark.parametrize("text", [
    "pp=2,dp=2,schedule=1f1b", "pp=2,dp=2,schedule=gpipe", "pp=4,schedule=zb",
    "pp=2,dp=2,schedule=interleaved,v=2", "pp=2,tp=2,sp=true,schedule=1f1b", "pp=2,dp=2,recompute=full"])
def test_dropout_in_a_pipeline_draws_what_one_device_accumulating_draws(text):
    """With dropout, a pipelined step equals plain torch on one device running the micro-batches one
    after another (gradient accumulation), mask for mask, whatever the schedule runs first: each
    micro-batch's draws are replayed in that order before the run (``Runtime._replay_draws``). Four
    steps with an 8-row batch in micro-batches of 1 (4 on pp=2 x dp=2, 8 on pp=4); losses, weights,
    and the generator's state after each step."""
    step = train_accumulating(text, 8 // (2 if "dp=2" in text else 1))
    assert step.traces == 2


@settings(max_examples=6, derandomize=True, database=None, deadline=None, print_blob=False)
@given(text=st.sampled_from(["pp=2,dp=2,schedule=1f1b", "pp=2,dp=2,schedule=gpipe", "pp=4,schedule=1f1b",
                             "pp=2,dp=2,schedule=zb", "pp=2,dp=2,schedule=interleaved,v=2",
                             "pp=2,tp=2,sp=true,schedule=interleaved,v=2", "pp=2,dp=2,recompute=selective",
                             "pp=2,tp=2,recompute=full"]),
       micro_batches=st.sampled_from([2, 4, 6]), micro_batch=st.integers(1, 2),
       dropout=st.sampled_from([0.1, 0.5]), seed=st.integers(0, 2**16))
def test_drawn_pipelines_with_dropout_equal_one_device_accumulating(text, micro_batches, micro_batch, dropout, seed):
    """Drawn plans, micro-batch counts and sizes, dropout rates and seeds: two steps each against
    plain torch's gradient accumulation (``train_accumulating``)."""
    train_accumulating(text, micro_batches, micro_batch, dropout, steps=2, seed=seed, optimizer=torch.optim.SGD)
