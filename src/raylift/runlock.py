"""One writer per run: a second command with the same name and storage stops at once.

Two ``raylift train`` (or ``tune``) commands writing one run folder would interleave
their checkpoints and continue one MLflow run. The first holds ``.raylift-lock`` in the
run folder: its host, pid, process start time and since when, refreshed every
``HEARTBEAT_S``. A second finds it and stops with exit 2, naming the first. A lock
whose holder is gone is taken over, and the taker says so: on the same host when the
pid no longer runs (or runs another program: its start time differs), on any host
when the heartbeat is older than ``STALE_S`` (a lost node).

Local storage only: object stores have no atomic create-if-absent that every backend
honours, so a run on ``s3://``/``gs://`` storage is not locked (the README says so).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from raylift.startup import process_start

LOCK_FILE = ".raylift-lock"
HEARTBEAT_S = 10.0
STALE_S = 60.0  # six missed heartbeats: the holder's node is gone


class RunLocked(RuntimeError):
    """Another live command holds this run."""


def _me() -> dict[str, object]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": round(process_start(), 1),
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


@contextlib.contextmanager
def hold(folder: Path, what: str, log: Callable[[str], None] = print) -> Iterator[None]:
    """Hold ``folder``'s lock while the block runs; :class:`RunLocked` if a live command
    holds it."""
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    mine = _me()
    _acquire(path, mine, what, log)
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(path, stop), daemon=True)
    beat.start()
    try:
        yield
    finally:
        stop.set()
        beat.join()
        with contextlib.suppress(OSError, ValueError):
            if json.loads(path.read_text()).get("pid") == mine["pid"]:
                path.unlink()
        if created:  # a run that wrote nothing (bad shards, say) leaves no folder behind
            with contextlib.suppress(OSError):
                folder.rmdir()


def _acquire(path: Path, mine: dict[str, object], what: str, log: Callable[[str], None]) -> None:
    for _ in range(3):  # a holder that vanishes between our checks: look again
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read(path)
            if holder is None:
                continue
            why = stale(holder, path)
            if why is None:
                raise RunLocked(
                    f"{what} is already running: {describe(holder)} holds {path}. Wait for "
                    "it, stop it, or give this run another name= (or storage=)"
                ) from None
            log(f"raylift: taking over the lock of {describe(holder)}: {why}")
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(mine, f)
        return
    raise RunLocked(f"could not take {path}: other commands keep taking it")


def _read(path: Path) -> dict[str, object] | None:
    try:
        return dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {"host": "?", "pid": -1, "started": 0, "since": "?"}  # torn write: judge by age


def stale(holder: dict[str, object], path: Path) -> str | None:
    """Why ``holder``'s lock is stale, or None while its command lives."""
    try:
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return "it was released"
    if age > STALE_S:
        return f"no heartbeat for {age:.0f} s"
    if holder.get("host") != socket.gethostname():
        return None  # cannot look at another host's processes: its heartbeat decides
    pid = int(str(holder.get("pid", -1)))
    try:
        import psutil

        proc = psutil.Process(pid)
        started = float(proc.create_time())
    except (ValueError, psutil.NoSuchProcess):
        return f"pid {pid} is not running"
    if abs(started - float(str(holder.get("started", 0)))) > 2.0:  # psutil: whole seconds
        return f"pid {pid} is now another process"
    return None


def describe(holder: dict[str, object]) -> str:
    return f"pid {holder.get('pid')} on {holder.get('host')} (since {holder.get('since')})"


def _heartbeat(path: Path, stop: threading.Event) -> None:
    while not stop.wait(HEARTBEAT_S):
        with contextlib.suppress(OSError):
            os.utime(path)
