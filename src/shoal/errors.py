"""Errors of graph mode that eager code raises too: a traced step reading a tensor's value into
Python, an op that cannot run on shapes alone. They name the user's line. Imports nothing of shoal."""

from __future__ import annotations

import os
import traceback

import torch

__all__ = ["TraceError", "value_read", "untraceable", "library_file", "user_line"]

# code that is not the user's: shoal, torch, the standard library (and installed packages, below)
_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in (__file__, torch.__file__, os.__file__))
# frames between a reading library function and the tracer: not worth naming
_PLUMBING = ("/shoal/graph/", "/shoal/dispatch/", "/shoal/dispatch.py", "/shoal/tensor.py", "/shoal/aliasing.py",
             "/shoal/seam.py", "/_python_dispatch.py", "/_ops.py", "/_dynamo/", "/_compile.py")
# shoal's code written with shoal as a user's would be: named where no user's frame is on the stack
_SHIPPED = tuple(_LIBRARY_DIRS[0] + p for p in ("models" + os.sep, "train.py", "demo.py"))


class DoesNotFit(MemoryError):
    """A plan that would hold more bytes on a device than ``shoal.init(memory_per_device=...)``
    allows, refused before it runs."""


class TraceError(RuntimeError):
    pass


def value_read(what: str) -> TraceError:
    """The error for reading a traced tensor's value into Python (by ``what``), naming the user's line."""
    return TraceError(
        f"shoal.compile: {what} reads a tensor's value into Python (.item(), bool(t), .tolist(), .numpy(), "
        f"torch.equal) at\n  {user_line()}\nA compiled step cannot branch on tensor values: compute it "
        f"with tensor ops (torch.where), or return the tensor and read it outside the compiled function."
    )


def library_file(filename: str) -> bool:
    """Whether code in ``filename`` is a library's (shoal, torch, the standard library, an installed
    package), not the user's."""
    f = os.path.abspath(filename)
    return f.startswith(_LIBRARY_DIRS) or f"{os.sep}site-packages{os.sep}" in f or f"{os.sep}dist-packages{os.sep}" in f


def user_line(frames=None) -> str:
    """The innermost frame of the user's code in ``frames`` (a ``traceback.StackSummary``; default:
    the current stack), as 'file:line: code', and the library function below it that did the
    reading, if any. Without a user's frame (``shoal train``): the innermost frame of code written
    with shoal that ships as a library (shoal's models and training loop, an installed package)."""
    inner = shipped = None
    for fr in reversed(traceback.extract_stack() if frames is None else frames):
        f = os.path.abspath(fr.filename)
        if library_file(f):
            if not any(s in f for s in _PLUMBING):
                inner = inner or fr
                if shipped is None and (f.startswith(_SHIPPED) or not f.startswith(_LIBRARY_DIRS)):
                    shipped = fr
            continue
        return _where(fr, inner)
    return "<unknown>" if shipped is None else _where(shipped, None if inner is shipped else inner)


def _where(fr, inner) -> str:
    via = f"\n  (in {inner.filename}:{inner.lineno} {inner.name})" if inner is not None else ""
    return f"{fr.filename}:{fr.lineno}: {fr.line}{via}"


def untraceable(func, why: str) -> TraceError:
    """The error for an op a traced step cannot run on shapes alone (``why``), naming the user's line."""
    return TraceError(
        f"shoal.compile: {func} cannot be traced: {why}, at\n  {user_line()}\nA compiled step runs on "
        f"shapes alone while it is traced: run this op outside the compiled function (eagerly)."
    )
