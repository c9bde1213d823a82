"""The bundled models train under every plan exactly as on one device; ``shoal train`` runs them.

Each model is trained 5 steps on one device (the oracle) and, from the same initial weights, laid
out by its plan on 4 virtual devices: losses at every step, final parameters and buffers
(BatchNorm running statistics included) must agree.
"""

import copy
import dataclasses
import json
import subprocess
import sys
from functools import cache

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shoal
from shoal.cli import main
from shoal.data import CharData, Stripes
from shoal.models import KINDS, bert, gpt, resnet
from shoal.testing import assert_same_value
from shoal.train import gather

STEPS, BATCH = 5, 6  # 6 rows over 4 devices: an uneven split (2, 2, 1, 1)

MODELS = {
    "gpt": (gpt, lambda: gpt.GPT(gpt.GPTConfig(vocab_size=13, block_size=8, n_layer=2, n_head=4, n_embd=32))),
    "bert": (bert, lambda: bert.BERT(bert.BERTConfig(vocab_size=15, block_size=8, n_layer=2, n_head=4, n_embd=32))),
    "resnet": (resnet, lambda: resnet.ResNet(resnet.ResNetConfig(num_classes=5, width=8, blocks=(1, 1, 1)))),
}
MESHES = {"dp": ((4,), ("dp",)), "tp": ((4,), ("tp",)), "dp,tp": ((2, 2), ("dp", "tp")), "zero": ((4,), ("dp",)),
          "zero2": ((4,), ("dp",)), "zero3": ((4,), ("dp",))}
# Adam divides each gradient by its own running size, so where a gradient is tiny and mostly
# cancellation (attention keys at initialisation: up to 1e-3 relative error in fp32 against fp64 on one
# device) rounding differences reach the update at full size, about lr x 1e-3 per step. Hence a
# transformer-sized lr for AdamW and an absolute tolerance of 5e-6 on the parameters.
PARAM_ATOL = 5e-6
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
}


