"""Run under torchrun by tests/test_multiprocess.py with 2 processes of one device each: a pipeline
of two stages, one per process, trained with each schedule for 3 steps equals plain torch on one
device (the losses and every parameter)."""

import copy
import sys
from pathlib import Path

import torch

import shoal
from shoal.testing import assert_same_value

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_pipeline import Net, even_stages, step_fn  # noqa: E402

w = shoal.init()
torch.set_num_threads(1)
assert w.size == 2 and w.processes == 2, w
mesh = shoal.Mesh([0, 1], axes=("pp",))
for schedule in ("1f1b", "gpipe", "zb"):
    torch.manual_seed(0)
    ref = Net(4)
    model = shoal.distribute_module(copy.deepcopy(ref), mesh, shoal.Plan(stages=even_stages(2)))
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))

    step = shoal.compile(step_fn, micro_batches=4, schedule=schedule)

    g = torch.Generator().manual_seed(1)
    for i in range(3):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        got = step(model, opt, shoal.to_global(x, mesh, shoal.B), shoal.to_global(y, mesh, shoal.B))
        ref_opt.zero_grad()
        want = ref(x, y)
        want.backward()
        ref_opt.step()
        assert abs(got.item() - want.item()) <= 1e-5 * abs(want.item()), (schedule, i, got.item(), want.item())
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):  # reading a value is collective: all ranks
        assert_same_value(p.detach(), q.detach(), f"{schedule}: {n}", rtol=1e-5, atol=1e-5)
    print(f"pipeline {schedule}: rank {w.rank} ok", flush=True)
print(f"OK rank {w.rank} of {w.processes} x {w.devices_per_process} devices", flush=True)
sys.exit(0)
