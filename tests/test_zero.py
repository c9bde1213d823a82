"""ZeRO as layouts (``Plan(zero=1|2|3)``): training equals one device's, eager and compiled, and each
device holds the bytes the ZeRO paper's formulas say (Rajbhandari et al. 2019, section 5)."""

import contextlib
import dataclasses

import pytest
import torch

import shoal
from shoal.models import gpt
from test_models import MODELS, batches, check_state, fit, initial, mesh_for, reference


def gpt_step(model, opt, x, y):
    _, loss = model(x, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


def compiled_fit(model, opt, data) -> list[float]:
    step = shoal.compile(gpt_step)
    return [step(model, opt, x, y).item() for x, y in data]


@pytest.mark.parametrize("kind", ["zero", "zero2", "zero3"])
@pytest.mark.parametrize("name", list(MODELS))
def test_compiled_zero_trains_like_one_device(name, kind):
    ref_losses, ref_state = reference(name, "adamw")
    mesh = mesh_for(kind)
    module, _ = MODELS[name]
    model = shoal.distribute_module(initial(name), mesh, module.plans(mesh, kind))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = compiled_fit(model, opt, batches(name))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    check_state(model, ref_state, f"{name} {kind} compiled")


@pytest.mark.parametrize("compiled", [False, True])
def test_zero3_with_tensor_parallel(compiled):
    """ZeRO-3 over dp of a Megatron tensor-parallel GPT on a 2x2 mesh: each parameter split over dp
    at rest (on a dim tp does not split), gathered to its tensor-parallel layout for its unit."""
    ref_losses, ref_state = reference("gpt", "adamw")
    mesh = mesh_for("dp,tp")
    plan = dataclasses.replace(gpt.plans(mesh, "dp,tp"), zero=3)
    model = shoal.distribute_module(initial("gpt"), mesh, plan)
    w = model.blocks[0].mlp.up.weight  # (B, S(0)) in the tp plan: at rest split over dp on dim 1
    assert w.sbp == (shoal.S(1), shoal.S(0)), w.sbp
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = (compiled_fit if compiled else fit)(model, opt, batches("gpt"))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    check_state(model, ref_state, f"zero3 x tp compiled={compiled}")


def test_layouts_of_each_stage():
    """Parameter, gradient and Adam state of one weight after a step, per ZeRO stage. (Without ZeRO
    a data-parallel gradient may come out split too, where dispatch finds reduce-scattering it
    cheaper; only from stage 2 on is it kept split.)"""
    mesh = mesh_for("dp")
    want = {0: (False, False), 1: (False, True), 2: (False, True), 3: (True, True)}  # (parameter, state) split

    def split(t):
        return isinstance(t.sbp[0], shoal.Split)

    for level in (0, 1, 2, 3):
        model = shoal.distribute_module(initial("gpt"), mesh, dataclasses.replace(gpt.plans(mesh, "dp"), zero=level))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        fit(model, opt, batches("gpt")[:1])
        for name, p in model.named_parameters():
            if p.ndim == 2:
                assert (split(p), split(opt.state[p]["exp_avg"])) == want[level], (level, name)
                if level >= 2:
                    assert split(p.grad), (level, name)


def per_parameter_bytes(level: int, n: int = 4) -> float:
    """Bytes per parameter per device under fp32 AdamW: 4 parameters + 4 gradients + 8 Adam state,
    the ZeRO paper's split (their 16 bytes are mixed precision's 2 + 2 + 12)."""
    p, g, s = 4.0, 4.0, 8.0
    return {0: p + g + s, 1: p + g + s / n, 2: p + (g + s) / n, 3: (p + g + s) / n}[level]


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_bytes_per_device_follow_the_formula(level):
    """A GPT whose every parameter has a dim divisible by 4: each device holds exactly its share."""
    torch.manual_seed(0)
    cfg = gpt.GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=4, n_embd=32)
    mesh = mesh_for("dp")
    model = shoal.distribute_module(gpt.GPT(cfg), mesh, dataclasses.replace(gpt.plans(mesh, "dp"), zero=level))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(16, (4, 8))
    _, loss = model(shoal.to_global(x, mesh, shoal.S(0)), shoal.to_global(x, mesh, shoal.S(0)))
    loss.backward()
    opt.step()
    psi = sum(p.numel() for p in model.parameters())
    report = shoal.memory_report(model, opt)
    for d, total in report.total().items():
        assert total == psi * per_parameter_bytes(level), (d, total / psi)
    assert "optimizer state" in str(report) and "device 3" in str(report)


