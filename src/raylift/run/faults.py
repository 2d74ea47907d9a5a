"""A handled fault is one line on the console: what happened, and what raylift does about it.

When a worker dies (a SIGKILL, the OOM killer, a lost node) Ray Train restarts the worker
group from the latest checkpoint, and Ray prints the dead actor's error, the broken
collectives' tracebacks on the surviving ranks and a failed shutdown: some 50 lines.
Those go to the run's log file (``--verbose`` shows them); instead,
:class:`FaultReporter`, a Ray Train callback that runs in the controller, reports a
crashed process (:class:`Crash`: its signal, the end of its stderr, its log files) and
prints which rank failed and on which node, the checkpoint the restart starts from and
how many restarts are left. A failure that is not retried is reported by the driver,
with the failing worker's traceback, once.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import threading
import time
from typing import Any

from ray.train import UserCallback

from raylift.core import console
from raylift.run.leaving import silent
from raylift.tensors.checkpoints import newest_written

_EXIT = re.compile(r"Worker exit type: (\w+) Worker exit detail: ([^.]*)")
_IP = re.compile(r"\bip: (\S+)")


class FaultReporter(UserCallback):
    """Runs in the Ray Train controller: one raylift line per worker-group failure, after
    a crashed process's own report (:class:`Crash`)."""

    def __init__(
        self,
        max_failures: int,
        run_dir: str,
        tracking: Any = None,
        run_log: str | None = None,
        run_id: str | None = None,
        memory: bool = False,
    ):
        self.max_failures, self.run_dir, self.memory = max_failures, run_dir, memory
        self.tracking, self.run_log, self.run_id = tracking, run_log, run_id
        self.failures = 0

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Any]) -> None:
        if self.tracking is not None and self.run_id:
            # When the restart's clock starts (raylift.run.restarts): first, not waited for.
            self.tracking.fault.remote(self.run_id, time.time())
        console.route_ray_process()  # this line is raylift's, in the controller's process
        self.failures += 1
        report = functools.partial(self.report, dict(worker_exceptions), self.failures)
        if self.max_failures >= 0 and self.failures > self.max_failures:
            report()  # the run ends here: said before the controller does
            return
        # Ray Train restarts the group once this returns. Reading the dead process's stderr
        # on its node (a task there: a process to start, about a second) and listing the
        # storage are for the console, not for the restart: they run beside it.
        threading.Thread(target=report, name="raylift-fault-report", daemon=True).start()

    def report(self, worker_exceptions: dict[int, Any], failures: int) -> None:
        """The failure's lines: a crashed process's account, then what raylift does."""
        # The folder, not Ray's record: a checkpoint written just before the failure may
        # not be registered yet, and the restart resumes from it (raylift.run.worker.resume).
        start = newest_written(self.run_dir)
        rank, exc = primary(worker_exceptions)
        crash = Crash.find(exc, self.tracking, rank) if died(exc) else None
        if crash is not None:
            print("\n".join(crash.report(self.run_log)), flush=True)
        how = crash.how() if crash is not None else None
        lost = None if died(exc) else lost_node(self.tracking)
        said = describe(
            worker_exceptions, failures, self.max_failures, start, how, self.memory, lost
        )
        print(said, flush=True)


# faulthandler's first line names the signal in words (Python's own format).
FAULT_SIGNALS = {
    "Segmentation fault": "SIGSEGV",
    "Aborted": "SIGABRT",
    "Bus error": "SIGBUS",
    "Floating-point exception": "SIGFPE",
    "Illegal instruction": "SIGILL",
}
_FAULT = re.compile(r"^Fatal Python error: ([A-Za-z][A-Za-z -]*)", re.M)
TAIL_LINES = 20
LOOKUP_TIMEOUT_S = 5.0  # for the tracking actor's record of where each rank ran


