"""An object store that fails as real ones do (tests/s3_faults.py, in front of the S3
server): what a retry can fix is retried once, by the layer that can, and a read that
breaks resumes where it broke; what no retry can fix stops at once, in one line."""

from __future__ import annotations

import errno
import os
import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest

from raylift.cli import main as cli_main
from raylift.core import storage, stores
from raylift.core.storage import StorageError
from tests.s3_faults import FaultProxy, start_moto, stop

# What pyarrow 25 said, word for word, when the proxy faulted its requests.
FLUSH = (
    "AWS Error INTERNAL_FAILURE during GetObject operation: Failed to flush response stream "
    "(eof: 0, bad: 1)"
)
CLIENT_RETRIED = [  # passing, and S3's client tried them again itself
    "When getting information for key 'x' in bucket 'b': AWS Error UNKNOWN (HTTP status 503) "
    "during HeadObject operation: No response body.",
    "When uploading part for key 'y' in bucket 'b': AWS Error SLOW_DOWN during UploadPart "
    "operation: Please reduce your request rate.",
    "When initiating multiple part upload for key 'y' in bucket 'b': AWS Error "
    "INTERNAL_FAILURE during CreateMultipartUpload operation: We encountered an internal "
    "error. Please try again.",
    "AWS Error NETWORK_CONNECTION during GetObject operation: curlCode: 18, Transferred a "
    "partial file; Details: end of response with 38 bytes missing",
    "AWS Error UNKNOWN (HTTP status 429) during HeadObject operation: No response body.",
]
FINAL = [
    "When getting information for key 'x' in bucket 'b': AWS Error ACCESS_DENIED during "
    "HeadObject operation: No response body.",
    "When listing objects under key 'x/' in bucket 'b': AWS Error INVALID_ACCESS_KEY_ID "
    "during ListObjectsV2 operation: The AWS Access Key Id you provided does not exist in "
    "our records.",
    "When listing objects under key 'x/' in bucket 'nob': AWS Error NO_SUCH_BUCKET during "
    "ListObjectsV2 operation: The specified bucket does not exist",
    "Bucket 'nob' not found. To create buckets, enable the allow_bucket_creation option.",
    "AWS Error UNKNOWN (HTTP status 403) during HeadObject operation: No response body.",
    "AWS Error UNKNOWN (HTTP status 404) during HeadObject operation: No response body.",
]
SAID = {
    **{said: (True, False) for said in CLIENT_RETRIED},
    FLUSH: (True, True),  # passing, and the client gave up on it at once: raylift's to retry
    **{said: (False, False) for said in FINAL},
}


@pytest.mark.parametrize("said", list(SAID))
def test_what_a_retry_can_fix_is_told_from_the_store_s_words(said: str) -> None:
    passing, ours = SAID[said]
    assert stores.transient(OSError(said)) is passing
    assert stores.left_to_us(OSError(said), client_retries=True) is ours
    assert stores.left_to_us(OSError(said), client_retries=False) is passing


def test_what_a_retry_can_fix_is_told_from_the_error_s_kind() -> None:
    for passing in (ConnectionResetError(), TimeoutError(), stores.ShortRead("short")):
        assert stores.transient(passing) and stores.left_to_us(passing, True)
    final = [FileNotFoundError(errno.ENOENT, "Path does not exist 'b/x'"), PermissionError(),
             OSError(errno.ENOSPC, "No space left on device"), OSError("what is this"),
             RuntimeError(FLUSH)]  # fmt: skip
    assert not any(stores.transient(exc) for exc in final)


def test_the_backoff_is_jittered_and_grows_to_its_ceiling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stores.random, "random", lambda: 1.0)
    assert [stores.backoff(n) for n in (1, 2, 3, 6, 9)] == [1.0, 2.0, 4.0, 20.0, 20.0]
    monkeypatch.setattr(stores.random, "random", lambda: 0.25)
    assert stores.backoff(3) == 1.0


