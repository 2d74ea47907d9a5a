"""Ray Data datasets from a task: raw columns -> ``map_batches(preprocess)`` -> materialized."""

from __future__ import annotations

from typing import Any

from raylift.tasks.base import Columns, Task

PREPROCESS_BATCH = 64


def _rows(cols: Columns) -> list[dict[str, Any]]:
    n = len(next(iter(cols.values())))
    return [{k: v[i] for k, v in cols.items()} for i in range(n)]


def build_datasets(task: Task, num_cpus: int) -> tuple[dict[str, Any], dict[str, int]]:
    """One preprocessed, materialized dataset per split, and the row count of each."""
    import ray.data

    datasets, counts = {}, {}
    for split, cols in task.sources().items():
        n = len(next(iter(cols.values())))
        blocks = max(1, min(n // PREPROCESS_BATCH, 2 * num_cpus))
        raw = ray.data.from_items(_rows(cols), override_num_blocks=blocks)
        ds = raw.map_batches(
            task.preprocess, batch_format="numpy", batch_size=PREPROCESS_BATCH
        ).materialize()
        datasets[split], counts[split] = ds, ds.count()
        if counts[split] == 0:
            raise ValueError(f"task: split {split!r} is empty after preprocessing")
    if "train" not in datasets or "val" not in datasets:
        raise ValueError(
            f"task: sources() must return 'train' and 'val' splits, got {sorted(datasets)}"
        )
    return datasets, counts
