"""The manual's task example (docs/tasks.md) works as printed."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from raylift.core.parsing import merge
from raylift.tasks import task_problems
from raylift.validation import config_from_dict
from tests.helpers import BASE, ListTracker, LocalReporter, init_pg, make_trainer

TASKS = Path(__file__).resolve().parents[2] / "docs" / "tasks.md"


@pytest.fixture
def readme_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    blocks = re.findall(r"```python\n(# mytasks\.py.*?)```", TASKS.read_text(), re.S)
    assert len(blocks) == 1, "the tasks page shows one task example"
    (tmp_path / "mytasks.py").write_text(blocks[0])
    monkeypatch.syspath_prepend(str(tmp_path))
    init_pg(0, 1, str(tmp_path / "pg"))
    yield "mytasks:Iris"
    dist.destroy_process_group()
    sys.modules.pop("mytasks", None)


def test_readme_task_example_trains(readme_task: str, tmp_path: Path) -> None:
    assert task_problems(readme_task, {"hidden": 64}) == []
    base = {k: v for k, v in BASE.items() if k != "task_args"}
    cfg = config_from_dict(
        merge(
            base,
            dict(
                task=readme_task,
                task_args={"hidden": 64},
                data={"batch_size": 8},
                optim={"lr": 0.02},
                train={"max_epochs": 20, "log_every_n_steps": 5},
            ),
        )
    )
    tracker = ListTracker()
    trainer = make_trainer(cfg, 0, 1, LocalReporter(tmp_path), tracker)
    metrics = trainer.run()
    assert metrics["val_acc"] > 0.8
