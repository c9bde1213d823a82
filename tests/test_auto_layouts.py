"""Per-op layouts by an integer program (``auto.layouts``): hand-checked choices, and the GPT's plan
running in shoal like plain torch."""

import copy
import dataclasses
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import shoal
from shoal import auto
from shoal.auto.cluster import Link
from shoal.auto.layouts import _dispatched, _Pricer, box_seconds, gpt_layouts, solve, trace
from shoal.models import gpt
from shoal.models.gpt import GPT, GPTConfig
from shoal.sbp import Broadcast, Partial, Split
from shoal.train import gather, train_step

B, S = Broadcast(), Split
A100 = auto.Cluster.preset("a100-80gb", devices=8)


class MLP(nn.Module):
    """Two matrix multiplies around a GELU (the trace's backward starts from the output's sum)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Regression(MLP):
    """The MLP's mean squared error against a target: the loss needs the whole output."""

    def forward(self, x, y):
        return F.mse_loss(super().forward(x), y)


def _args(tokens: int, d: int):
    return torch.zeros(tokens, d, device="meta"), torch.zeros(tokens, d, device="meta")


SLOW = auto.Cluster(name="slow", devices=4, flops={"fp32": 1e12}, memory=float("inf"), hbm=1e11,
                    links=(Link("slow", None, alpha=1e-3, bandwidth=1e8),), gemm_efficiency=1.0,
                    gemm_half=16.0, op_overhead=1e-6)


def test_boxing_is_priced_by_the_clusters_collectives():
    shape, n = (1024, 256), 4
    nbytes = 1024 * 256 * 2
    assert box_seconds(A100, (n,), shape, 2, (Partial("sum"),), (B,)) == pytest.approx(A100.all_reduce(nbytes, n))
    assert box_seconds(A100, (n,), shape, 2, (S(0),), (B,)) == pytest.approx(A100.all_gather(nbytes, n))
    assert box_seconds(A100, (n,), shape, 2, (B,), (S(1),)) == 0.0  # a local slice
    # on a 2x2 mesh the inner axis' groups are neighbours, the outer one's two apart; each works on half
    assert box_seconds(A100, (2, 2), shape, 2, (S(0), Partial("sum")), (S(0), B)) == pytest.approx(
        A100.all_reduce(nbytes / 2, 2, 1))


def test_a_large_mlp_is_column_then_row_parallel():
    """Megatron's MLP: the up projection split on its outputs, the down one on its inputs (its bias
    whole, added once to the partial sums); the output stays a partial sum into the loss, so nothing
    but the scalar loss is communicated."""
    tokens, d, tp = 2048, 4096, 4
    x = _args(tokens, d)[:1]
    with torch.device("meta"):
        mlp = MLP(d)
    got = solve(mlp, x, A100, (tp,), precision="bf16")
    assert got.params == {"up.weight": (S(0),), "up.bias": (S(0),), "down.weight": (S(1),), "down.bias": (B,)}
    assert got.breakdown["communication"] <= A100.all_reduce(4, tp)
    replicated = solve(mlp, x, A100, (tp,), precision="bf16", fixed={"*": B})
    # replicated weights: some matmuls split by tokens instead, and their weight's gradient is all-reduced
    assert replicated.breakdown["communication"] >= A100.all_reduce(4 * d * d * 2, tp)
    assert got.seconds < replicated.seconds
    assert got.plan().params == {"up.weight": (S(0),), "up.bias": (S(0),), "down.weight": (S(1),)}


def test_tiny_matrices_on_a_slow_link_stay_replicated():
    got = solve(Regression(8), _args(4, 8), SLOW, (4,))
    assert set(got.params.values()) == {(B,)} and got.breakdown["communication"] == 0.0
    assert got.plan().params == {}
    # nothing split: dispatch's own decisions (every op on Broadcast) cost what the program priced
    assert got.dispatched == pytest.approx(got.breakdown, rel=1e-9)
    mega = solve(Regression(8), _args(4, 8), SLOW, (4,), fixed={"up.*": S(0), "down.weight": S(1)})
    assert mega.seconds > got.seconds + 1e-3  # Megatron's layout pays at least an all-reduce's alpha


def test_a_memory_limit_forces_the_parameters_apart():
    """Replicated parameters' states (16 bytes each in fp32 under Adam) exceed the limit: the program
    must split them even where replication is faster."""
    params = 8 * 32 + 32 + 32 * 8 + 8
    got = solve(Regression(8), _args(4, 8), SLOW, (4,), memory=16 * params / 2)
    assert sum(16 * _numel(n) / (4 if lay != (B,) else 1) for n, lay in got.params.items()) <= 16 * params / 2
    assert any(lay != (B,) for lay in got.params.values())
    with pytest.raises(ValueError, match="no solution"):
        solve(Regression(8), _args(4, 8), SLOW, (4,), memory=16 * params / 8)


def _numel(name: str) -> int:
    return dict(MLP(8).named_parameters())[name].numel()