@dataclasses.dataclass
class Crash:
    """A worker process that died: where it ran, the end of its stderr, its node's memory."""

    rank: int
    node: str
    pid: int
    stderr: str | None  # the file, on its node
    tail: list[str] | None  # None: its node is gone, or the file could not be read
    memory: tuple[float, float] | None = None  # node's (used, total) bytes, last interval
    preempted: bool = False  # Ray says its node was reclaimed

    @classmethod
    def find(cls, exc: Any, tracking: Any, rank: int) -> Crash | None:
        """The crash of the process behind ``exc`` (Ray's ``ActorDiedError``), from what it
        told the tracking actor when it started; None if it never did."""
        import ray

        if tracking is None:
            return None
        try:
            record = ray.get(tracking.worker_record.remote(_actor_id(exc), rank))
        except Exception:  # the tracking actor's node is gone too: Ray's account only
            return None
        if record is None:
            return None
        tail = read_tail(record["node_id"], record["stderr"]) if record["stderr"] else None
        memory = record.get("memory")
        preempted = bool(getattr(_actor_error(exc), "preempted", False))
        return cls(
            record["rank"], record["ip"], record["pid"], record["stderr"], tail, memory, preempted
        )

    def signal(self) -> tuple[str, str] | None:
        """(SIGSEGV, Segmentation fault), from the faulthandler dump in its stderr."""
        found = _FAULT.search("\n".join(self.tail or []))
        if found is None:
            return None
        words = found.group(1).strip()
        return FAULT_SIGNALS.get(words, words), words

    def how(self) -> str:
        if (signal := self.signal()) is not None:
            return f"its process (pid {self.pid}) died by {signal[0]} ({signal[1]})"
        if self.preempted:
            return f"its node was reclaimed (preempted), and its process (pid {self.pid}) with it"
        if self.tail is None:
            return f"its process (pid {self.pid}) died, and its node is gone"
        memory = ""
        if self.memory is not None:
            used, total = self.memory
            memory = (
                f"; node {self.node} had {used / 2**30:.1f} of {total / 2**30:.1f} GiB "
                "in use at its last logging interval"
            )
        return (
            f"its process (pid {self.pid}) ended without a Python error or a fault dump: "
            f"SIGKILL, often the kernel's OOM killer{memory}, or an exit that skips "
            "Python (os._exit)"
        )

    def report(self, run_log: str | None) -> list[str]:
        head = f"raylift: worker rank {self.rank} on node {self.node}: {self.how()}"
        lines = [head + (":" if self.tail else "")]
        lines += [f"    {line}" for line in self.tail or []]
        where = [f"its stderr: {self.stderr} on node {self.node}"] if self.stderr else []
        if run_log:
            where.append(f"this run's log: {run_log}")
        if where:
            lines.append(f"raylift: {'; '.join(where)}")
        return lines


def _actor_error(exc: Any) -> Any:
    """Ray's ``ActorDiedError`` behind ``exc`` (Train's health check keeps it as
    ``health_check_failure``), or None."""
    for candidate in (exc, getattr(exc, "health_check_failure", None), exc.__cause__):
        if isinstance(getattr(candidate, "actor_id", None), str):
            return candidate
    return None


def _actor_id(exc: Any) -> str | None:
    """The dead actor's id (public on Ray's ``ActorDiedError``)."""
    found = _actor_error(exc)
    return None if found is None else str(found.actor_id)


def own_stderr() -> str | None:
    """The file this process's stderr writes to (Ray points it at the worker's log)."""
    try:
        path = os.readlink("/proc/self/fd/2")
    except OSError:
        return None
    return path if path.startswith("/") and os.path.isfile(path) else None


def _tail(path: str, lines: int) -> list[str]:
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - 256 * 1024))
        text = f.read().decode(errors="replace")
    out = []
    for line in text.splitlines()[-lines:]:
        tagged = console.untag(line)
        out.append((tagged[2] if tagged else line)[:400])
    return out


