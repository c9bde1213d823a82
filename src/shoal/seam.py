"""The seam between eager execution and graph mode's tracer.

A few things eager execution does must be recorded instead while a step is traced: lay shards out
in another layout (``box``), hand a plain tensor to devices (``place``), run a collective. Each goes
through the ``Execution`` in force: ``Eager`` (the default) does it now; graph mode's tracer
(``shoal.graph.trace.Tracer``) records it into the step's graph, or refuses it (a value read into
Python). Nothing is swapped in a module while a trace runs. (ATen ops on plain tensors, random
draws among them, need no seam: the tracer's dispatch mode sees each and records it as host work.)

The execution in force is a context variable: it belongs to the thread (and asyncio task) that set
it. The runtime's threads, which may run a compiled step while another step is traced, see
``Eager``. A collective is a ``Collective`` (``comm``'s, or one made with ``@collective`` anywhere):
called, it asks the execution in force to run it, so a new collective is traced by being one.

This module imports nothing of shoal: everything below and above it may use it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable

__all__ = ["Execution", "Eager", "Collective", "collective", "current", "using"]


class Collective:
    """A function over a group of devices' shards, run through the seam.

    ``run`` is the eager function: ``run(devices, shards, *rest)`` returns one tensor per device
    (``None`` for devices another process owns), or, for a point-to-point one (``p2p=True``),
    ``run(src, dst, tensor, *rest)`` returns what ``dst`` holds. An asynchronous one (``start_of``
    names the collective it starts) returns a function that waits and gives that collective's
    result; traced, it is one task of that collective.
    """

    def __init__(self, run: Callable, *, p2p: bool = False, start_of: Collective | None = None) -> None:
        functools.update_wrapper(self, run)
        self.name, self.run, self.p2p, self.start_of = run.__name__, run, p2p, start_of

    def __call__(self, *args):
        return _CURRENT.get().collective(self, args)

    def __repr__(self) -> str:
        return f"<collective {self.name}>"


def collective(run: Callable | None = None, *, p2p: bool = False, start_of: Collective | None = None):
    """Decorator: ``run`` becomes a ``Collective`` (see there)."""
    if run is None:
        return lambda f: Collective(f, p2p=p2p, start_of=start_of)
    return Collective(run, p2p=p2p, start_of=start_of)


class Execution:
    """What eager execution and the tracer each do at the seam."""

    tracing: bool = False

    def box(self, shards: tuple, src, dst, run: Callable) -> tuple:
        """``shards`` laid out as ``src`` (a TensorSpec), made ``dst``'s by ``run(shards, src, dst)``."""
        raise NotImplementedError

    def place(self, t, mesh, copy: bool, run: Callable) -> tuple:
        """Plain tensor ``t`` held by each local device of ``mesh`` (a copy per device when ``copy``):
        ``run(t, mesh, copy)`` does it eagerly."""
        raise NotImplementedError

    def collective(self, c: Collective, args: tuple):
        raise NotImplementedError

    def read_value(self, what: str, value):
        """``value`` (a tensor holding a global value) read into Python by ``what``."""
        raise NotImplementedError


class Eager(Execution):
    """Runs everything now."""

    def box(self, shards, src, dst, run):
        return run(shards, src, dst)

    def place(self, t, mesh, copy, run):
        return run(t, mesh, copy)

    def collective(self, c, args):
        return c.run(*args)

    def read_value(self, what, value):
        return value


_CURRENT: contextvars.ContextVar[Execution] = contextvars.ContextVar(
    "shoal_execution", default=Eager())  # noqa: B039 - Eager holds no state


def current() -> Execution:
    """The execution in force in this thread."""
    return _CURRENT.get()


@contextlib.contextmanager
def using(execution: Execution):
    """Make ``execution`` the one in force in this thread while the block runs."""
    token = _CURRENT.set(execution)
    try:
        yield execution
    finally:
        _CURRENT.reset(token)