def batches(name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        if name == "gpt":
            out.append((torch.randint(13, (BATCH, 8), generator=g), torch.randint(13, (BATCH, 8), generator=g)))
        elif name == "bert":
            x = torch.randint(15, (BATCH, 8), generator=g)
            y = torch.where(torch.rand(BATCH, 8, generator=g) < 0.3, torch.randint(14, (BATCH, 8), generator=g), -100)
            y[0, 0] = 3
            out.append((x, y))
        else:
            out.append(Stripes(classes=5, size=8).batch(BATCH, g))
    return out


def mesh_for(kind: str) -> shoal.Mesh:
    shape, axes = MESHES[kind]
    return shoal.Mesh(torch.arange(4).reshape(shape).tolist(), axes=axes)


def fit(model, opt, data) -> list[float]:
    losses = []
    for x, y in data:
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def initial(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return MODELS[name][1]()


@cache
def reference(name: str, opt_name: str):
    """Single-device torch: the losses and the final state (parameters and buffers)."""
    model = initial(name)
    losses = fit(model, OPTIMIZERS[opt_name](model.parameters()), batches(name))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def distributed(name: str, kind: str, opt_name: str):
    module, _ = MODELS[name]
    mesh = mesh_for(kind)
    model = shoal.distribute_module(initial(name), mesh, module.plans(mesh, kind))
    return model, OPTIMIZERS[opt_name](model.parameters())


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(MODELS))
def test_trains_like_one_device(name, kind, opt_name):
    ref_losses, ref_state = reference(name, opt_name)
    model, opt = distributed(name, kind, opt_name)
    losses = fit(model, opt, batches(name))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    plain_grads = [n for n, p in model.named_parameters() if not isinstance(p.grad, shoal.GlobalTensor)]
    assert not plain_grads, f"gradients that are not GlobalTensors: {plain_grads}"
    check_state(model, ref_state, f"{name} {kind} {opt_name}")


def check_state(model, ref_state, what: str) -> None:
    """``model``'s parameters and buffers, GlobalTensors all, equal the oracle's ``ref_state``."""
    state = model.state_dict()
    assert state.keys() == ref_state.keys()
    for k, v in state.items():
        assert isinstance(v, shoal.GlobalTensor), k
        assert_same_value(v.detach(), ref_state[k], f"{what}: {k}", rtol=1e-5, atol=PARAM_ATOL)


@pytest.mark.parametrize("kind", ["dp,tp", "zero"])
def test_a_checkpoint_resumes_training_exactly(kind, tmp_path):
    """Model and optimizer state saved with torch.save after 2 steps, loaded with torch.load's
    defaults into a fresh model and optimizer of the same plan: the other 3 steps go as if never
    stopped."""
    ref_losses, ref_state = reference("gpt", "adamw")
    model, opt = distributed("gpt", kind, "adamw")
    data = batches("gpt")
    losses = fit(model, opt, data[:2])
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    saved = torch.load(tmp_path / "ckpt.pt")
    model, opt = distributed("gpt", kind, "adamw")
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    state = [v for st in opt.state_dict()["state"].values() for v in st.values()]
    want = [v for st in saved["opt"]["state"].values() for v in st.values()]
    assert [getattr(v, "sbp", None) for v in state] == [getattr(v, "sbp", None) for v in want]
    losses += fit(model, opt, data[2:])
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for k, v in model.state_dict().items():
        assert_same_value(v.detach(), ref_state[k], f"{kind}: {k}", rtol=1e-5, atol=PARAM_ATOL)


@pytest.mark.parametrize("kind", ["tp", "zero"])
def test_a_checkpoint_loads_into_another_plan(kind, tmp_path):
    """Model and optimizer state saved under DP x TP after 2 steps load into a model and optimizer
    laid out by another plan (each value moved onto its parameter's mesh and layout), and the
    other 3 steps go as if never stopped; the parameters also load into plain torch."""
    ref_losses, ref_state = reference("gpt", "adamw")
    model, opt = distributed("gpt", "dp,tp", "adamw")
    data = batches("gpt")
    losses = fit(model, opt, data[:2])
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    saved = torch.load(tmp_path / "ckpt.pt")
    plain = initial("gpt")
    plain.load_state_dict({k: v.full() for k, v in saved["model"].items()})
    model, opt = distributed("gpt", kind, "adamw")
    layouts = {k: v.sbp for k, v in model.state_dict().items()}
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    for k, v in model.state_dict().items():
        assert v.sbp == layouts[k], k
        assert_same_value(v, plain.state_dict()[k], k)
    losses += fit(model, opt, data[2:])
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for k, v in model.state_dict().items():
        assert_same_value(v.detach(), ref_state[k], f"{kind}: {k}", rtol=1e-5, atol=PARAM_ATOL)


def test_a_saved_global_tensor_loads_in_another_process(tmp_path):
    """Hashes of dtypes and strings differ from process to process, and a mesh knows which of its
    devices this process owns: a loaded layout is rebuilt, equal to one made there."""
    mesh = mesh_for("dp,tp")
    torch.save(shoal.to_global(torch.arange(12.0).reshape(4, 3), mesh, [shoal.S(0), shoal.P]), tmp_path / "x.pt")
    code = (
        "import torch, shoal\n"
        "shoal.init(devices=4)\n"
        f"x = torch.load({str(tmp_path / 'x.pt')!r})\n"
        "mesh = shoal.Mesh([[0, 1], [2, 3]], axes=('dp', 'tp'))\n"
        "want = shoal.TensorSpec((4, 3), torch.float32, mesh, (shoal.S(0), shoal.P))\n"
        "assert x._spec == want and hash(x._spec) == hash(want) and x.mesh.local_positions == (0, 1, 2, 3)\n"
        "assert torch.equal((x + 1).full(), torch.arange(12.0).reshape(4, 3) + 1)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_zero_splits_optimizer_state(opt_name):
    """ZeRO: after training, every optimizer state tensor with a dim of at least 4 is split over dp,
    so each device holds about a quarter of it."""
    model, opt = distributed("gpt", "zero", opt_name)
    fit(model, opt, batches("gpt")[:2])
    names = {p: n for n, p in model.named_parameters()}
    whole = {
        f"{names[p]}.{k}": v.sbp
        for p, st in opt.state.items()
        for k, v in st.items()
        if isinstance(v, shoal.GlobalTensor)
        and max(v.shape, default=0) >= 4
        and not any(isinstance(s, shoal.Split) for s in v.sbp)
    }
    assert not whole, f"optimizer state not split over dp: {whole}"


def dropout_model(name: str) -> torch.nn.Module:
    """``name``'s test model with dropout 0.1, from the same seed."""
    plain = MODELS[name][1]()
    torch.manual_seed(0)
    return type(plain)(dataclasses.replace(plain.cfg, dropout=0.1))


@pytest.mark.parametrize("kind", ["tp", "dp,tp"])
@pytest.mark.parametrize("name", ["gpt", "bert"])
def test_sequence_parallelism_trains_like_one_device(name, kind):
    """Sequence parallelism (``plans(..., sequence_parallel=True)``) with dropout on and a sequence of
    7 tokens, which tp does not divide: 3 SGD steps equal one device's (losses, final parameters;
    dropout draws one device's masks; SGD, not Adam, whose normalised update blows a near-zero
    gradient's rounding up to lr). The blocks' outputs are split on the sequence over tp, and a
    forward runs each of Megatron's all-reduces of a sub-block's or the embedding's output as a
    reduce-scatter and an all-gather instead."""
    module, _ = MODELS[name]
    mesh = mesh_for(kind)
    data = [(x[:, :7], y[:, :7]) for x, y in batches(name)[:3]]
    ref = dropout_model(name)
    ref_opt = OPTIMIZERS["sgd"](ref.parameters())
    torch.manual_seed(1)
    ref_losses = fit(ref, ref_opt, data)
    counts, outs = {}, {}
    for sp in (False, True):
        model = shoal.distribute_module(dropout_model(name), mesh, module.plans(mesh, kind, sequence_parallel=sp))
        model.blocks[0].register_forward_hook(lambda m, args, out, sp=sp: outs.__setitem__(sp, out.sbp))
        with shoal.CommCounter() as cc:
            model(*data[0])
        counts[sp] = cc.counts
    opt = OPTIMIZERS["sgd"](model.parameters())
    torch.manual_seed(1)
    losses = fit(model, opt, data)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    check_state(model, {k: v.detach() for k, v in ref.state_dict().items()}, f"{name} {kind} sp")
    tp_axis = mesh.axes.index("tp")
    assert outs[True][tp_axis] == shoal.S(1) and outs[False][tp_axis] == shoal.B
    moved = len(mesh.groups(tp_axis)) * (2 * len(model.blocks) + 1)  # per tp group: two per block, the embedding's
    assert counts[True]["all_reduce"] == counts[False]["all_reduce"] - moved
    for kind_ in ("reduce_scatter", "all_gather"):
        assert counts[True][kind_] >= counts[False][kind_] + moved


@pytest.mark.parametrize("name", ["gpt", "bert"])
def test_sequence_parallelism_keeps_gathered_inputs_split_for_backward(name):
    """Under sp the plan regathers (``Plan.regather``): what the attention, the MLP and the heads save
    of their all-gathered input is kept split over tp and gathered again in backward, as Megatron-LM
    does. The gradients are the same bits as keeping the gathered input; backward runs one more
    all-gather per sub-block and head in each tp group; the compiled step plans a lower peak."""
    from shoal.train import train_step

    module, _ = MODELS[name]
    mesh = mesh_for("dp,tp")
    x, y = batches(name)[0]
    x, y = torch.cat([x] * 4), torch.cat([y] * 4)  # activations outweigh the weights
    grads, counts, peaks = {}, {}, {}
    for regather in (True, False):
        torch.manual_seed(0)
        plan = module.plans(mesh, "dp,tp", sequence_parallel=True)
        assert plan.regather
        model = shoal.distribute_module(MODELS[name][1](), mesh,
                                        plan if regather else dataclasses.replace(plan, regather=()))
        loss = model(x, y)
        loss = loss[1] if isinstance(loss, tuple) else loss
        with shoal.CommCounter() as cc:
            loss.backward()
        counts[regather] = cc.counts
        grads[regather] = [p.grad.full() for p in model.parameters()]
        step = shoal.compile(train_step)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            step(model, opt, x, y)
        peaks[regather] = max(step.plan.peak_bytes.values())
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))
    groups = len(mesh.groups(mesh.axes.index("tp")))
    regathered = 2 * len(model.blocks) + len(plan.regather) - 2  # attention and MLP per block, and the heads
    assert counts[True]["all_gather"] == counts[False]["all_gather"] + groups * regathered
    assert peaks[True] < peaks[False]


