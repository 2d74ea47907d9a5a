"""Start-up phases add up, the console stays quiet, and rank 0's MLflow writes never block."""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest

from raylift import console, tracking
from raylift.startup import PHASES, Startup, from_metrics, process_start, table
from raylift.worker import logged_startup_since


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


CPP = (
    "[2026-11-23 20:35:25,436 E 14117 14149] core_worker.cc:2465: Actor with class name: "
    "'PreemptionWatcher' has constructor arguments in the object store"
)
# Abseil's raw log and the failure signal handler's stack dump, as a worker under load
# printed them on a CI run.
DUMP = [
    "[mutex.cc : 452] RAW: Lock blocking 0x55569fc163b0   @ 0x7f543462b1a2 0x7f54336fb23c",
    "*** SIGSEGV received at time=1763900000 on cpu 1 ***",
    "PC: @     0x7f543462b1a2  (unknown)  absl::Mutex::Lock()",
    "    @     0x7f543545a050       9104  (unknown)",
    "    @     0x7f53fc006410  (unknown)  (unknown)",
]
# Python's faulthandler as a worker that aborted at its exit wrote it, on a CI run.
FAULTHANDLER = [
    "Fatal Python error: Aborted",
    "Python runtime state: finalizing (tstate=0x0000556a2f1c1e40)",
    "Thread 0x00007f3a1cbf9640 (most recent call first):",
    '  File "/usr/lib/python3.11/threading.py", line 327 in wait',
    "  <no Python frame>",
    "Current thread 0x00007f3a5e2f4740 (most recent call first):",
    "Extension modules: msgpack._cmsgpack, psutil._psutil_linux, pyarrow.lib (total: 93)",
]


def test_ray_cpp_lines_are_dropped_from_the_console_and_the_rest_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    monkeypatch.delenv(console.VERBOSE_ENV, raising=False)
    printed: list[str] = []
    monkeypatch.setattr(dispatcher, "handlers", [])
    dispatcher.add_handler("ray_print_logs", lambda data: printed.extend(data["lines"]))
    console.filter_worker_logs()
    ours = "epoch   0  step      0  eval  val_loss 2.3184  val_acc 0.0279"
    dispatcher.emit({"lines": [CPP, ours, "", "Traceback (most recent call last):"], "pid": 1})
    dispatcher.emit({"lines": ["", "  "], "pid": 1})  # a flush's blank line
    dispatcher.emit({"lines": [CPP, *DUMP], "pid": 1})
    c10d = (
        "[W1126 01:48:03.303881950 socket.cpp:207] [c10d] The hostname of the client socket "
        "cannot be retrieved. err=-3"
    )  # a GPU worker's process group, seen on an H200
    dispatcher.emit({"lines": [c10d], "pid": 1})
    dispatcher.emit({"lines": FAULTHANDLER, "pid": 1})
    assert printed == [ours, "Traceback (most recent call last):"]
    # A Python traceback's frames (``line N, in f``) are not the faulthandler's.
    frame = '  File "/home/me/mymodels.py", line 40, in forward'
    dispatcher.emit({"lines": [frame], "pid": 1})
    assert printed[-1] == frame
    printed.pop()
    # What Ray's own processes publish goes to a file in Ray's logs folder, not here.
    busy = "WARNING: 8 PYTHON worker processes have been started on node: 25a8"
    dispatcher.emit({"lines": [busy], "pid": "raylet"})
    assert printed == [ours, "Traceback (most recent call last):"]
    assert busy in console._ray_messages_file().read_text()


def test_a_line_forwarded_by_several_nodes_on_one_host_prints_once() -> None:
    """Nodes sharing a host (the fake autoscaling cluster) share its logs folder and each
    forwards every worker's file; within one batch, on another host, or later, a repeated
    line is still shown."""
    seen = console.Forwarded(window_s=30.0, shared=lambda: True)
    line = "raylift: resumed from s3://runs/x/checkpoint-step00000010 at step 10"
    assert seen.first_copies("10.0.0.1", 7, [line, "epoch 1"]) == [line, "epoch 1"]
    assert seen.first_copies("10.0.0.1", 7, [line]) == []  # node 2's copy of pid 7's line
    assert seen.first_copies("10.0.0.1", 7, ["  ^^^", "  ^^^"]) == ["  ^^^", "  ^^^"]
    assert seen.first_copies("10.0.0.1", 8, [line]) == [line]  # another process
    assert seen.first_copies("10.0.0.2", 7, [line]) == [line]  # another host
    later = console.Forwarded(window_s=0.0, shared=lambda: True)
    later.first_copies("10.0.0.1", 7, [line])
    assert later.first_copies("10.0.0.1", 7, [line]) == [line]  # outside the window
    apart = console.Forwarded(window_s=30.0, shared=lambda: False)
    apart.first_copies("10.0.0.1", 7, [line])
    assert apart.first_copies("10.0.0.1", 7, [line]) == [line]  # one node per host


def test_verbose_keeps_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    monkeypatch.setenv(console.VERBOSE_ENV, "1")
    printed: list[str] = []
    monkeypatch.setattr(dispatcher, "handlers", [])
    dispatcher.add_handler("ray_print_logs", lambda data: printed.extend(data["lines"]))
    console.filter_worker_logs()
    dispatcher.emit({"lines": [CPP], "pid": 1})
    assert printed == [CPP]
    assert console.quiet_env() == {console.VERBOSE_ENV: "1"}


def test_rank0_writes_land_in_order_and_close_waits_for_them(
    ray_cluster: str, tmp_path: Path
) -> None:
    """Through the tracking actor on this node, as rank 0 writes from any node."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow = tracking.client(uri)
    exp = mlflow.create_experiment("t")
    run_id = mlflow.create_run(exp).info.run_id
    service = tracking.start_service(uri)
    tracker = tracking.ServiceTracker(service, run_id)
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
    tracker = tracking.ServiceTracker(tracking.start_service(uri), "no-such-run")
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
    service = tracking.start_service(uri)
    store = tracking.RemoteStore(service)
    command = Startup.begin(time.time() - 5.0)
    assert not logged_startup_since(store, run_id, command.origin)
    tracker = tracking.ServiceTracker(service, run_id)
    command.mark("first_step")
    tracker.log_metrics(command.metrics(), 1)
    tracker.close()
    assert logged_startup_since(store, run_id, command.origin)
    assert not logged_startup_since(store, run_id, time.time() + 1.0)
