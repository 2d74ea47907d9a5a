"""Offline preprocessing into parquet shards, and the shards a run trains on.

``raylift prep`` runs the task's ``preprocess`` once with Ray Data (``map_batches``
in parallel over the cluster's CPUs), shuffles the train split globally, and
writes parquet in small row groups: the unit the streaming reader permutes each
epoch. The manifest written last (:mod:`raylift.data.manifest`) records every file
and a fingerprint of the task, its args and its code; training refuses shards whose
files or fingerprint do not match.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from raylift.core import console
from raylift.core.config import Config
from raylift.core.errors import SourceError
from raylift.core.storage import filesystem, is_remote, join, resolve
from raylift.data.manifest import (
    Manifest,
    ShardError,
    kept_rows,
    open_shards,
    read_manifest,
    scan,
    shard_root,
    task_fingerprint,
    verify,
    write_manifest,
)
from raylift.data.sources import (
    SPLIT_COLUMN,
    SPLITS,
    RowSplit,
    Skipped,
    Source,
    as_dataset,
    check_sources,
    drop_bad_rows,
    estimated_bytes,
    num_rows,
    permuted,
    reads_shuffled_files,
    val_outputs,
    val_rows,
)
from raylift.tasks.base import Columns, Task

if TYPE_CHECKING:
    import ray.data

ROWS_PER_GROUP = 128  # the shuffle unit: small enough to mix well, big enough to read fast
ROWS_PER_FILE = 16_384
# Rows per ``preprocess`` call, unless the task sets ``preprocess_batch_size``.
PREPROCESS_BATCH = 64
SHUFFLE_SEED = 0  # the offline shuffle's; each epoch's order comes from train.seed
# A full shuffle holds the split in the object store (and spills past it): only
# splits of at most this share of it are shuffled whole.
SHUFFLE_MEMORY_SHARE = 0.3
SHUFFLE_WINDOW = 16_384  # rows shuffled together when the split is too big for a full shuffle
PROGRESS_EVERY_S = 10.0


# ---------------------------------------------------------------- prep


@dataclasses.dataclass
class PrepResult:
    root: str
    manifest: Manifest
    skipped: bool  # True: the shards were already there and current
    seconds: float


def prep(
    cfg: Config,
    task: Task,
    root: str,
    force: bool = False,
    log: Any = print,
    connect: Any = None,
) -> PrepResult:
    """Preprocess ``task``'s sources into parquet shards under ``root``, once.

    ``connect`` (called only when there is work to do) brings Ray up for Ray Data.
    """
    started = time.perf_counter()
    fp = task_fingerprint(cfg, task)
    existing = read_manifest(root)
    if existing is not None and not force:
        if existing.fingerprint != fp:
            raise ShardError(
                f"data.shards: {root} holds shards of another task, task_args, task code or "
                "raw data; rerun with --force to replace them"
            )
        verify(existing, fp)
        return PrepResult(root, existing, True, time.perf_counter() - started)
    if connect is not None:
        connect()
    if is_remote(root):
        manifest = _write_generation(task, root, fp, log)
    else:
        manifest = _write_staged(task, root, fp, log, replace=force)
    for line in getattr(task, "prep_notes", lambda _: [])(manifest):  # what the task counted
        log(line)
    return PrepResult(root, manifest, False, time.perf_counter() - started)


def _write_all(task: Task, root: str, fp: str, log: Any) -> Manifest:
    manifest = scan(root, fp, _write_splits(task, root, log))
    write_manifest(root, manifest)
    return manifest


GENERATION = "gen-"  # an object-store prep's own folder under the shards' root
STALE_GENERATION_S = 7 * 24 * 3600  # a replaced generation a run may still be reading


def _write_generation(task: Task, root: str, fp: str, log: Any) -> Manifest:
    """Object stores have no rename: each prep writes a folder of its own under ``root``
    and then the manifest, one object whose PUT replaces the old one whole. A reader sees
    the old shards or the new ones; of two preps at once the last manifest wins, and
    neither deletes the other's files. Generations no manifest names are removed once
    they are a week old (a cut-off prep's, or ones a run started before may read)."""
    generation = f"{GENERATION}{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
    splits = _write_splits(task, join(root, generation), log)
    manifest = scan(root, fp, splits, prefix=generation)
    write_manifest(root, manifest)
    _remove_stale_generations(root, keep=generation, log=log)
    return manifest


def _remove_stale_generations(root: str, keep: str, log: Any) -> None:
    import pyarrow.fs as pafs

    fs, base = filesystem(root)
    now = time.time()
    for info in fs.get_file_info(pafs.FileSelector(base)):
        name = info.path.rstrip("/").rsplit("/", 1)[-1]
        if info.type != pafs.FileType.Directory or not name.startswith(GENERATION):
            continue
        if name == keep:
            continue
        files = fs.get_file_info(pafs.FileSelector(info.path, recursive=True))
        # A generation another prep is still writing may have no file yet: its name's
        # time counts as a write, or it would look a week old and be deleted under it.
        written = [f.mtime.timestamp() for f in files if f.mtime is not None]
        newest = max([*written, _generation_started(name)])
        if now - newest > STALE_GENERATION_S:
            fs.delete_dir(info.path)
            log(f"raylift: prep removed {join(root, name)}, unused for over a week")


def _generation_started(name: str) -> float:
    """When a generation folder was made, from its name (``gen-YYYYmmdd-HHMMSS-id``);
    0 for a name of another shape."""
    try:
        return time.mktime(time.strptime(name[len(GENERATION) :][:15], "%Y%m%d-%H%M%S"))
    except ValueError:
        return 0.0


def _write_staged(task: Task, root: str, fp: str, log: Any, replace: bool) -> Manifest:
    """Write beside ``root`` and rename into place: readers never see a half-written folder,
    and of two runs preparing the same shards at once (a sweep's trials), one wins whole.

    ``replace`` (``--force``) moves existing shards aside; otherwise shards that appeared
    meanwhile with a manifest are kept, as another run may already be reading them.
    """
    import shutil
    import uuid

    final = Path(resolve(root))
    staging = final.with_name(f".{final.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        _write_all(task, str(staging), fp, log)
        old = final.with_name(f".{final.name}.{uuid.uuid4().hex[:8]}.old")
        if final.exists() and (replace or read_manifest(str(final)) is None):
            final.rename(old)  # the old shards go only once the new ones are whole
        with contextlib.suppress(OSError):  # another run put its shards in place first
            staging.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    manifest = read_manifest(str(final))
    if manifest is None:
        raise ShardError(f"data.shards: {final} has no manifest after prep; run prep again")
    return manifest


def _write_splits(task: Task, root: str, log: Any) -> list[str]:
    import ray

    sources = task.sources()
    check_sources(sources)
    cpus = int(ray.cluster_resources().get("CPU", 1))
    budget = SHUFFLE_MEMORY_SHARE * ray.cluster_resources().get("object_store_memory", 0.0)
    both = sources["train"]
    if isinstance(both, RowSplit):
        _write_row_split(task, both, root, cpus, budget, log)
        return list(SPLITS)
    counted = {s: _write_split(task, sources[s], s, root, cpus, budget, log) for s in SPLITS}
    for split in SPLITS:
        _check_skipped(task, root, (split,), *counted[split], log)
    return list(SPLITS)


def _write_split(
    task: Task, source: Source, split: str, root: str, cpus: int, budget: float, log: Any
) -> tuple[int, list[str]]:
    """Preprocess, shuffle (train) and write one split; the bad rows it dropped."""
    ds = _split_dataset(task, source, split, cpus, budget, log)
    # An ETA only from files' sizes: in-memory columns may be paths to the data.
    expected = None if isinstance(source, dict) else estimated_bytes(source)
    return _write(ds, join(root, split), f"split {split!r}", expected, log)


def _write_row_split(
    task: Task, source: RowSplit, root: str, cpus: int, budget: float, log: Any
) -> None:
    """Both splits in one pass over the data, shuffled as a train split is: each
    preprocess call parts its rows by the key's hash and preprocesses each part alone (no
    train row is made of val data), or, with ``source.outputs``, preprocesses each row
    alone and parts its output rows; the write files each row under the split it carries."""
    batch = getattr(task, "preprocess_batch_size", PREPROCESS_BATCH)
    unit, how = _row_split_how(source)
    log(
        f"raylift: prep splits {source.what} by {unit}: {source.val_percent}% of the "
        f"{unit}s go to val by a hash of {how}; one pass writes both splits"
    )
    if isinstance(source.dataset, dict):  # numpy columns: a few files' paths, say
        n = num_rows(source.dataset)
        log(
            f"raylift: prep shuffles splits 'train' and 'val' (read once) whole ({n:,} rows, "
            "in memory)"
        )
        ds = as_dataset(permuted(source.dataset, SHUFFLE_SEED), cpus, batch)
        ds = _preprocessed(task, ds, batch, source, permute=True)
    else:
        ds = _shuffled_dataset(task, source.dataset, batch, budget, log, source)
    counted = _write(ds, root, "splits 'train' and 'val'", estimated_bytes(source), log, True)
    # Bad rows first: where most were bad, that is why a split came out empty.
    _check_skipped(task, root, SPLITS, *counted, log)
    for split in SPLITS:
        if not _parquet_files(join(root, split)):
            raise SourceError(
                f"task: prep made no {unit} of split {split!r} from {source.what}: "
                f"{source.val_percent}% of its {unit}s go to val by a hash of {how}, and it "
                f"has too few {unit}s for that (or too little text for one window of the "
                "split); add data or change val_percent"
            )


def _row_split_how(source: RowSplit) -> tuple[str, str]:
    """What a RowSplit parts (rows, or what preprocess makes of each: windows) and by
    what, for messages."""
    if source.outputs:
        return source.outputs, f"their row's column {source.key!r} and their place in its output"
    return "row", f"column {source.key!r}"


def _write(
    ds: ray.data.Dataset,
    folder: str,
    label: str,
    expected: int | None,
    log: Any,
    by_split: bool = False,
) -> tuple[int, list[str]]:
    """Drop and count the rows ``preprocess`` marked bad and write the rest under
    ``folder`` (in a folder per split, named by SPLIT_COLUMN, with ``by_split``)."""
    skipped = f"raylift-prep-skipped-{uuid.uuid4().hex}"
    drop: Any = drop_bad_rows
    ds = ds.map_batches(drop, fn_kwargs={"skipped": skipped}, batch_format="pyarrow")
    # Directory partitioning: root/train/..., not Hive's root/_split=train/...
    parts: dict[str, Any] = (
        {"partition_cols": [SPLIT_COLUMN], "partitioning_flavor": None} if by_split else {}
    )
    # An object store's filesystem retries what a retry can fix; Ray's own would not.
    fs = filesystem(folder)[0] if is_remote(folder) else None
    try:
        with Progress(folder, label, expected, log, recursive=by_split):
            ds.write_parquet(
                folder, filesystem=fs, row_group_size=ROWS_PER_GROUP,
                max_rows_per_file=ROWS_PER_FILE, **parts,
            )  # fmt: skip
    finally:
        counted = Skipped.collect(skipped)
    return counted


def _parquet_files(folder: str) -> list[Any]:
    fs, base = filesystem(folder)
    return [i for i in fs.get_file_info(_selector(base)) if i.path.endswith(".parquet")]


def _check_skipped(
    task: Task, root: str, splits: tuple[str, ...], bad: int, examples: list[str], log: Any
) -> None:
    """Warn about rows ``preprocess`` could not use; past the task's share, stop."""
    if not bad:
        return
    import pyarrow.parquet as pq

    fs, _ = filesystem(root)
    # A task whose rows pack several examples names the column that counts them.
    column = getattr(task, "examples_column", None)
    kept = sum(
        kept_rows(pq.ParquetFile(fs.open_input_file(i.path)), column)
        for split in splits
        for i in _parquet_files(join(root, split))
    )
    share = bad / max(bad + kept, 1)
    allowed = float(getattr(task, "max_bad_fraction", 0.0))
    named = "; ".join(examples)
    label = " and ".join(repr(s) for s in splits)
    label = f"split {label}" if len(splits) == 1 else f"splits {label}"
    if share > allowed:
        raise SourceError(
            f"task: {bad} of {bad + kept} rows of {label} ({share:.1%}) could not be "
            f"read, more than task_args.max_bad_fraction={allowed:g} allows: {named}. Fix or "
            "remove those files, or raise task_args.max_bad_fraction"
        )
    log(
        f"raylift: warning: prep skipped {bad} unreadable row(s) of {label} ({share:.2%}): " + named
    )


def _selector(base: str) -> Any:
    import pyarrow.fs as pafs

    return pafs.FileSelector(base, allow_not_found=True)


def _split_dataset(
    task: Task, source: Source, split: str, cpus: int, budget: float, log: Any
) -> ray.data.Dataset:
    """The split's rows, preprocessed on every CPU of the cluster and, for train, shuffled."""
    batch = getattr(task, "preprocess_batch_size", PREPROCESS_BATCH)
    if split != "train":
        return _preprocessed(task, as_dataset(source, cpus, batch), batch)
    if isinstance(source, dict):  # numpy columns
        # In the driver's memory already: a full shuffle is a permutation, here. Rows
        # that preprocess turns into several (documents into windows) are mixed again
        # within each preprocess call's output, in the same task.
        log(f"raylift: prep shuffles split 'train' whole ({num_rows(source):,} rows, in memory)")
        ds = as_dataset(permuted(source, SHUFFLE_SEED), cpus, batch)
        fn: Any = _preprocess_permuted  # it takes the task's preprocess as a keyword
        kwargs = {"preprocess": task.preprocess}
        return ds.map_batches(fn, fn_kwargs=kwargs, batch_format="numpy", batch_size=batch)
    dataset: Any = source  # neither columns nor a RowSplit (prep writes those apart)
    return _shuffled_dataset(task, dataset, batch, budget, log)


def _shuffled_dataset(
    task: Task,
    ds: ray.data.Dataset,
    batch: int,
    budget: float,
    log: Any,
    rows: RowSplit | None = None,
) -> ray.data.Dataset:
    """A Dataset train split (or both splits of ``rows``): shuffled whole where it fits
    the object store, else by file."""
    size = estimated_bytes(ds)
    what = "split 'train'" if rows is None else "splits 'train' and 'val' (read once)"
    if size is not None and size <= budget:
        log(f"raylift: prep shuffles {what} whole ({size / 2**20:,.1f} MiB)")
        # One global shuffle offline, so each row group is a random sample of the data.
        return _preprocessed(task, ds, batch, rows).random_shuffle(seed=SHUFFLE_SEED)
    # Too big to shuffle whole in the object store: files (and blocks) in a random order,
    # then rows within windows of SHUFFLE_WINDOW. A reader that shuffles its files needs
    # nothing more and streams; else randomizing the blocks first reads the split whole.
    by_block = not reads_shuffled_files(ds)
    if by_block:
        ds = ds.randomize_block_order(seed=SHUFFLE_SEED)
    known = "not known before reading" if size is None else f"{size / 2**20:,.0f} MiB"
    order = "file and block" if by_block else "file (its reader shuffles the files)"
    log(
        f"raylift: prep shuffles {what} by {order}, then rows within "
        f"windows of {SHUFFLE_WINDOW:,}: a full shuffle needs it to be at most "
        f"{budget / 2**20:,.0f} MiB ({SHUFFLE_MEMORY_SHARE:.0%} of Ray's object store), "
        f"and its size is {known}"
    )
    return _preprocessed(task, ds, batch, rows).map_batches(
        _permute_rows, batch_format="numpy", batch_size=SHUFFLE_WINDOW
    )


def _preprocessed(
    task: Task,
    ds: ray.data.Dataset,
    batch: int,
    rows: RowSplit | None = None,
    permute: bool = False,
) -> ray.data.Dataset:
    # Each takes the task's preprocess as a keyword (its prints reach the console).
    fn: Any = _preprocess
    kwargs: dict[str, Any] = {"preprocess": task.preprocess}
    if rows is not None:
        fn = _preprocess_by_split
        kwargs |= {"key": rows.key, "percent": rows.val_percent, "outputs": bool(rows.outputs)}
        kwargs |= {"permute": permute}
    return ds.map_batches(fn, fn_kwargs=kwargs, batch_format="numpy", batch_size=batch)


def _preprocess_by_split(
    batch: Columns,
    preprocess: Any,
    key: str,
    percent: int,
    outputs: bool = False,
    permute: bool = False,
) -> Columns:
    """Each split's rows of ``batch`` preprocessed apart, marked with their split; with
    ``outputs``, each row preprocessed alone and its output rows parted (``val_outputs``).
    ``permute``: the output rows in a random order (the rows' windows mixed)."""
    parts = []
    if outputs:
        for i in range(num_rows(batch)):
            out = _preprocess({k: v[i : i + 1] for k, v in batch.items()}, preprocess)
            val = val_outputs(batch[key][i], num_rows(out), percent)
            for split, mask in (("train", ~val), ("val", val)):
                parts.append(_marked({k: v[mask] for k, v in out.items()}, split))
    else:
        val = val_rows(batch[key], percent)
        for split, mask in (("train", ~val), ("val", val)):
            if mask.any():
                out = _preprocess({k: v[mask] for k, v in batch.items()}, preprocess)
                parts.append(_marked(out, split))
    joined = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    return _permute_rows(joined) if permute else joined


def _marked(rows: Columns, split: str) -> Columns:
    return {**rows, SPLIT_COLUMN: np.full(num_rows(rows), split)}


def _preprocess(batch: Columns, preprocess: Any) -> Columns:
    """The task's preprocess in a Ray Data task: what it prints reaches the console."""
    console.route_ray_process()
    return preprocess(batch)


def _preprocess_permuted(batch: Columns, preprocess: Any) -> Columns:
    return _permute_rows(_preprocess(batch, preprocess))


def _permute_rows(batch: Columns) -> Columns:
    # Numpy, not Arrow's ``take``: on tensor columns numpy's row gather is ~7x faster.
    n = len(next(iter(batch.values())))
    # Seeded by the window's content, so a rerun of prep writes the same order.
    first = next(iter(batch.values()))[:1].tobytes()
    rng = np.random.default_rng([SHUFFLE_SEED, n, zlib.crc32(first)])
    order = rng.permutation(n)
    return {k: v[order] for k, v in batch.items()}


class Progress:
    """Prints how much of a split is written (rows, MiB, files, rates, ETA) every
    ``PROGRESS_EVERY_S`` while Ray Data writes it, and a summary when it is done.
    ``label`` names what is written ("split 'train'"); ``recursive``: in subfolders."""

    def __init__(
        self, folder: str, label: str, expected: int | None, log: Any, recursive: bool = False
    ):
        import threading

        self.folder, self.label, self.expected, self.log = folder, label, expected, log
        self.recursive = recursive
        self.rows_of: dict[str, int] = {}  # finished files' rows: each footer is read once
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.started = time.perf_counter()

    def __enter__(self) -> Progress:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        if exc[0] is None:
            files, size, rows = self.written()
            secs = time.perf_counter() - self.started
            self.log(
                f"raylift: prep wrote {self.label}: {rows:,} rows, {size / 2**20:,.1f} MiB "
                f"in {files} file(s), {secs:.1f} s ({size / 2**20 / max(secs, 1e-9):,.1f} "
                f"MiB/s, {rows / max(secs, 1e-9):,.0f} rows/s)"
            )

    def written(self) -> tuple[int, int, int]:
        """Files, bytes and rows under the folder so far (rows of finished files)."""
        import pyarrow.fs as pafs

        fs, base = filesystem(self.folder)
        try:
            selector = pafs.FileSelector(base, allow_not_found=True, recursive=self.recursive)
            infos = fs.get_file_info(selector)
        except OSError:  # listing an object store can fail transiently: report later
            return 0, 0, 0
        done = [i for i in infos if i.path.endswith(".parquet") and i.size is not None]
        rows = sum(self._rows(fs, i.path) for i in done)
        return len(done), sum(i.size for i in done), rows

    def _rows(self, fs: Any, path: str) -> int:
        if path not in self.rows_of:
            import pyarrow.parquet as pq

            try:
                self.rows_of[path] = pq.ParquetFile(fs.open_input_file(path)).metadata.num_rows
            except Exception:  # still being written: a parquet footer comes last
                return 0
        return self.rows_of[path]

    def _run(self) -> None:
        while not self.stop.wait(PROGRESS_EVERY_S):
            files, size, rows = self.written()
            secs = max(time.perf_counter() - self.started, 1e-9)
            rate = size / secs
            eta = ""
            if self.expected and size >= 2**20 and size < self.expected:  # a rate to go by
                eta = f", about {(self.expected - size) / rate:,.0f} s left"
            self.log(
                f"raylift: prep {self.label}: {rows:,} rows, {size / 2**20:,.1f} MiB in "
                f"{files} file(s) after {secs:.0f} s ({rate / 2**20:,.1f} MiB/s, "
                f"{rows / secs:,.0f} rows/s{eta})"
            )


# ---------------------------------------------------------------- for train


def shards_for_run(cfg: Config, task: Task, log: Any = print, connect: Any = None) -> Manifest:
    """The verified shards a run trains from, prepared once under storage when unnamed.

    A folder the user named in ``data.shards`` is never written by ``train``: when it
    is missing or stale the run stops before any worker starts and says to run prep.
    """
    root, fp = shard_root(cfg, task)
    if cfg.data.shards:
        return open_shards(root, fp)
    manifest = read_manifest(root)
    if manifest is not None:
        try:
            verify(manifest, fp)
            return manifest
        except ShardError as exc:
            log(f"raylift: {exc}; preparing them again")
    log(f"raylift: preparing the data once into {root} (`raylift prep` does this ahead of time)")
    return prep(cfg, task, root, force=manifest is not None, log=log, connect=connect).manifest


def cache_in_object_store(manifest: Manifest, log: Any = print) -> dict[str, list[Any]] | None:
    """``data.cache``: every shard file as an Arrow table in Ray's object store, if it fits."""
    import pyarrow.parquet as pq
    import ray

    need = manifest.memory()
    free = ray.available_resources().get("object_store_memory", 0.0)
    if need > 0.5 * free:  # leave room for everything else that lives there
        log(
            f"raylift: data.cache: the data takes {need / 2**30:.2f} GiB in memory, Ray's object "
            f"store has {free / 2**30:.2f} GiB free; streaming from the shard files instead "
            "(start Ray with a larger --object-store-memory, or set data.cache: false)"
        )
        return None
    fs, base = filesystem(manifest.root)
    refs = {
        split: [ray.put(pq.read_table(f"{base}/{f.path}", filesystem=fs)) for f in files]
        for split, files in manifest.splits.items()
    }
    log(f"raylift: data.cache: {need / 2**20:.1f} MiB of data held in Ray's object store")
    return refs
