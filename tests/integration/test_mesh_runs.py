"""FSDP's mesh from Ray's placement, on a Ray of two nodes on this host (two CPUs each, two
workers on each): ``strategy.name: fsdp`` with every mesh key ``auto`` shards within each
node and replicates across the two (HSDP), says so once, and trains as DDP does. A node
of an HSDP run drained: tests/integration/test_drain.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import GPT_SMALL, HANG_S
from tests.integration.test_drain import two_nodes
from tests.integration.test_train import OURS, history

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
# Two workers a node of two CPUs, with room beside them for Ray Data's reads.
FOUR = ["scaling.num_workers=4", "scaling.cpus_per_worker=0.8"]
HSDP_LINE = "raylift: mesh: replicate 2 (nodes) x shard 2 (workers per node) x tp 1"


def gpt_run(root: Path, env: dict[str, str], name: str, strategy: str) -> str:
    """GPT_SMALL's 30 fp32 steps under ``strategy``; the console."""
    args = GPT_SMALL["task_args"]
    task_args = "{" + ", ".join(f"{k}: {v}" for k, v in args.items()) + "}"
    done = subprocess.run(
        [sys.executable, "-m", "raylift.cli", "train", str(REPO / "configs" / "gpt-tiny.yaml"),
         f"name={name}", f"storage={root / 'runs'}", f"tracking.uri=sqlite:///{root / 'mlflow.db'}",
         f"task_args={task_args}", f"strategy.name={strategy}", "precision=32",
         "data.batch_size=8", "optim.lr=3e-3", "optim.warmup_steps=5", "optim.weight_decay=0.1",
         "optim.betas=[0.9,0.95]", "train.max_steps=30", "train.max_epochs=100",
         "train.log_every_n_steps=1", "train.grad_clip=1.0", "train.grad_accum=1",
         "train.early_stopping=null", "checkpoint.every_n_steps=1000", *FOUR],
        cwd=root, env=env, capture_output=True, text=True, timeout=HANG_S,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    return out


@pytest.fixture(scope="module")
def runs(user_shell: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    from mlflow.tracking import MlflowClient

    root = tmp_path_factory.mktemp("mesh")
    with two_nodes(root, user_shell, cpus=2) as (env, _, _):
        out = {s: gpt_run(root, env, f"gpt-{s}", s) for s in ("ddp", "fsdp")}
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    found = {r.data.tags["mlflow.runName"]: r.info.run_id for r in client.search_runs(
        [e.experiment_id for e in client.search_experiments()])}  # fmt: skip
    curves = {s: history(client, found[f"gpt-{s}"], "train_loss") for s in out}
    return {"out": out, "curves": curves}


def test_auto_builds_hsdp_from_where_ray_put_the_workers(runs: dict) -> None:
    fsdp = runs["out"]["fsdp"]
    assert fsdp.count(HSDP_LINE) == 1, fsdp
    assert "raylift: mesh:" not in runs["out"]["ddp"]
    assert not [x for x in fsdp.splitlines() if not x.startswith(OURS)], fsdp


def test_hsdp_on_two_nodes_follows_ddp(runs: dict) -> None:
    ref, got = runs["curves"]["ddp"], runs["curves"]["fsdp"]
    assert sorted(ref) == sorted(got) == list(range(1, 31))
    worst = max(abs(got[s] - v) / abs(v) for s, v in ref.items())
    print(f"HSDP 2 x 2 on two nodes against DDP, 30 fp32 steps: worst relative {worst:.1e}")
    assert worst <= 1e-5, (got, ref)
