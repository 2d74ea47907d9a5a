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
