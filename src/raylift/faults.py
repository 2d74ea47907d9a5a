"""A handled fault is one line on the console: what happened, and what raylift does about it.

When a worker dies (a SIGKILL, the OOM killer, a lost node) Ray Train restarts the worker
group from the latest checkpoint, and Ray prints the dead actor's error, the broken
collectives' tracebacks on the surviving ranks and a failed shutdown: some 50 lines.
Those go to Ray Train's log files (``logs/train/`` in Ray's session folder; ``--verbose``
shows them); instead, :class:`FaultReporter`, a Ray Train callback that runs in the
controller, prints which rank failed and on which node, the cause Ray gives, the
checkpoint the restart starts from and how many restarts are left. A failure that is not
retried is reported by the driver, with the failing worker's traceback, once.
"""

from __future__ import annotations

import re
from typing import Any

from ray.train import UserCallback

_EXIT = re.compile(r"Worker exit type: (\w+) Worker exit detail: ([^.]*)")
_IP = re.compile(r"\bip: (\S+)")


class FaultReporter(UserCallback):
    """Runs in the Ray Train controller: one raylift line per worker-group failure."""

    def __init__(self, max_failures: int, run_dir: str):
        self.max_failures, self.run_dir = max_failures, run_dir
        self.failures = 0

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Any]) -> None:
        from raylift.checkpoint import newest_written

        self.failures += 1
        # The folder, not Ray's record: a checkpoint written just before the failure may
        # not be registered yet, and the restart resumes from it (raylift.worker.resume).
        start = newest_written(self.run_dir)
        line = describe(worker_exceptions, self.failures, self.max_failures, start)
        print(line, flush=True)


def describe(
    exceptions: dict[int, Any], failures: int, max_failures: int, checkpoint: str | None
) -> str:
    rank, exc = primary(exceptions)
    what, node = cause(exc)
    where = f" on node {node}" if node else ""
    left = max_failures < 0 or failures <= max_failures
    if left:
        limit = ", no limit" if max_failures < 0 else f" of {max_failures}"
        start = checkpoint or "step 0 (no checkpoint was written yet)"
        then = f"restarting the workers from {start} (restart {failures}{limit})"
    else:
        then = f"no restarts left (train.max_failures: {max_failures}): the run fails"
    others = len(exceptions) - 1
    also = f", {others} other rank(s) failed with it" if others else ""
    return f"raylift: worker rank {rank}{where} failed: {what}{also}; {then}"


def primary(exceptions: dict[int, Any]) -> tuple[int, Any]:
    """The rank whose failure caused the others: a dead worker process, whose death broke
    the collectives the surviving ranks were in, before any exception raised in code."""
    dead = [r for r, e in sorted(exceptions.items()) if _died(e)]
    rank = dead[0] if dead else min(exceptions)
    return rank, exceptions[rank]


def _died(exc: Any) -> bool:
    return "ActorDiedError" in type(exc).__name__ or "actor died" in str(exc).lower()


def cause(exc: Any) -> tuple[str, str | None]:
    """(a short account of ``exc``, the node's address where Ray names it)."""
    text = str(exc)
    ip = _IP.search(text)
    node = ip.group(1) if ip else None
    if _died(exc):
        exit_ = _EXIT.search(text)
        how = f" ({exit_.group(1)}: {exit_.group(2).strip()})" if exit_ else ""
        return f"its process died{how}: killed, out of memory or crashed", node
    base = getattr(exc, "_base_exc", exc)  # Ray Train's wrapper of an exception in user code
    message = str(base).strip().splitlines()
    return f"{type(base).__name__}: {message[-1] if message else ''}".rstrip(": "), node
