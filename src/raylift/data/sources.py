"""A task's raw data per split, as ``Task.sources()`` returns it.

Two forms are accepted for each split:

- numpy columns of equal length: small data that fits in the driver (the digits set);
- a ``ray.data.Dataset`` built with any of Ray Data's readers (``read_parquet``,
  ``read_json``, ``read_text``, ``read_images``, ``read_binary_files``, ...), over local
  folders or ``s3://`` / ``gs://``: data of any size, read lazily and in parallel by
  the cluster. The driver never holds its rows.

Data with too few files to split by file (one large JSONL, say) can be given as one
:class:`RowSplit` for both splits: rows go to val by a hash of a key column, and prep
reads the data once for both. Data of a few long rows (one text file) can be split by
what ``preprocess`` makes of each row instead: its windows, each by a hash of the row's
key and the window's place (``RowSplit.outputs``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import zlib
from typing import TYPE_CHECKING, Any, Union

import numpy as np

from raylift.core.errors import SourceError
from raylift.core.storage import filesystem
from raylift.tasks.base import Columns

if TYPE_CHECKING:
    import ray.data

Source = Union[Columns, "ray.data.Dataset", "RowSplit"]
SPLITS = ("train", "val")
# Columns are cut into blocks of about this much data for Ray Data (at most 4 per CPU):
# every block is a task, and a task's worker process costs seconds to start.
BYTES_PER_BLOCK = 16 * 2**20
# A column ``preprocess`` may add: "" for a good row, else why the row's raw data could
# not be used (a corrupt image, say). Prep drops such rows, counts them and names some.
ERROR_COLUMN = "_error"
# The column a RowSplit's preprocessed rows carry to the write, which files them by it.
SPLIT_COLUMN = "_split"
FILE_SHUFFLE_SEED = 0


def in_val(key: bytes, percent: int) -> bool:
    """The train/val split: val for ``percent`` of keys, by a hash stable across machines."""
    return zlib.crc32(key) % 100 < percent


def files_version(infos: list[Any]) -> str:
    """A digest of files' paths, sizes and modification times (pyarrow ``FileInfo``s):
    what changes when a file of a corpus or image folder is added, removed or rewritten."""
    digest = hashlib.sha256()
    for info in sorted(infos, key=lambda i: i.path):
        digest.update(f"{info.path}\0{info.size}\0{info.mtime_ns}\n".encode())
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class RowSplit:
    """Both splits in one Dataset, read once: a row is val where the first 4 KiB of its
    ``key`` column hash below ``val_percent`` (:func:`in_val`), else train. For data with
    too few files to split by file, where a Dataset per split would read every file twice.
    ``sources()`` returns the same RowSplit for ``train`` and ``val``.

    With ``outputs`` (what ``preprocess`` makes of a row, named for messages: "window"),
    each row is preprocessed alone and its output rows go to val one by one, by a hash of
    the row's ``key`` and their place in its output (:func:`val_outputs`): for data of a
    few long rows, a text file each, too few to split whole. ``key`` then names each row
    uniquely (a file's path under the corpus), and ``dataset`` may be numpy columns."""

    dataset: Any  # a ray.data.Dataset, or numpy columns (small: a list of files)
    key: str
    val_percent: int
    what: str = "the data"  # for messages: "task_args.corpus /data/*.jsonl", say
    outputs: str = ""  # "": rows split whole; else the output rows' name, split one by one


def val_rows(keys: Any, percent: int) -> np.ndarray:
    """Which of ``keys`` (bytes or str values) are val rows under ``in_val``."""
    return np.fromiter(
        (in_val((k if isinstance(k, bytes) else str(k).encode())[:4096], percent) for k in keys),
        dtype=bool,
        count=len(keys),
    )


def val_outputs(key: Any, n: int, percent: int) -> np.ndarray:
    """Which of the ``n`` rows preprocessed from the row keyed ``key`` are val rows: by a
    hash of the key and each one's place, so the split is the same on every machine and
    in every file order, and any content (a file of one repeated line) splits."""
    prefix = (key if isinstance(key, bytes) else str(key).encode())[:4096] + b"\0"
    return np.fromiter((in_val(prefix + b"%d" % i, percent) for i in range(n)), dtype=bool, count=n)


def is_dataset(source: object) -> bool:
    import ray.data

    return isinstance(source, ray.data.Dataset)


def check_sources(sources: dict[str, Any]) -> None:
    """Both splits present, each a Dataset or numpy columns of one length."""
    missing = [s for s in SPLITS if s not in sources]
    if missing:
        raise SourceError(f"task: sources() must return 'train' and 'val' splits, lacks {missing}")
    if any(isinstance(sources[s], RowSplit) for s in SPLITS):
        if sources["train"] is not sources["val"]:
            raise SourceError(
                "task: a RowSplit holds both splits: return the same one for 'train' and 'val'"
            )
        return
    for split in SPLITS:
        source = sources[split]
        if is_dataset(source):
            continue
        if not isinstance(source, dict) or not source:
            raise SourceError(
                f"task: sources()[{split!r}] must be a ray.data.Dataset or a dict of numpy "
                f"columns, got {type(source).__name__}"
            )
        lengths = {k: len(v) for k, v in source.items()}
        if len(set(lengths.values())) > 1:
            raise SourceError(f"task: sources()[{split!r}] columns differ in length: {lengths}")


def as_dataset(source: Source, cpus: int, batch: int = 64) -> ray.data.Dataset:
    """``source`` as a Dataset; columns are cut into blocks of whole rows."""
    import ray.data

    if is_dataset(source):
        return source  # type: ignore[return-value]
    cols: Columns = source  # type: ignore[assignment]
    n = num_rows(cols)
    size = estimated_bytes(cols) or 0
    # Blocks by bytes, and at least one per 32 ``preprocess`` batches: rows that are
    # paths to files weigh little and cost much, and every CPU should get some.
    wanted = max(-(-size // BYTES_PER_BLOCK), -(-n // (32 * batch)))
    blocks = max(1, min(n, wanted, 4 * cpus))
    table = _arrow_table(cols)
    bounds = np.linspace(0, n, blocks + 1).astype(int)
    parts = [table.slice(a, b - a) for a, b in itertools.pairwise(bounds)]
    # Column blocks (arrow, tensors for n-d columns), not one Python dict per row.
    # ``from_blocks`` reads their metadata here; ``from_arrow`` runs a task per block for
    # it, and the first tasks of a job wait seconds for their worker processes to start.
    make = getattr(ray.data, "from_blocks", None) or ray.data.from_arrow
    return make(parts)


def num_rows(cols: Columns) -> int:
    return len(next(iter(cols.values())))


def permuted(cols: Columns, seed: int) -> Columns:
    """In-memory rows in a random order: a full shuffle without Ray's all-to-all."""
    order = np.random.default_rng(seed).permutation(num_rows(cols))
    return {k: np.asarray(v)[order] for k, v in cols.items()}


def read_bytes(path: str, limit: int | None = None) -> bytes:
    """A whole file, or its first ``limit`` bytes, local or in an object store
    (``s3://``, ``gs://``)."""
    if limit is not None and limit < 0:
        limit = None
    if "://" not in path:
        with open(path, "rb") as f:
            return f.read(-1 if limit is None else limit)

    fs, where = filesystem(path)
    with fs.open_input_stream(where) as stream:
        return bytes(stream.read(limit))


def _arrow_table(cols: Columns) -> Any:
    import pyarrow as pa
    from ray.data.extensions import ArrowTensorArray

    arrays = {}
    for name, column in cols.items():
        column = np.asarray(column)
        multi = column.ndim > 1
        arrays[name] = ArrowTensorArray.from_numpy(column) if multi else pa.array(column)
    return pa.table(arrays)


def estimated_bytes(source: Source) -> int | None:
    """In-memory size of the raw rows, when it is known without reading them."""
    if isinstance(source, RowSplit):
        if isinstance(source.dataset, dict):
            return None  # columns of paths, say: their size says nothing of the data's
        source = source.dataset
    if isinstance(source, dict):
        return int(sum(np.asarray(v).nbytes for v in source.values()))
    ds: Any = source
    try:
        # Metadata only (file sizes, parquet footers): it never executes the dataset.
        # Not a public API; its absence just means "unknown", never a wrong answer.
        size = ds._logical_plan.dag.infer_metadata().size_bytes
    except Exception:
        return None
    return int(size) if size is not None else None


def shuffled_files() -> Any:
    """The ``shuffle`` argument of Ray Data's file readers for a split prep should mix:
    files in a random order, the same on every run. Prep then streams the split instead
    of holding it whole to randomize its blocks (``reads_shuffled_files``)."""
    import ray.data

    return ray.data.FileShuffleConfig(seed=FILE_SHUFFLE_SEED, reseed_after_execution=False)


def reads_shuffled_files(ds: Any) -> bool:
    """True when every reader under ``ds`` reads its files in a shuffled order (``shuffle=
    "files"`` or a ``FileShuffleConfig``). Not a public API: unknown means False."""
    try:
        stack, reads = [ds._logical_plan.dag], []
        while stack:
            op = stack.pop()
            stack += op.input_dependencies
            if hasattr(op, "shuffle_config_factory"):  # Ray Data's listing-based readers
                reads.append(op.shuffle_config_factory() is not None)
            elif hasattr(op, "datasource"):
                reads.append(getattr(op.datasource, "_shuffle", None) is not None)
            elif not op.input_dependencies:  # in-memory blocks, or a reader of another kind
                reads.append(False)
        return bool(reads) and all(reads)
    except Exception:
        return False


def sample(source: Source, n: int) -> Columns:
    """The first ``n`` raw rows as numpy columns (a few rows are read, not the split)."""
    if isinstance(source, RowSplit):
        source = source.dataset
    if isinstance(source, dict):
        return {k: v[:n] for k, v in source.items()}
    ds: Any = source
    return dict(ds.take_batch(n, batch_format="numpy"))


class Skipped:
    """Rows ``preprocess`` marked bad, counted across the cluster: a Ray actor made by the
    first task that finds one, so a split with none starts no process for it."""

    def __init__(self) -> None:
        self.count = 0
        self.examples: list[str] = []

    def add(self, errors: list[str]) -> None:
        self.count += len(errors)
        self.examples += errors[: max(0, 5 - len(self.examples))]

    def summary(self) -> tuple[int, list[str]]:
        return self.count, self.examples

    @staticmethod
    def actor(name: str) -> Any:
        import ray

        # Detached: it outlives the task that made it; the driver ends it (``collect``).
        options = {"name": name, "get_if_exists": True, "lifetime": "detached", "num_cpus": 0}
        return ray.remote(Skipped).options(**options).remote()

    @staticmethod
    def collect(name: str) -> tuple[int, list[str]]:
        """What the tasks counted under ``name`` (nothing if no task found a bad row)."""
        import ray

        try:
            actor = ray.get_actor(name)
        except ValueError:
            return 0, []
        try:
            ref: Any = actor.summary.remote()
            summary: tuple[int, list[str]] = ray.get(ref)
        finally:
            ray.kill(actor)
        return summary


def drop_bad_rows(batch: Any, skipped: str) -> Any:
    """An Arrow batch without the rows its ``ERROR_COLUMN`` marks, which are counted under
    the name ``skipped``. Arrow in and out: a batch without the column passes untouched."""
    if ERROR_COLUMN not in batch.column_names:
        return batch
    import pyarrow.compute as pc
    import ray

    errors = batch.column(ERROR_COLUMN)
    bad = pc.not_equal(errors, "")
    batch = batch.drop_columns([ERROR_COLUMN])
    if not pc.any(bad).as_py():
        return batch  # the usual case: no copy
    # Rare: waiting for the count to land keeps it exact.
    ray.get(Skipped.actor(skipped).add.remote(errors.filter(bad).to_pylist()))
    return batch.filter(pc.invert(bad))
