"""End to end on the session's local Ray: 2 CPU workers, DDP over gloo, real MLflow store."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from raylift.cli import main as cli_main
from raylift.config import load_config
from raylift.launch import WORKER_ENV, train
from raylift.precision import DeviceFacts, choose
from raylift.startup import PHASES

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"


def mlflow_run(tmp: Path, run_id: str):  # type: ignore[no-untyped-def]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}")
    return client, client.get_run(run_id)


def history(client, run_id: str, key: str) -> dict[int, float]:  # type: ignore[no-untyped-def]
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


def test_quickstart_trains_and_logs_one_mlflow_run(ray_cluster: str, in_tmp: Path) -> None:
    cfg = load_config(QUICKSTART, ["name=qs", "train.max_epochs=3", "storage=./runs"])
    result = train(cfg)
    assert result.metrics["val_acc"] > 0.85
    assert Path(result.checkpoint or "").name == "checkpoint-step00000066"
    client, run = mlflow_run(in_tmp, result.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["raylift.strategy"] == "ddp"
    # precision: auto, resolved for a CPU worker of this host and recorded as resolved
    assert run.data.tags["raylift.precision"] == choose(DeviceFacts.here(use_gpu=False))[0]
    assert run.data.tags["raylift.world_size"] == "2"
    assert run.data.tags["raylift.final_checkpoint"] == result.checkpoint
    assert run.data.params["optim.lr"] == "0.003"
    timing = ("step_forward_frac", "step_backward_frac", "step_optimizer_frac", "step_h2d_frac")
    measures = ("mfu", "mem_rss_bytes", "step_time_s", "data_wait_frac", "step_sync_frac")
    for key in ("train_loss", "val_loss", "val_acc", "samples_per_s", "lr", *timing, *measures):
        assert history(client, result.run_id, key), key
    assert max(history(client, result.run_id, "val_acc")) == 66  # global step as MLflow step
    runs = client.search_runs([run.info.experiment_id])
    assert len(runs) == 1  # one run per training run, not one per worker


def test_a_nan_loss_under_stop_fails_the_run_through_ray(
    ray_cluster: str, in_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The stop is a report without a checkpoint, which Ray Train's result does not
    carry: the driver still sees it, exits 1 and keeps the last good checkpoint."""
    code = cli_main(
        [
            "train",
            str(QUICKSTART),
            "name=nan",
            "task=tests.flaky:NanDigits",
            "task_args={nan_at: 13, width: 8}",
            "train.max_steps=20",
            "train.log_every_n_steps=5",
            "checkpoint.every_n_steps=10",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1, err
    assert "inf/NaN at step 13" in err and "checkpoint-step00000010" in err, err
    client, run = mlflow_run(in_tmp, find_only_run(in_tmp))
    assert run.info.status == "FAILED"
    assert list(history(client, run.info.run_id, "nonfinite_step").values()) == [13.0]


def find_only_run(tmp: Path) -> str:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("raylift").experiment_id])
    return str(run.info.run_id)


# What raylift train prints: its own notes, and rank 0's progress lines.
OURS = ("raylift: ", "epoch ", "model state held by rank 0", "early stopping at step")
STARTUP_KEYS = {f"startup/{p}_s" for p in PHASES}


def cli_env() -> dict[str, str]:
    # A second driver joining the session's cluster uses its token.
    # The session's Ray was started with raylift's worker environment; a user's shell has none.
    env = {k: v for k, v in os.environ.items() if k not in WORKER_ENV}
    return {**env, "RAY_AUTH_MODE": "token", "PYTHONUNBUFFERED": "1"}


