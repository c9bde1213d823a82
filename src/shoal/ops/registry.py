"""The one rule registry: ATen op -> Rule.

A rule is written for one mesh axis: ``candidates(call)`` lists signatures (one SBP per tensor
input -> one SBP per tensor output) that are exact on that axis. The registry expands them to
n-D meshes (every axis picks a signature independently), drops the ones ``check_nd`` rejects and
always adds the all-Broadcast signature, which is exact for any deterministic op.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..sbp import SBP, Broadcast, NdSBP, Partial, Split

__all__ = ["Sig", "Shard", "Call", "Rule", "register", "lookup", "registered_ops", "all_sbps", "expand"]

_B = Broadcast()


@dataclass(frozen=True, slots=True)
class Sig:
    """One mesh axis: input SBPs (one per tensor input, in argument order) -> output SBPs."""

    ins: tuple[SBP, ...]
    outs: tuple[SBP, ...]


@dataclass(frozen=True, slots=True)
class Shard:
    """What a context-taking local function (``Rule(local_ctx=True)``) learns about the shard it runs on."""

    pos: int  # mesh position
    in_specs: tuple  # TensorSpec per tensor input
    out_specs: tuple  # TensorSpec per tensor output


@dataclass(slots=True)
class Call:
    """What a rule sees: the op, its arguments with tensors as meta tensors of the global shapes,
    the tensor inputs in order (``ins``) and the tensor outputs a meta run produced (``outs``)."""

    func: torch._ops.OpOverload
    args: tuple
    kwargs: dict
    ins: tuple[torch.Tensor, ...]
    outs: tuple[torch.Tensor, ...]
    # the inputs' actual layouts; only rules with ``nd=True`` may read them (others must not depend on them)
    specs: tuple = ()

    def arg(self, i: int, name: str, default=None):
        if i < len(self.args):
            return self.args[i]
        return self.kwargs.get(name, default)


@dataclass(frozen=True)
class Rule:
    """How one op is laid out. Decisions are cached by op, layouts, shapes and static args, with
    Python floats keyed by type only: nothing here may depend on a float argument's value (local
    functions receive each call's own arguments)."""

    candidates: Callable[[Call], Sequence[Sig]] = lambda call: ()
    # positional arg that holds the output's size (view, expand, new_zeros...): rewritten per shard
    size_arg: int | None = None
    # reject n-D combinations that are not exact (e.g. views of unevenly split dims)
    check_nd: Callable[[Call, tuple[NdSBP, ...], tuple[NdSBP, ...], tuple[int, ...]], bool] | None = None
    # replace the op run on each shard for a given n-D signature (e.g. mean over a split dim -> sum/N)
    local: Callable[[Call, tuple[NdSBP, ...], tuple[NdSBP, ...]], Callable | None] | None = None
    # local is called as local(Shard, *args): it needs its shard's position or specs (e.g. vocab offsets)
    local_ctx: bool = False
    # "rule": run on shards per the signature; "value" (.item(), equal): inputs made Broadcast and the op
    # run once, by design; "random": the global value is drawn as one device would, then sharded
    kind: str = "rule"
    # decompose this call (into ops that have rules) when the predicate holds for the input specs,
    # with ``decomposition`` or else torch's decomposition of the op (e.g. softmax over a split dim)
    decompose: Callable[[Call, tuple], bool] | None = None
    decomposition: Callable | None = None
    # candidates returns n-D signatures directly, as (input nd-SBPs, output nd-SBPs) pairs, and may read
    # call.specs (e.g. foreach ops, whose lists are too long to expand axis by axis)
    nd: bool = False
    name: str = field(default="", compare=False)


_RULES: dict[torch._ops.OpOverload, Rule] = {}
_GENERIC: list[tuple[Callable[[torch._ops.OpOverload], bool], Rule | Callable]] = []


def register(ops: torch._ops.OpOverload | Sequence[torch._ops.OpOverload], rule: Rule) -> Rule:
    for op in ops if isinstance(ops, (list, tuple)) else [ops]:
        if op in _RULES:
            raise ValueError(f"shoal: a rule for {op} is already registered")
        _RULES[op] = rule
    _RESOLVED.clear()
    return rule


def register_generic(pred: Callable[[torch._ops.OpOverload], bool],
                     rule: Rule | Callable[[torch._ops.OpOverload], Rule]) -> None:
    """A rule for every op ``pred`` accepts (e.g. by ``torch.Tag.pointwise``), after explicit ones:
    ``rule``, or the rule ``rule(op)`` makes for it."""
    _GENERIC.append((pred, rule))
    _RESOLVED.clear()


_RESOLVED: dict[torch._ops.OpOverload, Rule | None] = {}


def lookup(func: torch._ops.OpOverload) -> Rule | None:
    try:
        return _RESOLVED[func]
    except KeyError:
        rule = _RULES.get(func)
        if rule is None:
            rule = next((r for pred, r in _GENERIC if pred(func)), None)
            if rule is not None and not isinstance(rule, Rule):
                rule = rule(func)
        _RESOLVED[func] = rule
        return rule


def registered_ops() -> list[torch._ops.OpOverload]:
    return sorted(_RULES, key=str)


def all_sbps(ndim: int, partial: Sequence[str] = ("sum", "max", "min")) -> list[SBP]:
    return [_B, *(Split(d) for d in range(ndim)), *(Partial(o) for o in partial)]


def expand(call: Call, rule: Rule, mesh_shape: tuple[int, ...]) -> list[tuple[tuple[NdSBP, ...], tuple[NdSBP, ...]]]:
    """All exact n-D signatures: (input nd-SBPs, output nd-SBPs), the all-Broadcast one last."""
    nin, nout = len(call.ins), len(call.outs)
    if rule.nd:
        rep_nd = (((_B,) * len(mesh_shape),) * nin, ((_B,) * len(mesh_shape),) * nout)
        return [*(c for c in rule.candidates(call) if c != rep_nd), rep_nd]
    one = list(dict.fromkeys(rule.candidates(call)))
    rep = Sig((_B,) * nin, (_B,) * nout)
    if rep not in one:
        one.append(rep)
    out = []
    for combo in itertools.product(one, repeat=len(mesh_shape)):
        ins = tuple(tuple(sig.ins[i] for sig in combo) for i in range(nin))
        outs = tuple(tuple(sig.outs[i] for sig in combo) for i in range(nout))
        if rule.check_nd is not None and not rule.check_nd(call, ins, outs, mesh_shape):
            continue
        out.append((ins, outs))
    return out
