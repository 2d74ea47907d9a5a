from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from raylift.cli import main
from raylift.core.parsing import RUN_CONFIG
from tests.helpers import HANG_S

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")
SWEEP = str(Path(__file__).resolve().parents[2] / "configs" / "sweep-digits.yaml")


def test_validate_prints_resolved_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", QUICKSTART, "optim.lr=0.01"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["optim"]["lr"] == 0.01 and printed["data"]["prefetch_batches"] == 4


def test_bad_config_exits_2_without_traceback() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "raylift.cli",
            "validate",
            QUICKSTART,
            "optim.lr=-1",
            "scaling.num_workers=0",
        ],
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "optim.lr" in proc.stderr and "scaling.num_workers" in proc.stderr


def test_train_with_bad_config_exits_2_before_starting_ray(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["train", QUICKSTART, "precision=fp8"]) == 2
    assert "precision" in capsys.readouterr().err


def test_doctor_needs_at_least_two_steps_per_window(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", QUICKSTART, "--steps", "1"]) == 2
    assert "--steps must be >= 2" in capsys.readouterr().err


def test_an_unreachable_tracking_server_exits_2_at_once_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """MLflow alone would retry for minutes and then print its traceback."""
    import socket

    from raylift.artifacts import tracking

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        assert tracking.server_problem(f"http://127.0.0.1:{port}") is None
    # Closed now: nothing listens at that port.
    monkeypatch.chdir(tmp_path)
    uri = f"http://127.0.0.1:{port}"
    for verb, config in (("train", QUICKSTART), ("tune", SWEEP)):
        assert main([verb, config, f"tracking.uri={uri}", "storage=./runs"]) == 2
        err = capsys.readouterr().err
        assert f"tracking.uri: nothing answers at {uri} (Connection refused)" in err, err
        assert "start the MLflow server" in err and "Traceback" not in err
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # no shards, no run, no lock
    assert tracking.server_problem("sqlite:///x.db") is None  # a file, checked elsewhere


@pytest.mark.parametrize(
    ("verb", "config", "key", "bad"),
    [
        ("train", QUICKSTART, "storage", "s3://nobucket/runs"),
        ("tune", SWEEP, "storage", "s3://nobucket/runs"),
        ("prep", QUICKSTART, "data.shards", "s3://nobucket/shards"),
    ],
)
def test_storage_that_cannot_be_written_is_one_line_and_exit_2_on_any_cluster(
    verb: str, config: str, key: str, bad: str, s3_server: str, tmp_path: Path
) -> None:
    """On the S3 server, before anything starts or is written: a missing bucket is one
    raylift line naming the URI, the store's own message and the fix (it was a
    traceback from the run's lock). moto checks no credentials, so a refused secret is
    not tried here."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local run
    done = subprocess.run(
        [sys.executable, "-m", "raylift.cli", verb, config, f"{key}={bad}"],
        cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=HANG_S,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"raylift: {key}: cannot "), done.stderr
    assert bad in lines[0] and "check the URI" in lines[0], lines[0]
    assert "Traceback" not in done.stderr and not done.stdout.strip(), done.stdout
    assert not (tmp_path / "mlflow.db").exists()  # nothing started


def test_the_storage_check_leaves_no_folder_behind(tmp_path: Path) -> None:
    """The marker's write makes the folders it needs; the check removes those it made."""
    from raylift.run.check import writable

    where = tmp_path / "a" / "b" / "shards"
    writable(str(where), "data.shards")
    assert not (tmp_path / "a").exists()
    (tmp_path / "kept").mkdir()
    writable(str(tmp_path / "kept"), "storage")
    assert (tmp_path / "kept").is_dir() and not list((tmp_path / "kept").iterdir())


def test_verify_reads_a_run_folder_without_importing_the_task_its_config_names(
    tmp_path: Path,
) -> None:
    """A run folder is data: the module its recorded config names as the task is code, and
    verify (which needs no model) never imports it, whoever wrote the folder."""
    marker = tmp_path / "imported"
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "planted_task.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\nclass Task: ...\n"
    )
    run = tmp_path / "runs" / "x"
    (run / "checkpoint-step00000001").mkdir(parents=True)
    (run / RUN_CONFIG).write_text(
        yaml.safe_dump({"name": "x", "task": "planted_task:Task", "precision": "32"})
    )
    done = subprocess.run(
        [sys.executable, "-m", "raylift.cli", "verify", str(run)],
        env={**__import__("os").environ, "PYTHONPATH": str(tmp_path / "code")},
        capture_output=True, text=True, timeout=HANG_S,
    )  # fmt: skip
    assert "task planted_task:Task" in done.stdout + done.stderr, done.stderr
    assert not marker.exists()
