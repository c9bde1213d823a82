"""Mixed precision from the plan (``Plan(precision="bf16")``): bf16 parameters and compute, gradients
reduced in fp32, fp32 master weights and optimizer state. The oracle is the same recipe done by hand
in plain torch on one device: bf16 parameters (and images), fp32 copies updated by AdamW from the bf16
gradients, copied back after each step. bf16 rounds at 2^-8, so results agree within 1e-2."""

import dataclasses

import pytest
import torch

import shoal
from shoal import loss_scale
from shoal.parallel.precision import master_weights
from test_models import MODELS, batches, fit, initial, mesh_for
from test_recompute import CHECKPOINTED
from test_zero import compiled_fit

STEPS = 3
LR = 1e-3


def with_masters(model, dtype: torch.dtype, optimizer, step=lambda opt: opt.step()):
    """Mixed precision by hand on ``model`` (plain torch, one device): its parameters in ``dtype`` (batch
    norms' stay fp32); returns its step: fp32 masters given the low-precision gradients, ``step(opt)``
    on ``optimizer(masters)``, the masters copied back."""
    for m in model.modules():
        if not isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            for p in m.parameters(recurse=False):
                p.data = p.data.to(dtype)
    masters = [p.detach().float().requires_grad_() for p in model.parameters()]
    opt = optimizer(masters)

    def take_step():
        for p, m in zip(model.parameters(), masters):
            m.grad = p.grad.float()
        step(opt)
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters):
                p.copy_(m)

    return take_step


def recipe_by_hand(name: str, optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR)):
    """The bf16 recipe in plain torch on one device: the model, and its step (``with_masters``)."""
    model = initial(name)
    return model, with_masters(model, torch.bfloat16, optimizer)


def by_hand(name: str):
    """Losses and final bf16 parameters of the recipe by hand."""
    model, step = recipe_by_hand(name)
    losses = []
    for x, y in batches(name)[:STEPS]:
        _, loss = model(x.to(torch.bfloat16) if x.is_floating_point() else x, y)
        model.zero_grad(set_to_none=True)
        loss.backward()
        step()
        losses.append(loss.item())
    return losses, [p.detach() for p in model.parameters()]


def check_like_by_hand(name, model, losses):
    want_losses, want_params = by_hand(name)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-2, atol=0)
    for (n, p), q in zip(model.named_parameters(), want_params):
        assert p.dtype == q.dtype, n
        # a few bf16 roundings of the parameter, and Adam's steps of lr one way or the other where a tiny
        # gradient's sign differs
        torch.testing.assert_close(p.detach().full().float(), q.float(), rtol=1e-2, atol=2 * STEPS * LR + 1e-3, msg=n)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("zero", [0, 2, 3])
