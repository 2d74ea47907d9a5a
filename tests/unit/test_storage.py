"""Local folders vs URIs: resolving, joining, and the pyarrow filesystem (no network)."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from raylift.core.storage import filesystem, is_remote, join, local_path, resolve

URIS = ["s3://bucket/runs", "gs://bucket/runs/"]


@pytest.mark.parametrize("uri", URIS)
def test_uris_are_remote_and_pass_through(uri: str) -> None:
    assert is_remote(uri)
    assert resolve(uri) == uri
    assert local_path(uri) is None


def test_a_relative_path_resolves_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert not is_remote("runs")
    assert resolve("runs") == str(tmp_path.resolve() / "runs")
    assert local_path("runs") == tmp_path.resolve() / "runs"


def test_home_expands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve("~/runs") == str(tmp_path.resolve() / "runs")


def test_join_keeps_uris_and_makes_local_paths_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert join("s3://bucket/runs", "shards", "x") == "s3://bucket/runs/shards/x"
    assert join("gs://bucket/runs/", "shards") == "gs://bucket/runs/shards"
    monkeypatch.chdir(tmp_path)
    assert join("runs", "shards", "x") == str(tmp_path.resolve() / "runs" / "shards" / "x")


def test_filesystem_of_a_local_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    fs, path = filesystem("shards")
    assert isinstance(fs, pafs.LocalFileSystem)
    assert Path(path).is_absolute() and path == str(tmp_path.resolve() / "shards")


def test_a_listed_path_gets_its_scheme_back_only_under_a_uri() -> None:
    from raylift.core.storage import as_uri

    assert as_uri("bucket/images/a.jpg", like="s3://bucket/images") == "s3://bucket/images/a.jpg"
    assert as_uri("/data/a.jpg", like="/data") == "/data/a.jpg"
    assert as_uri("gs://b/a.jpg", like="gs://b") == "gs://b/a.jpg"


def test_a_prep_removes_only_generations_no_manifest_names_that_are_a_week_old(
    tmp_path: Path,
) -> None:
    """What a cut-off or replaced object-store prep left; a run that started before the
    replacement may read a younger one, and the current one is never touched."""
    import time

    from raylift.data.shards import STALE_GENERATION_S, _remove_stale_generations

    for name in ("gen-old", "gen-young", "gen-current", "train"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "part-0.parquet").write_bytes(b"rows")
    past = time.time() - STALE_GENERATION_S - 60
    for name in ("gen-old", "gen-current", "train"):
        os.utime(tmp_path / name / "part-0.parquet", (past, past))
    # Another prep's generation, made a moment ago, with no file written into it yet.
    starting = time.strftime("gen-%Y%m%d-%H%M%S-0a1b2c3d")
    (tmp_path / starting).mkdir()
    said: list[str] = []
    _remove_stale_generations(str(tmp_path), keep="gen-current", log=said.append)
    kept = ["gen-current", "gen-young", starting, "train"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)
    assert said == [f"raylift: prep removed {tmp_path}/gen-old, unused for over a week"]


def test_a_store_that_fails_mid_run_is_one_line_naming_the_uri_its_message_and_the_fix(
    s3_server: str, tmp_path: Path
) -> None:
    """A save into a bucket that is gone, against the S3 server; then the driver's account
    of a worker that failed so (Ray Train's own wrappers): one line, exit 2."""
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback
    from ray.train.v2._internal.execution.worker_group.poll import (
        WorkerGroupPollStatus,
        WorkerStatus,
    )
    from ray.train.v2.api.exceptions import WorkerGroupError

    from raylift.core.storage import StorageError, reaching, write_bytes
    from raylift.run.failures import failure_message, root_of
    from raylift.run.saving import Save
    from raylift.strategies.base import written
    from tests.helpers import make_config

    part = tmp_path / "part"
    (part / "engine").mkdir(parents=True)
    (part / "engine" / "__0_0.distcp").write_bytes(b"shard")
    dest = "s3://gone/runs/r/checkpoint-step00000004"
    upload = Save("checkpoint-step00000004", 4, {}, part, written({}), dest, 0.0)
    upload.upload(0)  # a save's thread: the error waits for the ranks to settle
    assert isinstance(upload.error, StorageError) and not part.exists()
    assert str(upload.error).startswith(f"storage {dest}: saving checkpoint-step00000004 failed")
    saving = reaching("s3://gone/runs", "saving checkpoint-step00000004")
    with pytest.raises(StorageError) as caught, saving:
        write_bytes("s3://gone/runs/r/checkpoint-step00000004/model.pt", b"weights")
    said = str(caught.value)
    assert said.startswith("storage s3://gone/runs: saving checkpoint-step00000004 failed: ")
    assert "gone" in said.split("failed: ", 1)[1]  # the store's own message names the bucket
    assert "\n" not in said and said.endswith("resumes from the newest complete checkpoint")
    # Ray Train's controller's error, made by its own code from the worker's wrapper.
    wrapped = UserExceptionWithTraceback(caught.value, "Traceback ...")
    group = WorkerGroupPollStatus({0: WorkerStatus(False, wrapped)}).get_worker_group_error()
    assert isinstance(group, WorkerGroupError) and group.worker_failures == {0: caught.value}
    line = failure_message(group, make_config(name="r"))
    assert line == f"training run 'r' failed: {said}"
    assert root_of(group, StorageError) is caught.value
