"""``SHOAL_DEBUG=1``: checks that the processes (more than one) run one program on one value (one
collective per check: slow).

Before every op: all processes run the same op on the same layouts, and plain tensors taken as
Broadcast hold the same values everywhere. ``to_global`` of a plain tensor: every process passes
the same value. ``from_local``: pieces of devices that differ only along Broadcast axes of the mesh
are equal. A failed check raises the same error on every process.
"""

from __future__ import annotations

import hashlib
import os

import torch

from .sbp import Broadcast, sbp_str

__all__ = ["ENABLED", "check_op", "check_same_value", "check_pieces"]

ENABLED = os.environ.get("SHOAL_DEBUG", "0") not in ("", "0")
_SEEN = [0]  # checks so far: where the processes diverged
_SEED = "seed every process alike (torch.manual_seed) before drawing"


def _digest(t: torch.Tensor) -> str:
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # any dtype, bfloat16 too
    return hashlib.sha1(raw.numpy().tobytes()).hexdigest()[:12]


def _plain(t: torch.Tensor) -> tuple:
    return ("plain", tuple(t.shape), str(t.dtype), _digest(t))


def _gather(mine) -> list:
    import torch.distributed as dist

    _SEEN[0] += 1
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def _diverged(what: str, rule: str, lines: list[str]) -> RuntimeError:
    body = "\n".join(f"  {line}" for line in lines)
    return RuntimeError(f"shoal (SHOAL_DEBUG): the processes diverged at op #{_SEEN[0]} ({what}): {rule}:\n{body}")


def check_op(func, args, kwargs, global_type: type) -> None:
    """All processes run ``func`` on the same layouts, with the same values in plain tensors
    (``global_type``: GlobalTensor, which this module, below it, does not import)."""

    def describe(a):
        if isinstance(a, global_type):
            return ("global", tuple(a.shape), str(a.dtype), sbp_str(a._spec.sbp), a._spec.mesh.devices)
        if isinstance(a, torch.Tensor):
            return _plain(a)
        if isinstance(a, (list, tuple)):
            return tuple(describe(e) for e in a)
        return repr(a)

    every = _gather((str(func), describe(tuple(args)), describe(tuple(kwargs.items()))))
    if any(e != every[0] for e in every):
        raise _diverged(str(func), "they must run the same ops on the same layouts, and plain tensors must hold "
                        f"the same values on every process; {_SEED} values meant to be the same",
                        [f"rank {r}: {e}" for r, e in enumerate(every)])


def check_same_value(op: str, t: torch.Tensor) -> None:
    """Every process passes ``op`` the same plain tensor ``t`` (a global value)."""
    every = _gather(_plain(t))
    if any(e != every[0] for e in every):
        raise _diverged(
            f"{op} of a plain tensor",
            f"the plain tensor is the global value, so every process must pass the same one; {_SEED} it, or give "
            "each process only its part (shoal.from_local_batch, shoal.from_local)",
            [f"rank {r}: {e}" for r, e in enumerate(every)],
        )


def check_pieces(op: str, spec, shards: tuple) -> None:
    """The pieces ``shards`` (one per mesh position, None where another process owns it) of devices
    that differ only along Broadcast axes of ``spec``'s mesh are equal."""
    mesh = spec.mesh
    kept = [a for a, s in enumerate(spec.sbp) if not isinstance(s, Broadcast)]
    if len(kept) == mesh.ndim:  # no Broadcast axis: every piece is its own
        return
    mine = [(mesh.devices[p], _plain(t)) for p, t in enumerate(shards) if t is not None]
    every = _gather(mine)
    rank = {d: r for r, pieces in enumerate(every) for d, _ in pieces}
    piece = {d: e for pieces in every for d, e in pieces}
    groups: dict = {}
    for d, c in zip(mesh.devices, mesh.coords):
        groups.setdefault(tuple(c[a] for a in kept), []).append(d)
    for devs in groups.values():
        if len({piece[d] for d in devs}) > 1:
            raise _diverged(
                op,
                f"devices {devs} of {mesh} differ only along its Broadcast axes (sbp {sbp_str(spec.sbp)}), so their "
                f"pieces must be equal; {_SEED} them, or lay the tensor out Split or Partial along those axes",
                [f"device {d} (rank {rank[d]}): {piece[d]}" for d in devs],
            )
