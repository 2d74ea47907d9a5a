"""A quiet console by default: raylift's own lines, and nothing a user cannot act on.

Ray, MLflow and DeepSpeed each print start-up chatter (a token-auth notice, database
migrations, C++ core-worker lines), and torch, DeepSpeed and fairscale warn from the
workers (ZeRO-3 about 20 deprecation warnings a step). All of it goes to Ray's log files
under its session folder (the workers' warnings to ``raylift-warnings-<pid>.log``, each
once); the console shows it only with ``RAYLIFT_VERBOSE=1`` (``--verbose``). Errors are
never hidden: a failed run's message is raylift's own.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import re
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

VERBOSE_ENV = "RAYLIFT_VERBOSE"

# What Ray's C++ side writes to the worker, raylet and GCS logs its driver forwards:
# its own log lines (``[2026-01-01 00:00:00,000 E 123 456] core_worker.cc:12: ...``),
# abseil's raw lines (``[mutex.cc : 452] RAW: Lock blocking ...``), and the failure
# signal handler's dump of a C++ stack (``*** SIGSEGV received at ...``, ``PC: @ ...``,
# ``    @     0x7f543545a050       9104  (unknown)``), torch's C++ warnings, and Python's
# faulthandler dump of a process that aborts (``Fatal Python error: Aborted``). A
# process that dies this way is reported by raylift in its own words; the lines stay in
# Ray's log files (the worker's own).
CPP_LINE = re.compile(
    r"^(\[\d{4}-\d\d-\d\d [\d:,.]+ [DIWEF] \d+ \d+\] \S+\.(cc|h):\d+"
    # torch's C++ (c10d) warnings: ``[W1126 01:48:03.303881950 socket.cpp:207] [c10d] ...``
    r"|\[[IWE]\d{4} [\d:.]+ \S+\.(cpp|cc|h):\d+\] "
    r"|\[\S+\.(cc|h) ?: ?\d+\] RAW: "
    r"|\*\*\* SIG[A-Z]+ received at "
    r"|PC: @ "
    r"|\s+@\s+0x[0-9a-f]+\s"
    # Python's faulthandler, when such a process aborts (a worker ending while a native
    # thread still runs): the error, its threads' frames, which it writes as ``line 12 in
    # f`` where a Python traceback writes ``line 12, in f``, and its list of modules.
    r"|Fatal Python error: "
    r"|Python runtime state: "
    r"|(Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):"
    r'|\s+File ".*", line \d+ in \S+$'
    r"|\s+<no Python frame>"
    r"|Extension modules: )"
)


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "").lower() not in ("", "0", "false", "no")


def quiet_env() -> dict[str, str]:
    """Environment for every process of a run: libraries log warnings and worse only."""
    if verbose():
        return {VERBOSE_ENV: "1"}
    return {"MLFLOW_LOGGING_LEVEL": "WARNING"}


def quiet_driver() -> None:
    """Before this process imports Ray: raylift's worker lines print without Ray's
    ``(RayTrainWorker pid=...)`` prefix, as the lines of the command they are, and a
    sweep prints raylift's trial table, not Ray Tune's (its newer console prints a
    configuration box and a TensorBoard hint whatever ``verbose`` says; the older one
    honours ``verbose=0``)."""
    if not verbose():
        os.environ.setdefault("RAY_DISABLE_WORKER_LOG_PREFIX", "1")
        # Ray folds lines that several workers print alike (each trial's "raylift: strategy
        # ddp") into one, prefixed with the first worker's name: each line is kept, as is.
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
        os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")


def ray_logging_level() -> int:
    """For ``ray.init``: its token-auth notice is a warning a local run cannot act on."""
    return logging.INFO if verbose() else logging.ERROR


# What Ray's own processes (not the run's workers) push to the driver: the raylet's
# warnings ("N worker processes have been started ... high concurrency"), the autoscaler's
# status. They are written to a file in Ray's logs folder instead of the console.
RAY_PROCESSES = ("raylet", "autoscaler", "gcs_server")


def filter_worker_logs() -> None:
    """Keep Ray's own lines off what this driver prints of the cluster's output.

    Ray offers no setting for this: its driver prints whatever its log monitor reads and
    whatever Ray's processes publish, so both of its print paths are swapped for one that
    filters: C++ log lines are dropped (they are in Ray's log files), and the messages of
    Ray's own processes go to ``raylift-ray-messages-<pid>.log`` in Ray's logs folder. If
    Ray's internals moved, the console stays as Ray left it.
    """
    if verbose():
        return
    try:
        import ray._private.worker as ray_worker
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return
    found = [h for name, h in getattr(dispatcher, "handlers", []) if name == "ray_print_logs"]
    if len(found) != 1:
        return
    printer = found[0]

    def filtered(data: dict[str, Any]) -> None:
        if (shown := _kept(data)) is not None:
            printer(shown)

    dispatcher.remove_handler("ray_print_logs")
    dispatcher.add_handler("ray_print_logs", filtered)
    original = getattr(ray_worker, "print_to_stdstream", None)
    if original is None or hasattr(original, "_raylift_original"):
        return

    def published(data: dict[str, Any], ignore_prefix: bool) -> None:
        if (shown := _kept(data)) is not None:
            original(shown, ignore_prefix)

    published._raylift_original = original  # type: ignore[attr-defined]
    ray_worker.print_to_stdstream = published  # Ray's error listener calls it by name


def _kept(data: dict[str, Any]) -> dict[str, Any] | None:
    """What of one batch of forwarded lines the console shows; None: nothing."""
    if data.get("pid") in RAY_PROCESSES:
        with _ray_messages_file().open("a") as out:
            out.writelines(f"({data.get('pid')}) {line}\n" for line in data.get("lines", []))
        return None
    # Blank lines too: a worker's flush can forward one, between raylift's lines.
    lines = [ln for ln in data.get("lines", []) if ln.strip() and not CPP_LINE.match(ln)]
    lines = _FORWARDED.first_copies(data.get("ip"), data.get("pid"), lines)
    return {**data, "lines": lines} if lines else None


class Forwarded:
    """Drops the copies of a line that several nodes on one host forward.

    Nodes that share one host share its logs folder (Ray's fake multinode nodes, the
    autoscaling cluster of ``cluster/local-fake.yaml``), and each node's log monitor
    forwards every worker's file: each line would print once per node, from the same
    address and pid. Where several alive nodes share an address, a line is a copy when
    the same text from the same process came in another batch within ``window_s``. On a
    cluster of one node per host nothing is dropped."""

    RECHECK_S = 10.0  # how often to ask the cluster whether nodes share a host

    def __init__(self, window_s: float = 5.0, shared: Callable[[], bool] | None = None):
        self.window_s = window_s
        self.shared = shared or self._nodes_share_a_host
        self.seen: dict[tuple[Any, Any, str], tuple[int, float]] = {}
        self.batches = 0
        self._checked_at, self._shared = -math.inf, False

    def first_copies(self, ip: Any, pid: Any, lines: list[str]) -> list[str]:
        if not lines or not self.shared():
            return lines
        now, self.batches = time.monotonic(), self.batches + 1
        if len(self.seen) > 10_000:  # forget what is past the window
            self.seen = {k: v for k, v in self.seen.items() if now - v[1] < self.window_s}
        kept = []
        for line in lines:
            first = self.seen.get((ip, pid, line))
            if first and first[0] != self.batches and now - first[1] < self.window_s:
                continue
            self.seen[(ip, pid, line)] = (self.batches, now)
            kept.append(line)
        return kept

    def _nodes_share_a_host(self) -> bool:
        now = time.monotonic()
        if now - self._checked_at > self.RECHECK_S:
            import ray

            try:
                ips = [n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")]
            except Exception:  # not connected, or the GCS is busy: one node per host
                ips = []
            self._checked_at, self._shared = now, len(ips) != len(set(ips))
        return self._shared


_FORWARDED = Forwarded()


def _ray_messages_file() -> Path:
    import tempfile

    import ray._private.worker as ray_worker

    node = ray_worker.global_worker.node
    logs = node.get_logs_dir_path() if node is not None else tempfile.gettempdir()
    return Path(logs) / f"raylift-ray-messages-{os.getpid()}.log"


def warnings_to_ray_logs(logs_dir: str | None = None) -> Path | None:
    """In a Ray worker: Python warnings go to ``raylift-warnings-<pid>.log`` in Ray's logs
    folder, each distinct one once, instead of to stderr, which Ray forwards to the
    driver's console. Returns the file; None with ``--verbose`` (the console shows them)."""
    if verbose():
        return None
    if logs_dir is None:
        import ray._private.worker

        node = ray._private.worker.global_worker.node
        if node is None:  # not in a Ray worker: nothing to route them to
            return None
        logs_dir = node.get_logs_dir_path()
    path = Path(logs_dir) / f"raylift-warnings-{os.getpid()}.log"
    seen: set[tuple[Any, ...]] = set()

    def to_file(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        # Libraries reset the warning registry (catch_warnings), so the same warning from
        # the same line would come back every step: written once here.
        key = (category, str(message), filename, lineno)
        if key in seen:
            return
        seen.add(key)
        with path.open("a") as out:
            out.write(warnings.formatwarning(message, category, filename, lineno, line))

    warnings.showwarning = to_file
    return path


# Loggers of libraries that write to the console from raylift's own process.
LIBRARY_LOGGERS = ("DeepSpeed", "torch", "transformers")


@contextlib.contextmanager
def library_quiet() -> Iterator[None]:
    """What libraries print, log below ERROR or warn inside this block is dropped, unless
    ``--verbose``: DeepSpeed's checkpoint converter prints a note per step and draws
    progress bars. Exceptions still propagate, with their messages."""
    if verbose():
        yield
        return
    loggers = [logging.getLogger(name) for name in LIBRARY_LOGGERS]
    levels = [lg.level for lg in loggers]
    sink = io.StringIO()
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(sink),
            contextlib.redirect_stderr(sink),
        ):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
