"""An object store's passing failures, and raylift's filesystem over a store, which
retries what a retry can fix.

Object stores fail a share of requests and recover: they throttle (S3's ``503 SlowDown``),
answer 5xx, cut a connection mid-response. Each failure is retried once, by the layer that
can: every request by the store's own client (S3's is built here with ``ATTEMPTS`` tries
and AWS's standard backoff, as ``FileSystem.from_uri`` cannot build it), and a read that
breaks mid-way where that client gives up on it, by the file :class:`Resilient` opens,
which resumes at the first byte not yet delivered. Nothing else is tried again: a missing
bucket or key and a refused credential stop at once, with the store's own words. boto3
(MLflow's artifacts in S3) gets the same settings through :func:`client_retries_env`.
"""

from __future__ import annotations

import configparser
import contextlib
import errno
import functools
import os
import random
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from raylift.core import hub

if TYPE_CHECKING:
    import pyarrow.fs

# Tries of one request to an object store (the first included), by its client's own retry
# strategy, and of one read that breaks mid-way, by raylift's: AWS_MAX_ATTEMPTS where the
# environment sets it. AWS's own default, 3, fails about one request in 37,000 outright
# when 3% are throttled: a long run makes that many.
ATTEMPTS = 10
MAX_BACKOFF_S = 20.0  # AWS's standard retry mode: a random wait below min(2^try, 20) s
T = TypeVar("T")


class ShortRead(OSError):
    """A store answered a read with fewer bytes than the file holds there."""


# ---------------------------------------------------------------- what a retry can fix

# The AWS SDK's names for errors that pass (pyarrow says "AWS Error <NAME> during <call>
# operation: ..."): throttling, the service failing or unreachable, a connection cut.
_PASSING = {"SLOW_DOWN", "THROTTLING", "SERVICE_UNAVAILABLE", "INTERNAL_FAILURE",
            "NETWORK_CONNECTION", "REQUEST_TIMEOUT", "REQUEST_TIMEOUT_EXCEPTION"}  # fmt: skip
_AWS = re.compile(r"AWS Error (\w+)(?: \(HTTP status (\d+)\))?")
# A throttled or failed answer to a ranged read whose error document does not fit the
# read's buffer: the AWS SDK reports INTERNAL_FAILURE with this and marks it final, so
# its client never tries it again; nor does it a read that came back short.
_CLIENT_GIVES_UP = ("Failed to flush response stream",)


def transient(exc: BaseException) -> bool:
    """Whether ``exc`` is a store's passing failure, which the same request may well not
    meet again: throttling (S3's SlowDown, HTTP 429), a 5xx answer, a connection refused,
    reset or timed out, a response cut off mid-body. A missing bucket or key, a refused
    credential (403), any other 4xx, a full disk and whatever this cannot name are not."""
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError,
                        NotADirectoryError)):  # fmt: skip
        return False
    if isinstance(exc, (ConnectionError, TimeoutError, ShortRead)):
        return True
    if not isinstance(exc, OSError) or exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
        return False
    said = str(exc)
    if any(s in said for s in _CLIENT_GIVES_UP):
        return True
    named = _AWS.search(said)
    if named is None:
        return False
    name, status = named.groups()
    if status is not None:
        return int(status) >= 500 or int(status) in (408, 429)
    return name in _PASSING


def retried_by_client(fs: Any) -> bool:
    """Whether ``fs`` retries its own requests on a passing error, with a backoff (the S3
    filesystem raylift builds does; others are retried here in full)."""
    import pyarrow.fs as pafs

    return isinstance(fs, pafs.S3FileSystem)


def left_to_us(exc: BaseException, client_retries: bool) -> bool:
    """Whether raylift should try again after ``exc``: a passing failure that the store's
    client did not already try again (and give up on) itself."""
    if not transient(exc):
        return False
    # Python's own connection errors never went through the client's retries.
    return (
        not client_retries
        or isinstance(exc, (ShortRead, ConnectionError, TimeoutError))
        or any(s in str(exc) for s in _CLIENT_GIVES_UP)
    )


def attempts() -> int:
    """Tries of one request or read: ``AWS_MAX_ATTEMPTS`` (or the AWS config file's
    ``max_attempts``) where set, else ``ATTEMPTS``."""
    said = os.environ.get("AWS_MAX_ATTEMPTS") or _aws_config().get("max_attempts", "")
    try:
        return max(1, int(said))
    except ValueError:
        return ATTEMPTS


