"""Where runs, checkpoints and shards live: a local folder or a URI (s3://, gs://, ...).

Every read, write and listing goes through a pyarrow filesystem, the same code for a
local folder (an NFS mount included) and an object store: a URI is never a second
class path. Paths are strings throughout; a URI keeps its scheme in everything raylift
prints. Only the engines' own loaders need files on this machine: :func:`local_copy`.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import pyarrow.fs

CHUNK = 64 << 20  # bytes read at a time when streaming a file (checksums, copies)
RETRIES = (0.2, 1.0)  # seconds before each further try of an object store's operation
T = TypeVar("T")


class StorageError(OSError):
    """The store failed mid-run (a bucket gone, credentials revoked): one line that names
    the URI, the store's own message and the fix."""


@contextlib.contextmanager
def reaching(uri: str, what: str) -> Iterator[None]:
    """Turn the store's error while doing ``what`` into a :class:`StorageError`; a full
    local disk keeps its own (the run's failure message names that one)."""
    import errno

    try:
        yield
    except StorageError:
        raise
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise
        said = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), repr(exc))
        raise StorageError(
            f"storage {uri}: {what} failed: {said}; check that it exists and that every "
            "node's credentials (AWS_*, GOOGLE_APPLICATION_CREDENTIALS) can write it, then "
            "rerun the same command: it resumes from the newest complete checkpoint"
        ) from exc


def retried(path: str, operation: Callable[[], T]) -> T:
    """``operation()``, tried again after a short wait where ``path`` is a URI: object
    stores answer a small share of requests with a transient error (seen here: S3's
    INTERNAL_FAILURE on a GetObject that the next try served)."""
    for wait in RETRIES if is_remote(path) else ():
        try:
            return operation()
        except OSError:
            time.sleep(wait)
    return operation()


def is_remote(path: str) -> bool:
    """True for a URI (``scheme://...``), which Ray and pyarrow open; False for a local path."""
    return "://" in str(path)


def resolve(path: str) -> str:
    """An absolute local path, ``~`` expanded, so Ray and workers in other folders agree
    on it; URIs pass through unchanged."""
    path = str(path)
    if is_remote(path):
        return path
    return str(Path(path).expanduser().resolve())


def local_path(path: str) -> Path | None:
    """The resolved local folder, or None for a URI (nothing on this machine to write to)."""
    return None if is_remote(path) else Path(resolve(path))


def join(base: str, *parts: str) -> str:
    """``base/part/...``: URIs joined with ``/`` as they are, local paths made absolute."""
    if is_remote(base):
        return "/".join([str(base).rstrip("/"), *parts])
    return str(Path(resolve(base)).joinpath(*parts))


def name(path: str) -> str:
    """The last component: ``checkpoint-step00000100`` of ``s3://b/run/checkpoint-step...``."""
    return str(path).rstrip("/").rsplit("/", 1)[-1]


def parent(path: str) -> str:
    """The folder holding ``path``, a URI where ``path`` is one."""
    if is_remote(path):
        return str(path).rstrip("/").rsplit("/", 1)[0]
    return str(Path(resolve(path)).parent)


def as_uri(path: str, like: str) -> str:
    """A path a pyarrow filesystem listed under ``like``, as a URI again when ``like`` is one
    (listings and Ray's checkpoints drop the scheme; other nodes and the user need it)."""
    if is_remote(like) and not is_remote(path):
        scheme = like.split("://", 1)[0]
        if scheme == "file":  # file:///abs/path: the listing's path is absolute already
            return f"file://{path}"
        return f"{scheme}://" + str(path).lstrip("/")
    return str(path)


def filesystem(path: str) -> tuple[pyarrow.fs.FileSystem, str]:
    """A pyarrow filesystem and the path in it, for local folders and URIs alike."""
    import pyarrow.fs as pafs

    if is_remote(path):
        return pafs.FileSystem.from_uri(path)
    return pafs.LocalFileSystem(), resolve(path)


# ---------------------------------------------------------------- queries


def is_file(path: str) -> bool:
    import pyarrow.fs as pafs

    fs, where = filesystem(path)
    return bool(fs.get_file_info(where).type == pafs.FileType.File)


def is_dir(path: str) -> bool:
    """A folder, or an object store prefix that holds objects."""
    import pyarrow.fs as pafs

    fs, where = filesystem(path)
    return bool(fs.get_file_info(where).type == pafs.FileType.Directory)


