"""Ray Jobs end to end on the session's Ray (its dashboard on 127.0.0.1): the quickstart
submitted with plain `ray job submit` SUCCEEDED with its MLflow run; `raylift submit`
ships the project folder, follows a failing job's log to its end, and returns at once
with --no-wait. (`raylift submit` of a job that trains, on the autoscaling cluster:
test_autoscaler.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import finish_output

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
    """One storage and MLflow store for the module's jobs."""
    return tmp_path_factory.mktemp("jobs")


def job_folder(tmp: Path) -> Path:
    """A user's project folder: the quickstart config beside their (empty) code."""
    (tmp / "configs").mkdir()
    shutil.copy(REPO / "configs" / "quickstart.yaml", tmp / "configs" / "quickstart.yaml")
    return tmp


def overrides(tmp: Path, name: str) -> list[str]:
    return [
        f"name={name}",
        "train.max_steps=4",  # what is checked is the job's end and its MLflow run
        f"storage={tmp / 'runs'}",
        f"tracking.uri=sqlite:///{tmp / 'mlflow.db'}",
    ]


def mlflow_run_names(tmp: Path) -> list[str]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}")
    exp = client.get_experiment_by_name("raylift")
    runs = client.search_runs([exp.experiment_id]) if exp else []
    return [r.data.tags["mlflow.runName"] for r in runs if r.info.status == "FINISHED"]


def commands(address: str, project: Path, tmp: Path) -> dict[str, list[str]]:
    """Each test's command, from a user's project folder of its own."""
    raylift = [RAYLIFT, "submit", "configs/quickstart.yaml", "--address", address]
    plain = [RAY, "job", "submit", "--address", address, "--working-dir", ".", "--"]
    plain += ["raylift", "train", "configs/quickstart.yaml", *overrides(project, "plain")]
    bad = [f"data.shards={tmp / 'nowhere'}"]  # a shard folder that is not there
    return {
        "plain": plain,
        "failing": [*raylift, *overrides(project, "missing"), *bad],
        "no-wait": [*raylift, *overrides(project, "queued"), *bad, "--no-wait"],
    }


@pytest.fixture(scope="module")
def jobs(
    head: tuple[str, dict[str, str]], project: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, subprocess.CompletedProcess[str]]:
    """The three submissions, made at once as a team's would be."""
    address, env = head
    started = {}
    for name, cmd in commands(address, project, tmp_path_factory.mktemp("bad")).items():
        folder = job_folder(tmp_path_factory.mktemp(f"job-{name}"))
        # Each its own package: Ray skips uploading one it already holds, and may delete
        # that one as the job that uploaded it ends (ray-project/ray#46625).
        (folder / "job.txt").write_text(name)
        started[name] = (cmd, subprocess.Popen(
            cmd, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        ))  # fmt: skip
    done = {}
    for name, (cmd, proc) in started.items():
        out, err = finish_output(proc, f"the job {name!r}")
        done[name] = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    return done


def test_plain_ray_job_submit_runs_raylift_train(jobs: dict, project: Path) -> None:
    done = jobs["plain"]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "succeeded" in (done.stdout + done.stderr).lower()
    assert "plain" in mlflow_run_names(project)


def test_submit_with_no_wait_returns_the_job_id_and_a_failing_job_fails(jobs: dict) -> None:
    failed, queued = jobs["failing"], jobs["no-wait"]
    assert failed.returncode == 1 and "FAILED" in failed.stdout, failed.stdout[-2000:]
    # The shipped job's own log, followed to its end: raylift's reason and fix.
    assert "nowhere" in failed.stdout and "raylift prep" in failed.stdout, failed.stdout[-2000:]
    assert queued.returncode == 0
    assert queued.stdout.strip().splitlines()[-1].startswith("raylift-train-queued-")
