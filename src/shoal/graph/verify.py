"""The IR verifier: every pass must leave a graph that still makes sense (run after each in tests)."""

from __future__ import annotations

from .ir import Graph, Ref, local_ids

__all__ = ["verify", "VerifyError"]


class VerifyError(AssertionError):
    pass


def verify(g: Graph, after: str = "") -> None:
    """Every Local is made once, before it is read, on the device of the op reading it; collectives
    read and make Locals of the devices taking part; outputs and state are defined; a Local's base
    is the Local that allocated its storage (a view of a view names the first one: the hazards
    between tasks, and whether a collective may hand out one tensor to several devices, are
    decided by base)."""
    where = f" (after {after})" if after else ""
    for x, loc in g.locals.items():
        if g.locals[loc.base].base != loc.base:
            raise VerifyError(f"Local {x} views Local {loc.base}, itself a view of {g.locals[loc.base].base}; "
                              f"its base must be the Local that allocated the storage{where}")
    defined = g.bound()
    made: set = set()
    for i, op in enumerate(g.ops):
        for x in (*op.reads, *op.writes):
            if x not in defined:
                raise VerifyError(f"op #{i} {op.name()} reads Local {x} before it is made{where}")
        for x in op.out_ids:
            if x in made or x in defined:
                raise VerifyError(f"op #{i} {op.name()} makes Local {x} a second time{where}")
            made.add(x)
            defined.add(x)
        if op.kind == "call":
            for x in (*op.reads, *op.out_ids):
                d = g.locals[x].device
                if d is not None and d != op.device:
                    raise VerifyError(
                        f"op #{i} {op.name()} on device {op.device} touches Local {x} of device {d}{where}"
                    )
        elif op.kind == "comm":
            for x in (*op.reads, *op.out_ids):
                if g.locals[x].device not in (*op.devices, None):
                    raise VerifyError(f"op #{i} {op.name()} over {op.devices} touches Local {x} of device "
                                      f"{g.locals[x].device}{where}")
        elif op.kind == "host":
            for x in (*op.reads, *op.out_ids):
                if g.locals[x].device is not None:
                    raise VerifyError(f"host op #{i} {op.name()} touches device Local {x}{where}")
        _check_refs(op, i, where)
    for v in g.out_refs:
        for x in local_ids(v):
            if x not in defined:
                raise VerifyError(f"an output reads Local {x}, which no op makes{where}")
    for s in g.slots:
        for x in local_ids(s.after):
            if x not in defined:
                raise VerifyError(f"state {s.label} is left as Local {x}, which no op makes{where}")


def _check_refs(op, i, where) -> None:
    found = set()

    def walk(a):
        if isinstance(a, Ref):
            found.add(a.id)
        elif isinstance(a, (list, tuple)):
            for e in a:
                walk(e)

    walk(op.args)
    walk(list(op.kwargs.values()))
    if not found <= set(op.reads):
        raise VerifyError(f"op #{i} {op.name()} uses Locals {sorted(found - set(op.reads))} it does not list{where}")
