"""Passes over the IR: dead code, common subexpressions, collective bucketing; the verifier runs
after each. SBP selection keeps eager's choices (the trace records them) and boxing is explicit
from the start (box nodes); memory planning happens where segments are compiled (``lower``).
"""

from __future__ import annotations

import torch

from .ir import Graph, Op, Ref
from .verify import verify

__all__ = ["run_passes", "dead_code", "common_subexpressions", "bucket_collectives", "PASSES"]


def _bases(g: Graph, lids) -> set:
    return {g.locals[x].base for x in lids if x is not None}


def _observed(g: Graph) -> tuple[set, set]:
    """Locals the caller gets back, and storages that outlive the step (state, inputs)."""
    lids = g.returned()
    return lids, _bases(g, g.bound() | lids)


def _shared(op: Op, w) -> bool:
    """A collective or transfer another process takes part in: what it does for that process (a
    send to it) is not visible here, and every process must run the same ones."""
    return op.kind == "comm" and not all(w.owns(d) for d in op.devices)


def dead_code(g: Graph) -> int:
    """Drop ops whose results nothing reads and that write nothing that outlives them."""
    from ..world import world

    w = world()
    need, bases = _observed(g)
    keep = []
    for op in reversed(g.ops):
        live = (
            any(x in need for x in op.out_ids)
            or any(g.locals[x].base in bases for x in op.writes)
            or op.random  # the random stream must advance as in eager
            or _shared(op, w)
        )
        if live:
            keep.append(op)
            need |= set(op.reads)
            bases |= _bases(g, op.reads)
    removed = len(g.ops) - len(keep)
    g.ops = keep[::-1]
    return removed


def _key(op: Op):
    def k(a):
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(k(e) for e in a))
        if isinstance(a, torch.Tensor):
            return ("tensor", id(a))
        try:
            hash(a)
        except TypeError:
            return ("id", id(a))
        return (type(a).__name__, a)

    return (op.kind, op.device, op.fn, k(op.args), tuple(sorted((n, k(v)) for n, v in op.kwargs.items())))


def common_subexpressions(g: Graph) -> int:
    """An op repeating an earlier one on the same inputs (not written in between) reuses its results.
    Only ops that write nothing, draw no random numbers and whose results are never written."""
    written = {g.locals[x].base for op in g.ops for x in op.writes}
    observed, _ = _observed(g)
    seen: dict = {}
    by_base: dict = {}  # base -> keys reading it

    def visit(op: Op, rename: dict) -> bool:
        for x in op.writes:
            for key in by_base.pop(g.locals[x].base, ()):
                seen.pop(key, None)
        pure = (op.kind in ("call", "host") and not op.writes and not op.random and op.out_ids
                and not any(g.locals[x].base in written or x in observed for x in op.out_ids))
        if not pure:
            return True
        key = _key(op)
        first = seen.get(key)
        if first is not None and len(first.out_ids) == len(op.out_ids):
            rename.update(zip(op.out_ids, first.out_ids))
            return False
        seen[key] = op
        for b in _bases(g, op.reads):
            by_base.setdefault(b, []).append(key)
        return True

    return _rewrite(g, visit)


def _rewrite(g: Graph, visit) -> int:
    """Walk the ops in order, each reading what earlier ops were renamed to; ``visit(op, rename)``
    may add renames and returns whether to keep the op. Returns how many ops went."""
    rename: dict = {}
    out = []
    for op in g.ops:
        if rename:
            _rename_op(op, rename)
        if visit(op, rename):
            out.append(op)
    removed = len(g.ops) - len(out)
    g.ops = out
    if rename:
        _rename_results(g, rename)
    return removed


def _rename_op(op: Op, rename: dict) -> None:
    def r(a):
        if isinstance(a, Ref):
            return Ref(rename.get(a.id, a.id))
        if isinstance(a, list):
            return [r(e) for e in a]
        if isinstance(a, tuple):
            return tuple(r(e) for e in a)
        return a

    if any(x in rename for x in op.reads) or any(x in rename for x in op.writes):
        op.args, op.kwargs = r(op.args), {k: r(v) for k, v in op.kwargs.items()}
        op.reads = tuple(rename.get(x, x) for x in op.reads)
        op.writes = tuple(rename.get(x, x) for x in op.writes)


