"""The console shows raylift's lines, what the user's own code prints, and every error.

The rule is who wrote a line, not what it looks like. Every raylift process (the driver,
each Ray Train worker, the controller's fault reporter, the data preprocessing tasks)
writes through a :class:`Router` on ``sys.stdout`` and ``sys.stderr`` that asks which
code called ``write``: raylift's package (its own lines), the user's code (a ``print`` in
a task's ``build_model``), or a library (Ray, torch, DeepSpeed, MLflow, the standard
library's ``logging`` and ``warnings``). In a Ray process the first two are tagged at
their source (:func:`tag`) and everything goes on to the file Ray forwards to the driver;
the driver shows tagged lines (each once, a user's with its rank) and writes everything
else, whole, to the run's log file, named on the console when the run starts. What
processes write below Python (C++ log lines, a faulthandler dump) is never tagged: it is
in the log file, and a crash's own report shows its last lines (:mod:`raylift.run.faults`).
``--verbose`` (``RAYLIFT_VERBOSE=1``) routes nothing: the console shows everything.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import itertools
import logging
import os
import re
import site
import sys
import sysconfig
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol, TextIO

VERBOSE_ENV = "RAYLIFT_VERBOSE"
LOG_DIR_ENV = "RAYLIFT_LOG_DIR"  # where runs' log files go; default ./raylift-logs


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "").lower() not in ("", "0", "false", "no")


def quiet_env() -> dict[str, str]:
    """Environment for every process of a run: libraries log warnings and worse only."""
    if verbose():
        return {VERBOSE_ENV: "1"}
    return {"MLFLOW_LOGGING_LEVEL": "WARNING", "RAY_TQDM_PATCH_PRINT": "0"}


def quiet_driver() -> None:
    """Before this process imports Ray, where it can: the log file gets Ray's forwarded
    lines without colour codes and each line as written (Ray would fold lines several
    workers print alike), and a sweep's console is raylift's trial table, not Ray Tune's
    (its newer console prints a configuration box whatever ``verbose`` says)."""
    if not verbose():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # read at each print
        # Ray's progress bars replace ``print`` with theirs, which would make every print
        # in the driver a line Ray's module wrote (read when the first bar's manager starts).
        os.environ.setdefault("RAY_TQDM_PATCH_PRINT", "0")
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
        os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")


def ray_logging_level() -> int:
    """For ``ray.init``: its token-auth notice is a warning a local run cannot act on."""
    return logging.INFO if verbose() else logging.ERROR


# ------------------------------------------------------------------ who wrote a line

RAYLIFT, USER, LIBRARY, ERROR = "raylift", "user", "library", "error"
_RAYLIFT_ROOT = str(Path(__file__).resolve().parents[1]) + os.sep  # the raylift package


@functools.cache
def _library_roots() -> tuple[str, ...]:
    """Where installed code lives: the standard library and every site-packages."""
    paths = sysconfig.get_paths()
    roots = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots.update(site.getsitepackages() if hasattr(site, "getsitepackages") else [])
    roots.add(site.getusersitepackages())
    roots.add(sys.prefix)  # a venv's own lib folder; user code is never inside it
    roots.add(sys.base_prefix)
    return tuple(sorted({str(Path(r).resolve()) + os.sep for r in roots if r}))


@functools.cache
def origin(filename: str) -> str:
    """Whose code ``filename`` is: raylift's, an installed library's, or the user's (a
    task module in their folders, one Ray shipped with the job, a notebook cell)."""
    if filename.startswith("<"):  # <frozen importlib>, or <stdin>, <string>, <ipython-...>
        return LIBRARY if filename.startswith("<frozen") else USER
    path = str(Path(filename).resolve())
    if path.startswith(_RAYLIFT_ROOT):
        return RAYLIFT
    return LIBRARY if path.startswith(_library_roots()) else USER


def _writer() -> str:
    """Whose code called ``write`` (two frames up: Router.write's caller); ERROR for a
    library's logging record of level ERROR or worse, which the console shows."""
    try:
        frame = sys._getframe(2)
    except ValueError:  # no Python caller: the interpreter itself (an uncaught error)
        return USER
    who = origin(frame.f_code.co_filename)
    if who == LIBRARY and frame.f_code.co_name == "emit":  # logging's StreamHandler.emit
        record = frame.f_locals.get("record")
        if isinstance(record, logging.LogRecord) and record.levelno >= logging.ERROR:
            return ERROR
    return who


# ------------------------------------------------------------------ tags

# A line for the console, from a Ray process: MARK, the writer's pid, the line's number in
# that process and the user's rank (letters only, so Ray's log deduplication, which drops
# words with digits before comparing lines, never folds two of them), MARK, the text.
MARK = "\x1f"  # ASCII unit separator: no library prints it, and no line ends at it
_TAGGED = re.compile(MARK + r"rl([a-z]+)\.([a-z]+)\.([a-z]*)" + MARK)


def _letters(n: int) -> str:
    out = ""
    while True:
        n, digit = divmod(n, 26)
        out = chr(ord("a") + digit) + out
        if n == 0:
            return out


def _number(letters: str) -> int:
    n = 0
    for c in letters:
        n = n * 26 + ord(c) - ord("a")
    return n


def tag(text: str, seq: int, rank: int | None, pid: int | None = None) -> str:
    who = "" if rank is None else _letters(rank)
    return f"{MARK}rl{_letters(pid or os.getpid())}.{_letters(seq)}.{who}{MARK}{text}"


def untag(line: str) -> tuple[tuple[str, str], int | None, str] | None:
    """(the line's key, the user's rank or None for raylift's, its text), or None."""
    found = _TAGGED.search(line)
    if found is None:
        return None
    rank = _number(found.group(3)) if found.group(3) else None
    return (found.group(1), found.group(2)), rank, line[found.end() :]


# ------------------------------------------------------------------ routing


class Sink(Protocol):
    def line(self, stream: TextIO, kind: str, text: str) -> None: ...


class Router:
    """``sys.stdout`` or ``sys.stderr`` of a raylift process: each line goes to ``sink``
    with whose code began it. Other threads' lines stay whole (a buffer per thread)."""

    def __init__(self, stream: TextIO, sink: Sink):
        self.stream, self.sink = stream, sink
        self._partial: dict[int, tuple[str, str]] = {}
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        return self._route(text, _writer())

    def writelines(self, lines: Any) -> None:
        who = _writer()
        for line in lines:
            self._route(line, who)

    def _route(self, text: str, who: str) -> int:
        with self._lock:
            kind, buf = self._partial.pop(threading.get_ident(), (who, ""))
            buf += text
            while "\n" in buf:
                line, buf = buf.split("\n", 1)
                self.sink.line(self.stream, kind, line)
                kind = who
            if buf:
                self._partial[threading.get_ident()] = (kind, buf)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:  # faulthandler and subprocess write to the descriptor itself
        return self.stream.fileno()

    def __getattr__(self, name: str) -> Any:  # encoding, errors, buffer, ...
        return getattr(self.stream, name)


class RaySink:
    """In a Ray process: raylift's and the user's lines tagged, all on to Ray's file."""

    def __init__(self, rank: int | None):
        # One numbering for both streams: a line's key is (pid, number), unique per process.
        self.rank, self._numbers = rank, itertools.count(1)

    def line(self, stream: TextIO, kind: str, text: str) -> None:
        if kind != LIBRARY and MARK not in text:
            text = tag(text, next(self._numbers), self.rank if kind == USER else None)
        stream.write(text + "\n")
        stream.flush()  # Ray forwards what is in the file; a console line should not wait


class DriverSink:
    """In the driver: console lines (tagged ones once each) to the console; all lines to
    the log file, opened at its first line."""

    def __init__(self, log: Path):
        self.log = log
        self._file: TextIO | None = None
        self._shown: set[tuple[str, str]] = set()
        self._lock = threading.Lock()  # stdout's and stderr's routers share this sink

    def line(self, stream: TextIO, kind: str, text: str) -> None:
        with self._lock:
            self._line(stream, kind, text)

    def _line(self, stream: TextIO, kind: str, text: str) -> None:
        tagged = untag(text)
        if tagged is not None:
            key, rank, text = tagged
            # Nodes that share a host share its logs folder, and each one's log monitor
            # forwards every worker's file: the same line, by its key, twice.
            if key in self._shown:
                return
            if len(self._shown) > 100_000:
                self._shown.clear()
            self._shown.add(key)
            text = text if rank is None else f"[rank {rank}] {text}"
        if tagged is not None or kind != LIBRARY:
            stream.write(text + "\n")
            stream.flush()
        self._write(text)

    def _write(self, text: str) -> None:
        if self._file is None:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.log.open("a", buffering=1)
        self._file.write(text + "\n")

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def _install(sink_for: Any, terminal_err: TextIO | None = None) -> None:
    """Routers on both streams; stderr's writes to ``terminal_err`` where fd 2 was moved."""
    for name in ("stdout", "stderr"):
        current = getattr(sys, name)
        stream = current.stream if isinstance(current, Router) else current
        router = Router(terminal_err if name == "stderr" and terminal_err else stream,
                        sink_for(name))  # fmt: skip
        setattr(sys, name, router)
        _repoint_handlers(stream, router)


_console_err: list[TextIO] = []  # the terminal's stderr, once fd 2 is the log's


def _below_python_to(log: Path) -> TextIO | None:
    """What this process writes to its fd 2 below Python (a C++ library's log line, as
    Arrow's S3 client writes one on each retry) goes to ``log``; Python's ``sys.stderr``
    keeps the terminal through a copy of the descriptor, and so does whatever asks the
    router for its ``fileno`` (faulthandler, a child's stderr). Only where ``sys.stderr``
    is the interpreter's own, on fd 2 (not a notebook's stream, nor a test's capture):
    the terminal's stream, or None."""
    current = sys.stderr.stream if isinstance(sys.stderr, Router) else sys.stderr
    own = current is sys.__stderr__  # the interpreter's, not a stand-in
    if not _console_err:
        try:
            if not own or current.fileno() != 2:
                return None
        except (AttributeError, OSError, ValueError):
            return None
        current.flush()
        terminal = os.fdopen(
            os.dup(2), "w", buffering=1, encoding=current.encoding, errors="backslashreplace"
        )
        _console_err.append(terminal)
        # A crash of this process (a C++ abort, a segfault) names its signal and stack on
        # the terminal, whose library lines go to the log from now on.
        faulthandler.enable(terminal, all_threads=True)
    elif current is not _console_err[0]:
        return None
    log.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    return _console_err[0]


def _repoint_handlers(stream: TextIO, router: Router) -> None:
    """Logging handlers made before routing hold the terminal's stream (Ray Data's, when
    a task module imports Ray at its top): they write through ``router`` instead."""
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for lg in loggers:
        for handler in getattr(lg, "handlers", []):
            if not isinstance(handler, logging.StreamHandler):
                continue
            held = handler.stream
            if held is stream or (isinstance(held, Router) and held.stream is stream):
                handler.setStream(router)  # the terminal's, or a previous run's router


def route_ray_process(rank: int | None = None) -> None:
    """In a Ray worker, controller or task raylift runs code in: tag the console's lines
    (the user's with ``rank``). Idempotent; nothing with ``--verbose``."""
    if verbose():
        return
    if _in_ray_process() and getattr(sys.stdout, "sink", None).rank == rank:  # type: ignore[union-attr]
        return
    sink = RaySink(rank)
    _install(lambda _name: sink)


_started: dict[str, Path] = {}
_announced: set[Path] = set()


def _in_ray_process() -> bool:
    current = sys.stdout
    return isinstance(current, Router) and isinstance(current.sink, RaySink)


def log_dir() -> Path:
    return Path(os.environ.get(LOG_DIR_ENV) or Path.cwd() / "raylift-logs")


def _log_path(name: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "raylift"
    return log_dir() / f"{safe}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"


def start_log(name: str, *, announce: bool = True) -> Path | None:
    """This command's log file, from now on: what Ray, torch, DeepSpeed and MLflow print,
    the workers' included. Named once on the console; None with ``--verbose``.
    ``announce=False`` routes to it without naming it yet: a command refused before its run
    starts stays one line, and the next call names the same file."""
    if verbose() or _in_ray_process():
        return None
    if (known := _started.get(name)) is None or current_log() != known:
        known = _started[name] = _log_path(name)
        route_driver(known)
        known.parent.mkdir(parents=True, exist_ok=True)
        known.touch()
    if announce and known not in _announced:  # prep, then train: named once
        _announced.add(known)
        print(f"raylift: the log of everything else (Ray, torch, libraries): {known}", flush=True)
    return known


def route_driver(log: Path) -> None:
    """This process's lines by the rule, the rest to ``log`` (one file for both streams)."""
    current = sys.stdout
    if isinstance(current, Router) and isinstance(current.sink, DriverSink):
        previous = current.sink
        if previous.log == log:
            return
        previous.close()
    sink = DriverSink(log)
    _install(lambda _name: sink, _below_python_to(log))
    _show_uncaught()


def _show_uncaught() -> None:
    """An uncaught exception, in the main thread or another, is an error: its traceback
    goes to the console whoever prints it. Ray's hook (it records a driver's failure in
    the cluster) still runs, its copy of the traceback going to the log."""
    import traceback

    if getattr(sys.excepthook, "_raylift", False):
        return
    previous, previous_thread = sys.excepthook, threading.excepthook

    def show(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        text = "".join(traceback.format_exception(kind, value, tb))
        err = sys.stderr
        if not isinstance(err, Router):
            previous(kind, value, tb)
            return
        err.stream.write(text)
        err.stream.flush()
        if previous is sys.__excepthook__:  # it would print the same to the console
            err.sink.line(err.stream, LIBRARY, text.rstrip("\n"))
        else:
            previous(kind, value, tb)

    def show_thread(args: Any) -> None:
        if args.exc_type is SystemExit:
            return
        if isinstance(sys.stderr, Router):
            show(args.exc_type, args.exc_value, args.exc_traceback)
        else:
            previous_thread(args)

    show._raylift = True  # type: ignore[attr-defined]
    sys.excepthook = show
    threading.excepthook = show_thread


def current_log() -> Path | None:
    current = sys.stdout
    if isinstance(current, Router) and isinstance(current.sink, DriverSink):
        return current.sink.log
    return None


def warnings_once() -> None:
    """In a Ray worker: each distinct Python warning once (to stderr, so to the log file).
    Libraries reset the warning registry (``catch_warnings``), so ZeRO-3's deprecation
    warnings would come back every step."""
    if verbose():
        return
    seen: set[tuple[Any, ...]] = set()
    show = warnings.showwarning

    def once(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        key = (category, str(message), filename, lineno)
        if key not in seen:
            seen.add(key)
            show(message, category, filename, lineno, file, line)

    warnings.showwarning = once


# Loggers of libraries that write to the console from raylift's own process.
LIBRARY_LOGGERS = ("DeepSpeed", "torch", "transformers")


@contextlib.contextmanager
def library_quiet(name: str = "raylift") -> Iterator[None]:
    """Inside this block what libraries print, log or warn goes to a log file (DeepSpeed's
    checkpoint converter prints a note per step and draws progress bars); raylift's lines,
    the user's and other threads' are shown as ever. Exceptions propagate."""
    if verbose():
        yield
        return
    if current_log() is None:
        route_driver(_log_path(name))
    # Their handlers hold the stream they were made with (the terminal, before routing):
    # for the block, one that writes to sys.stderr, a library's line to the log.
    loggers = [logging.getLogger(n) for n in LIBRARY_LOGGERS]
    saved = [(lg.handlers, lg.propagate) for lg in loggers]
    try:
        for lg in loggers:
            lg.handlers, lg.propagate = [logging.StreamHandler()], False
        yield
    finally:
        for lg, (handlers, propagate) in zip(loggers, saved, strict=True):
            lg.handlers, lg.propagate = handlers, propagate
