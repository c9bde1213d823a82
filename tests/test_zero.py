"""ZeRO as layouts (``Plan(zero=1|2|3)``): training equals one device's, eager and compiled, and each
device holds the bytes the ZeRO paper's formulas say (Rajbhandari et al. 2019, section 5)."""

import dataclasses

import pytest
import torch

import shoal
from shoal.models import gpt
from test_models import MODELS, batches, check_state, fit, initial, mesh_for, reference


def compiled_fit(model, opt, data) -> list[float]:
    @shoal.compile
    def step(model, opt, x, y):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return [step(model, opt, x, y).item() for x, y in data]


@pytest.mark.parametrize("kind", ["zero2", "zero3"])
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