def read_tail(node_id: str, path: str, lines: int = TAIL_LINES) -> list[str] | None:
    """The last ``lines`` of ``path`` on node ``node_id``, read there; None if the node
    is gone or the file cannot be read."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if node_id not in {n["NodeID"] for n in ray.nodes() if n.get("Alive")}:
        return None
    on_node = NodeAffinitySchedulingStrategy(node_id, soft=False)
    reader = ray.remote(num_cpus=0)(_tail).options(scheduling_strategy=on_node)
    try:
        return ray.get(reader.remote(path, lines))
    except Exception:  # the node went away, or the file with it
        return None


def describe(
    exceptions: dict[int, Any],
    failures: int,
    max_failures: int,
    checkpoint: str | None,
    how: str | None = None,
    memory: bool = False,
    lost: str | None = None,
) -> str:
    """The failure's one line; ``how``: a crash's account (:meth:`Crash.how`), else Ray's;
    ``memory``: the run keeps memory snapshots, which the restart may start from instead;
    ``lost``: the node that stopped answering (:func:`lost_node`), which caused it."""
    rank, exc = primary(exceptions)
    what, node = cause(exc)
    what = how or what
    where = f" on node {node}" if node else ""
    then = _then(failures, max_failures, checkpoint, memory)
    others = len(exceptions) - 1
    also = f", {others} other rank(s) failed with it" if others else ""
    if lost:
        return f"raylift: {lost}; worker rank {rank} failed with it ({what}){also}; {then}"
    return f"raylift: worker rank {rank}{where} failed: {what}{also}; {then}"


def _then(failures: int, max_failures: int, checkpoint: str | None, memory: bool) -> str:
    left = max_failures < 0 or failures <= max_failures
    if left:
        limit = ", no limit" if max_failures < 0 else f" of {max_failures}"
        start = checkpoint or "step 0 (no checkpoint was written yet)"
        if memory:
            start += " or a newer memory snapshot"
        then = f"restarting the workers from {start} (restart {failures}{limit})"
    else:
        then = f"no restarts left (train.max_failures: {max_failures}): the run fails"
    return then


def lost_node(tracking: Any) -> str | None:
    """Where no worker's process is known to have died: a node of the run whose raylet
    takes no connection (killed, its host gone), with the ranks it ran, from what the
    workers told the tracking actor. Ray calls such a node dead only after its health
    checks have failed for about half a minute; the surviving ranks' broken collectives
    reach the controller first, and alone they name only a peer that went away."""
    import ray

    if tracking is None:
        return None
    gone = silent([n for n in ray.nodes() if n.get("Alive")])
    if not gone:
        return None
    try:
        ranks = ray.get(tracking.ranks_on.remote(sorted(gone)), timeout=LOOKUP_TIMEOUT_S)
    except Exception:  # the tracking actor's node is gone too: Ray's account only
        return None
    if not ranks:
        return None
    ips = ", ".join(sorted(set(ranks.values())))
    return (
        f"node {ips} stopped answering (its raylet takes no connection) with worker "
        f"rank(s) {sorted(ranks)} on it"
    )


def primary(exceptions: dict[int, Any]) -> tuple[int, Any]:
    """The rank whose failure caused the others: a dead worker process, whose death broke
    the collectives the surviving ranks were in, before any exception raised in code."""
    dead = [r for r, e in sorted(exceptions.items()) if died(e)]
    rank = dead[0] if dead else min(exceptions)
    return rank, exceptions[rank]


def died(exc: Any) -> bool:
    """Whether ``exc`` says a worker's process died (Ray's ``ActorDiedError``)."""
    return "ActorDiedError" in type(exc).__name__ or "actor died" in str(exc).lower()


def cause(exc: Any) -> tuple[str, str | None]:
    """(a short account of ``exc``, the node's address where Ray names it)."""
    text = str(exc)
    ip = _IP.search(text)
    node = ip.group(1) if ip else None
    if died(exc):
        exit_ = _EXIT.search(text)
        how = f" ({exit_.group(1)}: {exit_.group(2).strip()})" if exit_ else ""
        return f"its process died{how}: killed, out of memory or crashed", node
    base = getattr(exc, "_base_exc", exc)  # Ray Train's wrapper of an exception in user code
    message = str(base).strip().splitlines()
    return f"{type(base).__name__}: {message[-1] if message else ''}".rstrip(": "), node
