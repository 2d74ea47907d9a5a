"""Seconds from the command to the first optimizer step, phase by phase.

A run's start-up crosses processes: the driver (config, shard check, Ray, MLflow),
Ray Train's controller (placement, worker processes), and every worker (imports,
process group, data, model, resume, step-0 evaluation, first step). Each side appends
the wall-clock end of its phases to one :class:`Startup` that travels with the run, so
the phases are contiguous and add up to the time from the command's process start to
the end of the first step. Rank 0 logs them as ``startup/<phase>_s`` MLflow metrics.

Wall clocks of one host agree; across nodes the controller and worker phases carry
whatever skew the nodes' clocks have (NTP keeps it to milliseconds).
"""

from __future__ import annotations

import dataclasses
import time

# In the order they happen; a phase a run skips (no step-0 evaluation on a resume) is 0 s.
PHASES = {
    "launch": "process start, imports and config",
    "shards": "shard check (or prep)",
    "ray": "Ray start or connect",
    "auto": "auto settings probe",
    "mlflow": "MLflow run (its start overlaps the next two phases)",
    "controller": "Train controller, placement, worker processes",
    "worker": "worker imports and process group",
    "data": "data source open",
    "build": "model build and strategy wrap",
    "resume": "checkpoint restore",
    "eval0": "step-0 evaluation",
    "first_step": "first optimizer step",
}
PREFIX = "startup/"


def process_start() -> float:
    """Wall-clock time this process started (the command, as the user typed it).

    On Linux from the process's age in clock ticks: ``psutil``'s create time rests on the
    boot time in whole seconds, so it can be up to a second off.
    """
    try:
        import os

        with open("/proc/self/stat") as f:
            ticks = int(f.read().rpartition(")")[2].split()[19])  # field 22: starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        import psutil

        return float(psutil.Process().create_time())


@dataclasses.dataclass
class Startup:
    """The wall-clock ends of a run's start-up phases, from ``origin``."""

    origin: float
    ends: dict[str, float] = dataclasses.field(default_factory=dict)

    @classmethod
    def begin(cls, origin: float | None = None) -> Startup:
        return cls(time.time() if origin is None else origin)

    def mark(self, phase: str, at: float | None = None) -> None:
        """``phase`` ended ``at`` (now by default); unknown names are a bug, not data."""
        if phase not in PHASES:
            raise KeyError(f"unknown start-up phase {phase!r}; known: {', '.join(PHASES)}")
        self.ends[phase] = time.time() if at is None else at

    def last(self) -> float:
        return max(self.ends.values(), default=self.origin)

    def seconds(self) -> dict[str, float]:
        """Each phase's duration: its end minus the latest end before it (0 when skipped)."""
        out, previous = {}, self.origin
        for phase in PHASES:
            end = self.ends.get(phase)
            if end is None:
                out[phase] = 0.0
                continue
            out[phase] = max(0.0, end - previous)
            previous = max(previous, end)
        return out

    def total(self) -> float:
        return self.last() - self.origin

    def metrics(self) -> dict[str, float]:
        """``startup/<phase>_s`` for every phase, and ``startup/total_s``."""
        out = {f"{PREFIX}{k}_s": v for k, v in self.seconds().items()}
        out[f"{PREFIX}total_s"] = self.total()
        return out


def from_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """The per-phase seconds back out of a run's metrics (what ``raylift doctor`` prints)."""
    return {p: metrics[f"{PREFIX}{p}_s"] for p in PHASES if f"{PREFIX}{p}_s" in metrics}


def table(seconds: dict[str, float], total: float) -> list[str]:
    """One line per phase, the largest marked, for the console."""
    width = max(len(PHASES[p]) for p in PHASES)
    top = max(seconds, key=lambda p: seconds[p], default=None)
    lines = [
        f"  {PHASES[p]:<{width}} {s:6.1f} s{'  <- largest' if p == top else ''}"
        for p, s in seconds.items()
    ]
    lines.append(f"  {'to the first step':<{width}} {total:6.1f} s")
    return lines