@settings(max_examples=12, derandomize=True, database=None, deadline=None, print_blob=False)
@given(kind=st.sampled_from(["tp", "dp,tp"]), rows=st.integers(1, 5), tokens=st.integers(1, 8),
       dropout=st.sampled_from([0.0, 0.3]), seed=st.integers(0, 2**16))
def test_sequence_parallel_gpt_equals_one_device_on_drawn_shapes(kind, rows, tokens, dropout, seed):
    """Batches and sequences hypothesis draws, fewer rows or tokens than devices among them (empty
    shards): the loss and every gradient of a sequence-parallel GPT equal one device's."""
    torch.manual_seed(seed)
    ref = gpt.GPT(gpt.GPTConfig(vocab_size=13, block_size=8, n_layer=2, n_head=4, n_embd=16, dropout=dropout))
    mesh = mesh_for(kind)
    model = shoal.distribute_module(copy.deepcopy(ref), mesh, gpt.plans(mesh, kind, sequence_parallel=True))
    x, y = torch.randint(13, (2, rows, tokens), generator=torch.Generator().manual_seed(seed))
    losses = []
    for m in (ref, model):
        torch.manual_seed(seed + 1)
        loss = m(x, y)[1]
        loss.backward()
        losses.append(loss)
    assert_same_value(losses[1], losses[0], "loss", rtol=1e-5, atol=1e-6)
    for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
        assert_same_value(q.grad, p.grad, name, rtol=1e-5, atol=1e-6)