_ALIASES = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}


def elide_aliases(g: Graph) -> int:
    """``detach`` of a shard, and a host tensor handed to a device of the same memory (CPU), are the
    tensor itself: later ops read it directly. A handed-over copy stays a copy where either side is
    written later, or where it is strided otherwise (a slice copied into contiguous memory)."""
    from ..world import world

    same_memory = world().device_type == "cpu"
    written = {g.locals[x].base for op in g.ops for x in op.writes}

    def visit(op: Op, rename: dict) -> bool:
        if op.kind == "call" and op.fn in _ALIASES and len(op.out_ids) == 1:
            rename[op.out_ids[0]] = op.reads[0]
            return False
        if op.kind == "place" and same_memory:
            src, dst = op.reads[0], op.out_ids[0]
            if g.locals[src].stride != g.locals[dst].stride:  # a copy into contiguous memory: later views need it
                return True
            if not op.fn or (g.locals[src].base not in written and g.locals[dst].base not in written):
                rename[dst] = src
                return False
        return True

    return _rewrite(g, visit)


def _rename_results(g: Graph, rename: dict) -> None:
    """Values, outputs and state that named a renamed Local name its replacement."""

    def r(x):
        while x in rename:
            x = rename[x]
        return x

    for v in g.values.values():
        v.locals = tuple(None if x is None else r(x) for x in v.locals)

    def out(o):
        if isinstance(o, Ref):
            return Ref(r(o.id))
        if isinstance(o, (list, tuple)):
            return type(o)(out(e) for e in o)
        if isinstance(o, dict):
            return {k: out(e) for k, e in o.items()}
        return o

    g.outputs = out(g.outputs)
    g.out_refs = [out(v) for v in g.out_refs]
    for s in g.slots:
        if isinstance(s.after, int):
            s.after = r(s.after)


_T = torch.ops.aten.t.default
_VIEWS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default}


def fold_views(g: Graph) -> int:
    """Views of views (backward is full of them): ``t(t(x))`` is ``x``; a reshaping view of a
    reshaping view of a contiguous ``x`` is one view of ``x``. The views in between die if unused."""
    made: dict = {}
    folded = [0]

    def visit(op: Op, rename: dict) -> bool:
        src = made.get(op.reads[0]) if op.kind == "call" and op.reads else None
        if src is not None and op.fn is _T and src.fn is _T:
            rename[op.out_ids[0]] = src.reads[0]
            return False
        if src is not None and op.fn in _VIEWS and src.fn in _VIEWS and g.locals[src.reads[0]].contiguous:
            op.args = (Ref(src.reads[0]), *op.args[1:])
            op.reads = (src.reads[0],)
            folded[0] += 1
        for x in op.out_ids:
            made[x] = op
        return True

    return _rewrite(g, visit) + folded[0]


def bucket_collectives(g: Graph, bucket_bytes: int | None = None) -> int:
    """Fuse all-reduces of small tensors (gradients reduced one by one) into one all-reduce per
    bucket (``comm.bucket_bytes()`` per device): flatten, reduce once, cut apart. Two all-reduces
    merge when they run over the same devices with the same op and dtype and nothing between them
    reads the first one's results."""
    from .. import comm
    from .bucket import fuse_all_reduces

    return fuse_all_reduces(g, bucket_bytes or comm.bucket_bytes())


PASSES = (("dead code", dead_code), ("aliases", elide_aliases), ("views", fold_views),
          ("common subexpressions", common_subexpressions),
          ("bucket collectives", bucket_collectives), ("dead code", dead_code))


# Verify the graph after every pass (the test suite does; a run verifies the trace and the last
# pass's result, which is a tenth of a second per pass saved on a 20,000-op graph).
VERIFY_EACH_PASS = False


def run_passes(g: Graph, check: bool = True) -> None:
    if check:
        verify(g, "trace")
    for i, (name, p) in enumerate(PASSES):
        n = p(g)
        if n:
            g.notes.append(f"{name}: {n}")
        if check and (VERIFY_EACH_PASS or i == len(PASSES) - 1):
            verify(g, name if VERIFY_EACH_PASS else "the passes")
