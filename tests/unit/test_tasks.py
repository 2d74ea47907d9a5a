from __future__ import annotations

import math
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from raylift.tasks import build_task, resolve_task, task_problems
from raylift.tasks.gpt import GPTTask


def test_digits_stays_uint8_until_the_device() -> None:
    task = build_task("digits", {})
    src = task.sources()
    assert len(src["train"]["label"]) + len(src["val"]["label"]) == 1797
    out = task.preprocess({k: v[:16] for k, v in src["train"].items()})
    assert out["image"].dtype == np.uint8 and out["image"].max() <= 255
    batch = task.finish({k: torch.from_numpy(v) for k, v in out.items()}, torch.float32)
    assert batch["image"].shape == (16, 1, 8, 8) and batch["image"].dtype == torch.float32
    assert abs(float(batch["image"].mean())) < 1.0
    model = task.build_model()
    with torch.no_grad():
        sums = task.eval_sums(model, batch)
    metrics = task.summarize({k: float(v) for k, v in sums.items()})
    assert 0 <= metrics["val_acc"] <= 1 and metrics["val_loss"] > 0


def test_gpt_split_is_by_file_and_deterministic(tmp_path: Path) -> None:
    for i in range(40):
        (tmp_path / f"m{i}.py").write_text(f"x = {i}\n" * 50)
    a = GPTTask(corpus=str(tmp_path), block_size=16, max_bytes=None, val_percent=20).sources()
    b = GPTTask(corpus=str(tmp_path), block_size=16, max_bytes=None, val_percent=20).sources()
    assert list(a["val"]["path"]) == list(b["val"]["path"])
    assert not set(a["train"]["path"]) & set(a["val"]["path"])
    assert len(a["train"]["path"]) + len(a["val"]["path"]) == 40


def test_gpt_windows_cover_every_byte_once_as_a_target(tmp_path: Path) -> None:
    text = bytes(range(256)) * 3
    (tmp_path / "a.py").write_bytes(text)
    task = GPTTask(corpus=str(tmp_path), block_size=32)
    tokens = task.preprocess({"path": np.array([str(tmp_path / "a.py")])})["tokens"]
    assert tokens.dtype == np.uint8 and tokens.shape[1] == 33
    targets = tokens[:, 1:].reshape(-1)
    assert bytes(targets) == text[1 : 1 + len(targets)]


def test_gpt_loss_starts_near_uniform() -> None:
    task = GPTTask(block_size=32, n_layer=1, d_model=32, n_head=2)
    model = task.build_model()
    tokens = torch.randint(0, 256, (4, 33), dtype=torch.uint8)
    batch = task.finish({"tokens": tokens}, torch.float32)
    with torch.no_grad():
        sums = task.eval_sums(model, batch)
    bpb = task.summarize({k: float(v) for k, v in sums.items()})["val_bpb"]
    assert abs(bpb - 8.0) < 0.5  # ln(256)/ln(2) bits: an untrained model knows nothing
    assert math.isfinite(float(task.loss(model, batch).detach()))


def test_user_task_from_outside_the_repository(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "mytask.py").write_text(
        textwrap.dedent("""
        from raylift.tasks.digits import DigitsTask
        class Small(DigitsTask):
            def __init__(self, width: int = 4):
                super().__init__(width=width)
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_task("mytask:Small").__name__ == "Small"
    assert task_problems("mytask:Small", {"width": 2}) == []
    assert "takes no argument 'depth'" in task_problems("mytask:Small", {"depth": 2})[0]
    assert "has no class" in task_problems("mytask:Nope", {})[0]
