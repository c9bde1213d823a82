"""Weights tied across pipeline stages (an embedding on the first stage, the output head on the last,
as GPT ties them): one parameter, laid out on the union of its stages' sub-meshes, its gradients
summed across the stages. The oracle is plain torch on one device (``test_pipeline``'s)."""

import copy

import pytest
import torch
from torch import nn

import shoal
from shoal.testing import assert_same_value
from test_pipeline import PP_DP, Block, assert_trained_alike, step_fn

B, S = shoal.B, shoal.S
VOCAB, WIDTH = 12, 16


class TiedLM(nn.Module):
    """Embedding, blocks, and a head whose weight is the embedding's."""

    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(blocks))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids, y):
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def stages(n: int) -> dict:
    """The embedding on stage 0, block i on stage i (of n), the head on the last."""
    return {"emb": 0, **{f"blocks.{i}": i for i in range(n)}, "head": n - 1}


def batch(mesh):
    lay = tuple(S(0) if a == "dp" else B for a in mesh.axes)
    ids, y = torch.randint(0, VOCAB, (8, 5)), torch.randint(0, VOCAB, (8, 5))
    return ids, y, shoal.to_global(ids, mesh, lay), shoal.to_global(y, mesh, lay)


def train(mesh, n_stages: int, schedule: str, m: int = 4, zero: int = 0):
    """(losses, final parameters) of shoal's pipelined AdamW steps and of plain torch on one device."""
    torch.manual_seed(0)
    ref = TiedLM(n_stages)
    model = shoal.distribute_module(copy.deepcopy(ref), mesh, shoal.Plan(stages=stages(n_stages), zero=zero))
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    step = shoal.compile(step_fn, micro_batches=m, schedule=schedule)
    got, want = [], []
    for _ in range(3):
        ids, y, gids, gy = batch(mesh)
        got.append(step(model, opt, gids, gy))
        want.append(step_fn(ref, ref_opt, ids, y).detach())
    return got, want, model, ref, step


MESHES = {"pp2": ([0, 1], ("pp",)), "pp2_dp2": PP_DP}


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("mesh", MESHES)
def test_tied_embedding_and_head_train_as_one_device(mesh, schedule):
    mesh = shoal.Mesh(*MESHES[mesh])
    got, want, model, ref, _ = train(mesh, 2, schedule)
    assert_trained_alike(got, want, model, ref)
    w = model.emb.weight
    assert w is model.head.weight and len(list(model.parameters())) == len(list(ref.parameters()))
    assert w.mesh == mesh and w.sbp == (B,) * mesh.ndim  # the union of both stages' sub-meshes
    assert w._shoal_stage == (0, 1)
    assert model.blocks[0].fc.weight.mesh != mesh  # the others stay on their stage


@pytest.mark.parametrize("schedule,n_stages,devices", [("zb", 2, 2), ("interleaved", 4, 2), ("1f1b", 4, 4)])
def test_tied_across_other_schedules_and_stage_counts(schedule, n_stages, devices):
    """Zero-bubble's split backward; virtual stages (stages 0 and 3 on devices 0 and 1); four stages,
    where the weight lives on the first and last devices only."""
    mesh = shoal.Mesh(list(range(devices)), axes=("pp",))
    got, want, model, ref, _ = train(mesh, n_stages, schedule)
    assert_trained_alike(got, want, model, ref)
    first, last = mesh.devices[0], mesh.devices[(n_stages - 1) % devices]
    assert model.emb.weight.mesh.devices == (first, last)


@pytest.mark.parametrize("zero", [1, 3])
def test_tied_with_zero_inside_stages(zero):
    got, want, model, ref, _ = train(shoal.Mesh(*PP_DP), 2, "1f1b", zero=zero)
    assert_trained_alike(got, want, model, ref)


def test_tied_gradient_crosses_no_stage_per_micro_batch():
    """Each stage's gradient of the tied weight stays a partial sum on its own devices through the
    micro-batches: the body moves only the activation forward and its gradient back."""
    *_, step = train(shoal.Mesh([0, 1], axes=("pp",)), 2, "1f1b", m=4)
    comms = [t for t in step.plan.tasks if t.kind != "compute"]
    assert len(comms) == 2 and all("transfer" in t.name for t in comms), [t.name for t in comms]


def test_clip_grad_norm_sees_every_stage():
    """SGD (which sees the gradients' scale) after clipping by the norm over all stages, the tied
    weight's gradient counted once: the clipped gradients and the parameters equal one device's."""
    mesh = shoal.Mesh(*PP_DP)
    torch.manual_seed(0)
    ref = TiedLM()
    model = shoal.distribute_module(copy.deepcopy(ref), mesh, shoal.Plan(stages=stages(2)))
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)

    def body(model, opt, ids, y):
        opt.zero_grad()
        loss = model(ids, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        return loss

    step = shoal.compile(body, micro_batches=4, schedule="gpipe")
    for _ in range(3):
        ids, y, gids, gy = batch(mesh)
        assert_same_value(step(model, opt, gids, gy), body(ref, ref_opt, ids, y), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_same_value(p.grad, q.grad, rtol=1e-4, atol=1e-7)
        assert_same_value(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)

    ids, y, gids, gy = batch(mesh)  # eager, where clip_grad_norm_ returns the norm
    for mod, x, t in ((model, gids, gy), (ref, ids, y)):
        mod.zero_grad()
        mod(x, t).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    assert_same_value(norm, torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05), rtol=1e-5, atol=1e-6)


def test_tied_on_two_virtual_stages_of_one_device():
    """Stages 0 and 2 both run on device 0 (interleaved): the weight stays on that device's sub-mesh,
    and neither stage's ops are filed under the other's."""

    class WithPost(TiedLM):
        def __init__(self) -> None:
            super().__init__()
            self.post = nn.Linear(VOCAB, VOCAB)

        def forward(self, ids, y):
            h = self.emb(ids)
            for b in self.blocks:
                h = b(h)
            return nn.functional.cross_entropy(self.post(self.head(h)).flatten(0, 1), y.flatten())

    mesh = shoal.Mesh([0, 1], axes=("pp",))
    torch.manual_seed(0)
    ref = WithPost()
    plan = shoal.Plan(stages={"emb": 0, "blocks.0": 1, "blocks.1": 2, "head": 2, "post": 3})
    model = shoal.distribute_module(copy.deepcopy(ref), mesh, plan)
    assert model.emb.weight.mesh.devices == (0,) and model.emb.weight._shoal_stage == (0, 2)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    step = shoal.compile(step_fn, micro_batches=4, schedule="interleaved")
    got, want = [], []
    for _ in range(3):
        ids, y, gids, gy = batch(mesh)
        got.append(step(model, opt, gids, gy))
        want.append(step_fn(ref, ref_opt, ids, y).detach())
    assert_trained_alike(got, want, model, ref)
