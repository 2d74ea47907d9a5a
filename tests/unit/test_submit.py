"""raylift submit's pieces: the entrypoint, the runtime env, the checks before submitting."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from raylift.commands.submit import (
    config_in_working_dir,
    entrypoint,
    job_lines,
    runtime_env,
    submission_id,
)
from raylift.core.config import ConfigError
from raylift.validation import load_config

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"


def test_entrypoint_is_a_quoted_raylift_command() -> None:
    cmd = entrypoint("configs/quickstart.yaml", "train", ["optim.lr=1e-3", "name=a b"])
    assert shlex.split(cmd) == [
        "raylift",
        "train",
        "configs/quickstart.yaml",
        "optim.lr=1e-3",
        "name=a b",
    ]


def test_runtime_env_ships_the_folder_and_the_extras_the_config_needs(tmp_path: Path) -> None:
    env = runtime_env(load_config(QUICKSTART), tmp_path)
    assert env["working_dir"] == str(tmp_path) and "pip" not in env
    assert ".git" in env["excludes"] and "mlflow.db" in env["excludes"]
    assert env["env_vars"]["RAY_TRAIN_ENABLE_PRINT_PATCH"] == "0"
    ds = runtime_env(load_config(QUICKSTART, ["strategy.name=deepspeed"]), tmp_path)
    assert ds["pip"] == ["deepspeed>=0.19,<0.20"]
    from raylift.commands.submit import pip_packages
    from raylift.core.config import Config

    assert pip_packages(Config(task="hf-causal-lm")) == ["transformers>=5.0,<5.25"]  # raylift[hf]
    sft = Config(task="hf-sft")
    sft.model.adapter.type = "lora"
    assert pip_packages(sft) == ["transformers>=5.0,<5.25", "peft>=0.15"]


def test_a_job_installs_the_versions_pyproject_allows() -> None:
    """The bounds in pyproject.toml (the versions raylift's tests ran against) hold on a
    cluster too: each package a job installs is spelled as one of raylift's extras."""
    import tomllib

    from raylift.commands.submit import ADAPTER_EXTRA, TASK_EXTRAS
    from raylift.strategies import REGISTRY

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {p for group in extras["optional-dependencies"].values() for p in group}
    shipped = {p for spec in REGISTRY.values() for p in spec.extras}
    shipped |= {p for packages in TASK_EXTRAS.values() for p in packages} | {ADAPTER_EXTRA}
    assert shipped and shipped <= declared, sorted(shipped - declared)


def test_no_secret_travels_in_the_runtime_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAY_AUTH_TOKEN", "s3cr3t-token-value")
    env = runtime_env(load_config(QUICKSTART), tmp_path)
    assert "s3cr3t-token-value" not in repr(env)


def test_a_config_outside_the_shipped_folder_is_refused(tmp_path: Path) -> None:
    assert config_in_working_dir(str(QUICKSTART), REPO) == "configs/quickstart.yaml"
    with pytest.raises(ConfigError, match="ships the current folder"):
        config_in_working_dir(str(QUICKSTART), tmp_path)


def test_submission_ids_are_readable() -> None:
    job = submission_id(load_config(QUICKSTART), "tune")
    assert job.startswith("raylift-tune-digits-ddp-") and " " not in job


def test_validate_prints_no_secret_values(capsys: pytest.CaptureFixture[str]) -> None:
    from raylift.cli import main

    args = [
        "strategy.name=deepspeed",
        "strategy.config={wandb_api_key: abc123, train_batch_size: 8}",
    ]
    assert main(["validate", str(QUICKSTART), *args]) == 0
    out = capsys.readouterr().out
    assert "abc123" not in out and "wandb_api_key: '***'" in out and "train_batch_size: 8" in out


def test_in_place_runs_in_the_folder_every_node_mounts(tmp_path: Path) -> None:
    from raylift.core.config import Config

    env = runtime_env(Config(), tmp_path, in_place=True)
    assert env["working_dir"] == f"local://{tmp_path}" and "excludes" not in env


def test_the_job_log_shows_the_run_not_rays_records(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAYLIFT_VERBOSE", raising=False)
    chunk = (
        "2026-11-25 23:51:34,971\tINFO job_manager.py:581 -- Runtime env is setting up.\n"
        "Running entrypoint for job raylift-train-x: raylift train configs/quickstart.yaml\n"
        "raylift: strategy ddp\n"
        "2026-11-25 23:51:35,002\tWARNING worker.py:12 -- something a user can act on\n"
    )
    assert job_lines(chunk) == (
        "raylift: strategy ddp\n"
        "2026-11-25 23:51:35,002\tWARNING worker.py:12 -- something a user can act on\n"
    )
    monkeypatch.setenv("RAYLIFT_VERBOSE", "1")
    assert job_lines(chunk) == chunk


def test_a_job_driver_adds_only_what_its_job_env_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from raylift.run.connect import job_env_vars

    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    assert job_env_vars() == {}
    job = {"runtime_env": {"env_vars": {"RAYLIFT_SUBMITTED": "1"}}, "metadata": {}}
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps(job))
    assert job_env_vars() == {"RAYLIFT_SUBMITTED": "1"}
