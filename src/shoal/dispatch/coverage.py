"""What served each op (a rule, a decomposition, the replicated fallback), counted in the decisions
themselves; the fallback's one warning per op."""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass

from ..sbp import sbp_str
from ..tensor import GlobalTensor

_FALLBACK_WARNED: set = set()
_DECISIONS: list = []  # every decision made, cached or not, for coverage()


@dataclass
class Coverage:
    by_rule: Counter
    by_decomposition: Counter
    by_fallback: Counter

    def __repr__(self) -> str:
        lines = [
            f"shoal coverage: {len(self.by_rule)} op(s) by rule, {len(self.by_decomposition)} by decomposition, "
            f"{len(self.by_fallback)} by fallback"
        ]
        lines += [f"  fallback  {op}  x{n}" for op, n in self.by_fallback.most_common()]
        return "\n".join(lines)


_COUNTER_OF = {
    "rule": "by_rule",
    "value": "by_rule",
    "random": "by_rule",
    "fallback": "by_fallback",
    "random_fallback": "by_fallback",
    "decompose": "by_decomposition",
}


def coverage(reset: bool = False) -> Coverage:
    """Ops served by rules, by decomposition into ruled ops, and by the replicated fallback since
    start (or the last reset; a reset also lets each fallback op warn once more)."""
    out = Coverage(Counter(), Counter(), Counter())
    if reset:
        _FALLBACK_WARNED.clear()
    for dec in _DECISIONS:
        func, n = dec.calls
        if n:
            getattr(out, _COUNTER_OF[dec.kind])[func] += n
        if reset:
            dec.calls[1] = 0
    return out


def _new_calls(func) -> list:
    return [func, 0]


def _warn_fallback(func, tensors) -> None:
    _FALLBACK_WARNED.add(func)
    specs = [sbp_str(t._spec.sbp) if isinstance(t, GlobalTensor) else "plain" for t in tensors]
    warnings.warn(
        f"shoal: no SBP rule for {func}; inputs {specs} are made Broadcast and the op runs replicated "
        f"(correct but slow). shoal.coverage() lists such ops.",
        stacklevel=4,
    )
