"""One line for an error: the exception's own type and message, not its wrappers'.

An exception raised in a Ray task or actor reaches the caller as Ray's ``RayTaskError``,
whose text starts with Ray's header (``ray::Store.log_model() (pid=..., ip=...)``) and
a traceback; the exception that was raised is its ``cause``. A one-line message shows
that one.
"""

from __future__ import annotations


def cause_of(exc: BaseException) -> BaseException:
    """The exception that was raised: through Ray's wrappers (each holds it as ``cause``)."""
    seen: set[int] = set()
    while isinstance(inner := getattr(exc, "cause", None), BaseException) and id(exc) not in seen:
        seen.add(id(exc))
        exc = inner
    return exc


def first_line(exc: BaseException) -> str:
    """``Type: first line of its message`` of the exception that was raised."""
    cause = cause_of(exc)
    lines = str(cause).strip().splitlines()
    name = type(cause).__name__
    return f"{name}: {lines[0].strip()}" if lines else name


class SourceError(ValueError):
    """A task's raw data cannot be read: the message names the path and what is wrong."""


class RefusedPickle(Exception):
    """A file raylift would unpickle names something no file of its kind holds: refused,
    nothing of it run (:mod:`raylift.tensors.pickles`). The message names the file and
    the global. Not a checkpoint's ordinary damage on purpose: a resume passes over a
    damaged checkpoint to the one before it, and a planted file must stop the command
    where it is seen instead. One argument, its message, so that it crosses processes
    (DCP gathers each rank's error, Ray a worker's) as it was raised."""
