"""What survives a fault, without Ray: NaN losses, cut-off checkpoint writes, preemption notices."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from raylift.core import storage
from raylift.core.config import ConfigError
from raylift.core.parsing import merge
from raylift.tensors.checkpoints import CheckpointError, resume_point, verify_checkpoint
from raylift.validation import load_config
from tests.helpers import HANG_S, ListTracker, LocalReporter, init_pg, make_config, make_trainer

REPO = Path(__file__).resolve().parents[2]
SMALL = {
    "data": {"batch_size": 64},
    "task_args": {"dropout": 0.2, "width": 8},
    "train": {"max_steps": 30, "max_epochs": 5, "log_every_n_steps": 1},
    "checkpoint": {"every_n_steps": 5},
}
NAN_TASK = {"task": "tests.flaky:NanDigits", "task_args": {"nan_at": 13, "width": 8}}


@pytest.fixture
def pg(tmp_path: Path) -> Iterator[None]:
    init_pg(0, 1, str(tmp_path / "pg"))
    yield
    dist.destroy_process_group()


def run(
    root: Path,
    reporter: LocalReporter | None = None,
    restore: Path | None = None,
    **overrides: object,
) -> tuple[ListTracker, LocalReporter, dict[str, float], torch.nn.Module]:
    cfg = make_config(**merge(SMALL, overrides))
    tracker, reporter = ListTracker(), reporter or LocalReporter(root)
    trainer = make_trainer(cfg, 0, 1, reporter, tracker)
    if restore is not None:
        trainer.restore(restore)
    last: dict[str, float] = {}
    with contextlib.suppress(KeyboardInterrupt):  # a simulated crash
        last = trainer.run()
    return tracker, reporter, last, trainer.engine.eval_model


def finite(module: torch.nn.Module) -> bool:
    return all(bool(p.isfinite().all()) for p in module.parameters())


def test_on_nan_stop_names_the_step_and_keeps_the_last_good_checkpoint(
    tmp_path: Path, pg: None
) -> None:
    tracker, reporter, last, _ = run(tmp_path, **NAN_TASK)
    assert last["nonfinite_step"] == 13
    steps = [int(p.name.removeprefix("checkpoint-step")) for p in reporter.checkpoints]
    assert steps == [5, 10]  # nothing written from the broken weights
    assert max(tracker.series("train_loss")) < 13  # stopped at the first sync after the NaN
    good = run(tmp_path / "again", restore=reporter.checkpoints[-1])[3]
    assert finite(good)


def test_on_nan_skip_steps_over_the_bad_batch_and_counts_it(tmp_path: Path, pg: None) -> None:
    tracker, _, last, model = run(tmp_path, train={"on_nan": "skip"}, **NAN_TASK)
    assert "nonfinite_step" not in last and last["step"] == 30
    assert finite(model)
    skipped = tracker.series("skipped_steps")
    assert skipped[12] == 0 and skipped[13] == 1 and skipped[30] == 1
    losses = tracker.series("train_loss")
    # Logged every step here: the interval of step 13 had no finite loss to average.
    assert [s for s, v in losses.items() if v != v] == [13]


def test_on_nan_is_checked_in_the_config() -> None:
    quick = REPO / "configs" / "quickstart.yaml"
    with pytest.raises(ConfigError, match=r"train\.on_nan"):
        load_config(quick, ["train.on_nan=ignore"])
    with pytest.raises(ConfigError, match="fp16 loss scaler"):
        load_config(quick, ["train.on_nan=skip", "strategy.name=deepspeed"])


def test_a_cut_off_checkpoint_write_resumes_from_the_previous_complete_one(
    tmp_path: Path, pg: None
) -> None:
    full, _, _, _ = run(tmp_path / "full")
    cut = LocalReporter(tmp_path / "cut", crash_after_step=15, cut_write=True)
    run(tmp_path / "cut", reporter=cut)
    latest = tmp_path / "cut" / "checkpoint-step00000015"
    assert latest.is_dir()  # the interrupted write left a folder behind
    with pytest.raises(CheckpointError, match="incomplete"):
        verify_checkpoint(latest)
    said: list[str] = []
    chosen = resume_point(str(latest), said.append)
    assert storage.name(chosen) == "checkpoint-step00000010"
    assert "incomplete" in said[0] and "newest complete" in said[-1]
    resumed, _, last, _ = run(tmp_path / "resumed", restore=chosen)
    assert last["step"] == 30
    want, got = full.series("train_loss"), resumed.series("train_loss")
    for step in range(11, 31):  # it lost the 5 steps after the last complete checkpoint, no more
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=1e-7), step
    assert resumed.series("restarts") == {10: 1.0}
    assert resumed.tags == {
        "raylift.restart.1": "step 10 from checkpoint-step00000010: 1 -> 1 workers"
    }


def test_two_resumes_from_one_checkpoint_are_two_restarts(tmp_path: Path, pg: None) -> None:
    """A node lost again before the resized group saved: the run resumes from the same
    checkpoint twice. The run counts its restarts, not the checkpoint (which says 0)."""
    _, reporter, _, _ = run(tmp_path / "first")
    ckpt = next(c for c in reporter.checkpoints if c.name == "checkpoint-step00000010")
    tracker = ListTracker()  # the one MLflow run both resumes log to
    for n in (1, 2):
        trainer = make_trainer(
            make_config(**SMALL), 0, 1, LocalReporter(tmp_path / f"{n}"), tracker
        )
        trainer.restore(ckpt)
        assert trainer.state.restarts == n
    assert [m["restarts"] for _, m in tracker.rows if "restarts" in m] == [1.0, 2.0]
    assert sorted(tracker.tags) == ["raylift.restart.1", "raylift.restart.2"]


def test_no_complete_checkpoint_is_an_error_with_the_fix(tmp_path: Path, pg: None) -> None:
    cut = LocalReporter(tmp_path, crash_after_step=5, cut_write=True)
    run(tmp_path, reporter=cut)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        resume_point(str(tmp_path / "checkpoint-step00000005"), lambda line: None)


def test_a_preemption_notice_takes_one_checkpoint_at_once(tmp_path: Path, pg: None) -> None:
    reporter = LocalReporter(tmp_path, preempt_at_call=7)
    run(tmp_path, reporter=reporter, checkpoint={"every_n_steps": None})
    steps = [int(p.name.removeprefix("checkpoint-step")) for p in reporter.checkpoints]
    assert steps == [7, 30]  # the notice at step 7, then only the end of the run
    verify_checkpoint(reporter.checkpoints[0])


def test_a_leaving_node_gets_a_last_checkpoint_before_its_deadline_and_a_wait(
    tmp_path: Path, pg: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The notice at step 7 saves at once; training goes on while the deadline is far off;
    at step 12 only one more save fits before it: that save, then the wait for Ray's
    restart. Here no restart comes (no Ray), so after the wait the run trains on."""
    import raylift.run.checkpointing

    monkeypatch.setattr(raylift.run.checkpointing, "HOLD_PAST_DEADLINE_S", 0.0)
    reporter = LocalReporter(tmp_path, preempt_at_call=7, deadline_at_call=12)
    said: list[str] = []
    cfg = make_config(**merge(SMALL, {"checkpoint": {"every_n_steps": None}}))
    make_trainer(cfg, 0, 1, reporter, log=said.append).run()
    steps = [int(p.name.removeprefix("checkpoint-step")) for p in reporter.checkpoints]
    assert steps == [7, 12, 30]  # the notice, the deadline's, the end
    out = "\n".join(said)
    assert "raylift: preemption notice: checkpoint at step 7" in out, out
    said = "raylift: the leaving node goes in 0 s: checkpoint at step 12 saved; waiting for Ray"
    assert said in out and "Ray had not stopped the workers: training on" in out, out
    assert out.count("preemption notice") == 1, out


