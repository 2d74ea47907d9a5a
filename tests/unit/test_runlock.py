"""One writer per run: a live holder stops a second command; a dead one's lock is taken over."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raylift import runlock
from raylift.cli import main as cli_main

HOLD = """
import sys, time
from pathlib import Path
from raylift.runlock import hold
with hold(Path(sys.argv[1]), "run 'x'", print):
    print("held", flush=True)
    time.sleep(600)
"""


def holder(folder: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_command_stops_naming_the_first_then_takes_over_when_it_dies(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "runs" / "x"
    first = holder(folder)
    try:
        running = rf"run 'x' is already running: pid {first.pid} on .* \(since "
        with (
            pytest.raises(runlock.RunLocked, match=running),
            runlock.hold(folder, "run 'x'", print),
        ):
            pass
    finally:
        first.send_signal(signal.SIGKILL)  # leaves its lock behind
        first.wait()
    assert (folder / runlock.LOCK_FILE).exists()
    said: list[str] = []
    with runlock.hold(folder, "run 'x'", said.append):
        assert json.loads((folder / runlock.LOCK_FILE).read_text())["pid"] == os.getpid()
    assert said == [
        f"raylift: taking over the lock of pid {first.pid} on " + said[0].split(" on ", 1)[1]
    ]
    assert f"pid {first.pid} is not running" in said[0]
    assert not (folder / runlock.LOCK_FILE).exists()  # released on the way out


def test_a_lock_from_another_host_is_stale_only_without_a_heartbeat(tmp_path: Path) -> None:
    lock = tmp_path / runlock.LOCK_FILE
    other = {"host": "node-that-is-gone", "pid": 1, "started": 0, "since": "then"}
    lock.write_text(json.dumps(other))
    assert runlock.stale(other, lock) is None  # alive as far as anyone here can tell
    old = time.time() - runlock.STALE_S - 5
    os.utime(lock, (old, old))
    assert "no heartbeat for" in (runlock.stale(other, lock) or "")


def test_the_cli_exits_2_on_a_held_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text("name: x\ntask: digits\nstorage: ./runs\n")
    first = holder(tmp_path / "runs" / "x")
    try:
        assert cli_main(["train", "c.yaml"]) == 2
        assert f"run 'x' is already running: pid {first.pid}" in capsys.readouterr().err
    finally:
        first.kill()
        first.wait()


def test_a_run_that_wrote_nothing_leaves_no_folder(tmp_path: Path) -> None:
    with runlock.hold(tmp_path / "runs" / "x", "run 'x'", print):
        pass
    assert not (tmp_path / "runs" / "x").exists()
