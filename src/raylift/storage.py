"""Where runs, checkpoints and shards live: a local folder or a URI (s3://, gs://, ...).

Every place that must tell the two apart, or turn a path into something Ray,
pyarrow or a worker in another folder can use, asks here.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyarrow.fs


def is_remote(path: str) -> bool:
    """True for a URI (``scheme://...``), which Ray and pyarrow open; False for a local path."""
    return "://" in path


def resolve(path: str) -> str:
    """An absolute local path, ``~`` expanded, so Ray and workers in other folders agree
    on it; URIs pass through unchanged."""
    if is_remote(path):
        return path
    return str(Path(path).expanduser().resolve())


def local_path(path: str) -> Path | None:
    """The resolved local folder, or None for a URI (nothing on this machine to write to)."""
    return None if is_remote(path) else Path(resolve(path))


def join(base: str, *parts: str) -> str:
    """``base/part/...``: URIs joined with ``/`` as they are, local paths made absolute."""
    if is_remote(base):
        return "/".join([base.rstrip("/"), *parts])
    return str(Path(resolve(base)).joinpath(*parts))


def as_uri(path: str, like: str) -> str:
    """A path a pyarrow filesystem listed under ``like``, as a URI again when ``like`` is one
    (listings drop the scheme; Ray Data's readers and other nodes need it back)."""
    if is_remote(like) and not is_remote(path):
        return like.split("://", 1)[0] + "://" + path
    return path


def filesystem(path: str) -> tuple[pyarrow.fs.FileSystem, str]:
    """A pyarrow filesystem and the path in it, for local folders and URIs alike."""
    import pyarrow.fs as pafs

    if is_remote(path):
        return pafs.FileSystem.from_uri(path)
    return pafs.LocalFileSystem(), resolve(path)


def write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` (a local path or a URI), replacing what was there."""
    fs, where = filesystem(path)
    fs.create_dir(where.rsplit("/", 1)[0], recursive=True)
    with fs.open_output_stream(where) as out:
        out.write(text.encode())


def read_text(path: str) -> str | None:
    """The text at ``path`` (a local path or a URI); None where no file is there."""
    import pyarrow.fs as pafs

    fs, where = filesystem(path)
    if fs.get_file_info(where).type != pafs.FileType.File:
        return None
    with fs.open_input_stream(where) as f:
        return bytes(f.read()).decode()
