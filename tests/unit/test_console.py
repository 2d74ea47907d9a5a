"""The console's rule: raylift's lines, the user's prints (once per rank) and errors show;
everything else goes, whole, to the run's log file. Lines are told apart by who wrote
them, with the standard library and real Ray as the writers."""

from __future__ import annotations

import io
import logging
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

from raylift.core import console
from raylift.run.worker import print0
from tests.helpers import HANG_S


def user_code(tmp_path: Path, body: str) -> Any:
    """A function compiled from a file in the user's folder, as a task module is."""
    path = tmp_path / "usertask.py"
    path.write_text(f"def run(out):\n    {body}\n")
    scope: dict[str, Any] = {}
    exec(compile(path.read_text(), str(path), "exec"), scope)
    return scope["run"]


def as_library(router: console.Router, text: str) -> None:
    """``text`` written by the standard library's code, as Ray's printer of forwarded
    lines, or any library, writes."""
    shutil.copyfileobj(io.StringIO(text), router)


def test_whose_code_wrote_is_known_by_where_it_lives(tmp_path: Path) -> None:
    import ray

    assert console.origin(console.__file__) == console.RAYLIFT
    assert console.origin(logging.__file__) == console.LIBRARY
    assert console.origin(ray.__file__) == console.LIBRARY
    assert console.origin(str(tmp_path / "mytask.py")) == console.USER
    assert console.origin("<stdin>") == console.USER
    assert console.origin("<frozen importlib._bootstrap>") == console.LIBRARY


def test_a_ray_process_tags_raylifts_and_the_users_lines_and_the_driver_shows_them_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ray_file = io.StringIO()  # what Ray's log monitor reads and forwards
    worker = console.Router(ray_file, console.RaySink(rank=1))
    monkeypatch.setattr("sys.stdout", worker)
    print0(0)("raylift: resumed at step 4")  # raylift's worker code prints it
    monkeypatch.undo()
    user_code(tmp_path, "print('built the model', file=out)")(worker)
    logging.getLogger("some.library").addHandler(handler := logging.StreamHandler(worker))
    logging.getLogger("some.library").warning("a deprecation")
    logging.getLogger("some.library").removeHandler(handler)
    written = ray_file.getvalue().split("\n")
    assert written[2] == "a deprecation", written  # untagged: the library's
    assert all(console.MARK in line for line in written[:2])

    screen, log = io.StringIO(), tmp_path / "run.log"
    driver = console.Router(screen, console.DriverSink(log))
    forwarded = "".join(f"(RayTrainWorker pid=7) {line}\n" for line in written)
    as_library(driver, forwarded)
    as_library(driver, forwarded)  # a second node on the same host forwards the same file
    assert screen.getvalue().splitlines() == [
        "raylift: resumed at step 4",
        "[rank 1] built the model",
    ]
    logged = log.read_text().splitlines()
    assert logged[:3] == [
        "raylift: resumed at step 4",
        "[rank 1] built the model",
        "(RayTrainWorker pid=7) a deprecation",
    ]


def test_the_same_print_on_two_ranks_shows_on_both_even_through_rays_dedup() -> None:
    """Ray folds lines that are alike but for words with digits: a tag has no digits."""
    from ray._private.ray_logging import _canonicalise_log_line

    a = console.tag("epoch 1", seq=1, rank=0, pid=1000)
    b = console.tag("epoch 1", seq=1, rank=1, pid=1001)
    assert _canonicalise_log_line(a) != _canonicalise_log_line(b)
    assert console.untag(a) == (("bmm", "b"), 0, "epoch 1")
    assert console.untag("no tag here") is None


def test_the_driver_shows_its_own_and_the_users_lines_and_errors_and_logs_the_rest(
    tmp_path: Path,
) -> None:
    screen, log = io.StringIO(), tmp_path / "run.log"
    driver = console.Router(screen, console.DriverSink(log))
    print("raylift: run 'x' finished", file=driver)
    user_code(tmp_path, "print('script: done', file=out)")(driver)
    lib = logging.getLogger("some.library")
    lib.addHandler(handler := logging.StreamHandler(driver))
    lib.warning("Started a local Ray instance.")
    lib.error("the GCS is unreachable")
    lib.removeHandler(handler)
    assert screen.getvalue().splitlines() == [
        "raylift: run 'x' finished",
        "script: done",
        "the GCS is unreachable",
    ]
    text = log.read_text()
    assert "Started a local Ray instance." in text
    assert "script: done" in text  # the log is the whole transcript


def test_another_threads_print_is_whole_and_shown_while_a_library_writes_a_partial_line(
    tmp_path: Path,
) -> None:
    screen, log = io.StringIO(), tmp_path / "run.log"
    driver = console.Router(screen, console.DriverSink(log))
    as_library(driver, "Loading checkpoint shards: 50%")  # no newline yet
    user = user_code(tmp_path, "print('from my thread', file=out)")
    thread = threading.Thread(target=user, args=(driver,))
    thread.start()
    thread.join()
    as_library(driver, " 100%\n")
    assert screen.getvalue() == "from my thread\n"
    assert "Loading checkpoint shards: 50% 100%" in log.read_text()


