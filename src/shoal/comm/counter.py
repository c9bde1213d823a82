"""CommCounter: counts collectives by kind and bytes; every collective in shoal reports here."""

from __future__ import annotations

from collections import Counter

__all__ = ["CommCounter", "record"]

_ACTIVE: list[CommCounter] = []


class CommCounter:
    """``with CommCounter() as cc: ...`` then ``cc.counts["all_gather"]``, ``cc.bytes["all_reduce"]``.

    One collective is one call over one device group (a 2x2 mesh gathering along one axis runs two).
    """

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def __enter__(self) -> CommCounter:
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __repr__(self) -> str:
        return f"CommCounter({dict(self.counts)}, bytes={dict(self.bytes)})"


def record(kind: str, nbytes: int) -> None:
    for c in _ACTIVE:
        c.counts[kind] += 1
        c.bytes[kind] += nbytes
