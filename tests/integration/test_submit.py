"""Ray Jobs end to end: a real `ray start --head` on 127.0.0.1, the quickstart submitted
with `raylift submit` and with plain `ray job submit`, each SUCCEEDED with its MLflow run."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).parent / "ray")
RAYLIFT = str(Path(sys.executable).parent / "raylift")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def head() -> Iterator[tuple[str, dict[str, str]]]:
    """A second, separate Ray: its own temp dir and ports, stopped by its PID."""
    temp = tempfile.mkdtemp(prefix="rl-head-", dir="/tmp")
    port, dash = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update({"RAY_AUTH_MODE": "token", "PYTHONPATH": str(REPO)})
    cmd = [RAY, "start", "--head", "--block", f"--temp-dir={temp}", f"--port={port}"]
    cmd += ["--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1"]
    cmd += [f"--dashboard-port={dash}", "--num-cpus=4", "--include-dashboard=true"]
    # Every fixed default port moved: another Ray on this host (the session's) holds them.
    for flag in (
        "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port",
        "metrics-export-port",
        "runtime-env-agent-port",
        "node-manager-port",
        "object-manager-port",
        "ray-client-server-port",
    ):
        cmd.append(f"--{flag}={free_port()}")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"http://127.0.0.1:{dash}"
    try:
        wait_for_jobs_api(address, env)
        yield address, env
    finally:
        proc.send_signal(signal.SIGTERM)  # --block: ray stops what it started, only that
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(temp, ignore_errors=True)


def wait_for_jobs_api(address: str, env: dict[str, str]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        probe = subprocess.run(
            [RAY, "job", "list", "--address", address], env=env, capture_output=True, text=True
        )
        if probe.returncode == 0:
            return
        time.sleep(2)
    raise RuntimeError(f"the Jobs API at {address} did not come up: {probe.stderr[-500:]}")


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
    head: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    address, env = head
    folder = job_folder(tmp_path)
    cmd = [RAYLIFT, "submit", "configs/quickstart.yaml", "--address", address, "train"]
    done = subprocess.run(
        [*cmd, *overrides(tmp_path, "submitted")],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "raylift-train-submitted-" in done.stdout and "SUCCEEDED" in done.stdout
    assert "finished in" in done.stdout  # the job's own log, followed to the end
    assert "submitted" in mlflow_run_names(tmp_path)


def test_plain_ray_job_submit_runs_raylift_train(
    head: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    address, env = head
    folder = job_folder(tmp_path)
    cmd = [RAY, "job", "submit", "--address", address, "--working-dir", ".", "--"]
    cmd += ["raylift", "train", "configs/quickstart.yaml", *overrides(tmp_path, "plain")]
    done = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "succeeded" in (done.stdout + done.stderr).lower()
    assert "plain" in mlflow_run_names(tmp_path)


def test_submit_with_no_wait_returns_the_job_id_and_a_failing_job_fails(
    head: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    address, env = head
    folder = job_folder(tmp_path)
    bad = [*overrides(tmp_path, "missing"), f"data.shards={tmp_path / 'nowhere'}"]
    cmd = [RAYLIFT, "submit", "configs/quickstart.yaml", "--address", address, *bad]
    failed = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    assert failed.returncode == 1 and "FAILED" in failed.stdout, failed.stdout[-2000:]
    queued = subprocess.run(
        [*cmd, "--no-wait"], cwd=folder, env=env, capture_output=True, text=True, timeout=120
    )
    assert queued.returncode == 0
    assert queued.stdout.strip().splitlines()[-1].startswith("raylift-train-missing-")
