"""Activation checkpointing from the plan (``Plan(checkpoint=[...])``): training equals one device's
without it (dropout draws the same masks when recomputed, batch norm updates its statistics once),
eager and compiled, under ZeRO too; in graph mode the recomputation is in the plan and the planned
peak shows the saving."""

import dataclasses

import pytest
import torch

import shoal
from shoal.models import gpt
from shoal.parallel.recompute import install_checkpointing
from test_models import MODELS, batches, check_state, fit, initial, mesh_for, reference
from test_zero import compiled_fit, gpt_step

CHECKPOINTED = {"gpt": ["blocks.*"], "bert": ["blocks.*"], "resnet": ["stages.*"]}


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("kind", ["dp", "zero2", "zero3"])
@pytest.mark.parametrize("name", list(MODELS))
def test_checkpointed_models_train_like_one_device(name, kind, compiled):
    ref_losses, ref_state = reference(name, "adamw")
    mesh = mesh_for(kind)
    module, _ = MODELS[name]
    plan = dataclasses.replace(module.plans(mesh, kind), checkpoint=CHECKPOINTED[name])
    model = shoal.distribute_module(initial(name), mesh, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = (compiled_fit if compiled else fit)(model, opt, batches(name))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    check_state(model, ref_state, f"{name} {kind} checkpointed, compiled={compiled}")


def dropout_gpt():
    torch.manual_seed(0)
    return gpt.GPT(gpt.GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.1))


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("kind,pattern", [("dp", "blocks.*"), ("zero3", "blocks.*"), ("dp", "blocks.*.attn.core"),
                                          ("tp", "blocks.*.attn.core")])
def test_recomputed_dropout_draws_the_same_masks(kind, pattern, compiled):
    """Three steps with dropout against one device without checkpointing, seeded once: the
    recomputation in backward must draw what the forward drew (or the gradients belong to other
    masks than the loss) and leave the generator where the forward left it. ``blocks.*.attn.core``
    recomputes attention's core alone (selective recomputation, ``recompute=selective``), its
    dropout on the attention weights included."""
    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(32, (8, 16), generator=g), torch.randint(32, (8, 16), generator=g)) for _ in range(3)]
    ref = dropout_gpt()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    torch.manual_seed(1)
    want = [gpt_step(ref, ref_opt, x, y).item() for x, y in data]
    mesh = mesh_for(kind)
    model = shoal.distribute_module(dropout_gpt(), mesh, dataclasses.replace(gpt.plans(mesh, kind),
                                                                             checkpoint=[pattern]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = shoal.compile(gpt_step) if compiled else gpt_step
    torch.manual_seed(1)
    got = [step(model, opt, shoal.to_global(x, mesh, shoal.S(0)), shoal.to_global(y, mesh, shoal.S(0))).item()
           for x, y in data]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().full(), q.detach(), rtol=1e-5, atol=5e-6)


def traced(kind: str, names: list[str]) -> tuple[int, int]:
    """Four wide blocks, a long batch (activations dominate), compiled under ``kind`` with ``names``
    checkpointed: the gelus device 0 runs in the traced step and the planned peak."""
    torch.manual_seed(0)
    base = gpt.GPT(gpt.GPTConfig(vocab_size=32, block_size=64, n_layer=4, n_head=4, n_embd=64))
    mesh = mesh_for(kind)
    x = shoal.to_global(torch.randint(32, (16, 64)), mesh, shoal.S(0))
    model = shoal.distribute_module(base, mesh, dataclasses.replace(gpt.plans(mesh, kind), checkpoint=names))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = shoal.compile(gpt_step)
    for _ in range(2):  # the first call makes the optimizer's state eagerly, the second traces
        step(model, opt, x, x)
    gelus = sum(1 for op in step.plan.graph.ops if op.device == 0 and "gelu.default" in str(op.fn))
    return gelus, max(step.plan.peak_bytes.values())


@pytest.mark.parametrize("kind", ["dp", "zero3"])
def test_the_plan_recomputes_in_backward_and_peaks_lower(kind):
    """With checkpointing each block's forward is traced twice (the second time in backward) and
    the planned peak is lower; under ZeRO-3 too (its gathers around each block's forward)."""
    (plain_gelus, plain_peak), (gelus, peak) = traced(kind, []), traced(kind, ["blocks.*"])
    assert (plain_gelus, gelus) == (4, 8)
    assert peak < plain_peak, (peak, plain_peak)


def test_only_the_outermost_match_is_checkpointed():
    """fnmatch's ``*`` crosses dots: ``blocks.*`` also names every module inside a block."""
    assert install_checkpointing(initial("gpt"), ["blocks.*", "blocks.*.mlp"]) == ["blocks.0", "blocks.1"]


def test_a_pattern_matching_nothing_is_an_error():
    mesh = mesh_for("dp")
    with pytest.raises(ValueError, match=r"checkpoint.*'block\.\*'.*match no submodule"):
        shoal.distribute_module(initial("gpt"), mesh, shoal.Plan(checkpoint=["block.*"]))


def test_regather_names_pinned_submodules_and_skips_checkpointed_ones():
    """``Plan.regather`` names submodules whose input pins gather: a pattern matching nothing, or a
    submodule without an input pin, is an error; inside a checkpointed block it is left off (the
    block keeps only its input)."""
    mesh = mesh_for("tp")
    sp = gpt.plans(mesh, "tp", sequence_parallel=True)
    with pytest.raises(ValueError, match=r"regather.*'block\.\*\.attn'.*match no submodule"):
        shoal.distribute_module(initial("gpt"), mesh, dataclasses.replace(sp, regather=["block.*.attn"]))
    with pytest.raises(ValueError, match=r"regather.*'blocks.0.ln1' has no input pin"):
        shoal.distribute_module(initial("gpt"), mesh, dataclasses.replace(sp, regather=["blocks.*.ln1"]))
    regathered = lambda m: [n for n, mod in m.named_modules() if "forward" in mod.__dict__  # noqa: E731
                            and getattr(mod.forward, "func", None).__name__ == "_regathered"]
    assert regathered(shoal.distribute_module(initial("gpt"), mesh, sp)) == [
        "blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "blocks.1.mlp", "lm_head"]
    full = shoal.distribute_module(initial("gpt"), mesh, dataclasses.replace(sp, checkpoint=["blocks.*"]))
    assert regathered(full) == ["lm_head"]


def test_the_recomputation_sees_the_gathered_parameters():
    """ZeRO-3: the recomputation runs outside the units' forward hooks, yet each batch norm's weight is
    gathered (whole) in the first forward and in its recomputation, and split at rest again after both."""
    mesh = mesh_for("dp")
    plan = dataclasses.replace(MODELS["resnet"][0].plans(mesh, "dp"), zero=3, checkpoint=CHECKPOINTED["resnet"])
    model = shoal.distribute_module(initial("resnet"), mesh, plan)
    bn = model.stages[1][0].bn1
    seen = []
    bn.register_forward_pre_hook(lambda m, args: seen.append(m.weight.sbp))
    x, y = batches("resnet")[0]
    model(x, y)[1].backward()
    assert seen == [(shoal.B,), (shoal.B,)]
    assert bn.weight.sbp == (shoal.S(0),)