@pytest.mark.slow
def test_ctrl_c_of_the_driver_then_rerun_resumes(ray_cluster: str, in_tmp: Path) -> None:
    args = [
        sys.executable,
        "-m",
        "raylift.cli",
        "train",
        str(QUICKSTART),
        "name=ctrlc",
        "train.early_stopping=null",
        "train.max_epochs=5",
        "checkpoint.every_n_steps=20",
    ]
    proc = subprocess.Popen(
        args, cwd=in_tmp, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    run_dir = in_tmp / "runs" / "ctrlc"
    deadline = time.time() + 240
    # Two checkpoints on disk: the first is complete and registered with Ray (a SIGINT
    # during a checkpoint's write may leave that one incomplete, and the run resume
    # from step 0, which this test is not about).
    while time.time() < deadline and len(list(run_dir.glob("checkpoint-step*/loop_state.pt"))) < 2:
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, out[-2000:]
    saved = sorted(run_dir.glob("checkpoint-step*"))
    assert saved, out[-2000:]
    resumed = subprocess.run(
        args, cwd=in_tmp, env=cli_env(), capture_output=True, text=True, timeout=400
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resuming from its latest checkpoint" in resumed.stdout
    found = re.search(r"resumed from \S+checkpoint-step(\d+) at step (\d+)", resumed.stdout)
    assert found, resumed.stdout[-3000:]
    ckpt_step, step = int(found.group(1)), int(found.group(2))
    assert step == ckpt_step >= 20 and f"checkpoint-step{ckpt_step:08d}" in {p.name for p in saved}
    assert "at step 110" in resumed.stdout  # ran on to the end: 5 epochs x 22 steps


@pytest.fixture(scope="module")
def kill_storage(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One storage for the kill tests: every run shares the shards prepared by the first."""
    return tmp_path_factory.mktemp("kill-runs")


def kill_overrides(storage: Path) -> list[str]:
    return [
        "task=tests.flaky:KilledGPT",
        f"task_args.marker={storage / 'killed'}",
        "task_args.kill_at=6",
        "task_args.max_bytes=200000",
        "task_args.n_layer=2",
        "task_args.d_model=64",
        "task_args.block_size=64",
        "train.eval_every_n_steps=null",
        "train.log_every_n_steps=4",
        "train.max_steps=12",
        "train.max_failures=1",
        "checkpoint.every_n_steps=4",
        "optim.warmup_steps=2",
        "precision=32",
        f"storage={storage}",
    ]


@pytest.fixture(scope="module")
def uninterrupted(ray_cluster: str, kill_storage: Path) -> dict[str, float]:
    """The run without a kill, on DDP: in fp32 every strategy follows DDP's curve to ~1e-6
    (test_strategies), so one reference serves them all."""
    (kill_storage / "killed").write_text("no kill")
    extra = ["name=clean", f"tracking.uri=sqlite:///{kill_storage / 'mlflow.db'}"]
    cfg = load_config(REPO / "configs" / "gpt-tiny.yaml", [*kill_overrides(kill_storage), *extra])
    return train(cfg).metrics


@pytest.mark.slow
# DDP only: its DCP checkpoint is written by every rank into its own folder and merged by
# Ray, as every sharded strategy's is. That FSDP, fairscale and DeepSpeed checkpoints
# resume and reshard to another world size is shown without Ray's restart around it, in
# test_strategies and test_deepspeed.
@pytest.mark.parametrize("strategy", ["tiny"])
def test_a_killed_worker_costs_one_checkpoint_interval_then_the_run_resumes_smaller(
    ray_cluster: str, in_tmp: Path, kill_storage: Path, uninterrupted: dict, strategy: str
) -> None:
    """SIGKILL of rank 1 mid-run: Ray restarts the group from the latest checkpoint and the
    run ends where an uninterrupted one does. Then the same run resumes on 1 worker (each
    rank wrote its shards to its own folder, Ray merged them) and exports."""
    marker = kill_storage / "killed"
    common = kill_overrides(kill_storage)
    path = REPO / "configs" / f"gpt-{strategy}.yaml"
    marker.unlink(missing_ok=True)
    killed = train(load_config(path, [*common, f"name=kill-{strategy}"]))
    assert marker.read_text().startswith("killed pid"), "rank 1 was never killed"
    assert killed.metrics["step"] == 12
    assert killed.metrics["val_loss"] == pytest.approx(uninterrupted["val_loss"], rel=0.02)
    client, run = mlflow_run(in_tmp, killed.run_id)
    assert history(client, killed.run_id, "restarts") == {4: 1.0}
    # Killed at step 6, restarted from step 4: two steps redone, within one interval of 4.
    assert run.data.tags["raylift.restart.1"].startswith("step 4 from checkpoint-step00000004")
    # The start-up is the command's, logged once at its first step, not again by the restart.
    assert list(history(client, killed.run_id, "startup/total_s")) == [1]
    smaller = train(
        load_config(
            path, [*common, f"name=kill-{strategy}", "train.max_steps=16", "scaling.num_workers=1"]
        )
    )
    assert smaller.run_id == killed.run_id and smaller.metrics["step"] == 16
    # One MLflow run across the kill and the rerun; nothing logged twice; what changed is tagged.
    assert sorted(history(client, killed.run_id, "train_loss")) == [4, 8, 12, 16]
    assert sorted(history(client, killed.run_id, "startup/total_s")) == [1, 13]  # the rerun's
    _, run = mlflow_run(in_tmp, killed.run_id)
    assert run.data.tags["raylift.resume_override.train.max_steps"] == "16"
    bpb = history(client, killed.run_id, "val_bpb")
    assert bpb[0] > 7.0 and bpb[16] < bpb[0] - 1.0  # from ~8 bits (uniform) down
    assert history(client, killed.run_id, "tokens_per_s")
    assert history(client, killed.run_id, "model_state_bytes_per_rank")
    out = in_tmp / "model.pt"
    assert cli_main(["export", str(kill_storage / f"kill-{strategy}"), "--out", str(out)]) == 0
    assert len(torch.load(out, weights_only=True)) > 0
