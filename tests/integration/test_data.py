"""`raylift prep` on the session's Ray, the manifest's checks, and training from shards."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from raylift.cli import main as cli_main
from raylift.data.ingest import ObjectStoreStore, ParquetStore, ShardSource
from raylift.data.manifest import MANIFEST, ShardError, open_shards, task_fingerprint
from raylift.data.shards import cache_in_object_store, prep
from raylift.tasks import build_task
from raylift.tensors.precision import DeviceFacts, choose
from raylift.validation import load_config
from tests.helpers import HANG_S, finish_output, wait_until
from tests.integration.test_train import cli_env
from tests.s3_faults import FLAKY, FaultProxy

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"
GPT_TINY = REPO / "configs" / "gpt-tiny.yaml"
IMAGES_YAML = REPO / "configs" / "images.yaml"


@pytest.fixture(scope="module")
def digits_shards(ray_cluster: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shards") / "digits"
    cfg = load_config(QUICKSTART, [f"data.shards={root}"])
    assert cli_main(["prep", str(QUICKSTART), f"data.shards={root}"]) == 0
    assert (root / MANIFEST).exists()
    assert open_shards(str(root), task_fingerprint(cfg, build_task(cfg.task, cfg.task_args)))
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
        open_shards(str(digits_shards), task_fingerprint(cfg, build_task(cfg.task, cfg.task_args)))


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
    files[-1].unlink()
    with pytest.raises(ShardError, match="is missing"):
        open_shards(str(tmp_path / "s"), None)
    # prep --force puts it right
    assert not prep(cfg, task, str(tmp_path / "s"), force=True).skipped
    assert open_shards(str(tmp_path / "s"), task_fingerprint(cfg, task))


@pytest.mark.slow
def test_preps_into_an_object_store_never_delete_or_mix_each_others_shards(
    ray_cluster: str, s3_server: str, s3_faults: FaultProxy, tmp_path: Path
) -> None:
    """Object stores have no rename: each prep writes its own folder and then the
    manifest. A run that read the first manifest still finds every file it names after
    ``prep --force`` replaced them; two preps at once both finish and leave one whole
    manifest, of files that are all there. The store throttles and drops connections
    throughout (FLAKY)."""
    with s3_faults.faults(seed=1, **FLAKY) as injected:
        preps_side_by_side(tmp_path)
    print(f"faults injected: {dict(injected)}")  # shown with -s, for the record
    assert injected["throttle"] > 0 and injected["drop"] > 0, injected


def preps_side_by_side(tmp_path: Path) -> None:
    from raylift.core import storage
    from raylift.data.manifest import read_manifest, verify

    root = f"s3://data/{tmp_path.name}/digits"
    cfg = load_config(QUICKSTART, [f"data.shards={root}"])
    task = build_task(cfg.task, cfg.task_args)
    fp = task_fingerprint(cfg, task)
    first = prep(cfg, task, root).manifest
    second = prep(cfg, task, root, force=True).manifest
    verify(first, fp)  # what a run that started before the second prep reads: all there
    assert read_manifest(root) == second
    assert {f.path for f in first.splits["train"]} != {f.path for f in second.splits["train"]}
    cmd = [sys.executable, "-m", "raylift.cli", "prep", str(QUICKSTART), f"data.shards={root}",
           "--force"]  # fmt: skip
    both = [subprocess.Popen(cmd, cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for _ in range(2)]  # fmt: skip
    outs = [finish_output(proc, "a prep beside another")[0] for proc in both]
    assert [proc.returncode for proc in both] == [0, 0], outs
    last = read_manifest(root)
    assert last is not None and last not in (first, second)
    verify(last, fp)
    verify(first, fp)
    generations = [p for p in storage.children(root) if "gen-" in p]
    assert len(generations) == 4, generations  # none removed: all are under a week old


def test_train_refuses_a_missing_shard_folder_before_any_worker_starts(
    in_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli_main(["train", str(QUICKSTART), "name=noshards", "data.shards=./nowhere"])
    assert code == 2
    err = capsys.readouterr().err
    assert "./nowhere" in err and "raylift prep" in err
    assert not (in_tmp / "runs" / "noshards").exists()  # nothing was started or written


def test_joining_a_token_cluster_without_the_token_stops_at_once_with_the_fix(
    ray_cluster: str, tmp_path: Path
) -> None:
    """The session's Ray wants Ray's token, as a `ray start` head does; a shell that
    names its address without RAY_AUTH_MODE=token gets the fix, not 20 s of retries."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    env["RAY_ADDRESS"] = ray_cluster  # host:port, as `ray start` prints it
    args = ["prep", str(QUICKSTART), f"data.shards={tmp_path / 'shards'}"]
    proc = subprocess.run(
        [sys.executable, "-m", "raylift.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"RAY_ADDRESS={ray_cluster}" in proc.stderr and "RAY_AUTH_MODE=token" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "shards").exists()


@pytest.mark.slow
def test_workers_that_cannot_be_placed_fail_within_the_bound_naming_them(
    digits_shards: Path, in_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """2 workers x 3 CPUs on the session's 4-CPU Ray: Ray Train alone would retry the
    placement forever; raylift stops after scaling.placement_timeout_s and says why (that
    it returns at all is the bound: how soon depends on how busy the machine is)."""
    code = cli_main(
        [
            "train",
            str(QUICKSTART),
            "name=toobig",
            f"data.shards={digits_shards}",
            "scaling.cpus_per_worker=3",
            "scaling.placement_timeout_s=5",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1, err
    assert "could not be placed" in err and "it needs CPU 6" in err, err
    assert "the cluster has CPU 4" in err and "placement_timeout_s=5 s" in err, err


@pytest.mark.slow
def test_quickstart_from_cached_shards_resumes_after_ctrl_c_into_one_mlflow_run(
    digits_shards: Path, in_tmp: Path
) -> None:
    """The quickstart for 6 epochs from prepared shards held in Ray's object store, as a
    user runs it: Ctrl-C of the driver once two checkpoints are on disk, then the same
    command again resumes from the newest and runs to the end. One MLflow run holds both
    (a single run shared by the start-ups they cost). Six epochs: from the object store
    the steps are fast, and the first command must still be training when it is stopped."""
    from mlflow.tracking import MlflowClient

    args = [
        sys.executable, "-m", "raylift.cli", "train", str(QUICKSTART), "name=qs",
        f"data.shards={os.path.relpath(digits_shards)}",  # relative: workers run elsewhere
        "data.cache=true", "train.early_stopping=null", "train.max_epochs=6",
        "checkpoint.every_n_steps=20", "storage=./runs",
    ]  # fmt: skip
    proc = subprocess.Popen(
        args, cwd=in_tmp, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    run_dir = in_tmp / "runs" / "qs"

    def saved_or_ended() -> bool:
        return len(list(run_dir.glob("checkpoint-step*/loop_state.pt"))) >= 2 or (
            proc.poll() is not None
        )

    # Two checkpoints on disk: the first is complete and registered with Ray (a SIGINT
    # during a checkpoint's write may leave that one incomplete, and the run resume
    # from step 0, which this test is not about).
    wait_until(saved_or_ended, "two checkpoints of the first command", every=0.1,
               seen=lambda: sorted(p.name for p in run_dir.glob("checkpoint-step*")))  # fmt: skip
    assert proc.poll() is None, "the first command ended before it was stopped"
    proc.send_signal(signal.SIGINT)
    out, _ = finish_output(proc, "the first command, stopped by Ctrl-C")
    # Ray Train's own SIGINT handler aborts the run; raylift still says it was a Ctrl-C.
    assert proc.returncode == 130, out[-2000:]
    said = "raylift: interrupted; rerun the same command to resume from the latest checkpoint"
    assert said in out.splitlines(), out[-2000:]
    saved = sorted(run_dir.glob("checkpoint-step*"))
    assert saved, out[-2000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{in_tmp / 'mlflow.db'}")
    (stopped,) = client.search_runs([client.get_experiment_by_name("raylift").experiment_id])
    assert stopped.info.status == "KILLED"  # stopped by its user, not failed
    resumed = subprocess.run(
        args, cwd=in_tmp, env=cli_env(), capture_output=True, text=True, timeout=HANG_S
    )
    said = resumed.stdout
    assert resumed.returncode == 0, said[-3000:] + resumed.stderr[-3000:]
    assert "resuming from its latest checkpoint" in said
    found = re.search(r"resumed from \S+checkpoint-step(\d+) at step (\d+)", said)
    assert found, said[-3000:]
    ckpt_step, step = int(found.group(1)), int(found.group(2))
    assert step == ckpt_step >= 20 and f"checkpoint-step{ckpt_step:08d}" in {p.name for p in saved}
    assert "at step 132" in said  # ran on to the end: 6 epochs x 22 steps
    # The run's last line about its checkpoint (a ctrl-c mid-save adds one, earlier, on the
    # cut-off checkpoint it passed over).
    final = re.search(r"^raylift: checkpoint (\S+)$", said, re.MULTILINE)
    assert final and Path(final.group(1)).name == "checkpoint-step00000132", said[-3000:]

    (run,) = client.search_runs([client.get_experiment_by_name("raylift").experiment_id])
    assert run.info.status == "FINISHED"  # one run: not one per worker, nor per command
    assert run.data.tags["raylift.strategy"] == "ddp"
    # precision: auto, resolved for a CPU worker of this host and recorded as resolved
    assert run.data.tags["raylift.precision"] == choose(DeviceFacts.here(use_gpu=False))[0]
    assert run.data.tags["raylift.world_size"] == "2"
    assert run.data.tags["raylift.final_checkpoint"] == final.group(1)
    assert run.data.params["optim.lr"] == "0.003"

    def history(key: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}

    timing = ("step_forward_frac", "step_backward_frac", "step_optimizer_frac", "step_h2d_frac")
    measures = ("mfu", "mem_rss_bytes", "step_time_s", "data_wait_frac", "step_sync_frac")
    for key in ("train_loss", "val_loss", "val_acc", "samples_per_s", "lr", *timing, *measures):
        assert history(key), key
    assert max(history("val_acc")) == 132  # global step as MLflow step
    assert history("val_acc")[132] > 0.85
    assert all(0.0 <= w <= 1.0 for w in history("data_wait_frac").values())


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
    from raylift.data.manifest import open_shards
    source = ShardSource(ParquetStore(open_shards(sys.argv[1], None)), 0, 1, 32, 32, seed=0)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rows = sum(len(b["tokens"]) for b in source.train_batches(0))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(rows, (peak - base) * 1024)
    """
)


@pytest.mark.slow
def test_streaming_memory_does_not_grow_with_the_corpus(ray_cluster: str, tmp_path: Path) -> None:
    grown = {}
    for max_bytes in (1_000_000, 12_000_000):
        root = tmp_path / str(max_bytes)
        cfg = load_config(REPO / "configs" / "gpt-tiny.yaml", [f"task_args.max_bytes={max_bytes}"])
        prep(cfg, build_task(cfg.task, cfg.task_args), str(root))
        out = subprocess.run(
            [sys.executable, "-c", PEAK_RSS, str(root)],
            capture_output=True,
            text=True,
            check=True,
            timeout=HANG_S,
        ).stdout.split()
        grown[max_bytes] = (int(out[0]), int(out[1]))
    (small_rows, small_rss), (big_rows, big_rss) = grown.values()
    assert big_rows > 10 * small_rows
    data_bytes = big_rows * 129
    # A whole epoch streamed: memory beyond start-up stays far below the data's size.
    assert big_rss < 0.25 * data_bytes, grown
    assert big_rss < small_rss + 16 * 2**20, grown


# ---------------------------------------------------------------- sources from Ray Data readers


def shard_rows(root: Path, split: str) -> list[tuple[int, bytes]]:
    """A split's rows as sorted (label, image bytes): its content, whatever its order."""
    store = ParquetStore(open_shards(str(root), None))
    manifest = open_shards(str(root), None)
    rows = []
    for i in range(sum(len(f.groups) for f in manifest.splits[split])):
        group = store.read(split, i)
        rows += [
            (int(lab), img.tobytes())
            for lab, img in zip(group["label"], group["image"], strict=True)
        ]
    return sorted(rows)


@pytest.mark.slow
def test_a_read_parquet_source_preps_the_same_rows_as_in_memory_columns(
    digits_shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.corpora import write_digits_parquet

    raw = write_digits_parquet(tmp_path / "raw")
    out = tmp_path / "shards"
    args = [f"data.shards={out}", "task=tests.corpora:ParquetDigits", f"task_args.root={raw}"]
    assert cli_main(["prep", str(QUICKSTART), *args]) == 0
    said = capsys.readouterr().out
    assert "prep wrote split 'train'" in said and "MiB/s" in said
    assert "shuffles split 'train'" in said  # which shuffle it chose, and why
    for split in ("train", "val"):
        assert shard_rows(out, split) == shard_rows(digits_shards, split), split


def test_prep_streams_a_split_whose_reader_shuffles_its_files(
    ray_cluster: str, tmp_path: Path
) -> None:
    """Only a source whose every reader shuffles its files skips the block shuffle,
    which reads the split whole before the first row is written."""
    import ray.data

    from raylift.data.sources import estimated_bytes, reads_shuffled_files, shuffled_files
    from tests.corpora import write_jsonl

    files = [str(p) for p in sorted(write_jsonl(tmp_path / "c", 12).glob("*.jsonl"))]
    shuffled = ray.data.read_json(files, shuffle=shuffled_files())
    plain = ray.data.read_json(files)
    # Sized from the files' metadata (Ray Data's logical plan), none of them read.
    assert estimated_bytes(plain) == sum(Path(f).stat().st_size for f in files)
    assert reads_shuffled_files(shuffled)
    assert reads_shuffled_files(shuffled.map_batches(lambda b: b))
    assert not reads_shuffled_files(plain)
    assert not reads_shuffled_files(shuffled.union(plain))
    assert not reads_shuffled_files(ray.data.from_items([{"a": 1}]))


def test_the_gpt_task_reads_a_jsonl_corpus_by_its_text_field(
    ray_cluster: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from raylift.data.sources import in_val
    from raylift.tasks.gpt import SEP
    from tests.corpora import documents, write_jsonl

    corpus = write_jsonl(tmp_path / "corpus", 120, field="body")
    args = [
        f"data.shards={tmp_path / 'shards'}",
        f"task_args={{corpus: '{corpus}/*.jsonl', text_field: body, block_size: 32, "
        "val_percent: 20}",
    ]
    assert cli_main(["prep", str(GPT_TINY), *args]) == 0
    out = capsys.readouterr().out
    # No file hashes into val (3 files, 20%): one pass over the rows writes both splits.
    assert "shuffles splits 'train' and 'val' (read once) by file" in out, out  # streamed
    assert "prep wrote splits 'train' and 'val'" in out
    manifest = open_shards(str(tmp_path / "shards"), None)
    store = ParquetStore(manifest)
    docs = [d.encode() for d in documents(120)]
    in_val_docs = [d for d in docs if in_val(d[:4096], 20)]
    text = {
        "val": SEP.join(in_val_docs),
        "train": SEP.join(d for d in docs if d not in in_val_docs),
    }
    for split in ("val", "train"):
        windows = store.read(split, 0)["tokens"]
        assert windows.dtype == np.uint8 and windows.shape[1] == 33
        # Every window is text of its split's documents, a separator between documents.
        pieces = [p for w in windows[:50] for p in bytes(w).split(SEP) if len(p) >= 8]
        assert pieces and all(p in text[split] for p in pieces), split
    val, train = manifest.rows("val"), manifest.rows("train")
    assert 0.05 < val / (val + train) < 0.4  # 20% of the documents, by hash


def test_the_gpt_task_splits_one_text_file_by_window(
    ray_cluster: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Most corpora start as one file: too few to split by path, so its windows are split,
    each by the file's name and its place; max_bytes plus val_percent of it are read."""
    from raylift.data.sources import val_outputs
    from tests.corpora import write_text_file

    text = write_text_file(tmp_path / "corpus" / "input.txt", 60).read_bytes()
    block, percent, cap = 32, 10, 60_000
    args = [
        f"data.shards={tmp_path / 'shards'}",
        f"task_args={{corpus: '{tmp_path / 'corpus' / 'input.txt'}', block_size: {block}, "
        f"val_percent: {percent}, max_bytes: {cap}}}",
    ]
    assert cli_main(["prep", str(GPT_TINY), *args]) == 0
    out = capsys.readouterr().out
    assert "input.txt (1 text file, too few to split by file) by window: 10% of the windows" in out
    assert "prep wrote splits 'train' and 'val'" in out
    store = ParquetStore(open_shards(str(tmp_path / "shards"), None))
    got = {
        split: sorted(
            bytes(w)
            for g in range(len(store.group_rows(split)))
            for w in store.read(split, g)["tokens"]
        )
        for split in ("train", "val")
    }
    read = text[: cap + cap * percent // 100]
    n = (len(read) - 1) // block
    val = val_outputs("input.txt", n, percent)
    for split, mask in (("train", ~val), ("val", val)):
        # Both splits, disjoint: each window of the text read is in the split of its place.
        want = sorted(read[i * block : i * block + block + 1] for i in np.flatnonzero(mask))
        assert got[split] == want, split
    assert 0.06 < len(got["val"]) / n < 0.14


@pytest.mark.parametrize(
    "task_args, named",
    [
        ("{corpus: '%s/corpus', text_field: text}", "task_args.text_field"),  # rows have 'body'
        ("{corpus: '%s/table', text_field: text}", "task_args.text_field"),  # parquet, 'body'
        ("{corpus: '%s/garbled'}", "first line is not JSON"),
        ("{corpus: '%s/nowhere'}", "does not exist"),
        ("{corpus: '%s/empty'}", "holds no files"),
        ("{corpus: '%s/mixed'}", "mixes text files with JSONL"),
        ("{corpus: '%s/one', val_percent: 1}", "no row of split 'val'"),  # 1 row, in train
        ("{corpus: '%s/note.txt'}", "no window of split"),  # too short for one window
        ("{corpus: '%s/blank'}", "holds no text"),
    ],
)
def test_a_bad_corpus_exits_2_naming_the_path_before_any_worker(
    ray_cluster: str, in_tmp: Path, capsys: pytest.CaptureFixture[str], task_args: str, named: str
) -> None:
    tmp_path = in_tmp
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.corpora import write_jsonl

    write_jsonl(tmp_path / "corpus", 12, field="body")
    (tmp_path / "empty").mkdir()
    write_jsonl(tmp_path / "mixed", 6)
    (tmp_path / "mixed" / "notes.txt").write_text("plain text")
    (tmp_path / "table").mkdir()
    pq.write_table(pa.table({"body": ["a document"] * 3}), tmp_path / "table" / "a.parquet")
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / "a.jsonl").write_text("text, not JSON\n")
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "a.jsonl").write_text(json.dumps({"text": "a single document " * 20}))
    (tmp_path / "note.txt").write_text("a note shorter than a window\n")
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    args = [f"storage={tmp_path / 'runs'}", f"task_args={task_args % tmp_path}"]
    assert cli_main(["train", str(GPT_TINY), *args]) == 2
    err = capsys.readouterr().err
    assert named in err and str(tmp_path) in err, err
    assert not list((tmp_path / "runs").rglob("*.parquet"))  # nothing half-written


# ---------------------------------------------------------------- the images task


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.corpora import write_image_folder

    return write_image_folder(tmp_path_factory.mktemp("images") / "shapes", per_class=40, size=24)


IMAGES = "{root: '%s', image_size: 16, width: 8, val_percent: 20%s}"  # over configs/images.yaml


@pytest.mark.slow
def test_a_corrupt_image_is_skipped_with_a_warning_or_stops_prep_past_the_share(
    ray_cluster: str, shapes: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = shapes / "square" / "zz-broken.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 cut off")
    try:
        strict = [
            f"data.shards={tmp_path / 'a'}",
            f"task_args={IMAGES % (shapes, ', max_bad_fraction: 0.0')}",
        ]
        lenient = [f"data.shards={tmp_path / 'b'}",
                   f"task_args={IMAGES % (shapes, ', max_bad_fraction: 0.05')}"]  # fmt: skip
        assert cli_main(["prep", str(IMAGES_YAML), *strict]) == 2
        err = capsys.readouterr().err
        assert str(bad) in err and "max_bad_fraction" in err, err
        assert not (tmp_path / "a").exists()  # nothing half-written
        assert cli_main(["prep", str(IMAGES_YAML), *lenient]) == 0
        out = capsys.readouterr().out
        assert "skipped 1 unreadable row(s)" in out and str(bad) in out, out
    finally:
        bad.unlink()
    manifest = open_shards(str(tmp_path / "b"), None)
    assert manifest.rows("train") + manifest.rows("val") == 120
    assert "uint8" in manifest.schema["image"]


@pytest.mark.slow
def test_an_images_run_resumed_mid_epoch_continues_the_uninterrupted_curve(
    ray_cluster: str, shapes: Path, tmp_path: Path
) -> None:
    import contextlib

    import torch.distributed as dist

    from raylift.core.parsing import merge
    from raylift.data.ingest import ShardSource
    from raylift.validation import config_from_dict
    from tests.helpers import BASE, ListTracker, LocalReporter, init_pg, make_trainer

    raw = {k: v for k, v in BASE.items() if k != "task_args"}
    cfg = config_from_dict(
        merge(raw, {
            "task": "images",
            "task_args": {"root": str(shapes), "image_size": 16, "width": 8, "val_percent": 20},
            "data": {"batch_size": 16, "shards": str(tmp_path / "shards")},
            "train": {"max_steps": 12, "max_epochs": 3, "log_every_n_steps": 1, "seed": 1},
            "checkpoint": {"every_n_steps": 3},
        })
    )  # fmt: skip
    task = build_task(cfg.task, cfg.task_args)
    manifest = prep(cfg, task, str(tmp_path / "shards")).manifest

    def run(where: Path, crash: int | None = None, restore: Path | None = None):  # type: ignore[no-untyped-def]
        source = ShardSource(
            ParquetStore(manifest), 0, 1, 16, 16, seed=1, prefetch_batches=2,
            shuffle=True, transform=task.transform,
        )  # fmt: skip
        tracker, reporter = ListTracker(), LocalReporter(where, crash_after_step=crash)
        trainer = make_trainer(cfg, 0, 1, reporter, tracker, source=source)
        if restore is not None:
            trainer.restore(restore)
        with contextlib.suppress(KeyboardInterrupt):
            trainer.run()
        return tracker.series("train_loss"), reporter

    init_pg(0, 1, str(tmp_path / "pg"))
    try:
        full, _ = run(tmp_path / "full")
        cut, reporter = run(tmp_path / "cut", crash=3)  # 96 train rows: 6 steps per epoch
        resumed, _ = run(tmp_path / "resumed", restore=reporter.checkpoints[-1])
    finally:
        dist.destroy_process_group()
    # The crash comes as step 3's async save goes on record, at the next save (step 6).
    assert reporter.checkpoints[-1].name == "checkpoint-step00000003" and max(cut) == 6
    assert min(resumed) == 4 and max(resumed) == 12  # across an epoch end
    for step in range(4, 13):
        assert resumed[step] == pytest.approx(full[step], rel=1e-6, abs=1e-7), step
