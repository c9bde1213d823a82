"""Per-op costs read off the model itself: one forward + backward on the meta device.

``profile(model, micro_batch, seq, dtype)`` builds a one-layer copy of a bundled GPT on meta
tensors and runs it, recording every ATen op (``OpCost``: FLOPs by ``FlopCounterMode``'s formulas,
bytes read and written, GEMM dims, forward or backward, the module that ran it) and the bytes
autograd saves for backward. Whether an op is split by tensor parallelism follows from the model's
own Megatron plan (``tp_modules``). Nothing is allocated: the costs come from shapes alone.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass
from functools import cache

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from ..models import gpt
from ..models.layers import Core
from ..sbp import Split

__all__ = ["OpCost", "Profile", "profile", "tp_modules", "gpt_config", "op_cost"]

# ops that move no data on a GPU: views, allocations, and dtype conversions (the CPU path's upcasts of
# low-precision attention, which a GPU kernel does in registers)
_FREE = {"detach", "alias", "_unsafe_view", "empty_like", "empty", "new_empty", "_to_copy"}
_DROPOUT = (torch.nn.functional.dropout, torch.dropout)  # the CPU path decomposes it into three ops
# the fused attention CPU runs (the meta device's decomposes it into products and a softmax)
_CPU_ATTENTION = {"_scaled_dot_product_flash_attention_for_cpu": lambda a: sdpa_flop_count(*(t.shape for t in a[:3])),
                  "_scaled_dot_product_flash_attention_for_cpu_backward":
                      lambda a: sdpa_backward_flop_count(*(t.shape for t in a[:4]))}
_GEMMS = {"mm": (0, 1), "addmm": (1, 2), "bmm": (0, 1), "baddbmm": (1, 2)}  # op -> positions of its two factors


@dataclass(frozen=True, slots=True)
class OpCost:
    """One ATen op: ``name``; ``phase`` "F" or "B"; ``where``: "block" (the representative layer),
    "embed" (embeddings, first stage) or "head" (final norm, head and loss, last stage); ``split``:
    whether tensor parallelism splits it; ``flops``; ``nbytes`` read and written; ``gemm``: (batch,
    m, n, k) for a matrix multiply, else None."""

    name: str
    phase: str
    where: str
    split: bool
    flops: float
    nbytes: float
    gemm: tuple[int, int, int, int] | None
    out_bytes: float = 0.0
    view: bool = False  # a view op: no kernel, only the host's call (``Cluster.view_overhead``)
    core: bool = False  # in attention's core (``layers.Core``): what selective recomputation runs again


@dataclass(frozen=True, slots=True)
class Profile:
    """A micro-batch's ops, and the bytes one layer saves for backward, each storage once and no
    parameter (``saved_split``: of tensors tensor parallelism splits; ``saved_other``: of the rest,
    which sequence parallelism splits, column-parallel layers' inputs among them; ``saved_core``: the
    attention core's part of ``saved_split``)."""

    ops: tuple[OpCost, ...]
    tokens: int
    saved_split: float
    saved_other: float
    head_saved: float
    saved_core: float  # of ``saved_split``: what attention's core saves (its scores among it)
    core_inputs: float  # what selective recomputation saves in its place: the core's inputs q, k, v
    block_params: int
    embed_params: int
    head_params: int
    allreduces_forward: int  # tensor-parallel all-reduces per layer in forward (row-parallel outputs)
    allreduces_backward: int  # and in backward (inputs of column-parallel regions)
    block_tensors: int = 0  # parameter tensors of one layer, and of the rest of the model
    other_tensors: int = 0
    views: tuple[tuple[str, str, int], ...] = ()  # (phase, where, count) of view ops: no kernel, host work


def gpt_config(model: nn.Module) -> gpt.GPTConfig:
    """The config of a bundled GPT, or a clear error for any other model."""
    cfg = getattr(model, "cfg", None)
    if not isinstance(cfg, gpt.GPTConfig):
        raise ValueError(f"auto: the cost model reads a bundled GPT (shoal.models.gpt.GPT), got "
                         f"{type(model).__name__}; build one with GPT(GPTConfig(...)) under torch.device('meta')")
    return cfg


def tp_modules(model: nn.Module) -> tuple[set[str], set[str], set[str], set[str]]:
    """From the model's own "tp" plan: (modules whose ops tensor parallelism splits, the row-parallel
    ones among them, the regions, the column-parallel ones). Split: modules owning a split
    parameter, and regions: modules all of whose parameter-owning children are split (the attention
    between q/k/v and the output projection, the MLP's activation), and attention's core
    (``layers.Core``) inside one.
    Row-parallel modules (weight split on its input features) end a region with a partial sum: an
    all-reduce in forward; a region's input gradient is one in backward."""
    plan = gpt.plans((2,), "tp")
    layouts = {n: _layout(plan.params, n) for n, _ in model.named_parameters()}
    owners = {n.rpartition(".")[0] for n, lay in layouts.items() if any(isinstance(s, Split) for s in lay)}
    rows = {n.rpartition(".")[0] for n, lay in layouts.items() if Split(1) in lay}
    regions = set()
    for name, mod in model.named_modules():
        kids = [f"{name}.{k}" if name else k for k, c in mod.named_children() if any(True for _ in c.parameters())]
        if kids and not any(True for _ in mod.parameters(recurse=False)) and all(k in owners for k in kids):
            regions.add(name)
    cores = {name for name, mod in model.named_modules()
             if isinstance(mod, Core) and name.rpartition(".")[0] in regions}
    return owners | regions | cores, rows, regions, owners - rows


def _layout(patterns, name: str) -> tuple:
    for pat, lay in patterns.items():
        if fnmatch.fnmatchcase(name, pat):
            return lay if isinstance(lay, tuple) else (lay,)
    return ()


class _Recorder(TorchFunctionMode):
    """Tags autograd nodes with the module that made them, so that backward ops are charged to the
    module whose forward made their node (a node's pre-hook sets ``where``)."""

    def __init__(self, state: dict) -> None:
        super().__init__()
        self.state = state
        self.seen: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        named = dict(zip(("input", "p", "training"), args)) | kwargs
        if func in _DROPOUT and named.get("training", True) and named.get("p", 0.5) > 0:
            out = torch.native_dropout(named["input"], named.get("p", 0.5), True)[0]  # one kernel, as on CUDA
        else:
            out = func(*args, **kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for t in outs:
            node = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
            if node is not None and id(node) not in self.seen:
                self.seen.add(id(node))
                name = self.state["stack"][-1]
                node.register_prehook(lambda g, name=name: self.state.__setitem__("where", name) or None)
        return out


class _Ops(TorchDispatchMode):
    """Records each ATen op but views and those in ``_FREE``, with tensors counted at the compute
    dtype's size (an embedding reads only the rows it gathers); views are counted apart, by phase and
    module (``views``)."""

    def __init__(self, state: dict, dtype: torch.dtype) -> None:
        super().__init__()
        self.state = state
        self.size = torch.finfo(dtype).bits // 8
        self.ops: list = []
        self.views: dict = {}

    def nbytes(self, t: torch.Tensor) -> float:
        return t.numel() * (self.size if t.is_floating_point() else t.element_size())

    def storage_bytes(self, t: torch.Tensor) -> float:
        """Bytes of the storage under ``t`` (a view's whole base), counted as ``nbytes`` counts."""
        return t.untyped_storage().nbytes() // t.element_size() * (self.size if t.is_floating_point()
                                                                    else t.element_size())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in _FREE:
            return out
        backward = self.state["backward"]
        where = self.state["where"] if backward else self.state["stack"][-1]
        if where.startswith("blocks."):
            self.state["blocks_seen"] = True
        elif where == "" and not backward and not self.state.get("blocks_seen"):
            where = "drop"  # the model's own ops before its first layer: the embedding's
        if getattr(func, "is_view", False):
            key = ("B" if backward else "F", where)
            self.views[key] = self.views.get(key, 0) + 1
            return out
        self.ops.append((name, "B" if backward else "F", where, *op_cost(func, args, kwargs, out, self.nbytes)))
        return out


def op_cost(func, args, kwargs, out, nbytes=lambda t: t.numel() * t.element_size()) -> tuple:
    """(FLOPs, bytes read and written, GEMM dims (batch, m, n, k) or None, bytes written) of the ATen
    op ``func`` on ``args``/``kwargs`` giving ``out`` (tensors on any device, meta included),
    ``nbytes(tensor)`` counting a tensor's bytes (default: at its dtype); an embedding reads only the
    rows it gathers."""
    name = func.overloadpacket.__name__
    flops = 0.0
    if func.overloadpacket in flop_registry:
        flops = float(flop_registry[func.overloadpacket](*args, **kwargs, out_val=out))
    elif name in _CPU_ATTENTION:  # CPU's flash attention: torch's counts of the CUDA kernels' products
        flops = float(_CPU_ATTENTION[name](args))
    read = args[1:] if name == "embedding" else (args, kwargs)
    tensors = [t for t in torch.utils._pytree.tree_leaves((read, out)) if isinstance(t, torch.Tensor)]
    gemm = None
    if name in _GEMMS:
        a, b = (args[i] for i in _GEMMS[name])
        gemm = (a.shape[0] if a.ndim == 3 else 1, a.shape[-2], b.shape[-1], a.shape[-1])
    outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    return flops, sum(map(nbytes, tensors)), gemm, sum(map(nbytes, outs))


@cache
def _profile(cfg: gpt.GPTConfig, micro_batch: int, seq: int, dtype: torch.dtype) -> Profile:
    with torch.device("meta"):
        model = gpt.GPT(dataclasses.replace(cfg, n_layer=1)).to(dtype)
    split, rows, regions, cols = tp_modules(model)
    cores = {name for name, mod in model.named_modules() if isinstance(mod, Core)}
    state: dict = {"stack": [""], "where": "", "backward": False}

    saved: dict[str, float] = {}
    ops = _Ops(state, dtype)

    def enter(name: str, args) -> None:
        state["stack"].append(name)
        if name in cores and not state["backward"]:  # what selective recomputation keeps: the core's inputs
            saved["core inputs"] = saved.get("core inputs", 0.0) + sum(ops.storage_bytes(a) for a in args)

    def leave(mod, args, out) -> None:
        state["stack"].pop()

    handles = []
    for name, mod in model.named_modules():
        handles.append(mod.register_forward_pre_hook(lambda m, a, name=name: enter(name, a)))
        handles.append(mod.register_forward_hook(leave))

    # what backward keeps: each storage once (x saved by q, k and v is one tensor), parameters not
    # (a weight saved for its input's gradient is held anyway)
    held = {p.untyped_storage()._cdata for p in model.parameters()}

    def pack(t):
        st = t.untyped_storage()._cdata
        if state["backward"] or st in held:
            return t
        held.add(st)
        where = state["stack"][-1]
        # a column-parallel layer's input is whole on every tp device (split under sp: ``Plan.regather``)
        key = "head" if not where.startswith("blocks.") else "split" if where in split - cols else "block"
        saved[key] = saved.get(key, 0.0) + ops.storage_bytes(t)
        if where in cores:
            saved["core"] = saved.get("core", 0.0) + ops.storage_bytes(t)
        return t

    idx = torch.zeros(micro_batch, seq, dtype=torch.long, device="meta")
    with _Recorder(state), ops, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(idx, idx)
        state["backward"] = True
        loss.backward()
    for h in handles:
        h.remove()

    def place(where: str) -> str:
        return "block" if where.startswith("blocks.") else "embed" if where.endswith("_emb") or where == "drop" \
            else "head"

    costs = tuple(OpCost(n, ph, place(w), w in split, f, b, g, o, core=w in cores)
                  for n, ph, w, f, b, g, o in ops.ops)
    where = [(place(n.rpartition(".")[0]), p) for n, p in model.named_parameters()]
    params = {k: sum(p.numel() for w, p in where if w == k) for k in ("block", "embed", "head")}
    block_tensors = sum(w == "block" for w, _ in where)
    return Profile(costs, micro_batch * seq, saved.get("split", 0.0), saved.get("block", 0.0),
                   saved.get("head", 0.0), saved.get("core", 0.0),
                   saved.get("core inputs", 0.0),
                   params["block"], params["embed"], params["head"],
                   allreduces_forward=sum(r.startswith("blocks.") for r in rows),
                   allreduces_backward=sum(r.startswith("blocks.") for r in regions),
                   block_tensors=block_tensors, other_tensors=len(where) - block_tensors,
                   views=tuple((ph, place(w), k) for (ph, w), k in ops.views.items()))


def profile(model: nn.Module, micro_batch: int, seq: int, dtype: torch.dtype = torch.bfloat16) -> Profile:
    """The ops of one micro-batch of ``micro_batch`` sequences of ``seq`` tokens through a one-layer
    twin of ``model`` (a bundled GPT), on meta tensors in ``dtype`` (cached per shape)."""
    cfg = gpt_config(model)
    if seq > cfg.block_size:
        raise ValueError(f"auto: seq {seq} exceeds the model's block_size {cfg.block_size}")
    return _profile(cfg, micro_batch, seq, dtype)
