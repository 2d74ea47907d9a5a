"""End to end on the session's local Ray: 2 CPU workers, DDP over gloo, real MLflow store."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from raylift.cli import main as cli_main
from raylift.config import load_config
from raylift.launch import train

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
    assert run.data.tags["raylift.precision"] == "bf16-mixed"
    assert run.data.tags["raylift.world_size"] == "2"
    assert run.data.tags["raylift.final_checkpoint"] == result.checkpoint
    assert run.data.params["optim.lr"] == "0.003"
    for key in ("train_loss", "val_loss", "val_acc", "samples_per_s", "lr"):
        assert history(client, result.run_id, key), key
    assert max(history(client, result.run_id, "val_acc")) == 66  # global step as MLflow step
    runs = client.search_runs([run.info.experiment_id])
    assert len(runs) == 1  # one run per training run, not one per worker


def test_rerun_with_the_same_name_resumes_the_same_mlflow_run(
    ray_cluster: str, in_tmp: Path
) -> None:
    common = [
        "name=resume",
        "train.max_epochs=10",
        "checkpoint.every_n_steps=10",
        "train.early_stopping=null",
        "train.log_every_n_steps=5",
    ]
    first = train(load_config(QUICKSTART, [*common, "train.max_steps=30"]))
    assert first.metrics["step"] == 30
    second = train(load_config(QUICKSTART, [*common, "train.max_steps=50"]))
    assert second.run_id == first.run_id
    assert second.metrics["step"] == 50
    client, run = mlflow_run(in_tmp, first.run_id)
    steps = sorted(history(client, first.run_id, "train_loss"))
    assert steps == list(range(5, 55, 5))  # continues at 35, nothing logged twice
    assert run.data.tags["raylift.resume_override.train.max_steps"] == "50"


def test_gpt_reports_bits_per_byte_and_tokens_per_second(ray_cluster: str, in_tmp: Path) -> None:
    cfg = load_config(
        REPO / "configs" / "gpt-tiny.yaml",
        [
            "name=gpt",
            "train.max_steps=12",
            "train.eval_every_n_steps=null",
            "train.log_every_n_steps=6",
            "task_args.max_bytes=200000",
            "task_args.n_layer=1",
            "task_args.d_model=64",
            "task_args.block_size=64",
            "optim.warmup_steps=2",
        ],
    )
    result = train(cfg)
    client, _ = mlflow_run(in_tmp, result.run_id)
    bpb = history(client, result.run_id, "val_bpb")
    assert bpb[0] > 7.0 and bpb[12] < bpb[0] - 1.0  # from ~8 bits (uniform) down
    assert history(client, result.run_id, "tokens_per_s")


def cli_env() -> dict[str, str]:
    # A second driver joining the session's cluster uses its token.
    return {**os.environ, "RAY_AUTH_MODE": "token", "PYTHONUNBUFFERED": "1"}


def test_cli_runs_a_user_task_from_outside_the_repository(ray_cluster: str, in_tmp: Path) -> None:
    (in_tmp / "mytasks.py").write_text(
        textwrap.dedent("""
        from raylift.tasks.digits import DigitsTask

        class TinyDigits(DigitsTask):
            def __init__(self, width: int = 4):
                super().__init__(width=width, dropout=0.0)
    """)
    )
    (in_tmp / "mine.yaml").write_text(
        textwrap.dedent("""
        name: user
        task: mytasks:TinyDigits
        task_args: {width: 4}
        data: {batch_size: 32}
        train: {max_steps: 8}
    """)
    )
    proc = subprocess.run(
        [sys.executable, "-m", "raylift.cli", "train", "mine.yaml"],
        cwd=in_tmp,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "finished" in proc.stdout and "step 8" in proc.stdout


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
        "train.max_epochs=20",
        "checkpoint.every_n_steps=20",
    ]
    proc = subprocess.Popen(
        args, cwd=in_tmp, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    run_dir = in_tmp / "runs" / "ctrlc"
    deadline = time.time() + 240
    while time.time() < deadline and not list(run_dir.glob("checkpoint-step*/loop_state.pt")):
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
    assert "at step 440" in resumed.stdout  # ran on to the end: 20 epochs x 22 steps


@pytest.mark.parametrize("strategy", ["fsdp", "fairscale", "zero3"])
def test_sharded_run_on_ray_resumes_on_fewer_workers(
    ray_cluster: str, in_tmp: Path, strategy: str
) -> None:
    """Each rank writes its shards to its own folder; Ray merges them; 2 -> 1 worker resumes."""
    common = [
        f"name=shard-{strategy}",
        "task_args.max_bytes=200000",
        "task_args.n_layer=2",
        "task_args.d_model=64",
        "task_args.block_size=64",
        "train.eval_every_n_steps=null",
        "train.log_every_n_steps=4",
        "checkpoint.every_n_steps=4",
        "optim.warmup_steps=2",
    ]
    path = REPO / "configs" / f"gpt-{strategy}.yaml"
    first = train(load_config(path, [*common, "train.max_steps=8"]))
    assert first.metrics["step"] == 8
    second = train(load_config(path, [*common, "train.max_steps=12", "scaling.num_workers=1"]))
    assert second.run_id == first.run_id and second.metrics["step"] == 12
    client, _ = mlflow_run(in_tmp, second.run_id)
    assert sorted(history(client, second.run_id, "train_loss")) == [4, 8, 12]
    assert history(client, second.run_id, "model_state_bytes_per_rank")
    out = in_tmp / "model.pt"
    assert cli_main(["export", str(in_tmp / "runs" / f"shard-{strategy}"), "--out", str(out)]) == 0
    assert len(torch.load(out, weights_only=True)) > 0
