"""``benchmarks/gpu.py --smoke``: the one call that measures a GPU machine, run here at
toy sizes on the CPU, so that it cannot rot between the rare GPU machines. Every part it
runs in the suite finishes with its numbers (its own Ray, as on the GPU machine); the
GPU tests part is the suite's own ``-m gpu`` tests, and the pipeline part is
``benchmarks/pipeline.py``, which the smoke run by hand covers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import finish_output
from tests.integration.test_own_ray import own_ray_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
PARTS = ("gpt2", "llama", "checkpoints", "check")


def test_the_gpu_script_runs_every_part_at_toy_sizes(user_shell: dict, tmp_path: Path) -> None:
    out = tmp_path / "gpu-smoke.json"
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "benchmarks" / "gpu.py"), "--smoke",
         "--parts", ",".join(PARTS), "--out", str(out)],
        cwd=tmp_path, env=own_ray_env(user_shell), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    printed, _ = finish_output(proc, "benchmarks/gpu.py --smoke")
    assert proc.returncode == 0, printed[-4000:]
    parts = json.loads(out.read_text())["parts"]
    assert list(parts) == list(PARTS)
    for name in PARTS:
        assert f"gpu.py: {name}: ok in " in printed, printed[-3000:]
    gpt, llama, saves = parts["gpt2"], parts["llama"], parts["checkpoints"]
    assert gpt["tokens_per_s"] > 0 and 0 < gpt["mfu"] <= 1 and gpt["first_step_s"] > 0
    assert gpt["hand_written_step_ms"] > 0 and gpt["ratio_to_hand_written"] > 0
    for mode in ("full", "lora"):
        assert llama[mode]["tokens_per_s"] > 0 and llama[mode]["planned_gib"] > 0, llama
    # LoRA trains fewer parameters: the plan holds fewer optimizer states for it.
    assert llama["lora"]["planned_gib"] < llama["full"]["planned_gib"]
    for save in (llama["full"]["async_save"], saves["sync_save"]):
        assert save["step"] == 5 and save["gib"] > 0 and save["save_s"] > 0 <= save["stall_s"]
    resume = saves["resume"]
    assert resume["read_mib"] > 0 and resume["checkpoint_mib"] > 0 and resume["seconds"] > 0
    assert any(line.startswith("node ") and "CUDA" in line for line in parts["check"]["printed"])
