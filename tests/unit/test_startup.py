"""Start-up phases add up, and rank 0's MLflow writes never block."""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest

from raylift.artifacts import tracking, tracking_service
from raylift.core.startup import PHASES, Startup, from_metrics, process_start, table
from raylift.run.worker import logged_startup_since


def test_phases_are_contiguous_and_add_up_to_the_total() -> None:
    s = Startup(100.0)
    s.mark("launch", 101.5)
    s.mark("ray", 104.0)  # shards skipped: 0 s, and ray counts from launch's end
    s.mark("mlflow", 103.0)  # ended before ray (they overlapped): 0 s, never negative
    s.mark("first_step", 110.0)
    sec = s.seconds()
    assert list(sec) == list(PHASES)
    assert sec["launch"] == 1.5 and sec["shards"] == 0.0 and sec["ray"] == 2.5
    assert sec["mlflow"] == 0.0 and sec["first_step"] == 6.0
    assert sum(sec.values()) == pytest.approx(s.total()) == pytest.approx(10.0)
    metrics = s.metrics()
    assert metrics["startup/total_s"] == 10.0
    assert from_metrics(metrics) == sec


def test_an_unknown_phase_is_refused() -> None:
    with pytest.raises(KeyError, match="unknown start-up phase 'warmup'"):
        Startup.begin().mark("warmup")


def test_process_start_is_this_process_start() -> None:
    started = process_start()
    assert started <= time.time()
    # psutil's figure rests on a boot time in whole seconds: within about a second of ours.
    assert abs(started - psutil.Process().create_time()) < 1.5


def test_the_table_marks_the_largest_phase() -> None:
    lines = table({"launch": 1.0, "controller": 7.0, "first_step": 0.1}, 8.1)
    assert "<- largest" in next(line for line in lines if PHASES["controller"] in line)
    assert sum("<- largest" in line for line in lines) == 1
    assert lines[-1].split()[-2] == "8.1"


def test_rank0_writes_land_in_order_and_close_waits_for_them(
    ray_cluster: str, tmp_path: Path
) -> None:
    """Through the tracking actor on this node, as rank 0 writes from any node."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow = tracking.client(uri)
    exp = mlflow.create_experiment("t")
    run_id = mlflow.create_run(exp).info.run_id
    service = tracking_service.start_service(uri)
    tracker = tracking_service.ServiceTracker(service, run_id)
    for step in range(5):
        tracker.log_metrics({"loss": 1.0 / (step + 1)}, step)
    tracker.set_tags({"k": "v"})
    (tmp_path / "trace.json").write_text("{}")
    tracker.log_artifact(tmp_path / "trace.json", "doctor")
    tracker.close()
    history = mlflow.get_metric_history(run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(s, 1.0 / (s + 1)) for s in range(5)]
    assert mlflow.get_run(run_id).data.tags["k"] == "v"
    assert [a.path for a in mlflow.list_artifacts(run_id, "doctor")] == ["doctor/trace.json"]


def test_a_failed_write_is_raised_not_lost(ray_cluster: str, tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = tracking_service.ServiceTracker(tracking_service.start_service(uri), "no-such-run")
    tracker.log_metrics({"loss": 1.0}, 0)
    with pytest.raises(Exception, match="no-such-run"):
        tracker.close()


def test_a_restarted_group_finds_its_command_start_up_logged(
    ray_cluster: str, tmp_path: Path
) -> None:
    """Rank 0 of a group Ray Train restarted sees this command's start-up in MLflow and
    leaves it; a later command resuming the run (a newer origin) logs its own."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow = tracking.client(uri)
    run_id = mlflow.create_run(mlflow.create_experiment("t")).info.run_id
    service = tracking_service.start_service(uri)
    store = tracking_service.RemoteStore(service)
    command = Startup.begin(time.time() - 5.0)
    assert not logged_startup_since(store, run_id, command.origin)
    tracker = tracking_service.ServiceTracker(service, run_id)
    command.mark("first_step")
    tracker.log_metrics(command.metrics(), 1)
    tracker.close()
    assert logged_startup_since(store, run_id, command.origin)
    assert not logged_startup_since(store, run_id, time.time() + 1.0)