def _trains_like_one_device(plan, mesh) -> None:
    """``plan`` on a small GPT (the bundled GPT's names; its split dims divide) trains as plain torch does."""
    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=4, n_head=4, n_embd=16))
    model = shoal.distribute_module(copy.deepcopy(base), mesh, plan)
    assert any(isinstance(p, shoal.GlobalTensor) and any(s != B for s in p.sbp) for p in model.parameters())
    want_model = copy.deepcopy(base)
    opt, want_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, want_model))
    x = torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        want = train_step(want_model, want_opt, x, x).detach()
        got = train_step(model, opt, x, x)
        torch.testing.assert_close(got.full(), want, rtol=1e-5, atol=0)
    state = gather(model).state_dict()
    for name, p in want_model.state_dict().items():
        torch.testing.assert_close(state[name], p, msg=name)


@pytest.mark.parametrize("tp", [2, 4])
def test_the_gpts_layouts_beat_or_match_megatron_and_train_like_one_device(tp):
    with torch.device("meta"):
        big = GPT(GPTConfig())  # the bundled GPT, priced on A100s
    best, mega = gpt_layouts(big, A100, tp, batch=8, precision="bf16")
    assert best.optimum <= mega.seconds * (1 + 1e-4)  # HiGHS stops within a relative gap of 1e-4
    assert best.optimum <= best.seconds * (1 + 1e-4) and mega.optimum == mega.seconds
    assert mega.params["blocks.0.mlp.up.weight"] == (S(0),) and mega.params["blocks.0.attn.proj.weight"] == (S(1),)
    assert mega.outputs == dict(gpt.plans((tp,), "tp").outputs)  # Megatron's pins, each moving something
    # dispatch picks each op's signature by its inputs' boxing alone: the step as shoal runs it costs
    # more than the program's, for both; the layouts the program moved toward what dispatch runs
    # fastest are still faster than Megatron's as dispatch runs both
    assert sum(mega.dispatched.values()) >= mega.seconds * (1 - 1e-4)
    assert sum(best.dispatched.values()) >= best.seconds * (1 - 1e-4)
    assert sum(best.dispatched.values()) < sum(mega.dispatched.values())
    _trains_like_one_device(best.plan(), shoal.Mesh(list(range(tp)), axes=("tp",)))



def test_a_twin_of_three_layers_lays_out_every_block_of_a_deep_gpt():
    with torch.device("meta"):
        deep = GPT(GPTConfig(n_layer=12))
    best, mega = gpt_layouts(deep, A100, 4, batch=8, precision="bf16", layers=3)
    names = [n for n, _ in deep.named_parameters()]
    assert list(best.params) == names and list(mega.params) == names
    for n in names:  # Megatron's layouts reach every block through the twin
        want = (S(0),) if n.startswith("blocks.") and (".attn.q" in n or ".attn.k" in n or ".attn.v" in n
                                                      or ".mlp.up" in n) else (B,)
        if n.endswith(("attn.proj.weight", "mlp.down.weight")):
            want = (S(1),)
        if n in ("tok_emb.weight", "lm_head.weight"):
            want = (S(0),)
        assert mega.params[n] == want, n
    for i in range(1, 11):  # the middle blocks share the twin's middle block's layouts
        assert best.params[f"blocks.{i}.mlp.up.weight"] == best.params["blocks.1.mlp.up.weight"]


def test_the_searchs_layouts_lay_out_a_dp_tp_mesh_through_to_plan():
    """The program's tp layouts (for a tp group) given to ``Parallel.to_plan`` on a (dp, tp) mesh:
    parameters Broadcast on dp, output pins split on the batch over dp (under sp: sp's own pins), a
    plan that trains as plain torch does."""
    with torch.device("meta"):
        big = GPT(GPTConfig())  # the bundled GPT, priced on A100s; the layouts train a small twin
    best, _ = gpt_layouts(big, A100, 2, batch=8, precision="bf16")
    mesh = shoal.Mesh([[0, 1], [2, 3]], axes=("dp", "tp"))
    par = auto.Parallel(tp=2, dp=2, pp=1, micro_batch=2, precision="fp32")
    plan, _ = par.to_plan(mesh, batch=4, layouts=best)
    assert plan.params and all(lay[0] == B and lay[1] == best.params[n][0] for n, lay in plan.params.items())
    assert best.outputs and plan.outputs == {k: (S(0), v[0]) for k, v in best.plan().outputs.items()}
    _trains_like_one_device(plan, mesh)
    sp, _ = dataclasses.replace(par, sequence_parallel=True).to_plan(mesh, batch=4, layouts=best)
    assert sp.params == plan.params and sp.regather  # sequence parallelism keeps its own pins
    _trains_like_one_device(sp, mesh)
    with pytest.raises(TypeError, match="auto.Layouts"):
        par.to_plan(mesh, layouts=best.params)
    with pytest.raises(ValueError, match="layouts of a tp group"):
        par.to_plan(mesh, layouts=dataclasses.replace(best, params={"lm_head.weight": (B, S(0))}))


