"""Mesh: an n-D array of global device ids with named axes (OneFlow: placement)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from .world import world

__all__ = ["Mesh"]

def _flatten(devices) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if hasattr(devices, "tolist"):
        devices = devices.tolist()
    if isinstance(devices, int):
        return (devices,), ()
    if not isinstance(devices, (list, tuple)):
        world().check(devices)  # raises a clear error for a non-int device id
    devices = list(devices)
    if not devices:
        raise ValueError("Mesh: the device list is empty")
    parts = [_flatten(d) for d in devices]
    inner = parts[0][1]
    if any(p[1] != inner for p in parts):
        raise ValueError(f"Mesh: the device array is ragged: {devices!r}")
    return tuple(itertools.chain.from_iterable(p[0] for p in parts)), (len(devices), *inner)


def _nest(flat: tuple, shape: tuple) -> list:
    """The row-major ``flat`` devices as nested lists of ``shape``."""
    if len(shape) == 1:
        return list(flat)
    step = len(flat) // shape[0]
    return [_nest(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


@dataclass(frozen=True, init=False, eq=True)
class Mesh:
    devices: tuple[int, ...]  # flattened, row-major
    shape: tuple[int, ...]
    axes: tuple[str, ...]

    def __init__(self, devices, axes: Sequence[str] | None = None) -> None:
        flat, shape = _flatten(devices)
        if not shape:
            shape = (1,)
        if axes is None:
            axes = tuple(f"d{i}" for i in range(len(shape)))
        if isinstance(axes, str):
            axes = (axes,)
        axes = tuple(axes)
        if len(axes) != len(shape):
            raise ValueError(f"Mesh: {len(axes)} axis name(s) {axes} for a {len(shape)}-D device array")
        if len(set(axes)) != len(axes):
            raise ValueError(f"Mesh: axis names must be unique, got {axes}")
        if len(set(flat)) != len(flat):
            raise ValueError(f"Mesh: a device appears twice in {flat}")
        w = world()
        for d in flat:
            w.check(d)
        object.__setattr__(self, "devices", flat)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "axes", axes)

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        # rebuilt by __init__: cached properties (the hash, which devices this process owns) are
        # recomputed where it is loaded, and the devices checked against that world
        return Mesh, (_nest(self.devices, self.shape), self.axes)

    @cached_property
    def _hash(self) -> int:
        return hash((self.devices, self.shape, self.axes))

    def __repr__(self) -> str:
        if self.ndim == 1:
            return f"Mesh({list(self.devices)}, axes={self.axes})"
        return f"Mesh(shape={self.shape}, devices={list(self.devices)}, axes={self.axes})"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return len(self.devices)

    def axis_index(self, axis: int | str) -> int:
        if isinstance(axis, str):
            if axis not in self.axes:
                raise ValueError(f"Mesh has no axis {axis!r}; its axes are {self.axes}")
            return self.axes.index(axis)
        if not -self.ndim <= axis < self.ndim:
            raise ValueError(f"Mesh axis {axis} out of range for a {self.ndim}-D mesh")
        return axis % self.ndim

    def axis_size(self, axis: int | str) -> int:
        return self.shape[self.axis_index(axis)]

    @cached_property
    def coords(self) -> tuple[tuple[int, ...], ...]:
        """coords[i]: the mesh coordinate of ``devices[i]``."""
        return tuple(itertools.product(*(range(n) for n in self.shape)))

    def coord_of(self, device: int) -> tuple[int, ...]:
        return self.coords[self.devices.index(device)]

    @cached_property
    def local_positions(self) -> tuple[int, ...]:
        """Positions (into ``devices``) of the devices this process owns, in mesh order."""
        w = world()
        return tuple(i for i, d in enumerate(self.devices) if w.owns(d))

    @cached_property
    def is_fully_local(self) -> bool:
        return len(self.local_positions) == self.size

    def groups(self, axis: int) -> tuple[tuple[int, ...], ...]:
        """Position groups along ``axis``: each group varies the axis coordinate, the others fixed."""
        return _groups(self.shape, self.axis_index(axis))

    def submesh(self, **fixed: int) -> Mesh:
        """The sub-mesh with the named axes fixed at the given coordinates, e.g. ``mesh.submesh(dp=0)``."""
        at: dict[int, int] = {}
        for name, c in fixed.items():
            a = self.axis_index(name)
            if not 0 <= c < self.shape[a]:
                raise ValueError(f"Mesh.submesh: {name}={c} out of range for axis size {self.shape[a]}")
            at[a] = c
        keep = [a for a in range(self.ndim) if a not in at]
        if not keep:
            raise ValueError("Mesh.submesh: fixing every axis leaves no mesh; keep at least one axis free")
        devs = [d for d, c in zip(self.devices, self.coords) if all(c[a] == v for a, v in at.items())]
        arr = _reshape(devs, [self.shape[a] for a in keep])
        return Mesh(arr, axes=[self.axes[a] for a in keep])

    def fixed_in(self, other: Mesh) -> dict[int, int] | None:
        """{axis of ``other``: coordinate} that fixing makes ``other`` into this mesh (``{}`` when
        they hold the same device array), or None when this mesh is no such sub-mesh of ``other``.

        Sub-mesh as ``other.submesh(...)`` makes it: exactly the devices at those coordinates, the
        other axes kept in order with their sizes (names are not compared: layouts go by axis
        position). Boxing and dispatch use it to move values between a pipeline stage's sub-mesh
        and the whole mesh exactly and cheaply.
        """
        if self.ndim > other.ndim or self.devices[0] not in other.devices:
            return None
        first = other.coord_of(self.devices[0])
        for keep in itertools.combinations(range(other.ndim), self.ndim):
            if tuple(other.shape[a] for a in keep) != self.shape:
                continue
            fixed = {a: first[a] for a in range(other.ndim) if a not in keep}
            devs = tuple(d for d, c in zip(other.devices, other.coords) if all(c[a] == v for a, v in fixed.items()))
            if devs == self.devices:
                return fixed
        if self.size == 1:  # one device of ``other`` (a pipeline stage of a 1-D mesh): every axis fixed
            return dict(enumerate(first))
        return None


def _reshape(flat: list[int], shape: list[int]):
    if len(shape) == 1:
        return list(flat)
    step = math.prod(shape[1:])
    return [_reshape(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


_GROUP_CACHE: dict = {}


def _groups(shape: tuple[int, ...], axis: int) -> tuple[tuple[int, ...], ...]:
    key = (shape, axis)
    g = _GROUP_CACHE.get(key)
    if g is None:
        strides = [math.prod(shape[a + 1 :]) for a in range(len(shape))]
        others = [range(n) if a != axis else range(1) for a, n in enumerate(shape)]
        g = tuple(
            tuple(sum(c[a] * strides[a] for a in range(len(shape))) + i * strides[axis] for i in range(shape[axis]))
            for c in itertools.product(*others)
        )
        _GROUP_CACHE[key] = g
    return g