def test_zero_errors():
    mesh = mesh_for("dp")
    with pytest.raises(ValueError, match=r"Plan\(zero=4\)"):
        shoal.distribute_module(initial("gpt"), mesh, shoal.Plan(zero=4))
    with pytest.raises(ValueError, match=r"dp_axis='data'.*axes"):
        shoal.distribute_module(initial("gpt"), mesh, shoal.Plan(zero=1, dp_axis="data"))


# -- the fit check ---------------------------------------------------------------------------------


@contextlib.contextmanager
def budget(nbytes):
    shoal.init(devices=4, memory_per_device=nbytes)
    try:
        yield
    finally:
        shoal.init(devices=4)


def deep_gpt():
    """A GPT of 8 blocks: each ZeRO-3 unit (a block) an eighth of the parameters."""
    torch.manual_seed(0)
    return gpt.GPT(gpt.GPTConfig(vocab_size=64, block_size=16, n_layer=8, n_head=4, n_embd=128))


def test_a_model_three_times_the_budget_trains_under_zero3_and_is_refused_without():
    """Parameters, gradients and AdamW state (16 bytes a parameter in fp32) are three times one
    device's budget: on 4 devices ZeRO-3 holds 3/4 of the budget at rest, and its planned peak (one
    block gathered at a time, its gradients, the activations) fits in the rest. Without ZeRO the
    plan is refused before anything runs, naming what would fit."""
    model, ref = deep_gpt(), deep_gpt()
    psi = sum(p.numel() for p in ref.parameters())
    mesh = mesh_for("dp")
    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(64, (4, 16), generator=g), torch.randint(64, (4, 16), generator=g)) for _ in range(3)]
    with budget(16 * psi // 3):
        with pytest.raises(MemoryError, match=r"(?s)over its budget.*Plan\(zero=3\): .*fits"):
            shoal.distribute_module(deep_gpt(), mesh, shoal.Plan(zero=0))
        with pytest.raises(MemoryError, match=r"Plan\(zero=3\)"):
            shoal.distribute_module(deep_gpt(), mesh, shoal.Plan(zero=2))
        shoal.distribute_module(model, mesh, shoal.Plan(zero=3))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = shoal.compile(gpt_step)
        losses = [step(model, opt, shoal.to_global(x, mesh, shoal.S(0)), shoal.to_global(y, mesh, shoal.S(0))).item()
                  for x, y in data]
        assert step.traces == 1 and max(step.plan.peak_bytes.values()) <= 16 * psi // 3
        assert max(shoal.memory_report(model, opt).total().values()) == 4 * psi  # 16 bytes / 4 devices
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    want = [gpt_step(ref, ref_opt, x, y).item() for x, y in data]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-5, atol=1e-6)


def test_a_compiled_step_over_the_budget_is_refused_before_it_runs():
    """States that fit (ZeRO-3 at rest: 4 bytes a parameter) but a planned peak that does not."""
    model = deep_gpt()
    psi = sum(p.numel() for p in model.parameters())
    mesh = mesh_for("dp")
    x = shoal.to_global(torch.randint(64, (4, 16)), mesh, shoal.S(0))
    with budget(4 * psi + 1024):
        shoal.distribute_module(model, mesh, shoal.Plan(zero=3))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = shoal.compile(gpt_step)
        step(model, opt, x, x)  # the first call, eager, makes the optimizer state
        before = [p.detach().full() for p in model.parameters()]
        with pytest.raises(MemoryError, match=r"(?s)planned peak on device \d.*over its budget.*states .*largest: "
                                              r"opt\[.*activations"):
            step(model, opt, x, x)
        assert all(torch.equal(p.detach().full(), b) for p, b in zip(model.parameters(), before))


