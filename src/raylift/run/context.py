"""What a worker's loop is given: where batches come from, where metrics and checkpoints go.

The loop runs the same way under Ray Train and in a plain process group; everything
environment-specific arrives through :class:`WorkerContext`. A :class:`Probe` (the
doctor's) watches the loop through :class:`StepView`, a narrow typed view of it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from raylift.core.startup import Startup
from raylift.data.ingest import BatchSource
from raylift.run.restarts import RestartWatch
from raylift.tensors.metrics import Clock, PhaseClock, StepTimes


class Reporter(Protocol):
    def report(self, metrics: dict[str, float]) -> None:
        """Called by every rank at the same points (Ray's report is a barrier)."""
        ...

    def destination(self, name: str) -> str:
        """Where the checkpoint ``name`` of this run goes (a folder or a URI)."""
        ...

    def register(self, metrics: dict[str, float], name: str) -> None:
        """The checkpoint at ``destination(name)``, complete in storage, is the run's
        newest. Called by every rank at the same points."""
        ...

    def leaving_in(self) -> float | None:
        """None while no node of this run is leaving; once one has been told it will be
        taken away, the seconds until the first goes (``math.inf`` where no deadline was
        given), by rank 0's clock: every rank gets the same number.

        Called by every rank at the same points (on Ray it is a barrier)."""
        ...


class MemoryKeepers(Protocol):
    """The run's memory snapshots, as a rank hands its parts over (raylift.run.snapshots)."""

    # The ranks of this rank's replica where each node keeps a whole copy of the state
    # (HSDP by node) and no part goes to a peer; (): parts go to this node and a peer.
    replica: tuple[int, ...]

    def send(self, step: int, folder: Path) -> int:
        """This rank's part of the snapshot at ``step`` (the files under ``folder``) to its
        keepers; returns its bytes once they hold it."""
        ...

    def where(self) -> str:
        """Where the parts are held, in words."""
        ...


class Tracker(Protocol):
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def set_tags(self, tags: dict[str, str]) -> None: ...

    def log_artifact(self, path: Path, folder: str) -> None: ...

    def restarts(self) -> int:
        """The highest restart number the run has logged (0: none)."""
        ...

    def close(self) -> None:
        """Wait until everything logged is written."""
        ...


class NullTracker:
    """What ranks other than 0 log to: nothing."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def set_tags(self, tags: dict[str, str]) -> None:
        pass

    def log_artifact(self, path: Path, folder: str) -> None:
        pass

    def restarts(self) -> int:
        return 0

    def close(self) -> None:
        pass


@dataclasses.dataclass
class StepView:
    """What a probe may see and do after each optimizer step, and nothing more."""

    rank: int
    world_size: int
    device: torch.device
    clock: PhaseClock  # open a window of steps, close it
    reduce: Callable[[StepTimes], dict[str, float]]  # a window -> metrics over all ranks
    publish: Callable[[dict[str, float]], None]  # carried in every later report
    tracker: Tracker
    step: int = 0


class Probe(Protocol):
    """Watches the run from outside the loop (``raylift doctor``'s windows)."""

    def after_step(self, view: StepView) -> None: ...


@dataclasses.dataclass
class WorkerContext:
    rank: int
    world_size: int
    device: torch.device
    source: BatchSource
    reporter: Reporter
    tracker: Tracker = dataclasses.field(default_factory=NullTracker)
    log: Callable[[str], None] = print
    probe: Probe | None = None
    now: Clock = time.perf_counter  # what step times are measured with; tests pass their own
    startup: Startup | None = None  # phases so far; the loop adds step-0 eval and first step
    # Every rank, at each logging interval: its node's memory for a crash's report.
    heartbeat: Callable[[], None] = lambda: None
    # Rank 0 on Ray: its progress for the tracking actor, a restart's phases (run.restarts).
    restarts: RestartWatch | None = None
    # The run's memory snapshots (checkpoint.memory on Ray); None: storage checkpoints only.
    keepers: MemoryKeepers | None = None


def gather(world: int, value: Any) -> list[Any]:
    """Collective: every rank's ``value``, in rank order (an object gather: any backend,
    no tensor on a device)."""
    if world == 1:
        return [value]
    import torch.distributed as dist

    out: list[Any] = [None] * world
    dist.all_gather_object(out, value)
    return out
