"""Loading: a checkpoint (or a plain safetensors state dict) into modules, optimizers and tensors in
place, whatever their plan, mesh or process count now; each local shard reads only its slices, and
optimizer state follows its parameter by name."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from ..sbp import Broadcast
from ..tensor import GlobalTensor, to_global
from .collect import join, optimizer_names, param_names
from .reading import Source

__all__ = ["load", "LoadResult"]


@dataclass(frozen=True, slots=True)
class LoadResult:
    """What ``load`` found: names the targets have and the checkpoint lacks (``missing_keys``), names
    it holds under the targets' keys that they lack (``unexpected_keys``), and the saved values
    (JSON) of the keys that were not targets (``values``, e.g. ``{"step": 100}``)."""

    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    values: dict = field(default_factory=dict)


def load(
    path: str | os.PathLike,
    targets: Mapping[str, object] | nn.Module,
    *,
    strict: bool = True,
    verify: bool = True,
) -> LoadResult:
    """Load checkpoint ``path`` (a directory ``save`` wrote, or a plain safetensors state dict) into
    ``targets`` (key -> module, optimizer or tensor, loaded in place; a bare module reads the
    checkpoint's one module), whatever their plan, mesh or device count now.

    Each local shard reads only the slices it needs and is converted to the target's dtype. A
    mismatch of names (``strict``) or shapes raises before anything is written, naming them;
    ``strict=False`` loads what matches and reports the rest. ``verify`` checks each file read
    against its sha256 in the index. Returns a ``LoadResult``.
    """
    with Source(path, verify) as src:
        if isinstance(targets, nn.Module):
            targets = {src.module_prefix("load"): targets}
        missing, unexpected, errors, jobs, optims = [], [], [], [], []
        for key, obj in targets.items():
            if isinstance(obj, nn.Module):
                sd = obj.state_dict(keep_vars=True)
                names = {join(key, n) for n in sd}
                unexpected += [n for n in src.under(key) if n not in names]
                tensors = {join(key, n): t for n, t in sd.items()}
            elif isinstance(obj, torch.optim.Optimizer):
                optims.append((key, obj))
                continue
            elif isinstance(obj, torch.Tensor):
                tensors = {key: obj}
            else:
                raise TypeError(f"checkpoint.load: target {key!r} is a {type(obj).__name__}; give modules, "
                                "optimizers or tensors to load into (saved values come back in the result's values)")
            for name, t in tensors.items():
                if not src.has(name):
                    missing.append(name)
                elif tuple(src.entry(name).shape) != tuple(t.shape):
                    errors.append(f"{name}: saved shape {list(src.entry(name).shape)}, target shape {list(t.shape)}")
                else:
                    jobs.append((name, t))
        pnames = param_names(targets)
        loads = [_optimizer_state(src, key, opt, pnames, missing, unexpected) for key, opt in optims]
        if errors:
            raise ValueError(f"checkpoint.load: shapes differ between {src.path} and the targets:\n  "
                             + "\n  ".join(errors))
        if strict and (missing or unexpected):
            raise ValueError(f"checkpoint.load: {src.path} does not match the targets: missing {_few(missing)}; "
                             f"unexpected {_few(unexpected)}; pass strict=False to load what matches")
        for f in src.files if verify else ():  # every file checked before anything is written
            src.open_file(f)
        with torch.no_grad():
            for name, t in jobs:
                t.copy_(src.read_like(name, t, t.dtype))
        for opt, sd in filter(None, loads):
            opt.load_state_dict(sd())
        values = {k: v for k, v in src.values.items() if src.kinds.get(k) == "value" and k not in targets}
    return LoadResult(missing, unexpected, values)


def _few(names: list[str]) -> str:
    return str(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")


def _optimizer_state(src: Source, key: str, opt: torch.optim.Optimizer, pnames: dict[int, str],
                     missing: list, unexpected: list):
    """Check the saved state of optimizer ``key`` against ``opt``; returns (opt, a function making the
    state dict that ``opt.load_state_dict`` takes), or None when the checkpoint has none. Each state
    tensor is laid out like the state ``opt`` has for its parameter, else like the parameter (torch's
    policy then casts its dtype)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    names = optimizer_names(opt, pnames, key, "load")
    index = {id(p): i for i, p in enumerate(params)}
    saved = src.values.get(key)
    if src.kinds.get(key) != "optimizer" or saved is None:
        missing.append(key)
        return None
    groups = saved["param_groups"]
    if [g["params"] for g in groups] != [[names[index[id(p)]] for p in g["params"]] for g in opt.param_groups]:
        # other parameters (or groups): the state follows each parameter by name, the hyperparameters stay
        unexpected.append(f"{key}/param_groups")
        groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    tensors: dict[str, dict[str, str]] = {}
    head = f"{key}/state/"
    for n in src.under(key):
        if n.startswith(head):
            pname, _, k = n[len(head):].rpartition("/")
            tensors.setdefault(pname, {})[k] = n
    stated = set(tensors) | set(saved["state"])
    unexpected += [f"{head}{n}" for n in sorted(stated - set(names))]
    if stated:
        missing += [f"{head}{n}" for n in names if n not in stated]

    def state_dict() -> dict:
        state = {}
        for i, (p, n) in enumerate(zip(params, names)):
            if n not in stated:
                continue
            have = opt.state.get(p, {})
            st = dict(saved["state"].get(n, {}))
            for k, full in tensors.get(n, {}).items():
                e, like = src.entry(full), have.get(k)
                if not (isinstance(like, torch.Tensor) and like.shape == e.shape):
                    like = p if e.shape == p.shape else None
                if like is None:  # a scalar (AdamW's step) stays plain; another shape is replicated on p's mesh
                    value = src.read(full, None, e.dtype)
                    st[k] = to_global(value, p.mesh, [Broadcast()] * p.mesh.ndim) \
                        if isinstance(p, GlobalTensor) and e.shape else value
                elif like is p:
                    st[k] = src.read_like(full, like, e.dtype)
                else:  # read into the state the optimizer has: no second copy of it while loading
                    with torch.no_grad():
                        st[k] = like.copy_(src.read_like(full, like, like.dtype))
            state[i] = st
        out_groups = []
        for g, mine in zip(groups, opt.param_groups):
            # JSON made tuples lists: give back the optimizer's own types (AdamW's betas)
            hyper = {k: tuple(v) if isinstance(mine.get(k), tuple) else v for k, v in g.items() if k != "params"}
            out_groups.append({**hyper, "params": [index[id(p)] for p in mine["params"]]})
        return {"state": state, "param_groups": out_groups}

    return opt, state_dict
