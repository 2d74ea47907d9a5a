"""The model, config and data a run logs to MLflow, without Ray: which checkpoint is logged,
the keys that ask for it, the dataset records, the system metrics and a submitted job's
default store."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from raylift.artifacts.mlmodel import choose_checkpoint, dataset_records, monitored
from raylift.core.config import ConfigError
from raylift.core.names import is_mlflow_uri
from raylift.data.manifest import Manifest, ShardFile
from raylift.tensors.checkpoints import FORMAT, LOOP_FILE
from raylift.tensors.metrics import system_now
from raylift.validation import load_config

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"


def fake_checkpoint(run: Path, step: int, val_loss: float | None, complete: bool = True) -> None:
    """A one-rank checkpoint holding only its loop state: complete (its rank's listing of
    what it wrote, as a save writes it last) or not."""
    from raylift.tensors.checkpoints import file_digest

    folder = run / f"checkpoint-step{step:08d}"
    folder.mkdir(parents=True)
    metrics = {} if val_loss is None else {"val_loss": val_loss}
    torch.save({"format": FORMAT, "metrics": metrics}, folder / LOOP_FILE)
    if complete:
        state = folder / LOOP_FILE
        listed = {LOOP_FILE: {"size": state.stat().st_size, "xxh3": file_digest(state)}}
        (folder / "complete-rank0.json").write_text(json.dumps(listed))


def test_best_is_the_best_scored_checkpoint_and_the_later_on_a_tie(tmp_path: Path) -> None:
    for step, loss in [(10, 0.9), (20, 0.4), (30, 0.6), (40, 0.4), (50, None)]:
        fake_checkpoint(tmp_path, step, loss)
    best = choose_checkpoint(str(tmp_path), "best", "val_loss", "min", log=lambda _: None)
    assert best is not None and best.endswith("checkpoint-step00000040")
    top = choose_checkpoint(str(tmp_path), "best", "val_loss", "max", log=lambda _: None)
    assert top is not None and top.endswith("checkpoint-step00000010")


def test_best_passes_over_a_better_checkpoint_that_is_not_complete(tmp_path: Path) -> None:
    """The best-scored checkpoint was never finished by its rank: the best complete one is
    logged instead (the finished run ended in RunFailed)."""
    fake_checkpoint(tmp_path, 10, 0.5)
    fake_checkpoint(tmp_path, 20, 0.1, complete=False)
    fake_checkpoint(tmp_path, 30, 0.7)
    said: list[str] = []
    best = choose_checkpoint(str(tmp_path), "best", "val_loss", "min", log=said.append)
    assert best is not None and best.endswith("checkpoint-step00000010")
    assert len(said) == 1 and "passing over" in said[0] and "step00000020" in said[0], said


def test_best_follows_early_stopping_else_val_loss() -> None:
    cfg = load_config(
        QUICKSTART, ["train.early_stopping.monitor=val_acc", "train.early_stopping.mode=max"]
    )
    assert monitored(cfg) == ("val_acc", "max")
    assert monitored(load_config(QUICKSTART, ["train.early_stopping=null"])) == ("val_loss", "min")


def test_best_keeps_the_best_checkpoints_not_only_the_newest() -> None:
    """With keep: 3 and patience past three evaluations, the newest three alone would no
    longer hold the best one by the end of the run."""
    from raylift.run.launch import checkpoint_config

    final = checkpoint_config(load_config(QUICKSTART, ["checkpoint.keep=3"]))
    assert final.num_to_keep == 3 and final.checkpoint_score_attribute is None
    best = checkpoint_config(load_config(QUICKSTART, [
        "checkpoint.keep=3", "tracking.log_model=best",
        "train.early_stopping.monitor=val_acc", "train.early_stopping.mode=max",
    ]))  # fmt: skip
    assert best.num_to_keep == 3
    assert (best.checkpoint_score_attribute, best.checkpoint_score_order) == ("val_acc", "max")


def test_log_model_and_register_as_are_checked_with_their_fix() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(QUICKSTART, ["tracking.log_model=always", "tracking.register_as=''"])
    text = str(err.value)
    assert "tracking.log_model: 'always' is not one of ('final', 'best', 'none')" in text
    assert "tracking.register_as: empty" in text
    with pytest.raises(ConfigError, match=r"nothing to register with tracking\.log_model: none"):
        load_config(QUICKSTART, ["tracking.log_model=none", "tracking.register_as=m"])
    cfg = load_config(QUICKSTART, ["model.weights=models:/m/3"])
    assert cfg.tracking.log_model == "final" and is_mlflow_uri(cfg.model.weights)
    assert not is_mlflow_uri("./weights/model.safetensors")


def test_dataset_records_name_the_shards_by_fingerprint_and_the_raw_data() -> None:
    cfg = load_config(QUICKSTART)
    files = {
        "train": (ShardFile("a", 1438, 1, (1438,), 1),),
        "val": (ShardFile("b", 359, 1, (359,), 1),),
    }
    manifest = Manifest("s3://runs/shards/digits-0123", "ab" * 32, files, {})
    shards, raw = dataset_records(cfg, manifest)
    assert (shards.source, shards.source_type, shards.context) == (manifest.root, "s3", "training")
    assert shards.digest == manifest.fingerprint[:36]
    assert shards.profile == {"rows": {"train": 1438, "val": 359}}
    assert raw.source.endswith("digits.csv.gz") and raw.source_type == "local"
    assert raw.context == "source" and len(raw.digest) == 36
    other = dataset_records(dataclasses.replace(cfg, task_args={"width": 8}), manifest)[1]
    assert other.profile == {"task_args": {"width": 8}}


def test_system_metrics_use_mlflows_names_and_need_no_device_sync() -> None:
    system_now(torch.device("cpu"))
    found = system_now(torch.device("cpu"))
    assert set(found) == {
        "system/cpu_utilization_percentage",
        "system/system_memory_usage_megabytes",
        "system/system_memory_usage_percentage",
    }
    assert found["system/system_memory_usage_megabytes"] > 0


@pytest.mark.gpu
def test_system_metrics_name_the_workers_gpu() -> None:
    """The GPU's memory in use rises by what this process takes, under MLflow's names."""
    device, key = torch.device("cuda", 0), "system/gpu_0_memory_usage_megabytes"
    before = system_now(device)[key]
    held = torch.empty(512 * 2**20, dtype=torch.uint8, device=device)
    after = system_now(device)
    assert after[key] - before >= 500, (before, after)  # the 512 MiB now held
    total = torch.cuda.get_device_properties(device).total_memory / 2**20
    percentage = after["system/gpu_0_memory_usage_percentage"]
    assert percentage == pytest.approx(100 * after[key] / total, rel=1e-6)
    del held


def test_a_submitted_jobs_default_store_is_under_raylift_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from raylift.artifacts.tracking import SUBMITTED, default_uri
    from raylift.commands.submit import runtime_env

    env = runtime_env(load_config(QUICKSTART), tmp_path)
    assert env["env_vars"][SUBMITTED] == "1"
    monkeypatch.chdir(tmp_path)
    assert default_uri() == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    monkeypatch.setenv(SUBMITTED, "1")
    monkeypatch.setenv("RAYLIFT_HOME", str(tmp_path / "home"))
    assert default_uri() == f"sqlite:///{(tmp_path / 'home').resolve() / 'mlflow.db'}"
    assert (tmp_path / "home").is_dir()


def test_a_sqlite_stores_artifacts_live_beside_its_file_not_in_the_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A submitted job's driver runs in Ray's copy of the shipped folder, deleted after the
    job: what the run logs must land beside the store in $RAYLIFT_HOME instead."""
    from mlflow.tracking import MlflowClient

    from raylift.artifacts.tracking import start_run

    home, job = tmp_path / "home", tmp_path / "job"
    home.mkdir()
    job.mkdir()
    monkeypatch.chdir(job)
    uri = f"sqlite:///{home / 'mlflow.db'}"
    cfg = load_config(QUICKSTART, [f"tracking.uri={uri}"])
    run_id = start_run(cfg, str(tmp_path / "runs"), resume=False, world_size=1)
    client = MlflowClient(tracking_uri=uri)
    (job / "note.txt").write_text("logged")
    client.log_artifact(run_id, str(job / "note.txt"))
    assert (home / "mlruns" / "raylift" / run_id / "artifacts" / "note.txt").is_file()
    assert not (job / "mlruns").exists()


