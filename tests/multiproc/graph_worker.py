"""Run under torchrun by tests/test_multiprocess.py: a compiled GPT step equals the eager one when
the collectives cross processes (the same plan; the runtime's collectives call torch.distributed),
also when it resumes from a checkpoint each process saved (its own shards) half-way, into a
directory given as the first argument."""

import sys
from pathlib import Path

import torch

import shoal
from shoal.models import gpt
from shoal.testing import assert_same_value
from shoal.train import train_step as step

w = shoal.init()
torch.set_num_threads(1)
assert w.size == 4, w
meshes = {"dp": shoal.Mesh([0, 1, 2, 3], axes=("dp",)), "dp,tp": shoal.Mesh([[0, 1], [2, 3]], axes=("dp", "tp"))}


def build(kind):
    torch.manual_seed(0)
    m = gpt.GPT(gpt.GPTConfig(vocab_size=13, block_size=8, n_layer=2, n_head=4, n_embd=32))
    mesh = meshes[kind]
    m = shoal.distribute_module(m, mesh, gpt.plans(mesh, kind))
    return m, torch.optim.AdamW(m.parameters(), lr=1e-3)


g = torch.Generator().manual_seed(1)
data = [(torch.randint(13, (8, 8), generator=g), torch.randint(13, (8, 8), generator=g)) for _ in range(4)]
ckpt = Path(sys.argv[1]) / f"{w.rank}.pt"
for kind in meshes:
    (a, oa), (b, ob) = build(kind), build(kind)
    compiled = shoal.compile(step)
    for i, (x, y) in enumerate(data):
        if i == 2:  # each process saves and loads its own shards
            torch.save({"model": b.state_dict(), "opt": ob.state_dict()}, ckpt)
            saved = torch.load(ckpt)
            b, ob = build(kind)
            b.load_state_dict(saved["model"])
            ob.load_state_dict(saved["opt"])
        la, lb = step(a, oa, x, y).item(), compiled(b, ob, x, y).item()
        assert abs(la - lb) <= 1e-5 * abs(la), (kind, i, la, lb)
    assert compiled.traces == 2, compiled.traces  # the first step eagerly; a new model and optimizer after the load
    comms = sum(op.kind == "comm" for op in compiled.graph.ops)
    assert comms > 0
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert_same_value(q.detach(), p.detach().full(), f"{kind}: {n}", rtol=1e-5, atol=5e-6)
    print(f"graph {kind}: rank {w.rank} ok, {comms} collectives", flush=True)
print(f"OK rank {w.rank} of {w.processes} x {w.devices_per_process} devices", flush=True)
sys.exit(0)