def test_sequence_parallelism_needs_a_tensor_parallel_axis():
    with pytest.raises(ValueError, match="sequence parallelism splits on the tensor-parallel axis"):
        gpt.plans(mesh_for("dp"), "dp", sequence_parallel=True)


def test_tp_plans_split_what_they_say():
    mesh = mesh_for("dp,tp")
    m = shoal.distribute_module(initial("gpt"), mesh, gpt.plans(mesh, "dp,tp"))
    sbp = {n: p.sbp for n, p in m.named_parameters()}
    B, S = shoal.B, shoal.S
    assert sbp["blocks.0.attn.q.weight"] == sbp["blocks.1.mlp.up.bias"] == (B, S(0))
    assert sbp["blocks.0.attn.proj.weight"] == sbp["blocks.0.mlp.down.weight"] == (B, S(1))
    assert sbp["blocks.0.attn.proj.bias"] == sbp["ln_f.weight"] == sbp["pos_emb.weight"] == (B, B)
    assert sbp["tok_emb.weight"] == sbp["lm_head.weight"] == (B, S(0))
    r = shoal.distribute_module(initial("resnet"), mesh, resnet.plans(mesh, "dp,tp"))
    assert r.stages[1][0].conv1.weight.sbp == r.stages[1][0].bn1.running_var.sbp == (B, S(0))
    assert r.stages[1][0].conv2.weight.sbp == (B, S(1))


def test_plans_need_the_right_mesh():
    with pytest.raises(ValueError, match="needs a 2-D mesh"):
        gpt.plans(mesh_for("dp"), "dp,tp")
    with pytest.raises(ValueError, match="needs a 1-D mesh"):
        bert.plans(mesh_for("dp,tp"), "tp")
    with pytest.raises(ValueError, match="unknown plan"):
        resnet.plans(mesh_for("dp"), "pp")


@pytest.mark.parametrize("name", list(MODELS))
def test_no_fallback_ops(name):
    """Every op of a training step under every plan has an SBP rule (or decomposes into ruled ops)."""
    module, _ = MODELS[name]
    shoal.coverage(reset=True)
    for kind in KINDS:
        for opt_name in OPTIMIZERS:
            model, opt = distributed(name, kind, opt_name)
            fit(model, opt, batches(name)[:2])
    fallback = shoal.coverage().by_fallback
    assert not fallback, f"{name}: ops that ran replicated through the fallback: {dict(fallback)}"


