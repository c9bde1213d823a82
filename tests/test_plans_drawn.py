"""Drawn plans: any parameter layouts and output pins for a small GPT (Partial pins, splits that do not
divide on 3 devices, and every pin on a 2 x 2 mesh), with ZeRO 0-3 over the mesh's first axis and
recomputed modules, train as plain torch does: each loss, the first gradients and the parameters
after three AdamW steps, eagerly and through ``shoal.compile``.
Hypothesis draws and shrinks them; the plans ``auto.layouts`` writes are of this kind, so any plan
it could propose runs as one device does."""

from __future__ import annotations

import copy
import os

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shoal
from shoal import B, P, S
from shoal.models.gpt import GPT, GPTConfig
from shoal.train import gather, train_step

EXAMPLES = int(os.environ.get("SHOAL_PLANS", "25"))
CFG = GPTConfig(vocab_size=12, block_size=6, n_layer=2, n_head=2, n_embd=8)
PARAMS = ["tok_emb.weight", "pos_emb.weight", "blocks.*.ln1.weight", "blocks.*.attn.q.weight", "blocks.*.attn.q.bias",
          "blocks.*.attn.k.weight", "blocks.*.attn.v.weight", "blocks.*.attn.proj.weight", "blocks.*.mlp.up.weight",
          "blocks.*.mlp.down.weight", "blocks.*.mlp.down.bias", "lm_head.weight"]
MODULES = ["tok_emb", "drop", "blocks.0", "blocks.*.ln1", "blocks.*.attn", "blocks.*.attn.q", "blocks.*.attn.core",
           "blocks.*.attn.proj", "blocks.*.ln2", "blocks.*.mlp", "blocks.*.mlp.up", "blocks.*.mlp.drop", "ln_f",
           "lm_head"]
MESHES = {(2,): [0, 1], (3,): [0, 1, 2], (2, 2): [[0, 1], [2, 3]]}
CHECKPOINTED = ["blocks.*", "blocks.*.attn.core", "blocks.*.mlp", "blocks.0.attn"]


@st.composite
def plans(draw):
    shape = draw(st.sampled_from(list(MESHES)))
    axes = len(shape)

    def layout(dims: int, partial: bool):
        options = [B, *(S(d) for d in range(dims))] + ([P] if partial else [])
        return tuple(draw(st.sampled_from(options)) for _ in range(axes))

    params = {n: layout(1 if n.endswith(("bias", "ln1.weight")) else 2, False)
              for n in draw(st.lists(st.sampled_from(PARAMS), unique=True, max_size=6))}
    outputs = {m: layout(3, True) for m in draw(st.lists(st.sampled_from(MODULES), unique=True, max_size=4))}
    zero = draw(st.sampled_from([0, 0, 1, 2, 3]))  # over the mesh's first axis
    checkpoint = tuple(draw(st.lists(st.sampled_from(CHECKPOINTED), unique=True, max_size=2)))
    return shape, shoal.Plan(params=params, outputs=outputs, zero=zero, checkpoint=checkpoint)


def _trains_like_one_device(shape, plan, seed: int, step) -> None:
    """Three AdamW steps of ``step`` (``train_step`` or its compiled form) under ``plan``: each loss,
    every gradient of the first backward (eagerly) and the parameters after, plain torch's."""
    torch.manual_seed(seed)
    base = GPT(CFG)
    x = torch.randint(0, CFG.vocab_size, (4, CFG.block_size), generator=torch.Generator().manual_seed(seed))
    want_model = copy.deepcopy(base)
    want_opt = torch.optim.AdamW(want_model.parameters(), lr=1e-2)
    model = shoal.distribute_module(copy.deepcopy(base), shoal.Mesh(MESHES[shape]), plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if step is train_step:  # the first step by hand: its gradients too
        want, got = want_model(x, x)[1], model(x, x)[1]
        want.backward()
        got.backward()
        torch.testing.assert_close(got.full(), want.detach(), rtol=1e-5, atol=1e-6)
        for (name, p), (_, q) in zip(model.named_parameters(), want_model.named_parameters()):
            torch.testing.assert_close(p.grad.full(), q.grad, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, name=name: f"{name}: {m}")
        for o in (opt, want_opt):
            o.step()
            o.zero_grad(set_to_none=True)
    for _ in range(2 if step is train_step else 3):
        want = train_step(want_model, want_opt, x, x).detach()
        torch.testing.assert_close(step(model, opt, x, x).full(), want, rtol=1e-5, atol=1e-6)
    state = gather(model).state_dict()
    for name, p in want_model.state_dict().items():
        torch.testing.assert_close(state[name], p, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


@settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None, print_blob=False)
@given(drawn=plans(), seed=st.integers(0, 3))
def test_a_drawn_plan_trains_like_one_device(drawn, seed):
    _trains_like_one_device(*drawn, seed, train_step)


@settings(max_examples=max(EXAMPLES // 3, 1), derandomize=True, database=None, deadline=None, print_blob=False)
@given(drawn=plans(), seed=st.integers(0, 3))
def test_a_drawn_plan_trains_compiled_like_one_device(drawn, seed):
    _trains_like_one_device(*drawn, seed, shoal.compile(train_step))


def test_found_a_pinned_projection_viewed_into_heads():
    """Found by the test above: q's output pinned split on the sequence, the block's input split on
    the hidden dim; a shard then viewed into heads had strides its GlobalTensor did not (a view of
    any layout now copies where the shard cannot be viewed, as reshape does)."""
    plan = shoal.Plan(outputs={"drop": S(2), "blocks.*.attn.q": S(1)})
    _trains_like_one_device((2,), plan, 0, train_step)


def test_a_stage_plan_without_a_batch_layout_is_staged_onto_a_two_axis_mesh():
    """``Plan.staged`` of a plan that lays out no batch (parameters alone) on a (pp, tp) mesh: the
    batch is left as it comes (it gave a one-axis layout for the two-axis mesh), and the pipelined
    step trains as plain torch does."""
    cfg = GPTConfig(vocab_size=12, block_size=6, n_layer=4, n_head=2, n_embd=8)
    plan = shoal.Plan(params={"blocks.*.mlp.up.weight": (S(0),), "blocks.*.mlp.down.weight": (S(1),)}).staged("auto")
    assert "" not in plan.inputs
    torch.manual_seed(0)
    base = GPT(cfg)
    x = torch.randint(0, cfg.vocab_size, (4, cfg.block_size), generator=torch.Generator().manual_seed(0))
    want_model = copy.deepcopy(base)
    want_opt = torch.optim.AdamW(want_model.parameters(), lr=1e-2)
    model = shoal.distribute_module(copy.deepcopy(base), shoal.Mesh([[0, 1], [2, 3]], axes=("pp", "tp")), plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = shoal.compile(train_step, micro_batches=2)
    for _ in range(3):
        want = train_step(want_model, want_opt, x, x).detach()
        torch.testing.assert_close(step(model, opt, x, x).full(), want, rtol=1e-5, atol=1e-6)
