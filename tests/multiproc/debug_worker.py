"""Run under torchrun with SHOAL_DEBUG=1: the ranks feed different plain tensors into one op."""

import torch

import shoal
from shoal import S

w = shoal.init()
mesh = shoal.Mesh(list(range(w.size)))
x = shoal.to_global(torch.ones(4, 3), mesh, S(0))
y = x * 2  # the same everywhere: fine
mask = torch.full((4, 3), float(w.rank))  # differs between ranks: must be reported, not silently used
z = x * mask
print("NOT DETECTED", flush=True)
