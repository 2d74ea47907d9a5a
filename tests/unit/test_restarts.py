"""A restart's phases and the run's goodput, from the times each side records: the
controller (a failure), the tracking actor (rank 0's progress) and the new rank 0."""

from __future__ import annotations

import pytest

from raylift.artifacts.tracking_service import Goodput, RunClock
from raylift.run.restarts import Fault, Phases


def test_each_phase_is_the_time_between_its_marks_and_the_steps_redone_are_counted() -> None:
    phases = Phases(Fault(at=100.0, step=30), group_up=104.0)
    phases.restore_started, phases.restored, phases.resumed_step = 106.0, 106.5, 20
    phases.restore_bytes = 500_000_000
    phases.first_step, phases.back = 107.0, 109.0
    assert phases.metrics() == pytest.approx({
        "restart/group_up_s": 4.0,  # death -> the new group's training function
        "restart/build_s": 2.0,  # task, data, model and engine
        "restart/restore_s": 0.5,
        "restart/restore_gbps": 1.0,  # 0.5 GB in 0.5 s
        "restart/first_step_s": 0.5,
        "restart/recovered_s": 9.0,  # death -> back at step 30
        "restart/steps_redone": 10.0,
        "restart/from_memory": 0.0,  # the state came from storage
    })  # fmt: skip
    line = phases.line(2)
    assert line.startswith("restart 2 cost 9.0 s: the worker group was up 4.0 s after")
    assert "476.8 MiB restored from storage in 0.5 s (1.00 GB/s)" in line
    assert line.endswith("back at step 30 after redoing 10 step(s)")
    phases.restore_source = "memory"
    assert phases.metrics()["restart/from_memory"] == 1.0
    assert "476.8 MiB restored from memory in 0.5 s (1.00 GB/s)" in phases.line(2)


def test_a_restart_without_a_checkpoint_says_it_started_over() -> None:
    phases = Phases(Fault(at=0.0, step=5), group_up=3.0)
    phases.first_step, phases.back = 5.0, 8.0
    got = phases.metrics()
    assert got["restart/restore_s"] == 0.0 and "restart/restore_gbps" not in got
    assert got["restart/steps_redone"] == 5.0 and got["restart/recovered_s"] == 8.0
    assert "no checkpoint to restore (started over)" in phases.line(1)


def test_a_new_group_claims_the_failures_before_it_once() -> None:
    clock = RunClock()
    assert clock.claim_fault() is None  # a first start: nothing to time
    clock.progress(10, at=50.0)
    clock.fault(at=60.0)
    clock.progress(12, at=61.0)  # a rank that reported once more before it went
    clock.fault(at=70.0)  # the group died again while it started
    assert clock.claim_fault() == {"at": 60.0, "step": 12}
    assert clock.claim_fault() is None


def test_goodput_is_the_training_time_not_lost_to_restarts() -> None:
    clock = RunClock()
    assert clock.goodput(end=10.0) is None  # no step was taken
    clock.progress(1, at=100.0)
    clock.lost += [7.0, 3.0]
    facts = clock.goodput(end=200.0)
    assert facts == Goodput(training_s=100.0, lost_s=10.0, restarts=2)
    assert facts.share == pytest.approx(0.9)
    assert facts.line() == "goodput 0.90: 2 restart(s) cost 10.0 s of 100.0 s of training"