def test_a_config_of_more_params_than_one_mlflow_batch_is_logged_whole(tmp_path: Path) -> None:
    """MLflow's client cuts log_batch into batches of the store's size (100 params)."""
    from mlflow.tracking import MlflowClient

    from raylift.artifacts.tracking import start_run
    from raylift.core.parsing import flatten

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    keys = [f"strategy.config.k{i}={i}" for i in range(60)]
    cfg = load_config(QUICKSTART, [f"tracking.uri={uri}", "strategy.name=deepspeed", *keys])
    assert len(flatten(cfg.to_dict())) > 100
    run_id = start_run(cfg, str(tmp_path / "runs"), resume=False, world_size=1)
    params = MlflowClient(tracking_uri=uri).get_run(run_id).data.params
    assert params.keys() == flatten(cfg.to_dict()).keys()
    assert params["strategy.config.k59"] == "59"


@contextlib.contextmanager
def committed_first(db: Path, before: str, sql: str, params: tuple[Any, ...]) -> Iterator[list]:
    """Another writer's ``sql``, committed on its own connection to the sqlite store ``db``
    just before this process's first statement that starts with ``before``; yields a list
    that holds True once it landed."""
    import sqlite3

    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    landed: list[bool] = []

    def theirs_first(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.startswith(before) and not landed:
            landed.append(True)
            with sqlite3.connect(db) as other:
                other.execute(sql, params)

    event.listen(Engine, "before_cursor_execute", theirs_first)
    try:
        yield landed
    finally:
        event.remove(Engine, "before_cursor_execute", theirs_first)


def test_two_runs_logging_the_same_shards_at_once_both_get_them(tmp_path: Path) -> None:
    """MLflow looks a dataset up, then inserts it: of two runs logging the same shards at
    once, the second insert fails on the store's unique constraint (seen with two jobs on
    one sqlite store). Here the other run's row is committed between this run's look-up
    and its insert: MLflow raises its real error, and the retry links the winner's row."""
    from raylift.artifacts.tracking import DatasetRecord
    from raylift.artifacts.tracking_service import Store

    db = tmp_path / "mlflow.db"
    store = Store(f"sqlite:///{db}")
    exp = store.client.create_experiment("raylift")
    ours = store.client.create_run(exp).info.run_id
    shards = [DatasetRecord("digits-1", "abc", str(tmp_path), "local", "training", {"rows": 3})]
    real = store.client.log_inputs
    raised: list[Exception] = []

    def watched(run_id: str, datasets: list) -> None:
        try:
            real(run_id, datasets=datasets)
        except Exception as exc:
            raised.append(exc)
            raise

    store.client.log_inputs = watched
    theirs = "INSERT INTO datasets VALUES (?, ?, 'digits-1', 'abc', 'local', '{}', NULL, '{}')"
    with committed_first(db, "INSERT INTO datasets", theirs, ("theirs", int(exp))) as landed:
        store.log_datasets(ours, shards)
    assert landed and len(raised) == 1, raised
    assert "unique constraint failed" in str(raised[0]).lower(), raised
    (got,) = store.client.get_run(ours).inputs.dataset_inputs
    assert got.dataset.name == "digits-1" and got.dataset.digest == "abc"


def test_register_as_works_with_a_sqlite_store_in_another_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLflow resolves a new version's ``models:/`` source through the process-wide URI,
    not the client's: with a store that is not MLflow's default (./mlflow.db) the
    registration failed, and left a ./mlruns in the working folder. The version it makes
    is fetched back as ``model.weights: models:/NAME/1`` fetches it."""
    import mlflow

    from raylift.artifacts.mlmodel import download
    from raylift.artifacts.tracking import start_run
    from raylift.artifacts.tracking_service import Store
    from raylift.tasks import build_task
    from raylift.tensors.preflight import check_for_config
    from raylift.tensors.weights import WeightsError

    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(work)
    uri = f"sqlite:///{elsewhere / 'm.db'}"
    cfg = load_config(QUICKSTART, [f"tracking.uri={uri}", "task_args.width=8"])
    run_id = start_run(cfg, str(tmp_path / "runs"), resume=False, world_size=1)
    store = Store(uri)
    model = tmp_path / "model"
    model.mkdir()
    (model / "weights.bin").write_bytes(b"\0" * 8)
    before = mlflow.get_tracking_uri()
    _, registered = store.log_model(run_id, str(model), {}, "digits")
    assert registered == "models:/digits/1"
    assert mlflow.get_tracking_uri() == before  # the process's URI is put back
    assert not (work / "mlruns").exists() and not (work / "mlflow.db").exists()
    version = store.client.get_model_version("digits", "1")
    assert version.run_id == run_id
    # Fetched from the store (then refused: a byte file is not the task's model).
    with pytest.raises(WeightsError) as refused:
        task = build_task(cfg.task, cfg.task_args)
        download("models:/digits/1", str(tmp_path / "staged"), uri,
                 lambda tmp: check_for_config(cfg, task, tmp))  # fmt: skip
    assert "cannot fetch" not in str(refused.value), refused.value


def test_two_commands_creating_the_experiment_at_once_both_use_it(tmp_path: Path) -> None:
    """The other command's experiment is committed between this one's look-up and its
    create: MLflow's real error, then this command finds the winner's."""
    from mlflow.tracking import MlflowClient

    from raylift.artifacts.tracking import experiment_id

    db = tmp_path / "mlflow.db"
    client = MlflowClient(f"sqlite:///{db}")
    client.search_experiments()  # the store's tables exist
    theirs = (
        "INSERT INTO experiments (name, artifact_location, lifecycle_stage, creation_time, "
        "last_update_time) VALUES ('raylift', ?, 'active', 0, 0)"
    )
    params = (str(tmp_path / "artifacts"),)
    with committed_first(db, "INSERT INTO experiments", theirs, params) as landed:
        found = experiment_id(client, "raylift")
    assert landed
    assert found == client.get_experiment_by_name("raylift").experiment_id


def test_a_trial_started_again_from_scratch_keeps_its_one_child_run(tmp_path: Path) -> None:
    """A trial stopped before its first checkpoint starts afresh on the resumed sweep (no
    resume): it writes to the child it had, where a plain run starts a new one."""
    from raylift.artifacts.tracking import start_run

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = load_config(QUICKSTART, [f"tracking.uri={uri}", "name=sweep-t0"])
    child = {"mlflow.parentRunId": "p" * 32}
    runs = str(tmp_path / "runs")
    first = start_run(cfg, runs, resume=False, world_size=1, extra_tags=child)
    assert start_run(cfg, runs, resume=False, world_size=1, extra_tags=child) == first
    assert start_run(cfg, runs, resume=False, world_size=1) != first
