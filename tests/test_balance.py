"""Cutting a module into contiguous pipeline stages balanced by cost."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from shoal.models.gpt import GPT, GPTConfig
from shoal.parallel.balance import balance, describe, partition, stage_units, unit_costs


def brute_force(costs, stages):
    """The smallest largest-stage sum over every way to cut ``costs`` into ``stages`` runs."""
    n = len(costs)
    return min(
        max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, n)))
        for cuts in itertools.combinations(range(1, n), stages - 1)
    )


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_partition_is_optimal(data):
    costs = data.draw(st.lists(st.integers(0, 100), min_size=1, max_size=8))
    stages = data.draw(st.integers(1, min(4, len(costs))))
    got = partition(costs, stages)
    assert got[0] == 0 and got[-1] == stages - 1
    assert all(b - a in (0, 1) for a, b in zip(got, got[1:]))  # contiguous, none empty
    worst = max(sum(c for c, s in zip(costs, got) if s == i) for i in range(stages))
    assert worst == brute_force(costs, stages)


class WithList(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.emb = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.seq = nn.Sequential(nn.ReLU(), nn.Linear(4, 2))
        self.head = nn.Linear(2, 2)


def test_stage_units_expand_lists():
    m = WithList()
    names = [n for n, _ in stage_units(m)]
    assert names == ["emb", "blocks.0", "blocks.1", "blocks.2", "seq.0", "seq.1", "head"]
    assert dict(stage_units(m))["blocks.1"] is m.blocks[1]


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 512), nn.Linear(512, 512), nn.Linear(512, 64), nn.Linear(64, 64))


def test_flops_cut_separates_heavy_layers():
    m, x = mlp(), torch.randn(8, 64)
    costs = unit_costs(m, (x,))
    assert costs == {"0": 2 * 8 * 64 * 512, "1": 2 * 8 * 512 * 512, "2": 2 * 8 * 512 * 64, "3": 2 * 8 * 64 * 64}
    assert balance(m, 2, (x,)) == {"0": 0, "1": 0, "2": 1, "3": 1}
    assert balance(m, 3, (x,)) == {"0": 0, "1": 1, "2": 2, "3": 2}


def test_flops_fall_back_to_params():
    m = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4))
    costs = unit_costs(m, (torch.zeros(2, 3, dtype=torch.long),))
    assert costs["0"] == 40 and costs["1"] == 2 * 6 * 4 * 4  # an embedding lookup does no FLOPs
    assert unit_costs(m) == unit_costs(m, cost="params") == {"0": 40.0, "1": 20.0}


@pytest.mark.parametrize("cost", ["flops", "time"])
def test_module_unchanged(cost):
    m = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 8))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    x = torch.randn(16, 8)
    rng = torch.get_rng_state()
    balance(m, 2, (x,), cost=cost)
    assert torch.equal(torch.get_rng_state(), rng)
    after = m.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert after[k].device.type == "cpu" and torch.equal(after[k], v), k
    assert all(not u._forward_hooks and not u._forward_pre_hooks for u in m.modules())


def test_time_costs():
    m, x = mlp(), torch.randn(8, 64)
    costs = unit_costs(m, (x,), cost="time")
    assert list(costs) == ["0", "1", "2", "3"] and all(c > 0 for c in costs.values())
    with pytest.raises(ValueError, match="example_args"):
        unit_costs(m, cost="time")


def test_errors():
    m = mlp()
    with pytest.raises(ValueError, match=r"into 5 stage\(s\): it has 4 unit\(s\).*\['0', '1', '2', '3'\]"):
        balance(m, 5)
    with pytest.raises(ValueError, match=r"into 0 stage\(s\): it has 4 unit\(s\)"):
        balance(m, 0)
    with pytest.raises(ValueError, match="cost must be one of"):
        balance(m, 2, cost="memory")

    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x) if x.sum() > 0 else x

    with pytest.raises(RuntimeError, match="meta tensors.*cost='params'"):
        balance(DataDependent(), 1, (torch.ones(2, 4),))


def test_describe():
    cut = {"a": 0, "b": 0, "c": 1}
    assert describe(cut, {"a": 1.0, "b": 2.0, "c": 1.0}) == (
        "stage 0: a..b (2 units, 75.0%)\nstage 1: c (1 unit, 25.0%)"
    )


def test_verbose_prints(capsys):
    balance(mlp(), 2, (torch.randn(8, 64),), verbose=True)
    assert capsys.readouterr().out.startswith("stage 0: 0..1 (2 units, ")


def test_gpt_four_stages():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=6))
    idx = torch.randint(0, 96, (2, 32))
    cut = balance(model, 4, (idx, idx))
    units = [n for n, _ in stage_units(model)]
    assert list(cut) == units and units[3:9] == [f"blocks.{i}" for i in range(6)]
    stages = list(cut.values())
    assert stages[0] == 0 and stages[-1] == 3 and all(b - a in (0, 1) for a, b in zip(stages, stages[1:]))
    assert all(p.device.type == "cpu" for p in model.parameters())