def flip_one_block(path: Path) -> None:
    """Damage a file as a bad disk block would: same size, different bytes."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    path.write_bytes(bytes(data))


def test_a_same_size_corruption_falls_back_to_the_previous_intact_checkpoint(
    tmp_path: Path, pg: None
) -> None:
    from raylift.cli import main as cli_main

    reporter = LocalReporter(tmp_path)
    run(tmp_path, reporter=reporter, train={"max_steps": 15})
    latest = tmp_path / "checkpoint-step00000015"
    assert cli_main(["verify", str(tmp_path)]) == 0  # all intact
    victim = max((p for p in latest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    size = victim.stat().st_size
    flip_one_block(victim)
    assert victim.stat().st_size == size  # sizes alone would call it complete
    name = str(victim.relative_to(latest))
    with pytest.raises(CheckpointError, match=f"corrupt: {name} does not match the checksum"):
        verify_checkpoint(latest)
    said: list[str] = []
    assert storage.name(resume_point(str(latest), said.append)) == "checkpoint-step00000010"
    assert name in said[0] and "newest complete" in said[-1]
    assert cli_main(["verify", str(tmp_path)]) == 1  # only older ones are intact
    # A completion list cut short (the disk filled while it was written) reads as incomplete.
    older = tmp_path / "checkpoint-step00000010" / "complete-rank0.json"
    older.write_text(older.read_text()[:10])
    with pytest.raises(CheckpointError, match=r"complete-rank0\.json is unreadable"):
        verify_checkpoint(older.parent)


def test_a_resume_whose_newest_checkpoint_fails_its_checksums_as_read_takes_the_one_before(
    tmp_path: Path, pg: None
) -> None:
    """A flipped block in the newest checkpoint's model shard: its listing is complete
    (sizes match), the restore's checked reads catch it, and the worker resumes from the
    checkpoint before, saying why."""
    from raylift.run.worker import restore_newest

    run(tmp_path, train={"max_steps": 10})
    newest = tmp_path / "checkpoint-step00000010"
    flip_one_block(next((newest / "engine").glob("*.distcp")))
    said: list[str] = []
    trainer = make_trainer(make_config(**SMALL), 0, 1, LocalReporter(tmp_path / "x"))
    trainer.ctx.log = said.append
    restore_newest(trainer, str(tmp_path), str(newest))
    assert trainer.state.step == 5
    assert "is corrupt: engine/__0_0.distcp bytes" in said[0] and said[0].endswith(
        "looking for the previous complete checkpoint"
    )
    assert any("resumed from" in line and "checkpoint-step00000005" in line for line in said)
    # With every checkpoint damaged, the run stops: part of the state may be loaded already.
    flip_one_block(next((tmp_path / "checkpoint-step00000005" / "engine").glob("*.distcp")))
    with pytest.raises(CheckpointError, match="no complete checkpoint to resume from"):
        restore_newest(trainer, str(tmp_path), str(newest))


def test_verify_exits_2_with_no_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from raylift.cli import main as cli_main

    assert cli_main(["verify", str(tmp_path)]) == 2
    assert "no checkpoint-step* folders" in capsys.readouterr().err


WIDE_GPT = {
    "task": "gpt",
    # Weights of several blocks each (ranged reads come in 1 MiB blocks): 28 MiB of model.
    "task_args": {
        "block_size": 32,
        "n_layer": 1,
        "n_head": 12,
        "d_model": 768,
        "max_bytes": 50_000,
    },
    "data": {"batch_size": 8},
    "train": {"max_steps": 2, "max_epochs": 1},
    "checkpoint": {"every_n_steps": 2},
}
RESHARDED = {
    "fsdp": {"name": "fsdp"},
    "zero3": {"name": "deepspeed", "zero_stage": 3, "config": {"zero_optimization": {
        "stage3_param_persistence_threshold": 0}}},
}  # fmt: skip


def restore_from_store(
    rank: int, world: int, cfg_dict: dict, ckpt: str, endpoint: str, out: str
) -> None:
    """In a pool rank: restore ``ckpt`` (an s3:// URI) through the S3 server at ``endpoint``;
    the problem found (every rank's the same) or the restored parameters."""
    from raylift.validation import config_from_dict
    from tests.helpers import full_params
    from tests.unit.test_deepspeed import full_params as zero_params

    os.environ["AWS_ENDPOINT_URL"] = endpoint
    trainer = make_trainer(config_from_dict(cfg_dict), rank, world, LocalReporter(Path(out)))
    try:
        trainer.restore(ckpt)
    except CheckpointError as exc:
        torch.save({"problem": str(exc)}, f"{out}.{rank}")
        return
    engine = trainer.engine
    params = zero_params(engine) if hasattr(engine, "ds") else full_params(engine.module)
    torch.save({"problem": None, "params": params}, f"{out}.{rank}")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", sorted(RESHARDED))
def test_a_resume_from_an_object_store_reads_each_ranks_share_once(
    tmp_path: Path, s3_server: str, strategy: str
) -> None:
    """Restoring a 2-rank checkpoint from the S3 server at 2 ranks and at 1, and a 1-rank
    one at 2, with the bytes the server sent counted by a proxy in front of it: each rank
    reads its own shards, not the whole checkpoint, and nothing twice to check it (at most
    1.2x the checkpoint). A flipped block in the file rank 1 reads stops both ranks'
    restore with one verdict."""
    import pyarrow.fs as pafs
    from safetensors.torch import load_file

    from raylift.artifacts.export import consolidated_state_dict
    from tests.helpers import CountingProxy, run_ranks, train_keep_checkpoints

    cfg = make_config(**merge(WIDE_GPT, {"strategy": RESHARDED[strategy]})).to_dict()
    out = str(tmp_path / "restored")

    def in_store(written_by: int) -> tuple[str, int]:
        """A checkpoint written by ``written_by`` ranks, copied to the store; its bytes."""
        run_ranks(
            written_by, tmp_path, train_keep_checkpoints, cfg, str(tmp_path / f"run{written_by}")
        )
        local = tmp_path / f"run{written_by}" / "checkpoint-step00000002"
        uri = f"s3://runs/{strategy}-{tmp_path.name}-{written_by}/checkpoint-step00000002"
        s3, where = storage.filesystem(uri)
        pafs.copy_files(str(local), where, destination_filesystem=s3)
        return uri, sum(p.stat().st_size for p in local.rglob("*") if p.is_file())

    def restored(world: int, uri: str, size: int, bound: float = 1.2) -> dict[str, torch.Tensor]:
        proxy = CountingProxy(s3_server)
        try:
            run_ranks(world, tmp_path, restore_from_store, cfg, uri, proxy.endpoint, out)
        finally:
            proxy.close()
        found = torch.load(f"{out}.0", weights_only=True)
        assert found["problem"] is None, found["problem"]
        assert size > 8 << 20 and proxy.served <= bound * size, (world, proxy.served, size)
        return found["params"]  # type: ignore[no-any-return]

    uri, size = in_store(2)
    params = {world: restored(world, uri, size) for world in (2, 1)}
    assert params[1].keys() == params[2].keys()
    for name, value in params[2].items():
        assert torch.equal(params[1][name], value), name
    one_uri, one_size = in_store(1)
    written_alone = consolidated_state_dict(tmp_path / "run1" / "checkpoint-step00000002")
    # 1 -> 2: each rank reads its half of every weight and moment. Reads come in checked
    # blocks of 1 MiB, and this model's weights are 0.75-9 MiB: where a rank's half ends
    # inside a block the other rank reads it too (ZeRO-3's pieces of each weight lie end to
    # end, so every weight's halves meet inside one); measured 1.19x (fsdp), 1.29x (zero3).
    bound = {"fsdp": 1.2, "zero3": 1.35}[strategy]
    for name, value in restored(2, one_uri, one_size, bound).items():
        assert torch.equal(written_alone[name], value), name
    # `raylift export` reads the model's bytes alone: not the optimizer's moments, nor
    # anything twice to check it; it writes the restored weights.
    proxy = CountingProxy(s3_server)
    out_file = tmp_path / "model.safetensors"
    try:
        exported = subprocess.run(
            [sys.executable, "-m", "raylift.cli", "export", uri, "--out", str(out_file)],
            env={**os.environ, "AWS_ENDPOINT_URL": proxy.endpoint}, capture_output=True,
            text=True, check=False,
            timeout=HANG_S,
        )  # fmt: skip
    finally:
        proxy.close()
    assert exported.returncode == 0, exported.stderr
    model = load_file(out_file)
    model_bytes = sum(t.numel() * t.element_size() for t in model.values())
    assert proxy.served <= 1.2 * model_bytes < 0.5 * size, (proxy.served, model_bytes, size)
    for name, value in params[2].items():  # a tied weight once, under its first name
        assert torch.equal(model.get(name, params[2]["tok.weight"]), value), name
    # Corrupt one block of a file only rank 1 reads, in the store itself: in the middle
    # of its largest, where tensors are (a byte of a zip's padding is never read).
    rank1 = re.compile(r"(__1_0\.distcp|zero_pp_rank_1_)")
    victim = max((n for n in storage.files_under(uri) if rank1.search(n[0])), key=lambda n: n[1])[0]
    data = bytearray(storage.read_bytes(storage.join(uri, victim)) or b"")
    data[len(data) // 2] ^= 0xFF
    storage.write_bytes(storage.join(uri, victim), bytes(data))
    run_ranks(2, tmp_path, restore_from_store, cfg, uri, s3_server, out)
    problems = [torch.load(f"{out}.{r}", weights_only=True)["problem"] for r in range(2)]
    assert problems[0] == problems[1] and victim in problems[0] and "corrupt" in problems[0]


def test_an_async_save_whose_copy_cannot_fit_in_host_memory_is_refused_before_taking_it(
    tmp_path: Path, pg: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """checkpoint.async copies the rank's part into host memory: on a node whose available
    memory (as psutil reads it, here set low) cannot hold it, the save is refused with the
    numbers and the fix, and nothing of it is written; async: false saves on that node."""
    import psutil

    reading = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: reading._replace(available=64 << 10))
    with pytest.raises(storage.StorageError) as caught:
        run(tmp_path / "run", train={"max_steps": 4}, checkpoint={"every_n_steps": 2})
    said = str(caught.value)
    assert "set checkpoint.async: false" in said, said
    assert re.search(r"rank 0 needs about \d+\.\d [KM]iB for it and this node has 64\.0 KiB", said)
    assert not list((tmp_path / "run").glob("checkpoint-*"))
    run(tmp_path / "sync", train={"max_steps": 4}, checkpoint={"every_n_steps": 2, "async": False})
    assert len(list((tmp_path / "sync").glob("checkpoint-*"))) == 2


def train_and_keep_rows(rank: int, world: int, cfg_dict: dict, root: str) -> None:
    """Train to the end, checkpoints under ``root``; rank 0 keeps what it logged."""
    from raylift.validation import config_from_dict

    tracker = ListTracker()
    make_trainer(config_from_dict(cfg_dict), rank, world, LocalReporter(Path(root)), tracker).run()
    if rank == 0:
        torch.save(tracker.rows, Path(root) / "rows.pt")


@pytest.mark.slow
def test_async_and_sync_saves_write_the_same_checkpoints_and_log_what_they_cost(
    tmp_path: Path,
) -> None:
    """FSDP on 2 ranks, a checkpoint every step (each save waits for the one before):
    uploaded by a thread while the loop trains, or before it goes on, the same bytes land
    in storage, and each checkpoint logs the loop's stop, its time to storage and its bytes."""
    from tests.helpers import GPT_SMALL, run_ranks

    roots = {}
    for background in (True, False):
        over = {"strategy": {"name": "fsdp"}, "train": {"max_steps": 3, "max_epochs": 1},
                "checkpoint": {"every_n_steps": 1, "async": background}}  # fmt: skip
        cfg = make_config(**merge(GPT_SMALL, over)).to_dict()
        roots[background] = tmp_path / f"async-{background}"
        run_ranks(2, tmp_path, train_and_keep_rows, cfg, str(roots[background]))
    losses = {b: {s: m["train_loss"] for s, m in torch.load(r / "rows.pt", weights_only=True)
                  if "train_loss" in m} for b, r in roots.items()}  # fmt: skip
    assert losses[True].keys() == losses[False].keys() == {1, 2, 3}, losses
    for step, loss in losses[True].items():
        assert abs(loss - losses[False][step]) <= 1e-5 * abs(loss), losses
    for step in (1, 2, 3):
        name = f"checkpoint-step{step:08d}"
        parts = {b: sorted(p.relative_to(r / name) for p in (r / name).rglob("*") if p.is_file())
                 for b, r in roots.items()}  # fmt: skip
        assert parts[True] == parts[False] and parts[True]
        # The shards and RNG states; DCP's .metadata names each save with a random id.
        engine = [p for p in parts[True] if p.suffix == ".distcp" or p.name.startswith("rng")]
        assert len(engine) == 4
        for part in engine:
            a, b = ((roots[x] / name / part).read_bytes() for x in (True, False))
            # Step 1's save is taken before anything trains beside an upload: the same
            # state, so the same bytes (a copy that aliased the live state, written while
            # step 2 trains, would differ). Steps 2 and 3 trained while a thread uploaded,
            # and the math libraries may round their last bits otherwise (seen in a busy
            # suite: 1e-8 in weights, more after Adam in elements near zero): the same
            # layout and RNG, and the loss curve above. (Compared outside the assert:
            # pytest explains two unequal megabytes with difflib, for hours.)
            same = a == b if step == 1 or part.name.startswith("rng") else len(a) == len(b)
            assert same, f"{name}/{part} differs between async and sync saves"
        verify_checkpoint(str(roots[True] / name))
        logged = next(m for s, m in torch.load(roots[True] / "rows.pt", weights_only=True)
                      if s == step and "checkpoint_bytes" in m)  # fmt: skip
        written = sum((roots[True] / name / p).stat().st_size for p in parts[True]
                      if not p.name.startswith("complete-"))  # fmt: skip
        assert logged["checkpoint_bytes"] == written
        assert logged["checkpoint_blocked_s"] > 0 and logged["checkpoint_save_s"] > 0
        assert 0 <= logged["checkpoint_wait_s"] <= logged["checkpoint_blocked_s"]


def test_checkpoints_in_an_object_store_verify_fall_back_and_export_as_local_ones(
    tmp_path: Path, pg: None, s3_server: str, capsys: pytest.CaptureFixture
) -> None:
    """The same code on s3:// (the S3 server): listing, checksums, the fallback past a
    damaged newest checkpoint, a resume from the URI, verify and export."""
    import pyarrow.fs as pafs
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from raylift.artifacts.export import consolidated_state_dict
    from raylift.cli import main as cli_main
    from raylift.tensors.checkpoints import CheckpointReader, newest_complete
    from raylift.tensors.streaming import DCPModel

    first, _, _, trained = run(tmp_path / "run", train={"max_steps": 10})
    run_uri = f"s3://runs/unit-{tmp_path.name}"
    s3, where = storage.filesystem(run_uri)
    pafs.copy_files(str(tmp_path / "run"), where, destination_filesystem=s3)
    newest = f"{run_uri}/checkpoint-step00000010"
    assert cli_main(["verify", run_uri]) == 0
    assert newest_complete(run_uri, print) == newest
    # A flipped byte in the newest checkpoint's first weight, in the store itself: what
    # every reader of it, an export too, must catch.
    model = DCPModel(CheckpointReader(newest))
    chunks = model.meta.state_dict_metadata[model.specs[0].fqn].chunks
    info = model.meta.storage_data[MetadataIndex(model.specs[0].fqn, chunks[0].offsets)]
    victim = f"{newest}/engine/{info.relative_path}"
    data = bytearray(storage.read_bytes(victim) or b"")
    data[info.offset + info.length // 2] ^= 0xFF
    storage.write_bytes(victim, bytes(data))
    said: list[str] = []
    older = newest_complete(run_uri, said.append)
    assert older == f"{run_uri}/checkpoint-step00000005", said
    assert "is corrupt" in said[0] and said[0].startswith(f"raylift: checkpoint {newest}")
    capsys.readouterr()
    assert cli_main(["verify", run_uri]) == 1  # only an older one is intact
    out = capsys.readouterr().out
    assert f"raylift: {run_uri}: no config.yaml" in out  # written by the test, not a run
    assert "a rerun resumes from checkpoint-step00000005" in out
    # A resume from the URI continues the first run: its steps 6-10 and its final weights.
    again, _, _, resumed = run(tmp_path / "again", restore=older, train={"max_steps": 10})
    assert sorted(again.series("train_loss")) == [6, 7, 8, 9, 10]
    for step, loss in again.series("train_loss").items():
        assert loss == pytest.approx(first.series("train_loss")[step], rel=1e-6), step
    for name, value in trained.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], value, msg=name)
    # Export reads the newest intact checkpoint, names it with its scheme, and writes it.
    exported = consolidated_state_dict(older)
    assert cli_main(["export", run_uri, "--out", str(tmp_path / "m.pt")]) == 0
    assert f"from {older} to" in capsys.readouterr().out  # the scheme kept
    got = torch.load(tmp_path / "m.pt", weights_only=True)
    assert got.keys() == exported.keys()
    for name, value in exported.items():
        torch.testing.assert_close(got[name], value, msg=name)


def died() -> Exception:
    """Ray's own error for a Train worker whose process died, as the driver receives it
    (Ray writes the text; the error message is what the raylet reports)."""
    from ray.core.generated.common_pb2 import ActorDiedErrorContext
    from ray.exceptions import ActorDiedError

    return ActorDiedError(
        ActorDiedErrorContext(
            class_name="RayTrainWorker", actor_id=b"\x01" * 16, pid=29630,
            node_ip_address="10.0.3.7",
            error_message="The actor is dead because its worker process has died. Worker "
            "exit type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a "
            "connection error code 2. End of file. Some common causes include: ...",
        )
    )  # fmt: skip


def test_a_handled_fault_is_one_line_naming_rank_node_cause_checkpoint_and_restarts() -> None:
    from raylift.run.faults import describe

    # Rank 1 died; rank 0's all-reduce broke because of it: rank 1 is named, once.
    failures = {0: RuntimeError("Connection reset by peer"), 1: died()}
    ckpt = "s3://runs/r1/digits-ddp/checkpoint-step00000100"
    line = describe(failures, 1, 3, ckpt)
    assert line == (
        "raylift: worker rank 1 on node 10.0.3.7 failed: its process died (SYSTEM_ERROR: "
        "Worker unexpectedly exits with a connection error code 2): killed, out of memory "
        "or crashed, 1 other rank(s) failed with it; restarting the workers from "
        f"{ckpt} (restart 1 of 3)"
    )
    assert "\n" not in line
    last = describe({0: ValueError("shapes do not match\nat call 3")}, 2, 1, None)
    assert last == (
        "raylift: worker rank 0 failed: ValueError: at call 3; "
        "no restarts left (train.max_failures: 1): the run fails"
    )
    first = describe({1: died()}, 1, -1, None)
    assert first.endswith("from step 0 (no checkpoint was written yet) (restart 1, no limit)")
    # A node's raylet killed: no process is reported dead yet, rank 0's collective broke.
    lost = (
        "node 10.0.3.8 stopped answering (its raylet takes no connection) with worker "
        "rank(s) [1] on it"
    )
    gloo = RuntimeError("[pair.cc:553] Connection closed by peer [10.0.3.8]:4535")
    line = describe({0: gloo}, 1, 2, None, memory=True, lost=lost)
    assert line == (
        f"raylift: {lost}; worker rank 0 failed with it (RuntimeError: [pair.cc:553] "
        "Connection closed by peer [10.0.3.8]:4535); restarting the workers from step 0 (no "
        "checkpoint was written yet) or a newer memory snapshot (restart 1 of 2)"
    )


def test_the_tracking_actor_knows_which_ranks_ran_on_a_node_by_their_newest_process() -> None:
    from raylift.artifacts.tracking_service import Store

    store = Store("sqlite:///unused.db")
    for actor, rank, node in [("a0", 0, "n1"), ("a1", 1, "n2"), ("b0", 0, "n2"), ("b1", 1, "n1")]:
        store.worker_started(actor, {"rank": rank, "node_id": node, "ip": f"ip-{node}"})
    # After a restart the ranks swapped nodes: the newest process of each rank counts.
    assert store.ranks_on(["n2"]) == {0: "ip-n2"}
    assert store.ranks_on(["n1", "n2"]) == {0: "ip-n2", 1: "ip-n1"}
    assert store.ranks_on(["n3"]) == {}


def test_what_killed_processes_left_in_the_temp_folder_is_removed_with_the_bytes_freed(
    tmp_path: Path,
) -> None:
    """A rank killed while it staged its part leaves a copy of its weights in the node's
    temp folder; the next worker on the node removes it, and those of every naming raylift
    has used (an older one with no pid in it, once a day untouched), and only those."""
    import subprocess
    import sys
    import time

    code = "import os; print(os.getpid())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=HANG_S)  # fmt: skip
    dead = done.stdout.strip()
    left = {
        tmp_path / f"raylift-ckpt-{dead}-abc123": 7,
        tmp_path / f"raylift-ds-universal-{dead}-q1": 3,
        tmp_path / "raylift-copy-k2j3h4": 5,  # an older naming, a day untouched
    }
    for folder, size in left.items():
        (folder / "engine").mkdir(parents=True)
        (folder / "engine" / "model.pt").write_bytes(b"w" * size)
    day_ago = time.time() - storage.UNNAMED_STALE_S - 60
    for path in [*(tmp_path / "raylift-copy-k2j3h4").rglob("*"), tmp_path / "raylift-copy-k2j3h4"]:
        os.utime(path, (day_ago, day_ago))
    kept = [
        tmp_path / f"raylift-ckpt-{os.getpid()}-def456",  # a live process's, mid-save
        tmp_path / "raylift-ckpt-x9y8z7",  # an older naming, touched today
        tmp_path / f"raylift-mlflow-{dead}",  # not one of raylift's model-sized folders
    ]
    for folder in kept:
        folder.mkdir()
    removed, freed = storage.sweep_scratch(tmp_path)
    assert sorted(removed) == sorted(left) and freed == 15
    assert all(not p.exists() for p in left) and all(p.is_dir() for p in kept)


def test_a_crashed_process_is_named_by_its_signal_or_by_what_left_no_dump() -> None:
    """The signal comes from Python's fault dump at the end of the process's stderr; no
    dump is SIGKILL (the OOM killer's) or os._exit, with its node's memory."""
    from raylift.run.faults import Crash

    dump = ["Fatal Python error: Bus error", "", "Current thread 0x7f (most recent call first):",
            '  File "/home/me/mytask.py", line 40 in loss']  # fmt: skip
    bus = Crash(1, "10.0.0.2", 4242, "/tmp/ray/logs/worker-1.err", dump)
    assert bus.signal() == ("SIGBUS", "Bus error")
    report = bus.report("/home/me/raylift-logs/r.log")
    assert report[0] == "raylift: worker rank 1 on node 10.0.0.2: its process (pid 4242) " \
        "died by SIGBUS (Bus error):"  # fmt: skip
    assert report[1:5] == [f"    {line}" for line in dump]
    assert report[5] == (
        "raylift: its stderr: /tmp/ray/logs/worker-1.err on node 10.0.0.2; "
        "this run's log: /home/me/raylift-logs/r.log"
    )
    killed = Crash(0, "10.0.0.3", 7, None, [":actor_name:RayTrainWorker"], (21.5 * 2**30, 2**35))
    assert killed.signal() is None
    assert killed.how() == (
        "its process (pid 7) ended without a Python error or a fault dump: SIGKILL, often "
        "the kernel's OOM killer; node 10.0.0.3 had 21.5 of 32.0 GiB in use at its last "
        "logging interval, or an exit that skips Python (os._exit)"
    )
    assert "node is gone" in Crash(0, "10.0.0.3", 7, None, None).how()
    assert "reclaimed (preempted)" in Crash(0, "10.0.0.3", 7, None, None, preempted=True).how()


def test_the_newest_written_checkpoint_passes_over_one_the_disk_cut_off(tmp_path: Path) -> None:
    """A full disk cut the step-12 checkpoint's loop state to nothing after every rank's
    completion marker was written: the fault report (and the restart) name step 8, and
    reading it raises nothing."""
    import torch

    from raylift.tensors.checkpoints import FORMAT, LOOP_FILE, newest_written

    for step, state in ((8, {"format": FORMAT, "world_size": 2}), (12, None)):
        folder = tmp_path / f"checkpoint-step{step:08d}"
        folder.mkdir()
        if state is None:
            (folder / LOOP_FILE).write_bytes(b"")
        else:
            torch.save(state, folder / LOOP_FILE)
        for rank in range(2):
            (folder / f"complete-rank{rank}.json").write_text("{}")
    assert newest_written(str(tmp_path)) == str(tmp_path / "checkpoint-step00000008")


@contextlib.contextmanager
def small_disk(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` at ``where`` (mounting needs root: the test skips without it)."""
    where.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True, text=True, check=False, timeout=HANG_S)  # fmt: skip
    if made.returncode != 0:
        pytest.skip(f"a small disk needs mount: {made.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, timeout=HANG_S)


def test_a_save_whose_part_cannot_fit_on_the_local_disk_is_refused_before_writing(
    tmp_path: Path, pg: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each save first writes the rank's part to the node's temp folder; a temp folder on
    a disk too small for it stops the run at the save, with the numbers and the fix, and
    nothing of it left anywhere."""
    import tempfile

    with small_disk(tmp_path / "disk", "4k") as disk:
        monkeypatch.setattr(tempfile, "tempdir", str(disk))
        with pytest.raises(storage.StorageError) as caught:
            run(tmp_path / "run", train={"max_steps": 4}, checkpoint={"every_n_steps": 2})
        said = str(caught.value)
        assert f"on this node's local disk ({disk})" in said and "set TMPDIR" in said, said
        assert re.search(r"needs about \d+\.\d [KM]iB .* and \d+\.\d KiB is free there", said)
        assert list(disk.iterdir()) == []
    assert not list((tmp_path / "run").glob("checkpoint-*"))
