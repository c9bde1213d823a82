"""Run under torchrun (4 processes x 1 device) by tests/test_multiprocess.py: a Mesh makes no process
group; the first collective over a mesh's ranks makes that group, on those ranks alone."""

import torch

import shoal
from shoal import B, S
from shoal.comm.dist import groups_made

w = shoal.init()
rank = w.rank
assert groups_made() == [], groups_made()
pair = shoal.Mesh([1, 2])
trio = shoal.Mesh([0, 1, 3])
everyone = shoal.Mesh([0, 1, 2, 3])
assert groups_made() == [], f"rank {rank}: a Mesh made groups {groups_made()}"

v = torch.arange(12.0).reshape(6, 2)
x = shoal.to_global(v, pair, S(0))  # placing shards: no collective across processes
assert groups_made() == [], f"rank {rank}: to_global made groups {groups_made()}"
y = x.to_global(pair, B)  # an all-gather over ranks 1 and 2
want = [(1, 2)] if rank in (1, 2) else []
assert groups_made() == want, f"rank {rank}: {groups_made()} after a collective over ranks 1, 2"
z = shoal.to_global(v, trio, S(0)).to_global(trio, B)  # then over 0, 1, 3: rank 1 joins a second group
want = sorted(want + ([(0, 1, 3)] if rank in (0, 1, 3) else []))
assert groups_made() == want, f"rank {rank}: {groups_made()}"
assert torch.equal(y.full(), v) and torch.equal(z.full(), v)  # full() broadcasts over the default group
assert torch.equal(shoal.to_global(v, everyone, S(1)).to_global(everyone, B).full(), v)
print(f"GROUPS OK rank {rank}: {groups_made()}", flush=True)
