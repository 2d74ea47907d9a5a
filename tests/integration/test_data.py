"""`raylift prep` on the session's Ray, the manifest's checks, and training from shards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from raylift.cli import main as cli_main
from raylift.config import load_config
from raylift.data.ingest import ObjectStoreStore, ParquetStore, ShardSource
from raylift.data.shards import (
    MANIFEST,
    ShardError,
    cache_in_object_store,
    fingerprint,
    open_shards,
    prep,
)
from raylift.launch import train
from raylift.tasks import build_task

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"


@pytest.fixture(scope="module")
def digits_shards(ray_cluster: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shards") / "digits"
    cfg = load_config(QUICKSTART, [f"data.shards={root}"])
    assert cli_main(["prep", str(QUICKSTART), f"data.shards={root}"]) == 0
    assert (root / MANIFEST).exists()
    assert open_shards(str(root), fingerprint(cfg, build_task(cfg.task, cfg.task_args)))
    return root


def test_prep_writes_uint8_shards_and_a_manifest_of_what_is_on_disk(digits_shards: Path) -> None:
    manifest = json.loads((digits_shards / MANIFEST).read_text())
    assert manifest["rows"] == {"train": 1438, "val": 359}
    assert "uint8" in manifest["schema"]["image"]
    for split, files in manifest["splits"].items():
        for f in files:
            path = digits_shards / f["path"]
            assert path.stat().st_size == f["bytes"] and sum(f["groups"]) == f["rows"], split
            assert max(f["groups"]) <= 128
    store = ParquetStore(open_shards(str(digits_shards), None))
    group = store.read("train", 0)
    assert group["image"].dtype == np.uint8 and group["image"].shape[1:] == (8, 8)
    assert group["image"].max() > 16  # preprocessed: 0..16 scaled to 0..255


def test_prep_again_is_a_no_op_and_a_changed_task_asks_for_force(
    digits_shards: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = (digits_shards / MANIFEST).stat().st_mtime_ns
    assert cli_main(["prep", str(QUICKSTART), f"data.shards={digits_shards}"]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert (digits_shards / MANIFEST).stat().st_mtime_ns == before
    changed = [f"data.shards={digits_shards}", "task_args.val_fraction=0.3"]
    assert cli_main(["prep", str(QUICKSTART), *changed]) == 2
    assert "--force" in capsys.readouterr().err
    cfg = load_config(QUICKSTART, changed)
    with pytest.raises(ShardError, match="raylift prep CONFIG --force"):
        open_shards(str(digits_shards), fingerprint(cfg, build_task(cfg.task, cfg.task_args)))


def test_truncated_or_missing_files_are_caught_with_the_fix(
    ray_cluster: str, tmp_path: Path
) -> None:
    cfg = load_config(QUICKSTART, [f"data.shards={tmp_path / 's'}"])
    task = build_task(cfg.task, cfg.task_args)
    manifest = prep(cfg, task, str(tmp_path / "s")).manifest
    files = [tmp_path / "s" / f.path for f in manifest.splits["train"]]
    whole = files[0].read_bytes()
    files[0].write_bytes(whole[:-10])
    with pytest.raises(ShardError, match=r"truncated.*raylift prep CONFIG --force"):
        open_shards(str(tmp_path / "s"), None)
    files[0].write_bytes(whole)
    files[1].unlink()
    with pytest.raises(ShardError, match="is missing"):
        open_shards(str(tmp_path / "s"), None)
    # prep --force puts it right
    assert not prep(cfg, task, str(tmp_path / "s"), force=True).skipped
    assert open_shards(str(tmp_path / "s"), fingerprint(cfg, task))


def test_train_refuses_a_missing_shard_folder_before_any_worker_starts(
    in_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli_main(["train", str(QUICKSTART), "name=noshards", "data.shards=./nowhere"])
    assert code == 2
    err = capsys.readouterr().err
    assert "./nowhere" in err and "raylift prep" in err
    assert not (in_tmp / "runs" / "noshards").exists()  # nothing was started or written


def test_train_from_prepared_shards_cached_in_the_object_store(
    digits_shards: Path, in_tmp: Path
) -> None:
    from mlflow.tracking import MlflowClient

    cfg = load_config(
        QUICKSTART,
        [
            "name=fromshards",
            f"data.shards={os.path.relpath(digits_shards)}",  # relative: workers run elsewhere
            "data.cache=true",
            "train.max_epochs=3",
        ],
    )
    result = train(cfg)
    assert result.metrics["val_acc"] > 0.85
    client = MlflowClient(tracking_uri=f"sqlite:///{in_tmp / 'mlflow.db'}")
    waits = [m.value for m in client.get_metric_history(result.run_id, "data_wait_frac")]
    assert waits and all(0.0 <= w <= 1.0 for w in waits)


def test_object_store_cache_reads_the_same_rows_as_the_files(digits_shards: Path) -> None:
    manifest = open_shards(str(digits_shards), None)
    refs = cache_in_object_store(manifest, log=lambda _: None)
    assert refs is not None

    def stream(store: object) -> list[np.ndarray]:
        src = ShardSource(store, 1, 2, 32, 32, seed=3)  # type: ignore[arg-type]
        return [b["label"].numpy() for b in src.train_batches(1, 64)]

    cached, files = stream(ObjectStoreStore(manifest, refs)), stream(ParquetStore(manifest))
    assert len(cached) == len(files) > 0
    assert all(np.array_equal(a, b) for a, b in zip(cached, files, strict=True))


def test_cache_that_does_not_fit_says_so_and_streams_instead(digits_shards: Path) -> None:
    class Huge:
        root = str(digits_shards)

        def memory(self) -> int:
            return 1 << 50

    lines: list[str] = []
    assert cache_in_object_store(Huge(), log=lines.append) is None  # type: ignore[arg-type]
    assert "does not fit" not in lines[0] and "streaming from the shard files" in lines[0]


PEAK_RSS = textwrap.dedent(
    """
    import resource, sys
    from raylift.data.ingest import ParquetStore, ShardSource
    from raylift.data.shards import open_shards
    source = ShardSource(ParquetStore(open_shards(sys.argv[1], None)), 0, 1, 32, 32, seed=0)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rows = sum(len(b["tokens"]) for b in source.train_batches(0))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(rows, (peak - base) * 1024)
    """
)


def test_streaming_memory_does_not_grow_with_the_corpus(ray_cluster: str, tmp_path: Path) -> None:
    grown = {}
    for max_bytes in (1_000_000, 12_000_000):
        root = tmp_path / str(max_bytes)
        cfg = load_config(REPO / "configs" / "gpt-tiny.yaml", [f"task_args.max_bytes={max_bytes}"])
        prep(cfg, build_task(cfg.task, cfg.task_args), str(root))
        out = subprocess.run(
            [sys.executable, "-c", PEAK_RSS, str(root)], capture_output=True, text=True, check=True
        ).stdout.split()
        grown[max_bytes] = (int(out[0]), int(out[1]))
    (small_rows, small_rss), (big_rows, big_rss) = grown.values()
    assert big_rows > 10 * small_rows
    data_bytes = big_rows * 129
    # A whole epoch streamed: memory beyond start-up stays far below the data's size.
    assert big_rss < 0.25 * data_bytes, grown
    assert big_rss < small_rss + 16 * 2**20, grown