def _replayed(module, args, cluster, tp: int, lay) -> Counter:
    """Bytes by collective kind of the step ``Layouts.dispatched`` prices for ``lay``'s plan."""
    log = []
    _dispatched(trace(module, args, (tp,)), lay.params, _Pricer(cluster, (tp,), "fp32", log), lay.outputs)
    out = Counter()
    for kind, nbytes, _ in log:
        out[kind] += nbytes
    return out


def _compiled(module, args, tp: int, plan) -> Counter:
    """Bytes by collective kind of shoal's compiled training step (the output summed, AdamW) of
    ``module(*args)`` under ``plan`` on ``tp`` devices, traced in a world of meta devices."""
    from shoal.auto.census import count
    from shoal.world import meta_world

    def step(m, opt, *a):
        opt.zero_grad()
        loss = m(*a).sum()
        loss.backward()
        opt.step()
        return loss

    with meta_world(tp):
        model = shoal.distribute_module(copy.deepcopy(module).to("meta"), shoal.Mesh(list(range(tp))), plan)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        compiled = shoal.compile(step)
        for _ in range(2):  # the first call makes the optimizer's state eagerly, the second is traced
            compiled(model, opt, *(torch.zeros(a.shape) for a in args))
    out = Counter()
    for c in count(compiled.graph):
        out[c.kind] += c.nbytes
    return out


def test_an_output_pin_that_moves_a_value_is_priced_as_shoal_runs_it():
    """Megatron's MLP with its output pinned whole: forward, the row-parallel partial sum is reduced
    at the pin; backward, the pin hands its gradient on in the layout the value came in (reduced).
    The replay of dispatch moves the bytes shoal's compiled step moves; a pin that moves nothing is
    not kept."""
    tokens, d, tp = 64, 32, 4
    x = _args(tokens, d)[:1]
    mega = {"up.*": S(0), "down.weight": S(1)}
    pinned = solve(MLP(d), x, SLOW, (tp,), fixed=mega, outputs={"down": B})
    free = solve(MLP(d), x, SLOW, (tp,), fixed=mega, outputs={"up": S(1)})  # where dispatch puts it anyway
    assert pinned.outputs == {"down": B} and free.outputs == {}
    assert pinned.plan().outputs == {"down": B}
    for lay in (pinned, free):
        assert _replayed(MLP(d), x, SLOW, tp, lay) == _compiled(MLP(d), x, tp, lay.plan())
    assert _replayed(MLP(d), x, SLOW, tp, pinned)["all_reduce"] >= tokens * d * 4  # the pin's reduction


_LAYOUTS = st.sampled_from([B, S(0), S(1)])


@settings(max_examples=20, derandomize=True, database=None, deadline=None, print_blob=False)
@given(up=_LAYOUTS, down=_LAYOUTS, pins=st.dictionaries(st.sampled_from(["up", "down"]),
                                                          st.sampled_from([B, S(0), S(1), Partial()]), max_size=2),
       tp=st.sampled_from([2, 3]))
def test_drawn_layouts_and_pins_are_replayed_as_shoal_compiles_them(up, down, pins, tp):
    """Any parameter layouts and output pins of the MLP (Partial pins, and on 3 devices splits that do
    not divide, included): the replay of dispatch moves the bytes of shoal's compiled step, kind by
    kind."""
    x = _args(12, 8)[:1]
    lay = solve(MLP(8), x, SLOW, (tp,), fixed={"up.weight": up, "down.weight": down}, outputs=pins)
    assert _replayed(MLP(8), x, SLOW, tp, lay) == _compiled(MLP(8), x, tp, lay.plan())


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("which", ["program", "megatron"])
def test_the_replay_of_dispatch_moves_the_bytes_of_the_step_shoal_compiles(which, tp):
    """What ``Layouts.dispatched`` prices (dispatch's decisions, the pins, a Partial value reduced once)
    is what shoal runs: the collectives' bytes of the compiled training step of the same plan (traced in
    a world of meta devices), kind by kind."""
    from shoal.auto.census import count, traced_step
    from shoal.world import meta_world

    mcfg = GPTConfig(n_layer=1)
    with torch.device("meta"):
        model = GPT(mcfg)
    best, mega = gpt_layouts(model, A100, tp, batch=4)
    lay = best if which == "program" else mega
    assert lay.outputs
    idx = torch.zeros(4, mcfg.block_size, dtype=torch.long, device="meta")
    replay, real = _replayed(model, (idx, idx), A100, tp, lay), Counter()
    with meta_world(tp):
        graph = traced_step(mcfg, auto.Parallel(tp=tp, dp=1, pp=1, micro_batch=4, precision="fp32"),
                            layouts=best if which == "program" else None)
    for c in count(graph):
        real[c.kind] += c.nbytes
    total = sum(real.values())
    for kind in {*replay, *real}:  # the loss's few scalars and rows aside, kind by kind
        assert replay[kind] == pytest.approx(real[kind], abs=1e-3 * total), kind

