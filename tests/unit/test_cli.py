from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from raylift.cli import main

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")


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
