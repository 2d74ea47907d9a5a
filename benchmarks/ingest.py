"""Rows/s of raylift's training-data ingest against a torch DataLoader over the same shards.

    python benchmarks/ingest.py [--config configs/gpt-tiny.yaml] [--max-bytes 32000000]
        [--batch-size 64] [--repeats 5] [--workers 0 1 2] [--sample-rows 60000] [--shards DIR]
        [--step-ms 0]

Prepares the config's task once into parquet shards as ``raylift prep`` does (Ray Data; a
``--shards`` folder already prepared for the task is reused, else a temporary folder), shuts
Ray down, then times whole train epochs in this process, each from scratch (DataLoader
workers are started anew every epoch, as a training epoch does), with the same batch size:

- raylift: ``ShardSource`` over ``ParquetStore``, background-thread prefetch;
- DataLoader, batched: an IterableDataset that reads the row groups in a seeded shuffled
  order with pyarrow, shuffles the rows of each, and yields whole batches
  (``batch_size=None``); each worker takes a contiguous part of the epoch's batches, so no
  row group is read twice and the epoch has exactly raylift's rows; for each ``--workers``;
- DataLoader, per-sample: the common naive way, a map-style Dataset over the split in
  memory whose ``__getitem__`` returns one row, default collation, shuffle, the best
  num_workers of the batched loader, capped to ``--sample-rows`` rows per epoch.

Methods are interleaved (repeat 1 of every method, then repeat 2, ...) after one untimed
warm-up epoch each. The consumer only counts rows, so this is raw ingest throughput;
``--step-ms`` sleeps that long per batch (a training step that releases the GIL, as a GPU
step does) to show how much reading each method hides behind the step. Prints each
method's median rows/s and repeats, and the ratio of raylift to the best batched DataLoader.

The default ``max_bytes`` (about the whole standard library, ~235k rows) makes an epoch
last a second or more: at 8 MB (~60k rows) epochs take ~0.4 s and repeats vary by +-50%.
With defaults the run takes 1-2 minutes on 2 idle cores (15-40 s of it the prep); other
load on the machine shows up as spread in the repeats.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, get_worker_info

REPO = Path(__file__).resolve().parents[1]

Batch = dict[str, torch.Tensor]
Group = tuple[str, int, int]  # (file path, row group in the file, rows)


def register_ray_types(_worker: int = 0) -> None:
    """Ray's tensor extension type must be registered in every process that reads the shards."""
    import ray.data  # noqa: F401


def to_batch(cols: dict[str, np.ndarray]) -> Batch:
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in cols.items()}


class GroupBatches(IterableDataset):
    """Whole batches from shuffled parquet row groups; workers split the epoch's batches."""

    def __init__(self, groups: list[Group], batch_size: int, seed: int):
        register_ray_types()
        self.groups, self.batch_size, self.seed = groups, batch_size, seed
        self.epoch = 0

    def __iter__(self) -> Iterator[Batch]:
        import pyarrow.parquet as pq

        from raylift.data.ingest import table_to_numpy

        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        rng = np.random.default_rng([self.seed, self.epoch])
        order = rng.permutation(len(self.groups))
        starts = np.concatenate([[0], np.cumsum([self.groups[g][2] for g in order])])
        b = self.batch_size
        batches = int(starts[-1]) // b  # the tail that fills no batch is dropped
        first, stop = batches * worker // workers * b, batches * (worker + 1) // workers * b
        files: dict[str, Any] = {}
        pending: list[dict[str, np.ndarray]] = []
        have = 0
        for i, g in enumerate(order):
            lo, hi = max(first, int(starts[i])), min(stop, int(starts[i + 1]))
            if lo >= hi:
                continue
            path, group, rows = self.groups[g]
            if path not in files:
                files[path] = pq.ParquetFile(path)
            cols = table_to_numpy(files[path].read_row_group(group))
            perm = np.random.default_rng([self.seed, self.epoch, int(g)]).permutation(rows)
            take = perm[lo - int(starts[i]) : hi - int(starts[i])]
            pending.append({k: v[take] for k, v in cols.items()})
            have += len(take)
            while have >= b:
                cols = {k: np.concatenate([p[k] for p in pending]) for k in pending[0]}
                yield to_batch({k: v[:b] for k, v in cols.items()})
                pending, have = [{k: v[b:] for k, v in cols.items()}], have - b


class Rows(Dataset):
    """The naive per-sample Dataset: the whole split in memory, one row per ``__getitem__``."""

    def __init__(self, groups: list[Group]):
        import pyarrow.parquet as pq

        from raylift.data.ingest import table_to_numpy

        register_ray_types()
        paths = list(dict.fromkeys(path for path, _, _ in groups))
        tables = [table_to_numpy(pq.read_table(path)) for path in paths]
        self.cols = {k: np.concatenate([t[k] for t in tables]) for k in tables[0]}

    def __len__(self) -> int:
        return len(next(iter(self.cols.values())))

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {k: v[i] for k, v in self.cols.items()}


