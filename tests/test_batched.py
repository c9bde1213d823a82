"""``shoal.compile`` (``batch=True``, the default): the devices' identical segments run as one batched task.

Parity: each bundled model takes 5 AdamW steps eagerly and 5 compiled with batching (the oracle and
tolerances of test_graph), under a plan whose devices run the same code (dp). The plan has fewer tasks than
the unbatched one, forward and backward ran batched, the split of the all-reduced gradient bucket
once (every input replicated) and the optimizer (it writes in place) as the loop. A batched run that
fails falls back to the loop, which computes exactly what the unbatched plan does.
"""

import pytest
import torch

import shoal
from shoal.graph import batch
from shoal.graph.batch import Batched
from shoal.testing import assert_same_value
from shoal.train import train_step as step
from test_graph import build, train
from test_models import batches


@pytest.fixture(autouse=True)
def groups_of_two(monkeypatch, request):
    """4 devices on 2 workers make groups of 2, fewer than batching takes by default (``MIN_GROUP``):
    here they merge, so that batching is checked on this world."""
    if "default" not in request.node.name:
        monkeypatch.setattr(batch, "MIN_GROUP", 2)


def batched_runs(compiled) -> list:
    return [t.run for t in compiled.plan.tasks if isinstance(t.run, Batched)]


def even_batches(name: str) -> list:
    """test_models' batches two at a time: 12 rows, an equal shard on each of 4 devices."""
    data = batches(name)
    return [(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])) for a, b in zip(data, data[1:] + data[:1])]


def fit(name: str, fn) -> tuple:
    model, opt = build(name, "dp")
    return model, [fn(model, opt, x, y).item() for x, y in even_batches(name)]


@pytest.mark.parametrize("name", ["gpt", "bert"])  # resnet: its segments differ by device (not merged)
def test_batched_steps_match_eager(name):
    eager, eager_losses = fit(name, step)
    compiled = shoal.compile(step)  # batch=True is the default
    model, losses = fit(name, compiled)
    assert compiled.traces == 1
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=1e-5, atol=1e-6)
    want, got = eager.state_dict(), model.state_dict()
    assert got.keys() == want.keys()
    for k, v in got.items():
        assert v.sbp == want[k].sbp, k
        assert_same_value(v.detach(), want[k].detach().full(), f"{name}: {k}", rtol=1e-5, atol=5e-6)

    runs = batched_runs(compiled)
    assert runs, "no segments were merged"
    assert any(r.batched for r in runs), "no merged segment ran batched"
    assert any(r.once for r in runs), "no merged segment of replicated inputs ran once"
    plain = shoal.compile(step, batch=False)
    fit(name, plain)
    assert len(compiled.plan.tasks) < len(plain.plan.tasks)


def test_uneven_shards_are_not_merged():
    """6 rows on 4 devices: shards of 2, 2, 1, 1 rows are different code; nothing merges."""
    compiled = shoal.compile(step, batch=True)
    train("gpt", "dp", compiled)
    assert not batched_runs(compiled)


def test_groups_smaller_than_the_default_are_not_merged_by_default():
    compiled = shoal.compile(step, batch=True)
    model, opt = build("gpt", "dp")
    x, y = even_batches("gpt")[0]
    for _ in range(2):
        compiled(model, opt, x, y)
    assert batch.MIN_GROUP > 2 and not batched_runs(compiled)


def test_failed_batched_run_falls_back_to_the_loop(monkeypatch):
    """A merged segment whose batched run raises (an op vmap cannot batch) runs its members in turn,
    from then on: the step then computes exactly what the unbatched plan computes."""

    def refuse(*args):
        raise RuntimeError("vmap: no batching rule")

    monkeypatch.setattr(batch, "_batched_fn", lambda t: refuse)
    (model, opt), (ref_model, ref_opt) = build("gpt", "dp"), build("gpt", "dp")
    compiled, plain = shoal.compile(step, batch=True), shoal.compile(step, batch=False)
    for x, y in even_batches("gpt"):
        assert compiled(model, opt, x, y).item() == plain(ref_model, ref_opt, x, y).item()
    runs = batched_runs(compiled)
    assert runs and not any(r.batched for r in runs) and any(r.looped for r in runs)
    for (k, a), b in zip(model.state_dict().items(), ref_model.state_dict().values()):
        assert torch.equal(a.detach().full(), b.detach().full()), k
