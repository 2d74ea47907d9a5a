"""Where runs, checkpoints and shards live: a local folder or a URI (s3://, gs://, ...).

Every read, write and listing goes through a pyarrow filesystem, the same code for a
local folder (an NFS mount included) and an object store: a URI is never a second
class path. Paths are strings throughout; a URI keeps its scheme in everything raylift
prints. Checkpoints and pretrained weights are read in ranges where they are
(:mod:`raylift.tensors.checkpoints`, :class:`Ranges`), never fetched whole first.
An object store's filesystem retries what a retry can fix (:mod:`raylift.core.stores`);
what it cannot fix stops the command with one line (:func:`reaching`).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from raylift.core import hub, stores

if TYPE_CHECKING:
    import pyarrow.fs

CHUNK = 64 << 20  # bytes read at a time when streaming an object (checksums): few requests
# ... and a local file: a buffer that stays in the CPU's cache while it is hashed. Read
# 64 MiB at a time, a 572 MiB torch.save file went through memory and hashed at 1.4 GB/s
# on the 2-core EPYC; 1 MiB at a time, at 10 GB/s.
LOCAL_CHUNK = 1 << 20
T = TypeVar("T")


class StorageError(OSError):
    """The store failed mid-run (a bucket gone, credentials revoked): one line that names
    the URI, the store's own message and the fix."""


def retried(path: str, operation: Callable[[], T], client_retries: bool = True) -> T:
    """``operation()``, tried again after a backoff where ``path`` is a URI and its error
    is one a retry can fix that the store's client did not try again itself (see
    :func:`raylift.core.stores.left_to_us`); any other error is raised at once."""
    return stores.retry(operation, client_retries, stores.attempts() if is_remote(path) else 1)


@contextlib.contextmanager
def reaching(uri: str, what: str, then: str | None = None) -> Iterator[None]:
    """Turn the store's error while doing ``what`` into a :class:`StorageError`; a full
    local disk keeps its own (the run's failure message names that one). ``then``: what
    to do once the store is put right (by default, rerun the command: a run resumes)."""
    try:
        yield
    except StorageError:
        raise
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise
        said = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), repr(exc))
        then = then or "rerun the same command: it resumes from the newest complete checkpoint"
        if stores.transient(exc):
            fix = f"the store kept failing for {stores.attempts()} tries; once it answers, {then}"
        else:
            fix = (
                "check that it exists and that every node's credentials (AWS_*, "
                f"GOOGLE_APPLICATION_CREDENTIALS) can read and write it, then {then}"
            )
        raise StorageError(f"storage {uri}: {what} failed: {said}; {fix}") from exc


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
    """A pyarrow filesystem and the path in it, for local folders and URIs alike. An
    object store's is raylift's (:class:`~raylift.core.stores.Resilient`): it retries what
    a retry can fix, and it pickles as its URI, so a Ray worker that gets it builds its
    own from its node's environment."""
    import pyarrow.fs as pafs

    if not is_remote(path):
        return pafs.LocalFileSystem(), resolve(path)
    return stores.open_uri(str(path))


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
    if fs.get_file_info(where).type != pafs.FileType.File:
        return None
    with fs.open_input_stream(where) as f:
        return bytes(f.read())


def read_text(path: str) -> str | None:
    """The text at ``path`` (a local path or a URI); None where no file is there."""
    data = read_bytes(path)
    return None if data is None else data.decode()


def read_chunks(path: str, chunk: int | None = None) -> Iterator[bytes]:
    """The file's bytes ``chunk`` at a time (``CHUNK`` from an object store, ``LOCAL_CHUNK``
    from a local file): memory stays at one chunk, whatever its size."""
    if chunk is None:
        chunk = CHUNK if is_remote(path) else LOCAL_CHUNK
    fs, where = filesystem(path)
    with fs.open_input_stream(where) as f:
        while data := f.read(chunk):
            yield bytes(data)