# ---------------------------------------------------------------- timing


def epoch(batches: Iterable[Batch], step_s: float) -> int:
    """Consume one epoch, sleeping ``step_s`` per batch; the rows delivered."""
    rows = 0
    for batch in batches:
        rows += len(next(iter(batch.values())))
        if step_s:
            time.sleep(step_s)
    return rows


def run(
    methods: dict[str, Callable[[int], Iterable[Batch]]], repeats: int, step_s: float
) -> dict[str, list[tuple[int, float]]]:
    """(rows, seconds) of ``repeats`` epochs of every method, interleaved, after a warm-up.

    ``methods`` map a repeat (-1: the warm-up) to that epoch's batches.
    """
    for make in methods.values():
        epoch(make(-1), step_s)
    out: dict[str, list[tuple[int, float]]] = {name: [] for name in methods}
    for rep in range(repeats):
        for name, make in methods.items():
            started = time.perf_counter()
            rows = epoch(make(rep), step_s)
            out[name].append((rows, time.perf_counter() - started))
    return out


def rates(results: list[tuple[int, float]]) -> list[float]:
    return [rows / seconds for rows, seconds in results]


# ---------------------------------------------------------------- setup


def machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    import pyarrow
    import ray

    return (
        f"{model}, {os.cpu_count()} cores ({usable} usable), torch {torch.__version__}, "
        f"pyarrow {pyarrow.__version__}, ray {ray.__version__}, "
        f"Python {platform.python_version()}, cuda {torch.cuda.is_available()}"
    )