def size(path: str) -> int | None:
    """The file's size in bytes; None where no file is there."""
    import pyarrow.fs as pafs

    fs, where = filesystem(path)
    info = fs.get_file_info(where)
    return int(info.size) if info.type == pafs.FileType.File else None


def mtime(path: str) -> float | None:
    """When the file was last written (the store's clock), in epoch seconds; None if absent."""
    import pyarrow.fs as pafs

    fs, where = filesystem(path)
    info = fs.get_file_info(where)
    if info.type != pafs.FileType.File or info.mtime is None:
        return None
    return float(info.mtime.timestamp())


def children(path: str, folders: bool = True) -> list[str]:
    """The names directly under ``path`` (folders, or files with ``folders=False``),
    sorted; [] where there is nothing."""
    import pyarrow.fs as pafs

    fs, where = filesystem(path)
    if fs.get_file_info(where).type != pafs.FileType.Directory:
        return []
    want = pafs.FileType.Directory if folders else pafs.FileType.File
    listed = fs.get_file_info(pafs.FileSelector(where, recursive=False))
    return sorted(info.base_name for info in listed if info.type == want)


def files_under(path: str) -> list[tuple[str, int]]:
    """Every file below ``path``, as (path relative to it with ``/``, size), sorted."""
    import pyarrow.fs as pafs

    fs, where = filesystem(path)
    if fs.get_file_info(where).type != pafs.FileType.Directory:
        return []
    root = where.rstrip("/") + "/"
    listed = fs.get_file_info(pafs.FileSelector(where, recursive=True))
    return sorted(
        (info.path[len(root) :], int(info.size))
        for info in listed
        if info.type == pafs.FileType.File
    )


# ---------------------------------------------------------------- reads and writes


def read_bytes(path: str) -> bytes | None:
    """The file's bytes; None where no file is there."""
    import pyarrow.fs as pafs

    fs, where = filesystem(path)

    def read() -> bytes | None:
        if fs.get_file_info(where).type != pafs.FileType.File:
            return None
        with fs.open_input_stream(where) as f:
            return bytes(f.read())

    return retried(path, read)


def read_text(path: str) -> str | None:
    """The text at ``path`` (a local path or a URI); None where no file is there."""
    data = read_bytes(path)
    return None if data is None else data.decode()


def read_chunks(path: str, chunk: int = CHUNK) -> Iterator[bytes]:
    """The file's bytes ``chunk`` at a time: memory stays at one chunk, whatever its size."""
    fs, where = filesystem(path)
    with fs.open_input_stream(where) as f:
        while data := f.read(chunk):
            yield bytes(data)


def write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` to ``path``, replacing what was there; the folder is made if missing."""
    fs, where = filesystem(path)

    def write() -> None:
        fs.create_dir(where.rsplit("/", 1)[0], recursive=True)
        with fs.open_output_stream(where) as out:
            out.write(data)

    retried(path, write)


def write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` (a local path or a URI), replacing what was there."""
    write_bytes(path, text.encode())


def delete(path: str) -> None:
    """Remove the file at ``path``; nothing happens where there is none."""
    fs, where = filesystem(path)

    def remove() -> None:
        with contextlib.suppress(FileNotFoundError):
            fs.delete_file(where)

    retried(path, remove)


def delete_dir_if_empty(path: str) -> None:
    """Remove the folder at ``path`` if nothing is in it (object stores hold no empty ones)."""
    import pyarrow.fs as pafs

    fs, where = filesystem(path)
    info = fs.get_file_info(where)
    if info.type == pafs.FileType.Directory and not fs.get_file_info(
        pafs.FileSelector(where, recursive=False)
    ):
        with contextlib.suppress(OSError):
            fs.delete_dir(where)


@contextlib.contextmanager
def local_copy(path: str) -> Iterator[Path]:
    """``path`` as a folder on this machine for the length of the block: itself where it
    is local, else a private copy in a temporary folder, removed after."""
    if not is_remote(path):
        yield Path(resolve(path))
        return
    import pyarrow.fs as pafs

    fs, where = filesystem(path)
    with tempfile.TemporaryDirectory(prefix="raylift-copy-") as tmp:
        pafs.copy_files(where, tmp, source_filesystem=fs, destination_filesystem=None)
        yield Path(tmp)
