"""Where a run's CPU-seconds go, process by process, read from outside the run.

A :class:`Sampler` polls the processes under this one (the command it started, and the
Ray this process runs: its daemons and the worker processes their raylet starts) every
``every`` seconds, keeping each pid's user+system CPU time with the wall clock it was
read at, and each process's title (``ray::<ActorName>`` for a Ray actor or task).
:func:`spent` then gives each process's CPU-seconds between two wall-clock instants
(interpolated between samples; a process that began between samples started from 0),
and :func:`rows` adds them up under the row each belongs to: the driver (the command's
process tree), Ray Train's controller, each worker, each helper actor by name, and each
of Ray's daemons.
"""

from __future__ import annotations

import bisect
import dataclasses
import os
import threading
import time
from collections import defaultdict

import psutil

WORKER = "RayTrainWorker"
CONTROLLER = "TrainController"
IDLE = "IDLE"
# Ray's daemons, by what their command line holds: the row each is shown in.
DAEMONS = {
    "gcs_server": "Ray's GCS",
    "raylet": "Ray's raylet",
    "dashboard/agent.py": "Ray's dashboard agent",
    "runtime_env/agent/main.py": "Ray's runtime env agent",
    "dashboard/dashboard.py": "Ray's dashboard",
    "ray-dashboard-": "Ray's dashboard",
    "log_monitor.py": "Ray's log monitor",
    "monitor.py": "Ray's autoscaler monitor",
}


@dataclasses.dataclass
class Seen:
    """One process as the samples saw it."""

    created: float
    parent: int
    titles: list[str] = dataclasses.field(default_factory=list)
    at: list[float] = dataclasses.field(default_factory=list)
    cpu: list[float] = dataclasses.field(default_factory=list)

    def cpu_at(self, t: float) -> float:
        """CPU-seconds this process had used at wall clock ``t``, interpolated."""
        at, cpu = [self.created, *self.at], [0.0, *self.cpu]
        if t <= at[0]:
            return 0.0
        i = bisect.bisect_right(at, t)
        if i >= len(at):
            return cpu[-1]  # ended (or not sampled again) before t
        share = (t - at[i - 1]) / max(at[i] - at[i - 1], 1e-9)
        return cpu[i - 1] + share * (cpu[i] - cpu[i - 1])

    def title(self) -> str:
        """What the process ran: its first Ray title that is not an idle worker's (a Ray
        worker shows its command line until it names itself ``ray::IDLE``), else its first."""
        ray = [t for t in self.titles if t.startswith("ray::")]
        busy = [t for t in ray if t.split()[0] != f"ray::{IDLE}"]
        return (busy or ray or self.titles or [""])[0]


class Sampler:
    """Polls this process's descendants in a thread; :meth:`sample` once by hand first."""

    def __init__(self, every: float = 0.5):
        self.every, self.me = every, psutil.Process()
        self.seen: dict[tuple[int, float], Seen] = {}  # (pid, created): pids are reused
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Sampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            self.sample()

    def sample(self) -> None:
        for p in self.me.children(recursive=True):
            try:
                with p.oneshot():
                    t, times = time.time(), p.cpu_times()
                    key = (p.pid, p.create_time())
                    title = " ".join(p.cmdline())
                    parent = p.ppid()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            seen = self.seen.setdefault(key, Seen(created=key[1], parent=parent))
            if title not in seen.titles:
                seen.titles.append(title)
            seen.at.append(t)
            seen.cpu.append(times.user + times.system)

    def by_pid(self) -> dict[int, Seen]:
        return {pid: s for (pid, _), s in self.seen.items()}


def row_of(pid: int, processes: dict[int, Seen], driver: int) -> str:
    """The row a process's CPU belongs to (a worker's row is named by its pid, numbered
    later); a process without a title of its own goes to its parent's row."""
    s = processes[pid]
    title = s.title()
    if pid == driver:
        return "driver"
    if title.startswith("ray::"):
        name = title[len("ray::") :].split(".")[0].split()[0]
        if name == WORKER:
            return f"worker {pid}"
        if name == CONTROLLER:
            return "Train controller"
        if name == IDLE:
            return "Ray's idle worker processes"
        return f"actor or task {name}"
    for needle, row in DAEMONS.items():
        if needle in title:
            return row
    if s.parent in processes and s.parent != os.getpid():
        return row_of(s.parent, processes, driver)
    return f"other: {os.path.basename(title.split(' ')[0])}"


def spent(sampler: Sampler, driver: int, start: float, end: float) -> dict[str, float]:
    """CPU-seconds each row used between wall clocks ``start`` and ``end``; workers are
    ``worker 1``, ``worker 2``, ... by CPU, the busiest first."""
    processes = sampler.by_pid()
    out: dict[str, float] = defaultdict(float)
    for pid, s in processes.items():
        used = s.cpu_at(end) - s.cpu_at(start)
        if used > 0:
            out[row_of(pid, processes, driver)] += used
    workers = sorted((k for k in out if k.startswith("worker ")), key=lambda k: -out[k])
    for n, key in enumerate(workers, 1):
        out[f"worker {n}"] = out.pop(key)
    return dict(out)


def worker_pids(sampler: Sampler) -> list[int]:
    processes = sampler.by_pid()
    return [pid for pid, s in processes.items() if s.title().startswith(f"ray::{WORKER}")]


def split(
    sampler: Sampler, pids: list[int], start: float, cut: float, end: float
) -> tuple[float, float]:
    """The CPU-seconds ``pids`` used from ``start`` to ``cut`` and from ``cut`` to ``end``."""
    processes = sampler.by_pid()
    before = sum(processes[p].cpu_at(cut) - processes[p].cpu_at(start) for p in pids)
    after = sum(processes[p].cpu_at(end) - processes[p].cpu_at(cut) for p in pids)
    return before, after


def median_rows(runs: list[dict[str, float]]) -> dict[str, float]:
    """The median of each row over ``runs`` (a row a run lacks counts as 0 there)."""
    import statistics

    keys: list[str] = []
    for r in runs:
        keys += [k for k in r if k not in keys]
    return {k: statistics.median(r.get(k, 0.0) for r in runs) for k in keys}