def backoff(tried: int) -> float:
    """Seconds to wait before the next try, after ``tried`` tries: AWS's standard backoff
    (full jitter), so that many readers throttled at once do not come back together."""
    return random.random() * min(2.0 ** (tried - 1), MAX_BACKOFF_S)


def retry(operation: Callable[[], T], client_retries: bool, tries: int | None = None) -> T:
    """``operation()``, tried again after a backoff, ``tries`` times in all (``attempts()``
    by default), where its error is one that :func:`left_to_us` says raylift should try
    again; any other error is raised at once."""
    tries, tried = tries or attempts(), 1
    while True:
        try:
            return operation()
        except OSError as exc:
            if tried >= tries or not left_to_us(exc, client_retries):
                raise
        time.sleep(backoff(tried))
        tried += 1


def client_retries_env() -> dict[str, str]:
    """What boto3 (MLflow's artifacts in S3) needs to retry as pyarrow's client does: AWS's
    standard mode, ``ATTEMPTS`` tries. Only what neither the environment nor the AWS
    config file sets already: a user's own setting stands."""
    wanted = {"AWS_RETRY_MODE": ("retry_mode", "standard"),
              "AWS_MAX_ATTEMPTS": ("max_attempts", str(ATTEMPTS))}  # fmt: skip
    configured = _aws_config()
    return {
        var: value
        for var, (key, value) in wanted.items()
        if var not in os.environ and key not in configured
    }


def _aws_config() -> dict[str, str]:
    """The AWS config file's settings for the profile in use (none where there is no file)."""
    path = Path(os.environ.get("AWS_CONFIG_FILE", "~/.aws/config")).expanduser()
    profile = os.environ.get("AWS_PROFILE", "default")
    parser = configparser.RawConfigParser()
    with contextlib.suppress(OSError, configparser.Error):
        parser.read(path)
    for section in (profile, f"profile {profile}"):
        if parser.has_section(section):
            return dict(parser.items(section))
    return {}


def open_uri(path: str) -> tuple[pyarrow.fs.FileSystem, str]:
    """raylift's filesystem for the URI ``path`` (``scheme://bucket/key...``), and the path
    in it; pyarrow's own for a ``file://`` URI or one with options (``?...``)."""
    import pyarrow.fs as pafs

    scheme, rest = path.split("://", 1)
    if scheme == "file" or "?" in rest:  # a local path; options only pyarrow reads
        return pafs.FileSystem.from_uri(path)
    if scheme == "hf":  # the Hugging Face Hub: huggingface_hub's filesystem, its retries
        return pafs.PyFileSystem(pafs.FSSpecHandler(hub.filesystem())), rest.rstrip("/")
    bucket, _, key = rest.partition("/")
    where = f"{bucket.rpartition('@')[2]}/{key}".rstrip("/")
    if scheme != "s3":
        where = pafs.FileSystem.from_uri(path)[1]
    return pafs.PyFileSystem(Resilient(f"{scheme}://{bucket}")), where


def native(root: str) -> pyarrow.fs.FileSystem:
    """pyarrow's own filesystem for ``scheme://bucket``, one per process and environment
    (an S3 client takes ~20 ms to build). S3's is built here, as ``from_uri`` builds it
    (``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``, the bucket's region where no endpoint
    is set, the default credential chain or the URI's key), with a retry strategy of
    ``attempts()`` tries that ``from_uri`` cannot take; others are ``from_uri``'s."""
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_")))
    return _native(root, env, os.getpid())


@functools.lru_cache(maxsize=32)
def _native(root: str, env: tuple[tuple[str, str], ...], pid: int) -> pyarrow.fs.FileSystem:
    import pyarrow.fs as pafs

    scheme, bucket = root.split("://", 1)
    if scheme != "s3":
        return pafs.FileSystem.from_uri(root)[0]
    vars_ = dict(env)
    user, _, bucket = bucket.rpartition("@")
    options: dict[str, Any] = {}
    if user:
        key, _, secret = user.partition(":")
        options.update(access_key=key, secret_key=secret)
    endpoint = vars_.get("AWS_ENDPOINT_URL_S3") or vars_.get("AWS_ENDPOINT_URL")
    if endpoint:
        options["endpoint_override"] = endpoint
    else:
        options["region"] = _region(bucket)
    strategy = pafs.AwsStandardS3RetryStrategy(max_attempts=attempts())
    return pafs.S3FileSystem(**options, retry_strategy=strategy)


@functools.lru_cache(maxsize=64)
def _region(bucket: str) -> str:
    """The bucket's region, as ``from_uri`` finds it (one request, kept for the process)."""
    import pyarrow.fs as pafs

    return str(retry(lambda: pafs.resolve_s3_region(bucket), client_retries=False))


