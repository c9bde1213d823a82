"""Run under torchrun by tests/test_multiprocess.py: rank 1 raises (or, with argument ``kill``, is
killed by SIGKILL) in the middle of training."""

import os
import signal
import sys

import torch

import shoal
from shoal import S

w = shoal.init()
mesh = shoal.Mesh(list(range(w.size)), axes=("dp",))
model = shoal.distribute_module(torch.nn.Linear(8, 4), mesh, shoal.Plan(inputs={"": S(0)}))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(16, 8)
for step in range(100):
    if step == 3 and w.rank == 1:
        if sys.argv[1:] == ["kill"]:
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("injected failure")
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    loss.item()
