"""Collective bucketing: all-reduces of small tensors (gradients reduced one by one) fused into one
all-reduce per bucket: each device flattens its pieces into one buffer, the buffer is reduced
once, and each device cuts it apart into views with the original Locals' ids (consumers are
unchanged). All-reduces join a bucket while they run over the same devices with the same op and
dtype, the bucket stays under ``bucket_bytes`` per device, and nothing between them reads a
member's result or writes a member's input; the fused all-reduce runs where the last member did.
"""

from __future__ import annotations

import math

import torch

from .. import comm
from .ir import Graph, Local, Op, Ref

__all__ = ["fuse_all_reduces"]

aten = torch.ops.aten


def _candidate(g: Graph, op: Op) -> tuple | None:
    if op.kind != "comm" or op.fn is not comm.all_reduce:
        return None
    devs, in_refs, *rest = op.args
    if any(r is None for r in in_refs) or any(r is None for r in op.outs):
        return None  # another process's devices take part: keep its collectives as they are
    outs = [g.locals[r.id] for r in op.outs]
    if not all(o.contiguous for o in outs):
        return None
    return (devs, rest[0] if rest else "sum", outs[0].dtype)


class _Bucket:
    def __init__(self, key) -> None:
        self.key = key
        self.members: list[Op] = []
        self.outs: set = set()
        self.in_bases: set = set()
        self.bytes = 0


def fuse_all_reduces(g: Graph, bucket_bytes: int) -> int:
    next_id = [max(g.locals) + 1]
    out: list = []
    open_: dict = {}
    fused = 0

    def flush(b: _Bucket) -> None:
        nonlocal fused
        del open_[b.key]
        if len(b.members) == 1:
            out.append(b.members[0])
            return
        out.extend(_fused_ops(g, b, next_id))
        fused += len(b.members) - 1

    for op in g.ops:
        # anything reading a member's result, or writing a member's input, closes that bucket first
        for b in list(open_.values()):
            if any(x in b.outs for x in op.reads) or any(g.locals[x].base in b.in_bases for x in op.writes):
                flush(b)
        key = _candidate(g, op)
        if key is None:
            out.append(op)
            continue
        size = g.locals[op.outs[0].id].nbytes or g.locals[op.outs[0].id].size_bytes
        b = open_.get(key)
        if b is not None and b.bytes + size > bucket_bytes:
            flush(b)
            b = None
        if b is None:
            b = open_[key] = _Bucket(key)
        b.members.append(op)
        b.outs |= set(op.out_ids)
        b.in_bases |= {g.locals[x].base for x in op.reads}
        b.bytes += size
    for b in list(open_.values()):
        flush(b)
    g.ops = out
    return fused


def _fused_ops(g: Graph, b: _Bucket, next_id: list) -> list:
    devs, op_name, dtype = b.key
    node = b.members[-1].node

    def new_local(device, shape, base=None) -> int:
        lid = next_id[0]
        next_id[0] += 1
        n = math.prod(shape)
        g.locals[lid] = Local(lid, device, tuple(shape), dtype, (1,) if len(shape) == 1 else (), base or lid,
                              0 if base else n * torch.empty((), dtype=dtype).element_size())
        return lid

    ops = []
    flat_in, flat_out = [], []
    sizes = [math.prod(g.locals[m.outs[0].id].shape) for m in b.members]
    total = sum(sizes)
    for i, d in enumerate(devs):
        pieces = []
        for m in b.members:
            src = m.args[1][i].id
            flat = new_local(d, (math.prod(g.locals[src].shape),), g.locals[src].base)
            g.locals[flat].stride = (1,)
            ops.append(Op("call", aten.reshape.default, (Ref(src), [-1]), {}, Ref(flat), d, node, reads=(src,),
                          out_ids=(flat,)))
            pieces.append(flat)
        buf = new_local(d, (total,))
        ops.append(Op("call", aten.cat.default, ([Ref(x) for x in pieces],), {}, Ref(buf), d, node,
                      reads=tuple(pieces), out_ids=(buf,)))
        flat_in.append(buf)
        flat_out.append(new_local(d, (total,)))
    first = b.members[0]
    ops.append(Op("comm", first.fn, (devs, [Ref(x) for x in flat_in], op_name), {}, [Ref(x) for x in flat_out], None,
                  node, reads=tuple(flat_in), out_ids=tuple(flat_out), devices=devs))
    remap = {}  # a result of the members -> the reduced buffer it becomes a view of
    for i, d in enumerate(devs):
        parts = [new_local(d, (n,), flat_out[i]) for n in sizes]
        for p in parts:
            g.locals[p].stride = (1,)
        ops.append(Op("call", aten.split_with_sizes.default, (Ref(flat_out[i]), sizes), {}, [Ref(p) for p in parts],
                      d, node, reads=(flat_out[i],), out_ids=tuple(parts)))
        for m, p in zip(b.members, parts):
            dst = m.outs[i].id
            loc = g.locals[dst]
            loc.nbytes = 0
            remap[dst] = flat_out[i]
            ops.append(Op("call", aten.view.default, (Ref(p), list(loc.shape)), {}, Ref(dst), d, node, reads=(p,),
                          out_ids=(dst,)))
    for v in g.locals.values():  # the cut-apart results view the reduced buffers, and so do views of them
        if v.base in remap:
            v.base = remap[v.base]
    return ops
