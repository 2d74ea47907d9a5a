"""The manifest that vouches for a run's shards: per split, every parquet file with its
row groups and size, the schema, and a fingerprint of the task, its args and its code.
Written last by ``raylift prep`` (:mod:`raylift.data.shards`); training refuses shards
whose files or fingerprint do not match it."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
from typing import TYPE_CHECKING, Any

from raylift.core.config import Config
from raylift.core.storage import filesystem, join, resolve
from raylift.data.ingest import table_to_numpy
from raylift.tasks.base import Columns, Task

if TYPE_CHECKING:
    pass

FORMAT_VERSION = 1

MANIFEST = "_raylift_manifest.json"


class ShardError(ValueError):
    """Shards missing, incomplete or made for another task; the message says how to fix it."""


@dataclasses.dataclass(frozen=True)
class ShardFile:
    path: str  # relative to the shards folder
    rows: int
    bytes: int
    groups: tuple[int, ...]  # rows per row group, in file order
    memory: int = 0  # uncompressed bytes: what the file takes in memory


@dataclasses.dataclass(frozen=True)
class Manifest:
    root: str
    fingerprint: str
    splits: dict[str, tuple[ShardFile, ...]]
    schema: dict[str, str]

    def rows(self, split: str) -> int:
        return sum(f.rows for f in self.splits[split])

    def memory(self) -> int:
        return sum(f.memory for files in self.splits.values() for f in files)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "fingerprint": self.fingerprint,
            "schema": self.schema,
            "rows": {s: self.rows(s) for s in self.splits},
            "splits": {
                s: [dataclasses.asdict(f) for f in files] for s, files in self.splits.items()
            },
        }

    @classmethod
    def from_json(cls, root: str, data: dict[str, Any]) -> Manifest:
        splits = {
            s: tuple(
                ShardFile(f["path"], f["rows"], f["bytes"], tuple(f["groups"]), f["memory"])
                for f in fs
            )
            for s, fs in data["splits"].items()
        }
        return cls(root, data["fingerprint"], splits, data["schema"])


def task_fingerprint(cfg: Config, task: Task) -> str:
    """Changes whenever the prepared rows could: the task, its args, its code, the format,
    and the raw data where the task can say what version of it it reads
    (``data_version()``: the built-in tasks digest their files' paths, sizes and mtimes)."""
    try:
        code = inspect.getsource(type(task))
    except (OSError, TypeError):  # no source on disk: fall back to the class's name
        code = type(task).__qualname__
    version = getattr(task, "data_version", None)
    blob = json.dumps(
        {
            "format": FORMAT_VERSION,
            "task": cfg.task,
            "task_args": cfg.task_args,
            "code": code,
            "data": version() if callable(version) else None,
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def default_location(cfg: Config, fp: str) -> str:
    """Where shards live when ``data.shards`` is unset: beside the runs, keyed by fingerprint."""
    return join(cfg.storage, "shards", f"{_slug(cfg.task)}-{fp[:12]}")


def shard_root(cfg: Config, task: Task) -> tuple[str, str]:
    """The run's shards folder (``data.shards``, else the default one) and its fingerprint."""
    fp = task_fingerprint(cfg, task)
    return cfg.data.shards or default_location(cfg, fp), fp


def _slug(task: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in task).strip("-")


def read_manifest(root: str) -> Manifest | None:
    """The manifest under ``root``, or None when there is none (never prepared, or cut off)."""
    import pyarrow.fs as pafs

    fs, base = filesystem(root)
    info = fs.get_file_info(f"{base}/{MANIFEST}")
    if info.type != pafs.FileType.File:
        return None
    with fs.open_input_stream(f"{base}/{MANIFEST}") as f:
        data = json.loads(f.read().decode())
    if data.get("format") != FORMAT_VERSION:
        return None
    # Absolute, so Ray workers in other folders (or on other nodes, over NFS) find it.
    return Manifest.from_json(resolve(root), data)


def verify(manifest: Manifest, fp: str | None) -> None:
    """Every file present at its recorded size, and made for this task; else ShardError."""
    import pyarrow.fs as pafs

    root = manifest.root
    if fp is not None and manifest.fingerprint != fp:
        raise ShardError(
            f"data.shards: {root} was prepared for another task, task_args, task code or "
            "raw data; run `raylift prep CONFIG --force` to prepare it again"
        )
    fs, base = filesystem(root)
    files = [f for fs_ in manifest.splits.values() for f in fs_]
    infos = fs.get_file_info([f"{base}/{f.path}" for f in files])
    for f, info in zip(files, infos, strict=True):
        if info.type != pafs.FileType.File:
            problem = "is missing"
        elif info.size != f.bytes:
            problem = f"has {info.size} bytes, the manifest says {f.bytes} (truncated?)"
        else:
            continue
        raise ShardError(
            f"data.shards: {root}/{f.path} {problem}; run `raylift prep CONFIG --force` "
            "to prepare the shards again"
        )


def open_shards(root: str, fp: str | None) -> Manifest:
    """The verified manifest of ``root``; ShardError with the fix when it cannot be used."""
    manifest = read_manifest(root)
    if manifest is None:
        raise ShardError(
            f"data.shards: no prepared shards at {root} (folder or its manifest missing); "
            "run `raylift prep CONFIG` first, or remove data.shards to prepare them "
            "automatically under storage/shards"
        )
    verify(manifest, fp)
    return manifest


def scan(root: str, fp: str, splits: list[str], prefix: str = "") -> Manifest:
    """Read back every file's footer: the manifest records what is really on disk (under
    ``root``'s folder ``prefix``, paths relative to ``root``)."""
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    fs, base = filesystem(root)
    found: dict[str, tuple[ShardFile, ...]] = {}
    schema: dict[str, str] = {}
    for split in splits:
        folder = f"{base}/{prefix}/{split}" if prefix else f"{base}/{split}"
        infos = fs.get_file_info(pafs.FileSelector(folder))
        files = []
        for info in sorted((i for i in infos if i.path.endswith(".parquet")), key=lambda i: i.path):
            with fs.open_input_file(info.path) as f:
                meta = pq.ParquetFile(f).metadata
                schema = schema or {
                    field.name: str(field.type) for field in pq.ParquetFile(f).schema_arrow
                }
            groups = [meta.row_group(i) for i in range(meta.num_row_groups)]
            rel = info.path[len(base) + 1 :]
            rows = tuple(g.num_rows for g in groups)
            memory = sum(g.total_byte_size for g in groups)
            files.append(ShardFile(rel, meta.num_rows, info.size, rows, memory))
        if not any(f.rows for f in files):
            raise ValueError(f"task: split {split!r} is empty after preprocessing")
        found[split] = tuple(f for f in files if f.rows)
    return Manifest(root, fp, found, schema)


def write_manifest(root: str, manifest: Manifest) -> None:
    fs, base = filesystem(root)
    with fs.open_output_stream(f"{base}/{MANIFEST}") as f:
        f.write(json.dumps(manifest.to_json(), indent=1).encode())


def head(manifest: Manifest, split: str, rows: int) -> Columns:
    """The first ``rows`` rows of a split's shards (fewer where it has fewer), as numpy
    columns: read a row group at a time, from the first file on."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray.data  # noqa: F401  registers Ray's tensor column type with pyarrow

    tables: list[Any] = []
    for shard in manifest.splits.get(split, ()):
        fs, path = filesystem(join(manifest.root, shard.path))
        reader = pq.ParquetFile(fs.open_input_file(path))
        for group in range(reader.num_row_groups):
            tables.append(reader.read_row_group(group))
            if sum(len(t) for t in tables) >= rows:
                return table_to_numpy(pa.concat_tables(tables).slice(0, rows))
    return table_to_numpy(pa.concat_tables(tables)) if tables else {}


def column_total(manifest: Manifest, column: str) -> int:
    """The sum of a numeric column over every shard of every split, that column alone read."""
    import pyarrow.parquet as pq

    total = 0
    for files in manifest.splits.values():
        for shard in files:
            fs, path = filesystem(join(manifest.root, shard.path))
            total += kept_rows(pq.ParquetFile(fs.open_input_file(path)), column)
    return total


def kept_rows(shard: Any, column: str | None) -> int:
    if column is None:
        return int(shard.metadata.num_rows)
    return int(shard.read(columns=[column]).column(0).to_numpy().sum())