def test_the_budget_is_checked_again_at_the_optimizer_s_first_step():
    """SGD without momentum keeps no state, Adam two tensors a parameter: a budget that holds the
    parameters and gradients (8 bytes each) passes distribute_module's Adam-like estimate only under
    ZeRO-1, and an SGD with momentum (1 tensor) fits where an AdamW with amsgrad (3) does not."""
    mesh = mesh_for("dp")
    model = deep_gpt()
    psi = sum(p.numel() for p in model.parameters())
    with budget(10 * psi):
        shoal.distribute_module(model, mesh, shoal.Plan(zero=1))  # 4 + 4 + 8/4 = 10 bytes a parameter
        x = shoal.to_global(torch.randint(64, (4, 16)), mesh, shoal.S(0))
        gpt_step(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), x, x)
        with pytest.raises(MemoryError, match="AdamW's first step"):
            gpt_step(model, torch.optim.AdamW(model.parameters(), amsgrad=True), x, x)


def test_budget_strings():
    from shoal.world import parse_bytes
    assert parse_bytes("512MiB") == 512 * 2**20 and parse_bytes("1.5 GB") == 1_500_000_000 and parse_bytes(7) == 7
    with pytest.raises(ValueError, match="memory_per_device"):
        parse_bytes("lots")


def test_zero1_gathers_each_updated_parameter_once():
    """ZeRO-1's AdamW updates a Broadcast parameter from split states: computed on the split and the
    result gathered (one all-gather per parameter), not each split state gathered to the parameter."""
    mesh = mesh_for("zero")
    model = shoal.distribute_module(initial("gpt"), mesh, gpt.plans(mesh, "zero"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = shoal.compile(gpt_step)
    x, y = batches("gpt")[0]
    for _ in range(2):
        step(model, opt, x, y)
    ops = step.graph.ops
    sources, made = [], {}  # Local id -> the name of the op that made or last wrote it
    for op in ops:
        if op.kind == "comm" and op.fn.name == "all_gather":
            sources.append(made.get(op.reads[0], "state"))
        made.update(dict.fromkeys(op.out_ids + op.writes, op.name()))
    by_optimizer = [name for name in sources if name.startswith("_foreach")]
    assert len(by_optimizer) == len(list(model.parameters())), sources


def test_zero3_gathers_run_one_segment_ahead_not_all_at_the_start():
    """A gather of state alone could start at once; each waits for the compute before its unit's
    previous one, so that not every layer's parameters are held gathered at the same time."""
    model = deep_gpt()
    mesh = mesh_for("dp")
    shoal.distribute_module(model, mesh, shoal.Plan(zero=3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = shoal.compile(gpt_step)
    x = shoal.to_global(torch.randint(64, (4, 16)), mesh, shoal.S(0))
    for _ in range(2):
        step(model, opt, x, x)
    static = step.plan.static
    gathers = [t for t in step.plan.tasks if t.kind == "comm" and t.name == "comm.all_gather"]
    assert len(gathers) > 20 and all(set(op.reads) <= static for t in gathers for op in t.ops)
    timeline = step.simulate(lambda t: 1.0 if t.kind == "compute" else 0.001)
    first_compute = min(f.end for f in timeline if f.thread.startswith("dev"))
    early = [f for f in timeline if f.task == "comm.all_gather" and f.start < first_compute]
    assert len(early) < len(gathers) / 4, (len(early), len(gathers))
