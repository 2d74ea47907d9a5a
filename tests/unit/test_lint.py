"""ruff and mypy on src/ run as part of the test command, so CI enforces them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# mypy's cache lives with the other compiled caches: a warm run takes seconds, not a minute.
CACHE = Path(os.environ.get("RAYLIFT_TEST_CACHE", Path.home() / ".cache" / "raylift-tests"))


@pytest.mark.parametrize(
    "cmd",
    [
        ["ruff", "check", "src", "tests"],
        ["ruff", "format", "--check", "src", "tests"],
        ["mypy", "--cache-dir", str(CACHE / "mypy"), "src"],
    ],
    ids=["ruff-check", "ruff-format", "mypy"],
)
def test_clean(cmd: list[str]) -> None:
    exe = shutil.which(cmd[0], path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip(f"{cmd[0]} is not installed (pip install -e '.[dev]')")
    proc = subprocess.run([exe, *cmd[1:]], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
