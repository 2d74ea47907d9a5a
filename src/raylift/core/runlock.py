"""One writer per run: a second command with the same name and storage stops at once.

Two ``raylift train`` (or ``tune``) commands writing one run folder would interleave
their checkpoints and continue one MLflow run. The first holds a lease,
``.raylift-lock`` in the run folder, written through pyarrow: the same code for a local
folder, an NFS mount and an object store (``s3://``, ``gs://``). It names the holder
(host, pid, process start time, since when) and carries a random token; the holder
rewrites it every ``HEARTBEAT_S``.

Taking it: a command reads the lease and stops (exit 2, naming the holder) if a live
command holds it; else it writes its own and, ``SETTLE_S`` later, reads it back. Of two
commands that wrote within that time, only the one whose write landed last finds its
own token; the other stops as if it had found the lease held. Object stores need no
atomic create for this, only what S3 and GCS give: a read sees the latest completed
write. A lease is stale, and taken over with a line saying so, when it is older than
``STALE_S`` by the store's clock (a lost node), or when its holder ran on this host and
its pid is gone or is another program.

What it cannot guarantee: a command that stalls for more than ``SETTLE_S`` between
reading the lease and writing its own (a long GC pause, a hung connection) can end up
running beside another; a holder cut off from the store for ``STALE_S`` is taken over
while it may still write (nothing fences its later writes); and hosts whose clocks
disagree with the store's by more than ``STALE_S`` misjudge a lease's age.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator

from raylift.core import storage
from raylift.core.startup import process_start

LOCK_FILE = ".raylift-lock"
HEARTBEAT_S = 10.0
STALE_S = 60.0  # six missed heartbeats: the holder's node is gone
SETTLE_S = 1.5  # how long two racing writes have to both land before the read-back

Log = Callable[[str], None]


class RunLocked(RuntimeError):
    """Another live command holds this run."""


def _me() -> dict[str, object]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": round(process_start(), 1),
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        "token": uuid.uuid4().hex,
    }


class RunLock:
    """The lease on one run folder (a local path or a URI): :meth:`claim`, then
    :meth:`confirm` before writing anything there, :meth:`release` at the end."""

    def __init__(self, folder: str, what: str, log: Log = print):
        self.folder, self.what, self.log = folder, what, log
        self.path = storage.join(folder, LOCK_FILE)
        self.mine = _me()
        self._created = not storage.is_dir(folder)
        self._claimed = 0.0
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def claim(self) -> None:
        """Write this command's lease unless a live command holds it (RunLocked)."""
        holder = read(self.path)
        if holder is not None:
            why = stale(holder, self.path)
            if why is None:
                raise self._held_by(holder)
            self.log(f"raylift: taking over the lock of {describe(holder)}: {why}")
        self._write()
        self._claimed = time.monotonic()

    def confirm(self) -> None:
        """Once the settle time is over, the lease must still be this command's
        (RunLocked otherwise); then the heartbeat starts."""
        if self._beat is not None:
            return
        time.sleep(max(0.0, self._claimed + SETTLE_S - time.monotonic()))
        holder = read(self.path)
        if holder is None or holder.get("token") != self.mine["token"]:
            raise self._held_by(holder or {"host": "?", "pid": "?", "since": "just now"})
        self._beat = threading.Thread(target=self._heartbeat, daemon=True)
        self._beat.start()

    def release(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        with contextlib.suppress(OSError):
            holder = read(self.path)
            if holder is not None and holder.get("token") == self.mine["token"]:
                storage.delete(self.path)
            if self._created:  # a run that wrote nothing (bad shards) leaves no folder
                storage.delete_dir_if_empty(self.folder)

    def _write(self) -> None:
        storage.write_text(self.path, json.dumps(self.mine))

    def _held_by(self, holder: dict[str, object]) -> RunLocked:
        return RunLocked(
            f"{self.what} is already running: {describe(holder)} holds {self.path}. Wait "
            "for it, stop it, or give this run another name= (or storage=)"
        )

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                holder = read(self.path)
                if holder is not None and holder.get("token") != self.mine["token"]:
                    self.log(
                        f"raylift: {describe(holder)} took over the lock of {self.what}; "
                        "this command no longer holds it"
                    )
                    return
                self._write()


@contextlib.contextmanager
def hold(folder: str, what: str, log: Log = print, confirm: bool = True) -> Iterator[RunLock]:
    """Hold ``folder``'s lease while the block runs; :class:`RunLocked` if a live command
    holds it. ``confirm=False``: the block calls ``lock.confirm()`` itself, before it
    writes to the folder, so the settle time passes while it does other work."""
    lock = RunLock(folder, what, log)
    lock.claim()
    try:
        if confirm:
            lock.confirm()
        yield lock
    finally:
        lock.release()


def read(path: str) -> dict[str, object] | None:
    try:
        text = storage.read_text(path)
    except OSError:
        text = '{"host": "?", "pid": -1}'
    if text is None:
        return None
    try:
        return dict(json.loads(text))
    except ValueError:
        return {"host": "?", "pid": -1, "started": 0, "since": "?"}  # torn write: judge by age


def stale(holder: dict[str, object], path: str) -> str | None:
    """Why ``holder``'s lease is stale, or None while its command lives."""
    written = storage.mtime(path)
    if written is None:
        return "it was released"
    age = time.time() - written
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
