"""Local folders vs URIs: resolving, joining, and the pyarrow filesystem (no network)."""

from __future__ import annotations

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