@pytest.mark.parametrize("name", list(MODELS))
def test_bf16_trains_like_the_recipe_by_hand(name, zero, compiled):
    mesh = mesh_for("dp")
    module, _ = MODELS[name]
    plan = dataclasses.replace(module.plans(mesh, "dp"), zero=zero, precision="bf16")
    model = shoal.distribute_module(initial(name), mesh, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = (compiled_fit if compiled else fit)(model, opt, batches(name)[:STEPS])
    check_like_by_hand(name, model, losses)
    states = [v for st in opt.state.values() for v in st.values() if isinstance(v, shoal.GlobalTensor) and v.ndim]
    assert states and all(v.dtype == torch.float32 for v in states)
    masters = master_weights(opt)  # one for each bf16 parameter; batch norms' fp32 ones are their own
    assert len(masters) == sum(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(m.dtype == torch.float32 for m in masters) and all(m in opt.state for m in masters)
    if zero:
        assert any(isinstance(s, shoal.Split) for v in states for s in v.sbp)
        assert any(isinstance(s, shoal.Split) for m in masters if m.ndim == 2 for s in m.sbp)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("zero", [2, 3])
@pytest.mark.parametrize("name", list(MODELS))
def test_bf16_zero_with_checkpointing(name, zero, compiled):
    """All three memory options at once: recomputing the blocks changes no value. (ResNet's recomputed
    batch norms see their fp32 parameters gathered, as the first forward did, and save fp32
    statistics for a bf16 input, as ATen does.)"""
    mesh = mesh_for("dp")
    module, _ = MODELS[name]
    plan = dataclasses.replace(module.plans(mesh, "dp"), zero=zero, precision="bf16", checkpoint=CHECKPOINTED[name])
    model = shoal.distribute_module(initial(name), mesh, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = (compiled_fit if compiled else fit)(model, opt, batches(name)[:STEPS])
    check_like_by_hand(name, model, losses)


def test_bf16_batch_norm_split_by_channel():
    """ResNet's tensor-parallel plan splits bn1 by channel: its backward kernel takes the statistics
    the forward saved, fp32 for a bf16 input with fp32 parameters."""
    mesh = mesh_for("tp")
    model = shoal.distribute_module(initial("resnet"), mesh,
                                    dataclasses.replace(MODELS["resnet"][0].plans(mesh, "tp"), precision="bf16"))
    losses = fit(model, torch.optim.AdamW(model.parameters(), lr=LR), batches("resnet")[:STEPS])
    check_like_by_hand("resnet", model, losses)


def test_bf16_is_really_used():
    """Not bit-equal to fp32 training (bf16 computes), yet within 1e-2 of it; after a step 14 bytes a
    parameter (2 + 4 master + 8 Adam: the step took the bf16 gradients), 14/4 with ZeRO-3 on 4 devices."""
    mesh = mesh_for("dp")
    runs = {}
    for precision, zero in ((None, 0), ("bf16", 0), ("bf16", 3)):
        model = shoal.distribute_module(initial("gpt"), mesh,
                                        dataclasses.replace(MODELS["gpt"][0].plans(mesh, "dp"), precision=precision,
                                                            zero=zero))
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        losses = fit(model, opt, batches("gpt")[:STEPS])
        report = shoal.memory_report(model, opt)
        psi = sum(p.numel() for p in model.parameters())
        runs[(precision, zero)] = (losses, report.total()[0] / psi, report)
    fp32, bf16, z3 = runs[(None, 0)], runs[("bf16", 0)], runs[("bf16", 3)]
    assert fp32[0] != bf16[0]
    torch.testing.assert_close(torch.tensor(bf16[0]), torch.tensor(fp32[0]), rtol=1e-2, atol=0)
    assert bf16[1] == 14.0 and z3[1] == 3.5 and "gradients" not in {k for k, v in bf16[2].kinds.items() if v}
    assert "master weights" in bf16[2].kinds and sum(bf16[2].kinds["master weights"].values()) == 4 * 4 * psi


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_gathers_the_updated_parameters_in_bf16(zero):
    """After the step each parameter is its master rounded to bf16 and gathered where the master is
    split (ZeRO-1/2): rounded first, so the gather carries 2 bytes a parameter, not the master's 4
    (Megatron-LM's distributed optimizer gathers bf16 too); the values are the same either way."""
    mesh = mesh_for("dp")
    model = shoal.distribute_module(initial("gpt"), mesh, dataclasses.replace(MODELS["gpt"][0].plans(mesh, "dp"),
                                                                              precision="bf16", zero=zero))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    fit(model, opt, batches("gpt")[:1])  # the first step makes the masters
    x, y = batches("gpt")[1]
    model(x, y)[1].backward()
    with shoal.CommCounter() as cc:
        opt.step()
    split = [p for p in model.parameters() if p.numel() >= mesh.size]  # gathered: the masters ZeRO splits
    assert cc.bytes["all_gather"] == sum(p.numel() * 2 for p in split)


def test_zero_grad_clears_the_bf16_gradients():
    """The optimizer holds the masters; its zero_grad() still clears the gradients of a backward that
    no step took (a step skipped), and a step takes them."""
    mesh = mesh_for("dp")
    model = shoal.distribute_module(initial("gpt"), mesh, dataclasses.replace(MODELS["gpt"][0].plans(mesh, "dp"),
                                                                              precision="bf16"))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    fit(model, opt, batches("gpt")[:1])
    assert all(p.grad is None for p in model.parameters())
    x, y = batches("gpt")[1]
    model(x, y)[1].backward()
    assert all(p.grad is not None for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_precision_errors():
    mesh = mesh_for("dp")
    with pytest.raises(ValueError, match=r"Precision\(param=torch.float32.*param=torch.bfloat16 or torch.float16"):
        shoal.Precision(param=torch.float32)
    with pytest.raises(ValueError, match="reduce=torch.bfloat16"):
        shoal.Precision(reduce=torch.bfloat16)
    with pytest.raises(ValueError, match="precision='int8'"):
        shoal.distribute_module(initial("gpt"), mesh, shoal.Plan(precision="int8"))


def bf16_gpt(zero: int, optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR)):
    mesh = mesh_for("dp")
    plan = dataclasses.replace(MODELS["gpt"][0].plans(mesh, "dp"), precision="bf16", zero=zero)
    model = shoal.distribute_module(initial("gpt"), mesh, plan)
    return model, optimizer(model.parameters())


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_gradient_accumulation_with_zero_grad_first(zero):
    """Two backward calls add up in the bf16 gradients before a step (zero_grad() at the start of the
    step, on the optimizer that holds the masters; bound before its first step, when it held the bf16
    parameters), as in the recipe by hand. SGD: a gradient left over from the step before would show
    (Adam would hide most of it)."""
    data = batches("gpt")[:4]
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731

    def accumulate(model, zero_grad, step):
        losses = []
        for k in (0, 2):
            zero_grad()
            for x, y in data[k:k + 2]:
                _, loss = model(x, y)
                loss.backward()
                losses.append(loss.item())
            step()
        return losses

    hand, hand_step = recipe_by_hand("gpt", sgd)
    want = accumulate(hand, hand.zero_grad, hand_step)
    model, opt = bf16_gpt(zero, sgd)
    got = accumulate(model, opt.zero_grad, opt.step)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-2, atol=0)
    for (n, p), q in zip(model.named_parameters(), hand.parameters()):
        torch.testing.assert_close(p.detach().full().float(), q.detach().float(), rtol=1e-2, atol=1e-3, msg=n)


@pytest.mark.parametrize("zero", [0, 2])
def test_a_bf16_checkpoint_resumes(zero, tmp_path):
    """Model and optimizer saved after 2 steps, loaded (before the first step) into a fresh bf16 model
    and optimizer: the loaded Adam state becomes the masters' (fp32 again, one entry a parameter) and
    the other 3 steps go as if never stopped, within bf16's rounding (the masters restart from the
    bf16 parameters, and the loaded state was rounded to bf16 by torch's load_state_dict)."""
    data = batches("gpt")
    model, opt = bf16_gpt(zero)
    want = fit(model, opt, data)
    want_state = [dict(st) for st in opt.state.values()]
    model, opt = bf16_gpt(zero)
    got = fit(model, opt, data[:2])
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    saved = torch.load(tmp_path / "ckpt.pt")
    model, opt = bf16_gpt(zero)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    got += fit(model, opt, data[2:])
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-2, atol=0)
    assert len(opt.state) == len(want_state) == len(master_weights(opt))
    for st, ws in zip(opt.state.values(), want_state):
        assert int(st["step"]) == len(data)
        for k in ("exp_avg", "exp_avg_sq"):
            v, w = st[k].full(), ws[k].full()
            assert v.dtype == torch.float32, k
            assert (v - w).norm() <= 2e-2 * w.norm(), k


@pytest.mark.filterwarnings("ignore:shoal. no SBP rule for aten._amp_foreach_non_finite_check_and_unscale_")
@pytest.mark.parametrize("zero", [0, 2, 3])
def test_fp16_autocast_with_grad_scaler(zero):
    """float16 the plain torch way on shoal's (fp32) parameters: torch.autocast and torch.amp.GradScaler.
    An inf loss at step 2 is skipped and halves the scale; SGD (unlike Adam) would show a gradient
    left scaled. (The scaler's unscale op has no SBP rule yet: it runs replicated.)"""

    def run(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu")
        losses = []
        for i, (x, y) in enumerate(batches("gpt")[:4]):
            with torch.autocast("cpu", dtype=torch.float16):
                _, loss = model(x, y)
            opt.zero_grad()
            scaler.scale(loss * (float("inf") if i == 1 else 1.0)).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
        return losses, scaler.get_scale(), [p.detach() for p in model.parameters()]

    want_losses, want_scale, want_params = run(initial("gpt"))
    mesh = mesh_for("dp")
    model = shoal.distribute_module(initial("gpt"), mesh,
                                    dataclasses.replace(MODELS["gpt"][0].plans(mesh, "dp"), zero=zero))
    losses, scale, params = run(model)
    assert scale == want_scale == 2.0**15
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-4, atol=0)
    for p, q in zip(params, want_params):
        torch.testing.assert_close(p.full(), q, rtol=1e-3, atol=1e-4)


def fp16_by_hand(name: str, steps: int, init_scale: float, interval: int, factors: list, optimizer):
    """The float16 recipe in plain torch on one device, torch.amp.GradScaler keeping the scale: float16
    parameters (batch norms' fp32), the loss times ``factors[i]`` given the scale as its gradient, fp32
    masters given the gradients and stepped through the scaler (which unscales them, skips the step on
    inf or nan and updates the scale). Losses, the scale after each step, final parameters."""
    model = initial(name)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=interval)
    step = with_masters(model, torch.float16, optimizer, lambda opt: (scaler.step(opt), scaler.update()))
    losses, scales = [], []
    for (x, y), f in zip((batches(name) * 2)[:steps], factors):
        _, loss = model(x.half() if x.is_floating_point() else x, y)
        model.zero_grad(set_to_none=True)
        (loss * f).backward(scaler.scale(torch.ones(())).to(loss.dtype))  # the scale as the loss's gradient
        step()
        losses.append(loss.item())
        scales.append(scaler.get_scale())
    return losses, scales, [p.detach() for p in model.parameters()]