class Ranges(contextlib.AbstractContextManager["Ranges"]):
    """The file at ``path`` open for ranged reads, each of which fetches from a store the
    bytes it asks for and no more: an object store's through its resilient file (a read
    broken mid-way resumes), a Hub file without fsspec's read-ahead
    (:func:`raylift.core.hub.open_exact`), a local file as it is."""

    def __init__(self, path: str):
        self.path = path
        if str(path).startswith(hub.SCHEME):
            self.file, self.client_retries = hub.open_exact(path), True
            return
        fs, where = filesystem(path)
        self.file, self.client_retries = fs.open_input_file(where), _client_retries(fs)

    def size(self) -> int:
        return int(self.file.size())

    def read(self, start: int, n: int) -> bytes:
        """The ``n`` bytes from ``start``, in one ranged read, tried again as
        :func:`retried` says (a store that answers short too)."""
        return retried(self.path, functools.partial(self._read, start, n), self.client_retries)

    def read_into(self, start: int, out: memoryview) -> None:
        """The ``len(out)`` bytes from ``start`` into ``out``, ``CHUNK`` at a time: host
        memory beyond ``out`` stays at one chunk."""
        for at in range(0, len(out), CHUNK):
            n = min(CHUNK, len(out) - at)
            out[at : at + n] = self.read(start + at, n)

    def _read(self, start: int, n: int) -> bytes:
        data = self.file.read_at(n, start)
        if len(data) != n:
            raise stores.ShortRead(f"{self.path}: {len(data)} of {n} bytes read at {start}")
        return bytes(data)

    def close(self) -> None:
        self.file.close()

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` to ``path``, replacing what was there; the folder is made if missing."""
    fs, where = filesystem(path)

    def write() -> None:
        fs.create_dir(where.rsplit("/", 1)[0], recursive=True)
        with fs.open_output_stream(where) as out:
            out.write(data)

    retried(path, write, _client_retries(fs))  # a write cut off is written again, whole


def _client_retries(fs: Any) -> bool:
    handler = getattr(fs, "handler", None)
    return handler.client_retries if isinstance(handler, stores.Resilient) else True


def upload_folder(local: Path, dest: str) -> None:
    """Copy every file under the local folder ``local`` to ``dest`` (a folder or a URI),
    in parallel; all again where an object store failed it as :func:`retried` says."""
    import pyarrow.fs as pafs

    fs, where = filesystem(dest)

    def copy() -> None:
        fs.create_dir(where, recursive=True)
        pafs.copy_files(str(local), where, destination_filesystem=fs, use_threads=True)

    retried(dest, copy, _client_retries(fs))


def bytes_under(folder: Path) -> int:
    """The bytes of every file under a local folder."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` (a local path or a URI), replacing what was there."""
    write_bytes(path, text.encode())


def delete(path: str) -> None:
    """Remove the file at ``path``; nothing happens where there is none."""
    fs, where = filesystem(path)
    with contextlib.suppress(FileNotFoundError):
        fs.delete_file(where)


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


# Every prefix of the temporary folders raylift fills with model-sized data, whatever its
# version: a killed process (SIGKILL, the OOM killer) leaves its own behind.
SCRATCH = ("ckpt", "copy", "ds-universal", "ds-names", "ds", "weights", "model", "artifact")
UNNAMED_STALE_S = 24 * 3600  # a left folder of a naming with no pid in it, untouched this long


def size_text(n: float) -> str:
    """Bytes as a person reads them: KiB below a MiB, MiB below a GiB, then GiB."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1024:.1f} KiB"


def scratch(kind: str) -> tempfile.TemporaryDirectory[str]:
    """A temporary folder named by this process (``raylift-<kind>-<pid>-...``), so that
    :func:`sweep_scratch` can tell it from a live one's once the process is killed."""
    return tempfile.TemporaryDirectory(prefix=f"raylift-{kind}-{os.getpid()}-")


def scratch_dir(kind: str) -> Path:
    """A folder named as :func:`scratch`'s, that outlives the block that made it (a
    checkpoint's part, uploaded by a thread): its user removes it."""
    return Path(tempfile.mkdtemp(prefix=f"raylift-{kind}-{os.getpid()}-"))


def sweep_scratch(root: Path | None = None) -> tuple[list[Path], int]:
    """Remove what ended raylift processes left in ``root`` (the temp folder): folders
    named by a process that is gone, and ones of an older naming (no pid) that nothing
    has touched for a day. The removed folders and the bytes freed."""
    root = root or Path(tempfile.gettempdir())
    removed, freed = [], 0
    for folder in sorted(root.glob("raylift-*")):
        try:
            if not (folder.is_dir() and _left(folder.name, folder)):
                continue
            files = [p for p in folder.rglob("*") if p.is_file() and not p.is_symlink()]
            size = sum(p.stat().st_size for p in files)
        except OSError:  # the node's other workers sweep at the same time: one removed it
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
        freed += size
    return removed, freed


def _left(name: str, folder: Path) -> bool:
    # Longest first: "ds-names" is not "ds" followed by a pid.
    kind = next(
        (k for k in sorted(SCRATCH, key=len, reverse=True) if name.startswith(f"raylift-{k}-")),
        None,
    )
    if kind is None:
        return False
    rest = name.removeprefix(f"raylift-{kind}-")
    pid, _, tail = rest.partition("-")
    if pid.isdigit() and tail:
        return not _alive(int(pid))
    times = [p.stat().st_mtime for p in folder.rglob("*")] + [folder.stat().st_mtime]
    return time.time() - max(times) > UNNAMED_STALE_S


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
