"""Run under torchrun (2 processes x 2 devices) with SHOAL_DEBUG=1: each way of making or using a global
value from values that differ between the ranks is reported, on every rank alike (so the run goes
on); what may differ (Split and Partial pieces) is not."""

import torch

import shoal
from shoal import B, P, S

w = shoal.init()
assert w.processes == 2 and w.size == 4, w
line = shoal.Mesh(list(range(w.size)))
grid = shoal.Mesh([[0, 1], [2, 3]], axes=("dp", "tp"))  # dp crosses the processes, tp stays inside
mine = float(w.rank)


def diverges(name, make):
    try:
        make()
    except RuntimeError as e:
        print(f"CAUGHT {name} on rank {w.rank}: {e}", flush=True)
    else:
        print(f"NOT DETECTED {name}", flush=True)


x = shoal.to_global(torch.ones(4, 3), line, S(0))
y = x * 2  # the same everywhere: fine
diverges("op", lambda: x * torch.full((4, 3), mine))  # a plain tensor taken as Broadcast
diverges("to_global", lambda: shoal.to_global(torch.full((4, 3), mine), line, S(0)))
# devices 0 and 2 (1 and 3) differ only along dp, laid out B: their pieces must be equal
pieces = {d: torch.full((2, 3), float(grid.coord_of(d)[1])) for d in w.local_devices}
shoal.from_local(pieces, grid, [B, S(0)], shape=(4, 3))
apart = {d: t + mine for d, t in pieces.items()}
diverges("from_local", lambda: shoal.from_local(apart, grid, [B, S(0)], shape=(4, 3)))
# pieces that may differ: Split and Partial ones
own = {d: torch.full((2, 3), float(d)) for d in w.local_devices}
for sbp, shape in (([S(0), S(0)], (8, 3)), ([P, S(0)], (4, 3)), ([S(0), P], (4, 3))):
    shoal.from_local(own, grid, sbp, shape=shape)
print(f"DEBUG OK rank {w.rank}", flush=True)