# -- data ------------------------------------------------------------------------------------


def test_char_data_is_deterministic_and_round_trips():
    a, b = CharData(max_bytes=20_000), CharData(max_bytes=20_000)
    assert a.chars == b.chars and torch.equal(a.train, b.train) and len(a.train) + len(a.val) == 20_000
    assert a.decode(a.encode("def f(x):\n    return x")) == "def f(x):\n    return x"
    x, y = a.batch("train", 3, 10, torch.Generator().manual_seed(0))
    x2, _ = b.batch("train", 3, 10, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (3, 10) and torch.equal(x, x2) and torch.equal(x[:, 1:], y[:, :-1])


def test_masked_batch():
    d = CharData(max_bytes=20_000)
    x, y = d.masked_batch("val", 64, 32, torch.Generator().manual_seed(0))
    picked = y != bert.IGNORE
    assert 0.1 < picked.float().mean() < 0.2  # about 15%
    assert (x[picked] == d.mask_id).float().mean() > 0.6  # mostly [MASK], some random or kept
    assert not (x[~picked] == d.mask_id).any() and (y[picked] < d.vocab_size).all()


def test_stripes():
    s = Stripes(classes=4, size=8)
    x, y = s.batch(5, torch.Generator().manual_seed(0))
    x2, y2 = s.batch(5, torch.Generator().manual_seed(0))
    assert x.shape == (5, 3, 8, 8) and x.dtype == torch.float32 and y.shape == (5,)
    assert torch.equal(x, x2) and torch.equal(y, y2) and y.min() >= 0 and y.max() < 4


# -- the command -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--devices", "8", "--mesh", "2x2"], "has 4 devices but devices is 8"),
        (["--plan", "dp,tp", "--mesh", "4"], "needs a 2-D mesh"),
        (["--plan", "tp", "--mesh", "2x2"], "needs a 1-D mesh"),
        (["--plan", "dp,tp", "--devices", "3"], "needs a 2-D mesh"),
        (["--set", "n_layers=2"], "has no field 'n_layers'"),
        (["--set", "n_layer=two"], "expected a value like 4"),
        (["--set", "n_head=3"], "not a multiple of n_head 3"),
        (["--batch", "2"], "smaller than the 4 data-parallel devices"),
    ],
)
def test_cli_errors(argv, message, capsys):
    assert main(["train", "gpt", *argv]) == 2
    assert message in capsys.readouterr().err


def test_cli_usage_errors(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "gpt", "--mesh", "2y2"])
    assert e.value.code == 2 and "expected sizes joined by 'x'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "vgg"])


def test_cli_trains_and_writes_a_run(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "gpt", "--plan", "dp,tp", "--mesh", "2x2", "--steps", "3", "--batch", "4", "--out", str(out)]
    tiny = ["--set", "n_layer=1", "--set", "n_embd=32", "--set", "block_size=16", "--sample", "20", "--no-progress"]
    assert main(argv + tiny) == 0
    text = capsys.readouterr().out
    assert "fallback ops:" in text and "memory per device" in text and "sample:" in text
    record = json.loads((out / "losses.json").read_text())
    assert len(record["losses"]) == 3 and record["config"]["mesh"] == [2, 2]
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_python_dash_m_shoal():
    r = subprocess.run(
        [sys.executable, "-m", "shoal", "train", "resnet", "--plan", "tp", "--mesh", "2x2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "plan 'tp' needs a 1-D mesh" in r.stderr


def test_gather_gives_a_plain_copy():
    """``gather`` (used for sampling) turns a laid-out model back into a plain one with the same values."""
    mesh = mesh_for("tp")
    m = shoal.distribute_module(initial("gpt"), mesh, gpt.plans(mesh, "tp"))
    plain = gather(m)
    for (k, v), w in zip(plain.state_dict().items(), initial("gpt").state_dict().values()):
        assert not isinstance(v, shoal.GlobalTensor)
        torch.testing.assert_close(v, w, msg=k)