def test_boto3_retries_as_the_s3_client_does_unless_the_user_said_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """For MLflow's artifacts in S3: AWS's standard mode and raylift's tries, where
    neither the environment nor the AWS config file's profile says otherwise."""
    for var in ("AWS_RETRY_MODE", "AWS_MAX_ATTEMPTS", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    assert stores.client_retries_env() == {"AWS_RETRY_MODE": "standard", "AWS_MAX_ATTEMPTS": "10"}
    assert stores.attempts() == stores.ATTEMPTS
    monkeypatch.setenv("AWS_RETRY_MODE", "adaptive")
    assert stores.client_retries_env() == {"AWS_MAX_ATTEMPTS": "10"}
    (tmp_path / "config").write_text("[profile ci]\nmax_attempts = 4\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_PROFILE", "ci")
    assert stores.client_retries_env() == {} and stores.attempts() == 4
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "6")
    assert stores.attempts() == 6


# ---------------------------------------------------------------- against the S3 server


@pytest.fixture
def faults(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    """A fault proxy of this test's own in front of the session's S3 server, which this
    process's S3 clients reach (its counts are this test's); raylift's own waits shortened
    (the client's are its own)."""
    proxy = FaultProxy(s3_server)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    monkeypatch.setattr(stores, "MAX_BACKOFF_S", 0.01)
    try:
        yield proxy
    finally:
        proxy.close()


def asked_once(proxy: FaultProxy) -> None:
    """The store was asked little, and nothing tried again: pyarrow's own checks before a
    write (a probe, and the bucket's HEAD, which it sends twice) and the call; a retry would
    have asked ``attempts()`` times."""
    asked = [(x.method, x.target, x.range) for x in proxy.exchanges]
    most = max(asked.count(a) for a in asked)
    assert 0 < len(asked) <= 3 and most <= 2 < stores.attempts(), asked


def gets(proxy: FaultProxy) -> list[tuple[str | None, str | None, int]]:
    """The proxy's GETs: the range each asked for, its fault, the body bytes it sent."""
    return [(x.range, x.fault, x.sent) for x in proxy.exchanges if x.method == "GET"]


def test_a_read_cut_off_mid_body_resumes_where_it_broke_and_fetches_no_more_again(
    faults: FaultProxy, tmp_path: Path
) -> None:
    """Three 1 MiB chunks and 100 bytes, streamed as `raylift verify` streams a file: the
    second chunk's answer is cut off mid-body (its client fetches that range again), the
    last one is throttled (an error document larger than the read: the client gives up
    and the file resumes there). Every byte arrives once, in order; the store sent the
    file and the cut-off part, nothing more; no chunk delivered is asked for again."""
    from raylift.tensors.checkpoints import file_digest

    data = os.urandom(3 << 20) + b"the last hundred bytes".ljust(100, b".")
    uri = f"s3://data/{tmp_path.name}/blob"
    storage.write_bytes(uri, data)
    faults.reset()
    second = "bytes=1048576-2097151"
    last = "bytes=3145728-3145827"
    faults.force("drop", when=lambda method, target, asked: asked == second)
    faults.force("throttle", when=lambda method, target, asked: asked == last)
    got = b"".join(storage.read_chunks(uri, chunk=1 << 20))
    assert got == data
    asked = gets(faults)
    cut = next(sent for rng, fault, sent in asked if fault == "drop")
    assert 0 < cut < 1 << 20
    assert [(rng, fault) for rng, fault, _ in asked] == [
        ("bytes=0-1048575", None), (second, "drop"), (second, None),
        ("bytes=2097152-3145727", None), (last, "throttle"), (last, None),
    ]  # fmt: skip
    assert faults.counts["body"] == len(data) + cut
    (tmp_path / "blob").write_bytes(data)
    faults.set_rates(throttle=0.1, drop=0.1)
    assert file_digest(uri) == file_digest(tmp_path / "blob")


def test_a_throttle_storm_is_ridden_out_and_an_endless_one_stops_after_its_tries(
    faults: FaultProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small ranged reads (a checkpoint's listing, a header), each answered 503 SlowDown
    or 500 InternalError six times running: read whole. Then a store that throttles
    every read: one line after exactly AWS_MAX_ATTEMPTS requests, raylift's tries not
    stacked on the client's."""
    uri = f"s3://data/{tmp_path.name}/small"
    storage.write_bytes(uri, bytes(range(256)) * 4)
    fs, where = storage.filesystem(uri)
    f = fs.open_input_file(where)
    faults.reset()
    faults.force("throttle", times=4, when=lambda method, target, asked: method == "GET")
    faults.force("error", times=2, when=lambda method, target, asked: method == "GET")
    assert f.read_at(100, 10) == (bytes(range(256)) * 4)[10:110]
    assert [fault for _, fault, _ in gets(faults)] == ["throttle"] * 4 + ["error"] * 2 + [None]
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "3")
    faults.reset()
    faults.force("throttle", times=100, when=lambda method, target, asked: method == "GET")
    with pytest.raises(StorageError) as caught, storage.reaching(uri, "reading it"):
        storage.filesystem(uri)[0].open_input_file(where).read_at(100, 10)
    assert len(gets(faults)) == 3
    said = str(caught.value)
    assert said.startswith(f"storage {uri}: reading it failed: AWS Error INTERNAL_FAILURE")
    assert "kept failing for 3 tries" in said and "\n" not in said
    # A store that throttles every request: the client's own tries, and no more.
    faults.reset()
    faults.force("throttle", times=100)
    with pytest.raises(OSError, match=r"HTTP status 503"):
        storage.is_file(uri)
    assert faults.counts["requests"] == 3


def test_errors_no_retry_can_fix_stop_at_once(
    faults: FaultProxy, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bucket that is not there (to read from, to write to) and a key that is not
    there: nothing asked of the store twice, one line naming the URI and the store's
    words."""
    cases = {
        "s3://no-such-bucket/run/file": lambda uri: b"".join(storage.read_chunks(uri)),
        "s3://no-such-bucket/run/out": lambda uri: storage.write_bytes(uri, b"x"),
        f"s3://runs/{tmp_path.name}/missing": lambda uri: b"".join(storage.read_chunks(uri)),
    }
    for uri, do in cases.items():
        faults.reset()
        with pytest.raises(StorageError) as caught, storage.reaching(uri, "reaching it"):
            do(uri)
        asked_once(faults)
        said = str(caught.value)
        assert said.startswith(f"storage {uri}: reaching it failed: ") and "\n" not in said
        assert "check that it exists" in said, said


def test_a_refused_credential_stops_every_command_at_once_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An S3 server that checks credentials (moto with its auth on) refuses this
    process's: 403, and nothing asked twice; `raylift verify` and `export` say so in one
    line and exit 2."""
    server, endpoint = start_moto({"INITIAL_NO_AUTH_ACTION_COUNT": "0"})
    proxy = FaultProxy(endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        for do in (lambda: storage.write_bytes("s3://runs/x/f", b"x"),
                   lambda: storage.read_bytes("s3://runs/x/f")):  # fmt: skip
            proxy.reset()
            with pytest.raises(OSError, match=r"ACCESS_DENIED|INVALID_ACCESS_KEY_ID") as caught:
                do()
            assert not stores.transient(caught.value)
            asked_once(proxy)
        capsys.readouterr()
        for argv in (
            ["verify", "s3://runs/r"],
            ["export", "s3://runs/r", "--out", str(tmp_path / "m.pt")],
        ):
            assert cli_main(argv) == 2
            out, err = capsys.readouterr()
            (line,) = err.splitlines()
            assert line.startswith("raylift: storage s3://runs/r: ") and "ACCESS_DENIED" in line
            assert line.endswith("then rerun the same command") and "Traceback" not in out + err
    finally:
        proxy.close()
        stop(server)


def test_a_filesystem_sent_to_another_process_builds_its_own_client_there(
    faults: FaultProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What Ray pickles to a worker is the bucket's URI: the worker's own environment
    says where the store is (and its client retries as raylift's does); a fresh process
    reads with it as it is."""
    import subprocess
    import sys

    uri = f"s3://data/{tmp_path.name}/f"
    storage.write_bytes(uri, b"hello")
    fs, where = storage.filesystem(uri)
    read = f"import pickle, sys; print(pickle.loads(sys.stdin.buffer.read()).open_input_stream({where!r}).read())"  # noqa: E501
    fresh = subprocess.run(
        [sys.executable, "-c", read], input=pickle.dumps(fs), capture_output=True
    )
    assert fresh.stdout == b"b'hello'\n", fresh.stderr[-2000:]
    other = FaultProxy(faults.endpoint)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", other.endpoint)
        there = pickle.loads(pickle.dumps(fs))
        assert there.equals(fs) and there.type_name == "py::s3"
        with there.open_input_stream(where) as f:
            assert f.read() == b"hello"
        assert other.counts["requests"] >= 2  # its HEAD and GET went to this environment's
    finally:
        other.close()
