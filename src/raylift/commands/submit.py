"""``raylift submit``: a Ray Jobs submission of ``raylift train|tune`` with its runtime env.

The job ships the current folder (the config and any user task code) as its
``working_dir``, installs the extras the config needs, and carries the worker
environment raylift always sets. The auth token is read from the environment by
Ray's own client and travels only in request headers: raylift never writes it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shlex
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from raylift.artifacts.tracking import SUBMITTED
from raylift.core.config import Config, ConfigError
from raylift.core.console import verbose
from raylift.run.connect import WORKER_ENV
from raylift.strategies import REGISTRY

TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
AGENT_WAIT_S = 60.0
EXCLUDES = [".git", ".venv", "runs", "shards", "mlflow.db", "mlruns", "*.pt", "__pycache__"]


def submission_id(cfg: Config, verb: str) -> str:
    """Readable and unique: ``raylift-train-digits-ddp-20261122-041512-3f9a``."""
    return f"raylift-{verb}-{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"


def entrypoint(config: str, verb: str, overrides: Sequence[str]) -> str:
    return shlex.join(["raylift", verb, config, *overrides])


def pip_packages(cfg: Config) -> list[str]:
    """Only what the cluster image may lack; raylift, torch and ray come with the image."""
    # auto picks its strategy on the workers: the image must bring what it may pick.
    spec = REGISTRY.get(cfg.strategy.name)
    packages = list(spec.extras) if spec else []
    if (cfg.tune or {}).get("search") == "optuna":
        packages.append("optuna>=3")
    packages += TASK_EXTRAS.get(cfg.task, [])
    if cfg.model.adapter.type:
        packages.append(ADAPTER_EXTRA)
    return packages


# Built-in tasks whose packages are an optional extra of raylift's (pip install raylift[hf]),
# and the one adapters need, spelled as pyproject.toml spells them.
TRANSFORMERS = "transformers>=5.0,<5.25"
TASK_EXTRAS = {"hf-causal-lm": [TRANSFORMERS], "hf-sft": [TRANSFORMERS]}
ADAPTER_EXTRA = "peft>=0.15"


def runtime_env(cfg: Config, working_dir: Path, in_place: bool = False) -> dict[str, Any]:
    """The job's runtime env: ``working_dir`` shipped (uploaded, unpacked on each node), or
    ``in_place`` where every node mounts it at the same path (Ray's ``local://``)."""
    # The default store goes to $RAYLIFT_HOME on the head, outliving the job's folder.
    env_vars = {**WORKER_ENV, SUBMITTED: "1"}
    env: dict[str, Any] = {"env_vars": env_vars}
    if in_place:
        env["working_dir"] = f"local://{working_dir}"
    else:
        env.update(working_dir=str(working_dir), excludes=EXCLUDES)
    if packages := pip_packages(cfg):
        env["pip"] = packages
    return env


def config_in_working_dir(config: str, working_dir: Path) -> str:
    """The config's path inside the shipped folder; a config elsewhere would not arrive."""
    path = Path(config).expanduser().resolve()
    try:
        return path.relative_to(working_dir).as_posix()
    except ValueError:
        raise ConfigError(
            [
                f"{config}: raylift submit ships the current folder ({working_dir}) to the "
                "cluster; run it from a folder that contains the config"
            ]
        ) from None


def client(address: str) -> Any:
    from ray.job_submission import JobSubmissionClient

    if os.environ.get("RAY_AUTH_TOKEN") and not os.environ.get("RAY_AUTH_MODE"):
        os.environ["RAY_AUTH_MODE"] = "token"  # this process only; the token stays in memory
    return JobSubmissionClient(address)


def submit(
    cfg: Config,
    config: str,
    verb: str,
    overrides: Sequence[str],
    address: str,
    in_place: bool = False,
) -> tuple[Any, str]:
    working_dir = Path.cwd().resolve()
    rel = config_in_working_dir(config, working_dir)
    jobs = client(address)
    request = {
        "entrypoint": entrypoint(rel, verb, overrides),
        "submission_id": submission_id(cfg, verb),
        "runtime_env": runtime_env(cfg, working_dir, in_place),
        "metadata": {"raylift.name": cfg.name, "raylift.verb": verb},
    }
    deadline = time.monotonic() + AGENT_WAIT_S
    while True:
        try:
            return jobs, str(jobs.submit_job(**request))
        except RuntimeError as exc:
            # A head that has just started answers before its job agent is up.
            if "No available agent" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(2)


# Ray's own records in a job's log and in this process: the job manager's ("Runtime env is
# setting up."), the entrypoint it runs, the log stream's ("WebSocket closed"). Warnings
# and errors are kept.
RAY_JOB_RECORD = re.compile(
    r"^(\d{4}-\d\d-\d\d [\d:,]+\s+(DEBUG|INFO) \S+\.py:\d+ -- |Running entrypoint for job )"
)


def job_lines(chunk: str) -> str:
    """What of a chunk of the job's log the console shows: raylift's run, not Ray's."""
    if verbose():
        return chunk
    return "".join(ln for ln in chunk.splitlines(keepends=True) if not RAY_JOB_RECORD.match(ln))


def follow(jobs: Any, job_id: str, log: Any = print) -> str:
    """Stream the job's logs until it ends; its final status."""

    async def tail() -> None:
        async for lines in jobs.tail_job_logs(job_id):
            if shown := job_lines(lines):
                log(shown, end="")

    if not verbose():
        logging.getLogger("ray.dashboard.modules.job.sdk").setLevel(logging.WARNING)
    asyncio.run(tail())
    status = str(jobs.get_job_status(job_id))
    while status.rsplit(".", 1)[-1] not in TERMINAL:  # logs can end a moment before the status
        time.sleep(0.5)
        status = str(jobs.get_job_status(job_id))
    return status.rsplit(".", 1)[-1]
