"""Local folders vs URIs: resolving, joining, and the pyarrow filesystem (no network)."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from raylift.storage import filesystem, is_remote, join, local_path, resolve

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
    from raylift.storage import as_uri

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
    said: list[str] = []
    _remove_stale_generations(str(tmp_path), keep="gen-current", log=said.append)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gen-current", "gen-young", "train"]
    assert said == [f"raylift: prep removed {tmp_path}/gen-old, unused for over a week"]
