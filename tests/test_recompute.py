"""Activation checkpointing from the plan (``Plan(checkpoint=[...])``): training equals one device's
without it (dropout draws the same masks when recomputed, batch norm updates its statistics once),
eager and compiled, under ZeRO too; in graph mode the recomputation is in the plan and the planned
peak shows the saving."""

import copy
import dataclasses

import pytest
import torch

import shoal
from shoal.models import gpt
from test_models import MODELS, batches, check_state, fit, initial, mesh_for, reference
from test_zero import compiled_fit, gpt_step

CHECKPOINTED = {"gpt": ["blocks.*"], "bert": ["blocks.*"], "resnet": ["stages.*"]}


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("kind", ["dp", "zero3"])
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
def test_recomputed_dropout_draws_the_same_masks(compiled):
    """Three steps with dropout: the recomputation in backward must draw what the forward drew, or
    the gradients belong to other masks than the loss."""
    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(32, (8, 16), generator=g), torch.randint(32, (8, 16), generator=g)) for _ in range(3)]
    ref = dropout_gpt()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    torch.manual_seed(1)
    want = [gpt_step(ref, ref_opt, x, y).item() for x, y in data]
    mesh = mesh_for("dp")
    model = shoal.distribute_module(dropout_gpt(), mesh, dataclasses.replace(gpt.plans(mesh, "dp"),
                                                                             checkpoint=["blocks.*"]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = shoal.compile(gpt_step) if compiled else gpt_step
    torch.manual_seed(1)
    got = [step(model, opt, shoal.to_global(x, mesh, shoal.S(0)), shoal.to_global(y, mesh, shoal.S(0))).item()
           for x, y in data]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().full(), q.detach(), rtol=1e-5, atol=5e-6)


def test_the_plan_recomputes_in_backward_and_peaks_lower():
    """Four wide blocks, a long batch: activations dominate. With checkpointing each block's
    forward is traced twice (the second time in backward) and the planned peak is lower."""
    torch.manual_seed(0)
    base = gpt.GPT(gpt.GPTConfig(vocab_size=32, block_size=64, n_layer=4, n_head=4, n_embd=64))
    mesh = mesh_for("dp")
    x = shoal.to_global(torch.randint(32, (16, 64)), mesh, shoal.S(0))
    seen = {}
    for names in ([], ["blocks.*"]):
        model = shoal.distribute_module(copy.deepcopy(base), mesh,
                                        dataclasses.replace(gpt.plans(mesh, "dp"), checkpoint=names))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = shoal.compile(gpt_step)
        for _ in range(2):
            step(model, opt, x, x)
        g = step.plan.graph
        gelus = sum(1 for op in g.ops if op.device == 0 and "gelu.default" in str(op.fn))
        seen[bool(names)] = (gelus, max(step.plan.peak_bytes.values()))
    assert seen[False][0] == 4 and seen[True][0] == 8, seen
    assert seen[True][1] < seen[False][1], seen


def test_a_pattern_matching_nothing_is_an_error():
    mesh = mesh_for("dp")
    with pytest.raises(ValueError, match=r"checkpoint.*'block\.\*'.*match no submodule"):
        shoal.distribute_module(initial("gpt"), mesh, shoal.Plan(checkpoint=["block.*"]))
