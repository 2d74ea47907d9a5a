"""Ray Jobs end to end on the session's Ray (its dashboard on 127.0.0.1): the quickstart
submitted with `raylift submit` and with plain `ray job submit`, each SUCCEEDED with its
MLflow run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).parent / "ray")
RAYLIFT = str(Path(sys.executable).parent / "raylift")


@pytest.fixture(scope="module")
def head(ray_jobs: str) -> tuple[str, dict[str, str]]:
    """The session's Ray, reached as a user reaches a cluster: by its Jobs API address,
    with its auth token, from processes that share nothing else with this one."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update({"RAY_AUTH_MODE": "token", "PYTHONPATH": str(REPO)})
    return ray_jobs, env


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One storage and MLflow store for the module's jobs: the first job prepares the
    shards, the others reuse them, as a user's later runs do."""
    return tmp_path_factory.mktemp("jobs")


def job_folder(tmp: Path) -> Path:
    """A user's project folder: the quickstart config beside their (empty) code."""
    (tmp / "configs").mkdir()
    shutil.copy(REPO / "configs" / "quickstart.yaml", tmp / "configs" / "quickstart.yaml")
    return tmp


def overrides(tmp: Path, name: str) -> list[str]:
    return [
        f"name={name}",
        "train.max_epochs=1",
        f"storage={tmp / 'runs'}",
        f"tracking.uri=sqlite:///{tmp / 'mlflow.db'}",
    ]


def mlflow_run_names(tmp: Path) -> list[str]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}")
    exp = client.get_experiment_by_name("raylift")
    runs = client.search_runs([exp.experiment_id]) if exp else []
    return [r.data.tags["mlflow.runName"] for r in runs if r.info.status == "FINISHED"]


def test_raylift_submit_runs_the_quickstart_as_a_ray_job(
    head: tuple[str, dict[str, str]], project: Path, tmp_path: Path
) -> None:
    address, env = head
    folder = job_folder(tmp_path)
    cmd = [RAYLIFT, "submit", "configs/quickstart.yaml", "--address", address, "train"]
    done = subprocess.run(
        [*cmd, *overrides(project, "submitted")],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "raylift-train-submitted-" in done.stdout and "SUCCEEDED" in done.stdout
    assert "finished in" in done.stdout  # the job's own log, followed to the end
    assert "submitted" in mlflow_run_names(project)


def test_plain_ray_job_submit_runs_raylift_train(
    head: tuple[str, dict[str, str]], project: Path, tmp_path: Path
) -> None:
    address, env = head
    folder = job_folder(tmp_path)
    cmd = [RAY, "job", "submit", "--address", address, "--working-dir", ".", "--"]
    cmd += ["raylift", "train", "configs/quickstart.yaml", *overrides(project, "plain")]
    done = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "succeeded" in (done.stdout + done.stderr).lower()
    assert "plain" in mlflow_run_names(project)


def test_submit_with_no_wait_returns_the_job_id_and_a_failing_job_fails(
    head: tuple[str, dict[str, str]], project: Path, tmp_path: Path
) -> None:
    address, env = head
    folder = job_folder(tmp_path)
    bad = [*overrides(project, "missing"), f"data.shards={tmp_path / 'nowhere'}"]
    cmd = [RAYLIFT, "submit", "configs/quickstart.yaml", "--address", address, *bad]
    failed = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    assert failed.returncode == 1 and "FAILED" in failed.stdout, failed.stdout[-2000:]
    queued = subprocess.run(
        [*cmd, "--no-wait"], cwd=folder, env=env, capture_output=True, text=True, timeout=120
    )
    assert queued.returncode == 0
    assert queued.stdout.strip().splitlines()[-1].startswith("raylift-train-missing-")
