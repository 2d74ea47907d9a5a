"""ruff and mypy on src/ run as part of the test command, so CI enforces them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import finish_output

REPO = Path(__file__).resolve().parents[2]
# mypy's cache lives with the other compiled caches: a warm run takes seconds, not a minute.
CACHE = Path(os.environ.get("RAYLIFT_TEST_CACHE", Path.home() / ".cache" / "raylift-tests"))


LINTERS = {
    "ruff-check": ["ruff", "check", "src", "tests"],
    "ruff-format": ["ruff", "format", "--check", "src", "tests"],
    "mypy": ["mypy", "--cache-dir", str(CACHE / "mypy"), "src"],
}


def start(name: str) -> subprocess.Popen[str] | None:
    cmd = LINTERS[name]
    exe = shutil.which(cmd[0], path=str(Path(sys.executable).parent))
    if exe is None:
        return None
    return subprocess.Popen(
        [exe, *cmd[1:]], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.mark.parametrize("name", list(LINTERS))
def test_clean(name: str) -> None:
    proc = start(name)
    if proc is None:
        pytest.skip(f"{LINTERS[name][0]} is not installed (pip install -e '.[dev]')")
    out, _ = finish_output(proc, name)
    assert proc.returncode == 0, out
