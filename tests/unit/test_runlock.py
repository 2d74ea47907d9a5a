"""One writer per run: a live holder stops a second command; a dead one's lock is taken
over; of two that raced, one goes on. The same lease in a local folder and on s3://."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raylift.cli import main as cli_main
from raylift.core import runlock, storage

# The holders here never race: a short settle time keeps the tests from waiting on it.
SETTLE_S = 0.2
HOLD = f"""
import sys, time
from raylift.core import runlock
from raylift.core.runlock import hold
runlock.SETTLE_S = {SETTLE_S}
with hold(sys.argv[1], "run 'x'", print):
    print("held", flush=True)
    time.sleep(600)
"""


def holder(folder: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, folder], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


@pytest.fixture(autouse=True)
def _short_settle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runlock, "SETTLE_S", SETTLE_S)


@pytest.fixture(params=["local", "s3"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A run's storage: a local folder, or a bucket on the S3 server."""
    if request.param == "local":
        return str(tmp_path / "runs")
    request.getfixturevalue("s3_server")
    return f"s3://runs/lock-{tmp_path.name}"


def test_a_second_command_stops_naming_the_first_then_takes_over_when_it_dies(
    where: str,
) -> None:
    folder = storage.join(where, "x")
    lock = storage.join(folder, runlock.LOCK_FILE)
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
    assert storage.is_file(lock)
    said: list[str] = []
    with runlock.hold(folder, "run 'x'", said.append):
        assert json.loads(storage.read_text(lock) or "")["pid"] == os.getpid()
    assert said == [
        f"raylift: taking over the lock of pid {first.pid} on " + said[0].split(" on ", 1)[1]
    ]
    assert f"pid {first.pid} is not running" in said[0]
    assert not storage.is_file(lock)  # released on the way out


def test_a_lock_from_another_host_is_stale_only_without_a_heartbeat(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    lock = storage.join(where, runlock.LOCK_FILE)
    other = {"host": "node-that-is-gone", "pid": 1, "started": 0, "since": "then"}
    storage.write_text(lock, json.dumps(other))
    assert runlock.stale(other, lock) is None  # alive as far as anyone here can tell
    monkeypatch.setattr(runlock, "STALE_S", 1.0)  # the store's clock says how old it is
    time.sleep(2.5)  # object stores keep whole seconds
    assert "no heartbeat for" in (runlock.stale(other, lock) or "")


def test_of_two_commands_that_claimed_at_once_exactly_one_goes_on(where: str) -> None:
    """Both found no lease and both wrote theirs: the read-back after the settle time
    lets only the one whose write landed last go on, and names it to the other."""
    folder = storage.join(where, "race")
    first, second = (runlock.RunLock(folder, "run 'race'", print) for _ in range(2))
    for lock in (first, second):  # the race: neither saw the other's claim
        lock._write()
        lock._claimed = time.monotonic()
    with pytest.raises(runlock.RunLocked, match=f"pid {os.getpid()} on"):
        first.confirm()
    second.confirm()
    try:
        with pytest.raises(runlock.RunLocked, match="already running"):
            runlock.RunLock(folder, "run 'race'", print).claim()  # a third finds it held
    finally:
        second.release()
    assert not storage.is_file(storage.join(folder, runlock.LOCK_FILE))


def test_the_cli_exits_2_on_a_held_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text("name: x\ntask: digits\nstorage: ./runs\n")
    first = holder(str(tmp_path / "runs" / "x"))
    try:
        assert cli_main(["train", "c.yaml"]) == 2
        assert f"run 'x' is already running: pid {first.pid}" in capsys.readouterr().err
    finally:
        first.kill()
        first.wait()


def test_a_run_that_wrote_nothing_leaves_no_folder(tmp_path: Path) -> None:
    with runlock.hold(str(tmp_path / "runs" / "x"), "run 'x'", print):
        pass
    assert not (tmp_path / "runs" / "x").exists()
