"""A worker imports only what its run uses: a DDP run of the quickstart trains without
DeepSpeed, fairscale, transformers, PEFT, MLflow or the Hugging Face Hub's client in the
process (each costs seconds at every worker's start, and at every sweep trial's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Libraries a run imports only where it uses them: a strategy, a task or an adapter that
# needs one, or the driver (MLflow's client; a worker logs through the tracking actor).
ONLY_WHERE_USED = {"deepspeed", "fairscale", "transformers", "peft", "mlflow", "datasets",
                   "huggingface_hub", "sklearn", "safetensors", "tokenizers"}  # fmt: skip


def test_a_ddp_worker_imports_none_of_the_libraries_it_does_not_use() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tests.worker_imports", str(REPO / "configs" / "quickstart.yaml")],
        cwd=REPO, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    imported = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert {"torch", "ray", "raylift"} <= imported
    assert not imported & ONLY_WHERE_USED, sorted(imported & ONLY_WHERE_USED)
    third_party = sorted(imported - set(sys.stdlib_module_names) - {"tests"})
    print("a DDP worker's third-party packages:", ", ".join(third_party))  # for the record