def scaled_step(model, opt, x, y, f):
    _, loss = model(x, y)
    opt.zero_grad()
    (loss * f).backward()
    opt.step()
    return loss


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("zero,name,optimizer", [(0, "gpt", "adamw"), (3, "gpt", "adamw"), (2, "resnet", "sgd")])
def test_fp16_scales_the_loss_and_skips_overflowed_steps(name, zero, optimizer, compiled):
    """precision=fp16 against GradScaler's rule by hand. An inf in the loss at the first and the fifth
    step overflows the gradients: those steps are skipped and halve the scale; after two clean steps it
    doubles. Compiled, the first call runs eagerly (no optimizer state yet) and so does the second
    (the first was skipped: still no state); the fifth, traced, keeps the old values where it overflowed.
    SGD with momentum, unlike Adam, would show a gradient left scaled (ResNet's batch norms' are fp32)."""
    optimizer = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=LR),
                 "sgd": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9)}[optimizer]
    # float16 against itself in another order: Adam moves by at most lr a step; SGD's steps (a batch
    # norm's gradient left scaled by 2^9 would move it by about 1) differ by float16's roundings,
    # which ResNet grows over the steps (plain torch's float16 recipe is 3e-2 from its fp32 one at lr=0.05)
    steps, init, interval = 6, 2.0**10, 2
    atol = steps * LR + 1e-3 if optimizer == "adamw" else 5e-3
    factors = [float("inf"), 1.0, 1.0, 1.0, float("inf"), 1.0]
    want_losses, want_scales, want_params = fp16_by_hand(name, steps, init, interval, factors, optimizer)
    assert want_scales == [2.0**9, 2.0**9, 2.0**10, 2.0**10, 2.0**9, 2.0**9]  # the schedule this test means
    mesh = mesh_for("dp")
    prec = shoal.Precision(param=torch.float16, init_scale=init, growth_interval=interval)
    plan = dataclasses.replace(MODELS[name][0].plans(mesh, "dp"), zero=zero, precision=prec)
    model = shoal.distribute_module(initial(name), mesh, plan)
    opt = optimizer(model.parameters())
    step = shoal.compile(scaled_step) if compiled else scaled_step
    losses, scales = [], []
    for (x, y), f in zip((batches(name) * 2)[:steps], factors):
        losses.append(step(model, opt, x, y, torch.tensor(f)).item())
        scales.append(loss_scale(model))
    assert scales == want_scales
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-2, atol=0)
    for (n, p), q in zip(model.named_parameters(), want_params):
        assert p.dtype == q.dtype, n
        torch.testing.assert_close(p.detach().full().float(), q.float(), rtol=1e-2, atol=atol, msg=n)
    assert all(int(st.get("step", 4)) == 4 for st in opt.state.values())  # four steps taken, two skipped
    if compiled:
        assert step.traces == 1
