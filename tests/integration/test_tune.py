"""`raylift tune` on the session's Ray, with the shipped sweep (configs/sweep-digits.yaml)
and its storage on a flaky S3 server: a failed trial restarts from its checkpoint, an
interrupted sweep resumes, and the best trial's logged model loads back (the ASHA sweep
runs on its own Ray: test_own_ray)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from raylift.commands.tune import reports_to_tune
from raylift.validation import load_config
from tests.helpers import HANG_S, finish_output
from tests.s3_faults import FLAKY, FaultProxy

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
SWEEP = REPO / "configs" / "sweep-digits.yaml"


# The ASHA sweep of distributed trials runs on its own Ray beside a training run:
# tests/integration/test_own_ray.py.


FLAKY_SWEEP = [
    "name=flaky",
    "task=tests.flaky:FlakyDigits",
    "task_args={width: 16, dropout: 0.0, fail_at: 30}",
    "train.max_epochs=2",
    "train.early_stopping=null",
    "checkpoint.every_n_steps=20",
    "tune.num_samples=1",
    "tune.scheduler=none",
]


def flaky_sweep(tmp: Path, *extra: str) -> Path:
    """The shipped sweep with a task that fails once and a two-trial grid, as a YAML file."""
    raw = yaml.safe_load(SWEEP.read_text())
    raw["tune"]["space"] = {"optim.lr": {"grid": [0.001, 0.003]}}
    path = tmp / "flaky.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg = load_config(path, [*FLAKY_SWEEP, *extra])  # validates the overrides
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    return path


def report_and_return(config: dict[str, int]) -> None:
    """A trial whose run makes three reports from another process, as Train's controller
    does, and returns at once after the last: with Ray's TuneReportCallback this trial
    never ends (its actor's main thread waits on itself; every try here timed out)."""
    import ray

    @ray.remote(num_cpus=0)
    def controller(callback: object, reports: int) -> None:
        for i in range(reports):
            callback.after_report(None, [{"i": i, "trial": config["trial"]}], None)  # type: ignore[attr-defined]

    with reports_to_tune() as callback:
        ray.get(controller.remote(callback, 3))


def test_every_report_reaches_tune_when_the_run_returns_straight_after_its_last(
    ray_cluster: str, tmp_path: Path
) -> None:
    from ray import tune

    tuner = tune.Tuner(
        report_and_return,
        param_space={"trial": tune.grid_search([0, 1])},
        run_config=tune.RunConfig(storage_path=str(tmp_path), verbose=0),
        tune_config=tune.TuneConfig(max_concurrent_trials=1),
    )
    results = tuner.fit()
    assert not results.errors
    got = sorted((r.metrics["trial"], list(r.metrics_dataframe["i"])) for r in results)
    assert got == [(0, [0, 1, 2]), (1, [0, 1, 2])]


def test_a_failed_trial_restarts_and_an_interrupted_sweep_resumes(
    ray_cluster: str, in_tmp: Path, s3_server: str, s3_faults: FaultProxy
) -> None:
    """The first trial fails once at step 30 and restarts from its step-20 checkpoint; the
    sweep is then stopped with Ctrl-C and rerun: each trial keeps one child run. Its
    storage is on the S3 server, which throttles and drops connections throughout (FLAKY)."""
    with s3_faults.faults(seed=3, **FLAKY) as injected:
        interrupted_and_resumed(in_tmp)
    print(f"faults injected: {dict(injected)}")  # shown with -s, for the record
    assert injected["throttle"] > 0 and injected["drop"] > 0, injected


def interrupted_and_resumed(in_tmp: Path) -> None:
    marker = in_tmp / "failed-once"
    storage = f"s3://runs/{in_tmp.name}"
    path = flaky_sweep(
        in_tmp, f"task_args.marker={marker}", "tune.max_concurrent=1", f"storage={storage}"
    )
    cmd = [sys.executable, "-m", "raylift.cli", "tune", str(path), "name=resumable"]
    env = {**os.environ, "RAY_AUTH_MODE": "token", "PYTHONPATH": str(REPO)}
    first = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen = []
    for line in first.stdout:  # type: ignore[union-attr]  (until it says step 44, or ends)
        seen.append(line)
        if re.search(r"step\s+44\s+eval", line):
            break
    first.send_signal(signal.SIGINT)
    rest, _ = finish_output(first, "the sweep, stopped by Ctrl-C")
    assert first.returncode == 130, "".join(seen)[-2000:] + rest[-4000:]
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resuming" in second.stdout + second.stderr
    assert marker.exists()  # the injected failure happened, and the trial came back
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{in_tmp / 'mlflow.db'}")
    exp = client.get_experiment_by_name("raylift")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags.get("raylift.sweep") == "parent"]
    assert len(parents) == 1
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert len(children) == 2 and {c.info.status for c in children} == {"FINISHED"}
    # The shipped sweep's very end (test_shipped_runs leaves it to this run): the best
    # trial's model logged to MLflow, downloaded, and loaded into the task's model.
    from tests.integration.test_shipped_runs import loads_back

    assert loads_back(second.stdout + second.stderr, in_tmp, in_tmp / "logged")
