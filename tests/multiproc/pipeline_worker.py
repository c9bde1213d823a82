"""Run under torchrun by tests/test_multiprocess.py, one pipeline stage per process: trained for 3
steps, each schedule equals plain torch on one device (the losses, every parameter and gradient).
With 1 device per process the mesh is (pp=2), every schedule (interleaved: 4 virtual stages, two per
process); with 4 it is (pp=2, dp=2, tp=2), 1F1B and interleaved, the blocks column-parallel over tp, and a GPT
laid out by ``auto.Parallel.to_plan`` with and without sequence parallelism, with dropout: its masks are
those of one device accumulating the micro-batches' gradients in turn (``accumulated_step``) on every
process, whatever order each process's schedule draws in."""

import sys
from pathlib import Path

import torch

import shoal

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_pipeline import accumulated_step, assert_trained_alike, even_stages, train  # noqa: E402

w = shoal.init()
torch.set_num_threads(1)
assert w.processes == 2 and w.devices_per_process in (1, 4), w
if w.devices_per_process == 1:
    mesh, params, schedules = shoal.Mesh([0, 1], axes=("pp",)), None, ("1f1b", "gpipe", "zb", "interleaved")
else:
    mesh = shoal.Mesh([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], axes=("pp", "dp", "tp"))
    params = {"blocks.*.fc.weight": (shoal.B, shoal.S(0)), "blocks.*.fc.bias": (shoal.B, shoal.S(0))}
    schedules = ("1f1b", "interleaved")
for schedule in schedules:
    stages = even_stages(4 if schedule == "interleaved" else 2)
    got, want, model, ref, _ = train(mesh, stages, schedule, m=4, plan_params=params)
    assert_trained_alike(got, want, model, ref)  # reading a value is collective: every rank runs it
    print(f"pipeline {schedule}: rank {w.rank} ok", flush=True)
if w.devices_per_process == 4:  # a GPT by auto's plans: activations cross replicated over tp (sent 1/tp,
    # all-gathered on arrival) or, with sequence parallelism, split on the sequence
    import copy

    from shoal import auto
    from shoal.models.gpt import GPT, GPTConfig
    from shoal.train import train_step

    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=4, n_head=2, n_embd=16, dropout=0.2))
    x = torch.randint(0, 16, (8, 7), generator=torch.Generator().manual_seed(1))
    for sp in (False, True):
        cfg = auto.Parallel(tp=2, pp=2, dp=2, micro_batch=1, sequence_parallel=sp, precision="fp32")
        plan, options = cfg.to_plan(mesh, batch=8, model=base)
        model = shoal.distribute_module(copy.deepcopy(base), mesh, plan)
        ref = copy.deepcopy(base)
        opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
        step = shoal.compile(train_step, **options)
        for i in range(2):
            torch.manual_seed(5 + i)
            got = step(model, opt, x, x).full()
            torch.manual_seed(5 + i)
            want = accumulated_step(ref, ref_opt, x, x, options["micro_batches"])
            torch.testing.assert_close(got, want)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach().full(), q.detach(), msg=name)
        print(f"gpt sp={sp}: rank {w.rank} ok", flush=True)
print(f"OK rank {w.rank} of {w.processes} x {w.devices_per_process} devices", flush=True)
sys.exit(0)
