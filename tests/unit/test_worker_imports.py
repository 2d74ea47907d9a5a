"""A worker imports only what its run uses: a DDP run of the quickstart trains without
DeepSpeed, fairscale, transformers, PEFT, MLflow or the Hugging Face Hub's client in the
process (each costs seconds at every worker's start, and at every sweep trial's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.worker_imports import DDP_WORKER, NOT_FOR_DDP

REPO = Path(__file__).resolve().parents[2]


def test_a_ddp_worker_imports_none_of_the_libraries_it_does_not_use() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tests.worker_imports", str(REPO / "configs" / "quickstart.yaml")],
        cwd=REPO, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    imported = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert {"torch", "ray", "raylift"} <= imported
    assert not imported & NOT_FOR_DDP, sorted(imported & NOT_FOR_DDP)
    assert imported <= DDP_WORKER, sorted(imported - DDP_WORKER)
    third_party = sorted(imported - set(sys.stdlib_module_names) - {"tests"})
    print("a DDP worker's third-party packages:", ", ".join(third_party))  # for the record
