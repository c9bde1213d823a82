"""What a checkpoint holds: a state mapping (top-level key -> module, optimizer, tensor or JSON
value) flattened into named tensors (tied ones once) and JSON values; optimizer state is named by
its parameters' names in the modules beside it, so that it can follow them into another plan."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Collected:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> tensor, each stored once
    ties: dict[str, str] = field(default_factory=dict)  # name -> the name it is stored under
    values: dict = field(default_factory=dict)  # top-level key -> JSON value
    kinds: dict[str, str] = field(default_factory=dict)  # top-level key -> module | optimizer | tensor | value


def join(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


def param_names(objs: Mapping[str, object]) -> dict[int, str]:
    """id(parameter) -> its name in the module(s) among ``objs`` (tied: the first name)."""
    names: dict[int, str] = {}
    for obj in objs.values():
        if isinstance(obj, nn.Module):
            for n, p in obj.named_parameters():
                names.setdefault(id(p), n)
    return names


def optimizer_names(opt: torch.optim.Optimizer, names: dict[int, str], key: str, what: str) -> list[str]:
    """The names of ``opt``'s parameters, in its order; a clear error if one belongs to no module."""
    params = [p for g in opt.param_groups for p in g["params"]]
    unnamed = sum(id(p) not in names for p in params)
    if unnamed:
        raise ValueError(
            f"checkpoint.{what}: {unnamed} parameter(s) of the optimizer {key!r} belong to no module in the same "
            "mapping; pass the model beside it (e.g. {'model': model, 'optim': opt}): optimizer state is stored "
            "by parameter name so that it can follow its parameter into another plan"
        )
    return [names[id(p)] for p in params]


def collect(state: Mapping[str, object]) -> Collected:
    out = Collected()
    names = param_names(state)
    seen: dict[int, str] = {}

    def add(name: str, t: torch.Tensor) -> None:
        if id(t) in seen:  # tied weights: stored once
            out.ties[name] = seen[id(t)]
        else:
            seen[id(t)] = name
            out.tensors[name] = t

    for key, obj in state.items():
        if not isinstance(key, str) or "/" in key:
            raise ValueError(f"checkpoint.save: top-level key {key!r} must be a string without '/'")
        if isinstance(obj, nn.Module):
            out.kinds[key] = "module"
            for n, t in obj.state_dict(keep_vars=True).items():
                add(join(key, n), t)
        elif isinstance(obj, torch.optim.Optimizer):
            out.kinds[key] = "optimizer"
            pnames = optimizer_names(obj, names, key, "save")
            sd = obj.state_dict()
            plain: dict[str, dict] = {}
            for i, st in sd["state"].items():
                for k, v in st.items():
                    if isinstance(v, torch.Tensor):
                        add(join(key, f"state/{pnames[i]}/{k}"), v)
                    else:
                        plain.setdefault(pnames[i], {})[k] = as_json(v, f"{key}/state/{pnames[i]}/{k}")
            groups = [{**{k: as_json(v, f"{key}/param_groups/{j}/{k}") for k, v in g.items() if k != "params"},
                       "params": [pnames[i] for i in g["params"]]} for j, g in enumerate(sd["param_groups"])]
            out.values[key] = {"param_groups": groups, "state": plain}
        elif isinstance(obj, torch.Tensor):
            out.kinds[key] = "tensor"
            add(key, obj)
        else:
            out.kinds[key] = "value"
            out.values[key] = as_json(obj, key)
    return out


def as_json(v, where: str):
    """``v`` if JSON holds it exactly (tuples become lists); else a clear error naming ``where``."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"checkpoint.save: {where!r} is {v}, which JSON cannot hold; save a finite float")
        return v
    if isinstance(v, (list, tuple)):
        return [as_json(x, f"{where}/{i}") for i, x in enumerate(v)]
    if isinstance(v, dict):
        bad = [k for k in v if not isinstance(k, str)]
        if bad:
            raise TypeError(f"checkpoint.save: {where!r} has non-string key(s) {bad[:3]}; JSON keys are strings")
        return {k: as_json(x, f"{where}/{k}") for k, x in v.items()}
    if isinstance(v, torch.Tensor):
        raise TypeError(f"checkpoint.save: {where!r} is a tensor inside a value; give it a top-level key of its own")
    raise TypeError(
        f"checkpoint.save: {where!r} is a {type(v).__name__}, which JSON cannot hold; save ints, floats, strings, "
        "bools, None, lists and dicts of them (checkpoints hold no pickle, so that loading never runs code)"
    )
