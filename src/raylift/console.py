"""A quiet console by default: raylift's own lines, and nothing a user cannot act on.

Ray, MLflow and DeepSpeed each print start-up chatter (a token-auth notice, database
migrations, C++ core-worker lines). All of it still goes to Ray's log files under its
session folder; the console shows it only with ``RAYLIFT_VERBOSE=1`` (``--verbose``).
Errors are never hidden: a failed run's message is raylift's own, and Python warnings
and tracebacks from the workers still reach the console.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

VERBOSE_ENV = "RAYLIFT_VERBOSE"

# What Ray's C++ side writes to the worker, raylet and GCS logs its driver forwards:
# its own log lines (``[2026-01-01 00:00:00,000 E 123 456] core_worker.cc:12: ...``),
# abseil's raw lines (``[mutex.cc : 452] RAW: Lock blocking ...``), and the failure
# signal handler's dump of a C++ stack (``*** SIGSEGV received at ...``, ``PC: @ ...``,
# ``    @     0x7f543545a050       9104  (unknown)``). A process that dies this way is
# reported by raylift in its own words; the dump itself stays in Ray's log files.
CPP_LINE = re.compile(
    r"^(\[\d{4}-\d\d-\d\d [\d:,.]+ [DIWEF] \d+ \d+\] \S+\.(cc|h):\d+"
    r"|\[\S+\.(cc|h) ?: ?\d+\] RAW: "
    r"|\*\*\* SIG[A-Z]+ received at "
    r"|PC: @ "
    r"|\s+@\s+0x[0-9a-f]+\s)"
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


def filter_worker_logs() -> None:
    """Drop Ray's C++ log lines from what the workers' output forwards to this console.

    Ray offers no setting for this: its driver prints whatever its log monitor reads, so
    the dispatcher's print handler is swapped for one that filters. If Ray's internals
    moved, the console stays as Ray left it.
    """
    if verbose():
        return
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return
    found = [h for name, h in getattr(dispatcher, "handlers", []) if name == "ray_print_logs"]
    if len(found) != 1:
        return
    printer = found[0]

    def filtered(data: dict[str, Any]) -> None:
        # Blank lines too: a worker's flush can forward one, between raylift's lines.
        lines = [ln for ln in data.get("lines", []) if ln.strip() and not CPP_LINE.match(ln)]
        if lines:
            printer({**data, "lines": lines})

    dispatcher.remove_handler("ray_print_logs")
    dispatcher.add_handler("ray_print_logs", filtered)
