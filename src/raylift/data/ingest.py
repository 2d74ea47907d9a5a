"""Per-worker batch streams that can resume mid-epoch, at any world size.

Each epoch has one global order of the train rows, fixed by ``(seed, epoch)`` and
independent of the number of workers: the row groups of the shards are permuted,
and the rows inside each group too. Global micro-batch ``k`` is rows
``[k*B, (k+1)*B)`` of that order, and rank ``r`` of ``W`` takes ``k = r, r+W, ...``.
The data position is therefore one number, the rows of the epoch consumed by all
ranks together: a restart, on the same or another world size, continues with the
first row nobody has trained on. Groups are read (parquet, or Ray's object store
with ``data.cache``) in a background thread that keeps ``prefetch_batches`` ready.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np
import torch

from raylift.core.storage import filesystem
from raylift.tasks.base import Batch

Columns = dict[str, np.ndarray]
# A task's host-side work per training batch (random augmentation), in the prefetch thread.
Transform = Callable[[Columns, np.random.Generator], Columns]


class BatchSource(Protocol):
    rows_per_micro_batch: int  # global rows one micro-batch step consumes (B x world)

    def micro_batches_per_epoch(self) -> int:
        """Training batches each rank gets in a whole epoch."""
        ...

    def remaining_micro_batches(self, start_row: int) -> int:
        """Batches each rank still gets in an epoch whose first ``start_row`` rows are done."""
        ...

    def train_batches(self, epoch: int, start_row: int) -> Iterator[Batch]: ...

    def eval_batches(self) -> Iterator[Batch]: ...

    def regroup(self, index: int, count: int, group: int) -> None:
        """Read as reader ``index`` of ``count``, each taking the rows of ``group`` ranks:
        a tensor-parallel group's ranks then read the same batches, of ``group`` ranks'
        rows, in the order data parallel over ``count x group`` ranks reads them."""
        ...


def to_device(batch: Batch, device: torch.device) -> Batch:
    """Host -> device. On CUDA the batch comes from pinned memory, so the copy is asynchronous."""
    if device.type == "cpu":
        return batch
    return {k: v.to(device, non_blocking=device.type == "cuda") for k, v in batch.items()}


# ---------------------------------------------------------------- where groups come from


class GroupStore(Protocol):
    def group_rows(self, split: str) -> list[int]:
        """Rows of every row group of ``split``, in storage order."""
        ...

    def read(self, split: str, group: int) -> Columns: ...


class MemoryStore:
    """Columns already in memory, cut into groups: tests and single-process runs."""

    def __init__(self, splits: dict[str, Columns], group_rows: int = 128):
        self.splits, self.size = splits, group_rows

    def group_rows(self, split: str) -> list[int]:
        n = len(next(iter(self.splits[split].values())))
        return [min(self.size, n - i) for i in range(0, n, self.size)]

    def read(self, split: str, group: int) -> Columns:
        lo = group * self.size
        return {k: v[lo : lo + self.size] for k, v in self.splits[split].items()}


def column_to_numpy(column: Any) -> np.ndarray:
    """A pyarrow column (plain or Ray's tensor extension) as one numpy array."""
    array = column.combine_chunks() if hasattr(column, "combine_chunks") else column
    return np.asarray(array.to_numpy(zero_copy_only=False))


def table_to_numpy(table: Any) -> Columns:
    return {name: column_to_numpy(table.column(name)) for name in table.column_names}


class ParquetStore:
    """Row groups read from the shard files (local or remote) as they are needed."""

    def __init__(self, manifest: Any, open_files: int = 256):
        import ray.data  # noqa: F401  registers Ray's tensor column type with pyarrow

        self.manifest = manifest
        self.fs, self.base = filesystem(manifest.root)
        # (split, group) -> (file index, row group in the file)
        self.index = {
            split: [(fi, gi) for fi, f in enumerate(files) for gi in range(len(f.groups))]
            for split, files in manifest.splits.items()
        }
        self.handles: collections.OrderedDict[tuple[str, int], Any] = collections.OrderedDict()
        self.open_files = open_files

    def group_rows(self, split: str) -> list[int]:
        return [n for f in self.manifest.splits[split] for n in f.groups]

    def _file(self, split: str, fi: int) -> Any:
        import pyarrow.parquet as pq

        key = (split, fi)
        if key not in self.handles:
            path = f"{self.base}/{self.manifest.splits[split][fi].path}"
            self.handles[key] = pq.ParquetFile(self.fs.open_input_file(path))
            if len(self.handles) > self.open_files:
                self.handles.popitem(last=False)
        self.handles.move_to_end(key)
        return self.handles[key]

    def read(self, split: str, group: int) -> Columns:
        fi, gi = self.index[split][group]
        return table_to_numpy(self._file(split, fi).read_row_group(gi))


class ObjectStoreStore(ParquetStore):
    """``data.cache``: whole files held in Ray's object store, shared by a node's workers."""

    def __init__(self, manifest: Any, refs: dict[str, list[Any]]):
        super().__init__(manifest)
        self.refs = refs
        self.tables: dict[tuple[str, int], Any] = {}
        self.offsets = {
            split: [int(x) for f in files for x in np.cumsum((0, *f.groups))[:-1]]
            for split, files in manifest.splits.items()
        }

    def read(self, split: str, group: int) -> Columns:
        import ray

        fi, _ = self.index[split][group]
        if (split, fi) not in self.tables:
            self.tables[(split, fi)] = ray.get(self.refs[split][fi])  # zero-copy on this node
        rows = self.group_rows(split)[group]
        return table_to_numpy(self.tables[(split, fi)].slice(self.offsets[split][group], rows))


# ---------------------------------------------------------------- one epoch's order


@dataclasses.dataclass
class EpochOrder:
    """The global row order of one epoch: permuted groups, each with permuted rows."""

    sizes: list[int]  # rows per group, storage order
    seed: int
    epoch: int
    shuffle: bool = True

    def __post_init__(self) -> None:
        rng = np.random.default_rng([self.seed, self.epoch])
        n = len(self.sizes)
        self.groups = rng.permutation(n) if self.shuffle else np.arange(n)
        starts = np.concatenate([[0], np.cumsum([self.sizes[g] for g in self.groups])])
        self.starts: list[int] = [int(x) for x in starts]

    @property
    def total(self) -> int:
        return self.starts[-1]

    def pieces(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """(group, lo, hi) row ranges, in the epoch's order, that make up rows [start, stop)."""
        out = []
        i = bisect.bisect_right(self.starts, start) - 1
        while start < stop:
            g, g_start = int(self.groups[i]), self.starts[i]
            hi = min(stop, self.starts[i + 1])
            out.append((g, start - g_start, hi - g_start))
            start, i = hi, i + 1
        return out

    def row_perm(self, group: int) -> np.ndarray | None:
        """The order of ``group``'s rows this epoch: sorting hashed row ids, so any group's
        order is computed on its own, cheaply, from (seed, epoch, group) alone."""
        if not self.shuffle:
            return None
        ids = np.arange(self.sizes[group], dtype=np.uint64)
        key = np.uint64(((self.seed * 1_000_003 + self.epoch) * 1_000_003 + group) % 2**64)
        return np.argsort(_mix64(ids ^ _mix64(key)), kind="stable")


def _mix64(x: Any) -> Any:
    """splitmix64's finaliser: a fast, well-spread integer hash (wraps modulo 2**64)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


# ---------------------------------------------------------------- the source


class ShardSource:
    """This rank's micro-batches of the train split, and its part of the val split."""

    def __init__(
        self,
        store: GroupStore,
        rank: int,
        world_size: int,
        batch_size: int,
        eval_batch_size: int,
        seed: int,
        prefetch_batches: int = 4,
        pin_memory: bool = False,
        shuffle: bool = True,
        transform: Transform | None = None,
    ):
        self.store, self.rank, self.world = store, rank, world_size
        self.transform = transform
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.seed, self.shuffle = seed, shuffle
        self.prefetch, self.pin = prefetch_batches, pin_memory
        self.sizes = {s: store.group_rows(s) for s in ("train", "val")}
        self.train_rows = sum(self.sizes["train"])
        self.rows_per_micro_batch = batch_size * world_size
        val_rows = sum(self.sizes["val"])
        if val_rows < world_size:
            raise ValueError(f"data: the val split has {val_rows} rows, fewer than the workers")

    def micro_batches_per_epoch(self) -> int:
        return self.remaining_micro_batches(0)

    def regroup(self, index: int, count: int, group: int) -> None:
        # Batch k of reader i is rows [(k*count + i) * group*b, ...): exactly what ranks
        # i*group .. i*group + group-1 of count*group read at batch size b.
        self.rank, self.world = index, count
        self.batch_size *= group
        self.rows_per_micro_batch = self.batch_size * count

    def remaining_micro_batches(self, start_row: int) -> int:
        # Every rank gets the same count, so collectives line up; the tail is dropped.
        return max(self.train_rows - start_row, 0) // self.batch_size // self.world

    def train_batches(self, epoch: int, start_row: int = 0) -> Iterator[Batch]:
        order = EpochOrder(self.sizes["train"], self.seed, epoch, self.shuffle)
        first = start_row // self.batch_size + self.rank
        stop = first + self.remaining_micro_batches(start_row) * self.world
        b = self.batch_size
        spans = [(k * b, (k + 1) * b) for k in range(first, stop, self.world)]

        def read(reader: _Reader, span: tuple[int, int]) -> Columns:
            cols = reader.rows(order, *span)
            if self.transform is None:
                return cols
            # Seeded by the rows' place in the epoch: a resumed run, at any world size,
            # draws the same augmentation for the same rows.
            return self.transform(cols, np.random.default_rng([self.seed, epoch, span[0]]))

        return self._stream(read, spans)

    def eval_batches(self) -> Iterator[Batch]:
        """Every val row exactly once over all ranks, in the same number of batches per rank."""
        total = sum(self.sizes["val"])
        bounds = np.linspace(0, total, self.world + 1).astype(int)
        lo, hi = int(bounds[self.rank]), int(bounds[self.rank + 1])
        per_rank = int(np.diff(bounds).max())
        n = -(-per_rank // self.eval_batch_size)  # ceil: the same on every rank
        edges = np.linspace(lo, hi, n + 1).astype(int)
        order = EpochOrder(self.sizes["val"], self.seed, 0, shuffle=False)
        spans = [(int(a), int(b)) for a, b in itertools.pairwise(edges)]
        return self._stream(lambda reader, span: reader.rows(order, *span, split="val"), spans)

    def _stream(
        self, read: Callable[[_Reader, tuple[int, int]], Columns], spans: list[tuple[int, int]]
    ) -> Iterator[Batch]:
        reader = _Reader(self.store)

        def produce() -> Iterator[Batch]:
            for span in spans:
                yield self._tensors(read(reader, span))

        if self.prefetch == 0:
            return produce()
        return prefetched(produce(), self.prefetch)

    def _tensors(self, cols: Columns) -> Batch:
        # Arrow hands out read-only buffers; torch wants writable memory of its own.
        batch = {
            k: torch.from_numpy(v if v.flags.writeable else v.copy())
            for k, v in ((k, np.ascontiguousarray(v)) for k, v in cols.items())
        }
        if self.pin:
            batch = {k: v.pin_memory() for k, v in batch.items()}
        return batch


class _Reader:
    """Reads row ranges of an epoch order, keeping recently decoded groups."""

    def __init__(self, store: GroupStore, keep: int = 8):
        self.store, self.keep = store, keep
        self.cache: collections.OrderedDict[tuple[str, int, int], Columns] = (
            collections.OrderedDict()
        )

    def _group(self, order: EpochOrder, split: str, group: int) -> Columns:
        key = (split, order.epoch, group)
        if key not in self.cache:
            cols = self.store.read(split, group)
            perm = order.row_perm(group)
            self.cache[key] = cols if perm is None else {k: v[perm] for k, v in cols.items()}
            if len(self.cache) > self.keep:
                self.cache.popitem(last=False)
        self.cache.move_to_end(key)
        return self.cache[key]

    def rows(self, order: EpochOrder, start: int, stop: int, split: str = "train") -> Columns:
        parts = [
            {k: v[lo:hi] for k, v in self._group(order, split, g).items()}
            for g, lo, hi in order.pieces(start, stop)
        ]
        if len(parts) == 1:
            return parts[0]
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


_DONE = object()


def prefetched(items: Iterator[Any], depth: int) -> Iterator[Any]:
    """``items`` produced by a background thread, up to ``depth`` ahead of the consumer.

    Parquet decoding releases the GIL, so reading overlaps the training step.
    Errors in the producer are raised in the consumer; closing the consumer stops it.
    """
    q: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run() -> None:
        try:
            for item in items:
                if not put(item):
                    return
            put(_DONE)
        except BaseException as exc:  # handed to the consumer, raised there
            put(exc)

    thread = threading.Thread(target=run, name="raylift-prefetch", daemon=True)
    thread.start()
    try:
        while (item := q.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join(timeout=5)


class TensorSource(ShardSource):
    """In-memory columns in storage order (no shuffling): for single-process runs and tests."""

    def __init__(
        self,
        train: Columns | Batch,
        val: Columns | Batch,
        rank: int,
        world_size: int,
        batch_size: int,
        eval_batch_size: int,
    ):
        cols = {
            "train": {k: np.asarray(v) for k, v in train.items()},
            "val": {k: np.asarray(v) for k, v in val.items()},
        }
        super().__init__(
            MemoryStore(cols),
            rank,
            world_size,
            batch_size,
            eval_batch_size,
            seed=0,
            prefetch_batches=0,
            shuffle=False,
        )