class Resilient:
    """A pyarrow ``FileSystemHandler`` over the object store ``root`` (``scheme://bucket``):
    every call is its client's, tried again where :func:`left_to_us` says so, and every
    file opened for reading is a :class:`Resuming` one. Pickled, it is its root: the
    process that unpickles it builds its own client, from its own environment. (Registered
    as a handler when first used: ``import raylift`` loads no pyarrow.)"""

    def __init__(self, root: str):
        import pyarrow.fs as pafs

        pafs.FileSystemHandler.register(Resilient)  # also where it was unpickled, before use
        self.root = root
        self.fs = native(root)
        self.client_retries = retried_by_client(self.fs)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Resilient, (self.root,))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Resilient) and other.root == self.root

    def __hash__(self) -> int:
        return hash(self.root)

    def call(self, operation: Callable[[], T]) -> T:
        return retry(operation, self.client_retries)

    def get_type_name(self) -> str:
        return str(self.fs.type_name)

    def normalize_path(self, path: str) -> str:
        return str(self.fs.normalize_path(path))

    def get_file_info(self, paths: list[str]) -> list[Any]:
        return self.call(lambda: list(self.fs.get_file_info(paths)))

    def get_file_info_selector(self, selector: Any) -> list[Any]:
        return self.call(lambda: list(self.fs.get_file_info(selector)))

    def create_dir(self, path: str, recursive: bool) -> None:
        self.call(lambda: self.fs.create_dir(path, recursive=recursive))

    def delete_dir(self, path: str) -> None:
        self.call(lambda: self.fs.delete_dir(path))

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self.call(lambda: self.fs.delete_dir_contents(path, missing_dir_ok=missing_dir_ok))

    def delete_root_dir_contents(self) -> None:
        self.call(lambda: self.fs.delete_dir_contents("/", accept_root_dir=True))

    def delete_file(self, path: str) -> None:
        self.call(lambda: self.fs.delete_file(path))

    def move(self, src: str, dest: str) -> None:
        self.call(lambda: self.fs.move(src, dest))

    def copy_file(self, src: str, dest: str) -> None:
        self.call(lambda: self.fs.copy_file(src, dest))

    def open_input_stream(self, path: str) -> Any:
        return self.open_input_file(path)

    def open_input_file(self, path: str) -> Any:
        import pyarrow as pa

        return pa.PythonFile(Resuming(self, path), mode="r")

    def open_output_stream(self, path: str, metadata: Any) -> Any:
        # A write broken mid-way cannot resume: its caller writes it again (write_bytes).
        return self.call(lambda: self.fs.open_output_stream(path, metadata=metadata))

    def open_append_stream(self, path: str, metadata: Any) -> Any:
        return self.call(lambda: self.fs.open_append_stream(path, metadata=metadata))


class Resuming:
    """A file in an object store, open for reading (seekable, as pyarrow's ``PythonFile``
    wants it), whose every read is whole: one that breaks mid-way (an answer cut off, a
    throttled one the client will not try again, a short one) is tried again from the
    first byte not yet delivered, after a backoff, with the file opened anew; bytes
    already delivered are not fetched again. Errors no retry can fix are raised at once."""

    def __init__(self, store: Resilient, path: str):
        self.store, self.path = store, path
        self._file: Any = store.call(lambda: store.fs.open_input_file(path))
        self._size = int(self._file.size())
        self._pos = 0
        self.closed = False

    def read(self, n: int | None = -1) -> bytes:
        end = self._size if n is None or n < 0 else min(self._size, self._pos + n)
        parts: list[bytes] = []
        tried = 0
        while self._pos < end:
            try:
                data = self._fetch(end - self._pos)
            except OSError as exc:
                tried += 1
                if tried >= attempts() or not left_to_us(exc, self.store.client_retries):
                    raise
                time.sleep(backoff(tried))
                self._file = None  # opened anew: a client in a bad state is not reused
                continue
            parts.append(data)
            self._pos += len(data)
            tried = 0  # it moved on: each stall has its own tries
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _fetch(self, n: int) -> bytes:
        if self._file is None:
            self._file = self.store.fs.open_input_file(self.path)
        data = bytes(self._file.read_at(n, self._pos))
        if not data:
            raise ShortRead(
                f"{self.store.root}: {self.path} returned no bytes at {self._pos} of {self._size}"
            )
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def size(self) -> int:
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        self.closed = True
