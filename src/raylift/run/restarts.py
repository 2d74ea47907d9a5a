"""What a restart costs, by phase, and the run's goodput.

A restart after a failure goes through five phases: the worker's death, as Ray reports it
to the controller (:class:`raylift.run.faults.FaultReporter` tells the tracking actor when,
and the step rank 0 had reached); the new worker group up (its processes started, the
process group formed); the model built and the state restored (bytes, from where, GB/s);
the first step after the restore; and the run back at the step it had reached before the
death. Rank 0 of the new group measures them (:class:`RestartWatch`), logs them as
``restart/*`` metrics with ``restart/steps_redone``, and prints one line. The driver then
logs ``goodput``: the share of the training's wall time spent on steps that count, which
is the time from the first step to the end less each restart's death-to-back time.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import ray

# Rank 0 tells the tracking actor its step at most this often: where a failure finds the
# run, to within this much training: a call that is not waited for, at most 20 a second.
PROGRESS_EVERY_S = 0.05


@dataclasses.dataclass(frozen=True)
class Fault:
    at: float  # when the controller heard of the failure (time.time())
    step: int  # the newest step rank 0 had reported by then


@dataclasses.dataclass
class Phases:
    """One restart's timeline (time.time() each); None where it has not happened."""

    fault: Fault
    group_up: float  # the new group's training function started: processes and group up
    resumed_step: int = 0
    restore_started: float | None = None
    restored: float | None = None
    restore_bytes: int = 0
    restore_source: str = "storage"  # or "memory": the run's keepers (raylift.run.snapshots)
    first_step: float | None = None
    back: float | None = None

    def metrics(self) -> dict[str, float]:
        start = self.restore_started or self.group_up
        done = self.restored or start
        out = {
            "restart/group_up_s": self.group_up - self.fault.at,
            "restart/build_s": start - self.group_up,
            "restart/restore_s": done - start,
            "restart/steps_redone": float(max(0, self.fault.step - self.resumed_step)),
            "restart/from_memory": float(self.restore_source == "memory"),
        }
        if self.restore_bytes and done > start:
            out["restart/restore_gbps"] = self.restore_bytes / (done - start) / 1e9
        if self.first_step is not None:
            out["restart/first_step_s"] = self.first_step - done
        if self.back is not None:
            out["restart/recovered_s"] = self.back - self.fault.at
        return out

    def line(self, restart: int) -> str:
        m = self.metrics()
        restored = (
            f"{self.restore_bytes / 2**20:,.1f} MiB restored from {self.restore_source} in "
            f"{m['restart/restore_s']:.1f} s ({m.get('restart/restore_gbps', 0.0):.2f} GB/s)"
            if self.restored is not None
            else "no checkpoint to restore (started over)"
        )
        return (
            f"restart {restart} cost {m.get('restart/recovered_s', 0.0):.1f} s: the worker "
            f"group was up {m['restart/group_up_s']:.1f} s after the failure, the model built "
            f"in {m['restart/build_s']:.1f} s, {restored}, the first step "
            f"{m.get('restart/first_step_s', 0.0):.1f} s later; back at step "
            f"{self.fault.step} after redoing {int(m['restart/steps_redone'])} step(s)"
        )


class RestartWatch:
    """Rank 0's side: reports its step to the tracking actor (at most every
    :data:`PROGRESS_EVERY_S`) and, in a group started after a failure, times the restart
    until the run is back where it was."""

    def __init__(self, service: Any, run_id: str, group_up: float):
        self.service, self.run_id = service, run_id
        claimed = ray.get(service.claim_fault.remote(run_id))
        self.phases = Phases(Fault(**claimed), group_up) if claimed else None
        self._told = 0.0

    def restoring(self) -> None:
        """The restore begins (a memory restore's fetch, then the load: the first call)."""
        if self.phases is not None and self.phases.restore_started is None:
            self.phases.restore_started = time.time()

    def restored(self, step: int, nbytes: int, source: str = "storage") -> None:
        if self.phases is not None:
            self.phases.restored, self.phases.resumed_step = time.time(), step
            self.phases.restore_bytes, self.phases.restore_source = nbytes, source

    def after_step(self, step: int) -> Phases | None:
        """The restart's phases, once: when the run is back at the step it had reached."""
        now = time.time()
        if now - self._told >= PROGRESS_EVERY_S:
            self.service.progress.remote(self.run_id, step, now)  # not waited for
            self._told = now
        phases = self.phases
        if phases is None or phases.back is not None:
            return None
        if phases.first_step is None:
            phases.first_step = now
        if step < phases.fault.step:
            return None
        phases.back = now
        self.service.recovered.remote(self.run_id, now - phases.fault.at)
        return phases