def prepare(opts: argparse.Namespace, root: str) -> tuple[Any, str]:
    """The prepared shards' manifest, and a line on where they came from."""
    import ray

    from raylift.data.shards import prep
    from raylift.run.connect import connect_ray
    from raylift.tasks import build_task
    from raylift.validation import load_config

    overrides = [f"storage={root}/storage", *opts.override]
    if opts.max_bytes is not None:
        overrides.append(f"task_args.max_bytes={opts.max_bytes}")
    cfg = load_config(opts.config, overrides)
    task = build_task(cfg.task, cfg.task_args)
    shards = opts.shards or f"{root}/shards"
    logging.getLogger("ray.data").setLevel(logging.WARNING)  # no progress lines in the table
    result = prep(cfg, task, shards, connect=lambda: connect_ray(cfg), log=lambda *_: None)
    if ray.is_initialized():
        ray.shutdown()
    how = "reused" if result.skipped else f"prepared in {result.seconds:.1f} s"
    args = ", ".join(f"{k}={v}" for k, v in cfg.task_args.items())
    return result.manifest, f"{cfg.task} ({args}) from {opts.config}; shards {shards} ({how})"


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args.add_argument("--config", default=str(REPO / "configs" / "gpt-tiny.yaml"))
    args.add_argument(
        "--max-bytes", type=int, default=32_000_000, help="task_args.max_bytes (gpt); 0: unset"
    )
    args.add_argument("--override", nargs="*", default=[], help="more dotted key=value overrides")
    args.add_argument("--shards", help="shards folder, reused if prepared (default: a temp one)")
    args.add_argument("--batch-size", type=int, default=64)
    args.add_argument("--repeats", type=int, default=5)
    args.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    args.add_argument("--prefetch", type=int, default=4, help="raylift's prefetch_batches")
    args.add_argument(
        "--sample-rows", type=int, default=60_000, help="per-sample epoch cap; 0: skip it"
    )
    args.add_argument("--seed", type=int, default=0)
    args.add_argument("--step-ms", type=float, default=0.0, help="simulated step per batch")
    opts = args.parse_args()
    opts.max_bytes = opts.max_bytes or None

    register_ray_types()
    from raylift.data.ingest import ParquetStore, ShardSource

    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="raylift-ingest-") as tmp:
        manifest, origin = prepare(opts, tmp)
        base = str(Path(manifest.root).expanduser().resolve())
        groups = [
            (f"{base}/{f.path}", gi, rows)
            for f in manifest.splits["train"]
            for gi, rows in enumerate(f.groups)
        ]
        b, pin = opts.batch_size, torch.cuda.is_available()

        def raylift(rep: int) -> Iterable[Batch]:
            source = ShardSource(
                ParquetStore(manifest),
                rank=0,
                world_size=1,
                batch_size=b,
                eval_batch_size=b,
                seed=opts.seed,
                prefetch_batches=opts.prefetch,
                pin_memory=pin,
                shuffle=True,
            )
            return source.train_batches(epoch=rep + 1, start_row=0)

        dataset = GroupBatches(groups, b, opts.seed)

        def batched(workers: int) -> Callable[[int], Iterable[Batch]]:
            def make(rep: int) -> Iterable[Batch]:
                dataset.epoch = rep + 1
                return DataLoader(
                    dataset,
                    batch_size=None,
                    num_workers=workers,
                    pin_memory=pin,
                    worker_init_fn=register_ray_types if workers else None,
                )

            return make

        name = f"raylift ShardSource (prefetch {opts.prefetch})"
        methods = {name: raylift}
        loaders = {f"DataLoader batched, num_workers={w}": w for w in opts.workers}
        methods.update({label: batched(w) for label, w in loaders.items()})
        results = run(methods, opts.repeats, opts.step_ms / 1e3)

        medians = {m: statistics.median(rates(r)) for m, r in results.items()}
        best = max(loaders, key=lambda label: medians[label])
        expect = dict.fromkeys(methods, manifest.rows("train") // b * b)
        sample_note = ""
        if opts.sample_rows:
            started = time.perf_counter()
            rows = Rows(groups)
            load = time.perf_counter() - started
            cap = min(opts.sample_rows, len(rows)) // b * b

            def per_sample(rep: int) -> Iterable[Batch]:
                gen = torch.Generator().manual_seed(opts.seed * 1000 + rep + 1)
                return DataLoader(
                    rows,
                    batch_size=b,
                    sampler=RandomSampler(rows, num_samples=cap, generator=gen),
                    drop_last=True,
                    num_workers=loaders[best],
                    pin_memory=pin,
                    worker_init_fn=register_ray_types if loaders[best] else None,
                )

            label = f"DataLoader per-sample, num_workers={loaders[best]}"
            expect[label] = cap
            results.update(run({label: per_sample}, opts.repeats, opts.step_ms / 1e3))
            medians[label] = statistics.median(rates(results[label]))
            sample_note = (
                f"per-sample: capped to {cap:,} of {len(rows):,} rows per epoch; "
                f"the split is read into memory once beforehand ({load:.2f} s, not timed)"
            )

    train = manifest.rows("train")
    on_disk = sum(f.bytes for f in manifest.splits["train"])
    schema = ", ".join(f"{k}: {v}" for k, v in manifest.schema.items())
    print(f"machine: {machine()}")
    print(f"data: {origin}")
    print(
        f"train split: {train:,} rows, {len(manifest.splits['train'])} files, "
        f"{len(groups)} row groups, {on_disk / 2**20:.1f} MiB on disk (page cache warm); {schema}"
    )
    print(
        f"batch size {b}, {opts.repeats} repeats of one whole train epoch each (DataLoader "
        f"workers started anew each epoch), 1 untimed warm-up epoch per method, "
        f"pin_memory={pin}, step {opts.step_ms:g} ms per batch"
    )
    print()
    print(f"{'method':<42}{'rows/epoch':>11}{'median rows/s':>15}  repeats (rows/s)")
    for label, res in results.items():
        reps = " ".join(f"{r / 1e3:.0f}k" for r in rates(res))
        print(f"{label:<42}{res[0][0]:>11,}{medians[label]:>15,.0f}  {reps}")
    print()
    got = {label: sorted({rows for rows, _ in res}) for label, res in results.items()}
    if all(got[label] == [rows] for label, rows in expect.items()):
        print(
            f"rows check: OK, every full epoch of every method delivered {train // b * b:,} "
            f"rows (the last {train % b} fill no batch), every capped one its cap"
        )
    else:
        print(f"rows check: MISMATCH, rows per epoch {got}, expected {expect}")
    if sample_note:
        print(sample_note)
    print(f"wall time: {time.perf_counter() - began:.0f} s (prep included)")
    ratio = medians[name] / medians[best]
    print(f"ratio raylift/DataLoader(best num_workers={loaders[best]}): {ratio:.2f}x")
    table = [[label, f"{res[0][0]:,}", f"{medians[label]:,.0f}"] for label, res in results.items()]
    sys.path.insert(0, str(REPO / "benchmarks"))
    from results import save

    save(
        __file__,
        f"raylift's shard stream against DataLoader over the same shards (batch {b})",
        ["method", "rows/epoch", "median rows/s"],
        table,
        {"what": f"rows/s of one train epoch, batch {b}",
         "raylift": f"{medians[name]:,.0f} rows/s",
         "baseline": f"DataLoader, num_workers={loaders[best]}: {medians[best]:,.0f} rows/s",
         "ratio": f"{ratio:.2f}x"},
        notes=f"Data: {origin}. Median of {opts.repeats} whole epochs per method.",
    )  # fmt: skip


if __name__ == "__main__":
    main()
