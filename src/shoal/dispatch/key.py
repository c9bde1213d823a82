"""Dispatch's cache key and argument templates: tensors in an op's arguments become slots (filled
with shards, meta tensors or whole values later); everything else is part of the key."""

from __future__ import annotations

import torch


class _Slot:
    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


class _Seq:
    """A list or tuple argument that holds tensors."""

    __slots__ = ("kind", "items")

    def __init__(self, kind, items) -> None:
        self.kind, self.items = kind, items


def _template(obj, tensors: list, key: list):
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        key.append(_Slot)  # not None: [None, t] and [t, None] (index's indices) must not share a decision
        return _Slot(len(tensors) - 1)
    if isinstance(obj, (list, tuple)):
        if any(isinstance(e, torch.Tensor) for e in obj):
            key.append(len(obj))
            return _Seq(type(obj), [_template(e, tensors, key) for e in obj])
        key.append(tuple(obj))
        return obj
    key.append(float if type(obj) is float else obj)
    return obj


def _fill(obj, values):
    t = type(obj)
    if t is _Slot:
        return values[obj.i]
    if t is _Seq:
        return obj.kind(_fill(e, values) for e in obj.items)
    return obj


def _fill_args(targs: tuple, values) -> tuple:
    return tuple(_fill(a, values) for a in targs)


def _retemplate(args: tuple) -> tuple[tuple, dict]:
    found: list = []
    return tuple(_template(a, found, []) for a in args), {}


def _plain_key(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.dtype, t.stride(), t.device)


def _slots_in(v) -> tuple[int, ...]:
    if type(v) is _Slot:
        return (v.i,)
    if type(v) is _Seq:
        return tuple(e.i for e in v.items if type(e) is _Slot)
    return ()


def _tensor_args(targs) -> tuple[int, ...]:
    return tuple(i for i, a in enumerate(targs) if type(a) is _Slot)