def test_routing_is_installed_once_and_verbose_routes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sys.stdout", io.StringIO())
    monkeypatch.setattr("sys.stderr", io.StringIO())
    monkeypatch.setenv(console.LOG_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(console.VERBOSE_ENV, raising=False)
    first = console.start_log("my run")
    assert first is not None and first.parent == tmp_path and first.is_file()
    assert console.start_log("my run") == first  # the same command's second call
    import sys

    assert isinstance(sys.stdout, console.Router) and not isinstance(
        sys.stdout.stream, console.Router
    )
    second = console.start_log("another")
    assert second != first and console.current_log() == second
    assert not isinstance(sys.stdout.stream, console.Router)  # swapped, not stacked
    monkeypatch.setenv(console.VERBOSE_ENV, "1")
    assert console.start_log("verbose") is None
    monkeypatch.setattr("sys.stdout", io.StringIO())
    console.route_ray_process(0)
    assert not isinstance(sys.stdout, console.Router)
    assert console.quiet_env() == {console.VERBOSE_ENV: "1"}


def test_library_quiet_logs_a_libraries_lines_and_keeps_the_users(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    screen = io.StringIO()
    monkeypatch.setattr("sys.stdout", screen)
    monkeypatch.setattr("sys.stderr", screen)
    monkeypatch.setenv(console.LOG_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(console.VERBOSE_ENV, raising=False)
    with console.library_quiet("export"):
        logging.getLogger("DeepSpeed").warning("Processing zero checkpoint")
        user_code(tmp_path, "print('mine', file=out)")(sys.stdout)
    assert screen.getvalue() == "mine\n"
    (log,) = tmp_path.glob("export-*.log")
    assert "Processing zero checkpoint" in log.read_text()


def test_a_ray_process_numbers_its_lines_once_for_both_streams(tmp_path: Path) -> None:
    """A user's print to stdout and one to stderr are two lines, neither taken for a copy."""
    ray_file = io.StringIO()
    sink = console.RaySink(rank=0)
    out, err = console.Router(ray_file, sink), console.Router(ray_file, sink)
    user_code(tmp_path, "print('to stdout', file=out)")(out)
    user_code(tmp_path, "print('to stderr', file=out)")(err)
    screen = io.StringIO()
    driver = console.Router(screen, console.DriverSink(tmp_path / "run.log"))
    as_library(driver, ray_file.getvalue())
    assert screen.getvalue().splitlines() == ["[rank 0] to stdout", "[rank 0] to stderr"]


@pytest.mark.parametrize("where", ["main", "thread", "ray"])
def test_an_uncaught_exception_is_shown_whoever_prints_it(tmp_path: Path, where: str) -> None:
    """An uncaught exception reaches the console and the log, in the main thread or
    another, and when Ray's hook (a library's frames, which print it) is installed."""
    import subprocess
    import sys

    boom = "raise ValueError('boom')"
    body = boom if where == "main" else (
        f"import threading\nt = threading.Thread(target=lambda: exec({boom!r}))\n"
        "t.start()\nt.join()"
    )  # fmt: skip
    code = (
        ("import ray\n" if where == "ray" else "")
        + "from pathlib import Path\nfrom raylift import console\n"
        f"console.route_driver(Path({str(tmp_path / 'run.log')!r}))\n{body}\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S
    )
    assert "ValueError: boom" in done.stderr, done.stderr
    assert "ValueError: boom" in (tmp_path / "run.log").read_text()


def test_what_a_library_writes_below_python_goes_to_the_log(tmp_path: Path) -> None:
    """A C++ library's line to fd 2 (Arrow's S3 client logs each retry so) is in the log,
    not on the console; raylift's lines, a child's stderr and errors still reach it."""
    import subprocess
    import sys

    code = (
        "import os, subprocess, sys\nfrom pathlib import Path\n"
        "from raylift.core import console\n"
        f"console.route_driver(Path({str(tmp_path / 'run.log')!r}))\n"
        "os.write(2, b's3fs.cc:817: SlowDown, retry = 1\\n')\n"
        "print('raylift: mine', file=sys.stderr)\n"
        "subprocess.run([sys.executable, '-c', 'import sys; print(\"child\", file=sys.stderr)'],"
        " stderr=sys.stderr)\n"
        "raise ValueError('boom')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S
    )
    log = (tmp_path / "run.log").read_text()
    assert "SlowDown" in log and "SlowDown" not in done.stderr, (done.stderr, log)
    assert "raylift: mine" in done.stderr and "child" in done.stderr, done.stderr
    assert "ValueError: boom" in done.stderr and done.returncode == 1
    crash = code.replace("raise ValueError('boom')", "os.abort()")
    done = subprocess.run(
        [sys.executable, "-c", crash], capture_output=True, text=True, timeout=HANG_S
    )
    assert done.returncode == -6 and "Fatal Python error: Aborted" in done.stderr, done.stderr


def test_a_log_started_before_the_run_is_named_once_when_the_run_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run on an object store routes to its log before its first write there, unnamed, so
    that a refused storage stays one line; the run's start names that same file, once."""
    screen = io.StringIO()
    monkeypatch.setattr("sys.stdout", screen)
    monkeypatch.setattr("sys.stderr", io.StringIO())
    monkeypatch.setenv(console.LOG_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(console.VERBOSE_ENV, raising=False)
    early = console.start_log("on s3", announce=False)
    assert early is not None and early.is_file() and console.current_log() == early
    assert screen.getvalue() == ""
    assert console.start_log("on s3") == early
    assert console.start_log("on s3") == early
    named = f"raylift: the log of everything else (Ray, torch, libraries): {early}\n"
    assert screen.getvalue() == named
