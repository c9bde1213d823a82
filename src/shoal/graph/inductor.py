"""The optional backend: a device's compute segment as a torch.fx graph of ATen ops, compiled by
torch inductor (fusing its pointwise work into generated kernels). A segment inductor cannot take
runs as plain generated Python, with a warning saying why."""

from __future__ import annotations

import warnings

import torch
import torch.fx as fx

from ..world import world
from .ir import Graph, Ref
from .trace import DEVICE

__all__ = ["compile_segment"]


def _to_fx(t, g: Graph, dev) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict = {}
    for lid in t.imports:
        env[lid] = graph.placeholder(f"v{lid}")

    def arg(a):
        if isinstance(a, Ref):
            return env[a.id]
        if isinstance(a, list):
            return [arg(e) for e in a]
        if isinstance(a, tuple):
            return tuple(arg(e) for e in a)
        if isinstance(a, str) and a == DEVICE:
            return dev
        return a

    for op in t.ops:
        if op.kind == "place":
            kw = {"device": dev, "memory_format": torch.contiguous_format} if op.fn else {"device": dev}
            node = graph.call_function(torch.ops.aten._to_copy.default, (env[op.args[0].id],), kw)
            env[op.outs.id] = node
            continue
        node = graph.call_function(op.fn, arg(op.args), {k: arg(v) for k, v in op.kwargs.items()})
        _bind(op.outs, node, env, graph)
    graph.output(tuple(env[lid] for lid in t.exports))
    return fx.GraphModule(torch.nn.Module(), graph)


def _bind(outs, node, env, graph, path=()):
    import operator

    if isinstance(outs, Ref):
        if path:
            for i in path:
                node = graph.call_function(operator.getitem, (node, i))
        env[outs.id] = node
    elif isinstance(outs, (list, tuple)):
        for i, o in enumerate(outs):
            _bind(o, node, env, graph, (*path, i))


def _example(g: Graph, lid: int, dev):
    loc = g.locals[lid]
    if loc.dtype.is_floating_point:
        return torch.empty_strided(loc.shape, loc.stride, dtype=loc.dtype, device=dev).normal_()
    return torch.empty_strided(loc.shape, loc.stride, dtype=loc.dtype, device=dev).zero_()


def compile_segment(t, g: Graph):
    """The segment compiled by inductor, or None (then it runs as generated Python)."""
    from torch._inductor.compile_fx import compile_fx

    if any(getattr(op.fn, "_schema", None) is not None and op.fn._schema.name.startswith("aten::_fused_")
           for op in t.ops):
        return None  # a fused optimizer kernel is one kernel already (and inductor cannot functionalize it)
    dev = world().torch_device(t.device)
    try:
        gm = _to_fx(t, g, dev)
        example = [_example(g, lid, dev) for lid in t.imports]
        fn = compile_fx(gm, example)
    except Exception as e:  # noqa: BLE001 - any failure: fall back to the plain segment
        warnings.warn(f"shoal.compile(backend='inductor'): {t.name} runs uncompiled: {type(e).__name__}: {e}",
                      stacklevel=2)
        return None

    def run(ins):
        out = fn(*ins)
        return tuple(out) if isinstance(out, (list, tuple)) else (out,)

    return run
