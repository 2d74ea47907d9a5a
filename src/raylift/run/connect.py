"""Connecting to Ray: a cluster's address, or a local Ray of this machine's size; the
job's environment, which every worker inherits; and the cluster's token, checked before
anything is sent."""

from __future__ import annotations

import math
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from raylift.core import console, stores
from raylift.core.config import Config, EnvironmentProblem
from raylift.tasks import BUILTINS

# Environment every Ray process of a raylift run gets.
WORKER_ENV = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    # Ray Train collects reports by polling; 2 s per poll would stall every epoch-end report.
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25",
    "RAY_DATA_DISABLE_PROGRESS_BARS": "1",
    # Quiet by default: raylift prints its own progress lines; Ray's go to the run's log.
    "RAY_DATA_LOG_LEVEL": "ERROR",
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
    "PYTHONWARNINGS": "ignore::DeprecationWarning",
    **console.quiet_env(),
}


def local_num_cpus(cfg: Config, workers: int | None = None) -> int:
    """Logical CPUs for a private local Ray: every worker's slot, plus one for Ray Data.

    ``workers`` overrides the run's own count (a sweep runs several runs at once).
    """
    workers = cfg.scaling.max_workers if workers is None else workers
    needed = math.ceil(workers * cfg.scaling.cpus_per_worker) + 1
    return max(os.cpu_count() or 1, needed)


def user_code_env(task: str) -> dict[str, Any]:
    """A runtime env that ships a user task's module to every Ray worker.

    Built-in tasks and installed packages need nothing; a module or package that
    lives in the user's folders travels as ``py_modules``.
    """
    module_name = task.partition(":")[0]
    if task in BUILTINS or not module_name:
        return {}
    import importlib

    top = importlib.import_module(module_name.split(".")[0])
    path = Path(getattr(top, "__path__", [None])[0] or top.__file__ or "")
    if not path.exists() or {"site-packages", "dist-packages"} & set(path.parts):
        return {}
    return {"py_modules": [str(path)]}


def connect_ray(cfg: Config, workers: int | None = None) -> None:
    """Join ``RAY_ADDRESS`` if set, else start a private local Ray for this run."""
    import ray

    # Before Ray's start-up prints anything; a command that stops before it needs Ray
    # (bad input) leaves no log behind.
    console.start_log(cfg.name)
    # boto3 (MLflow's artifacts in S3) retries as raylift's S3 client does, where nothing
    # set it otherwise; a local Ray started below passes it to every worker.
    os.environ.update(stores.client_retries_env())
    if ray.is_initialized():
        return
    env = dict(WORKER_ENV)
    # User tasks given as module:Class import from the current folder, as they would in Python.
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    if os.environ.get("RAY_ADDRESS"):
        check_reachable(os.environ["RAY_ADDRESS"])
        check_token(os.environ["RAY_ADDRESS"])
        # This driver reads some of them too (Ray Data's log level, at its import).
        os.environ.update(env)
        if ":" in os.environ["RAY_ADDRESS"] and "://" not in os.environ["RAY_ADDRESS"]:
            # Train's controller finds "the" cluster for its State API calls by this
            # variable; without it, another Ray on the same host makes that ambiguous.
            env["RAY_ADDRESS"] = os.environ["RAY_ADDRESS"]
        # Ray ships local modules only at the job level; every task and actor inherits them.
        code = user_code_env(cfg.task)
        try:
            ray.init(
                runtime_env={**code, "env_vars": env},
                logging_level=console.ray_logging_level(),
                log_to_driver=True,
            )
        except ValueError:
            # Inside a Ray job whose runtime env already sets these (raylift submit does),
            # Ray refuses to merge the same keys twice: the job's own env applies, plus what
            # it lacks (RAY_ADDRESS, above).
            job_env = job_env_vars()
            missing = {k: v for k, v in env.items() if k not in job_env}
            ray.init(
                runtime_env={**code, "env_vars": missing} if missing else code or None,
                logging_level=console.ray_logging_level(),
                log_to_driver=True,
            )
        return
    env["PYTHONPATH"] = os.pathsep.join(p for p in (cwd, os.environ.get("PYTHONPATH")) if p)
    env.update(own_cluster_env())
    os.environ.update(env)  # the local raylet, and so every worker, inherits these
    # The dashboard serves the State API, which Train uses to free placement groups; it
    # listens on 127.0.0.1 only.
    ray.init(
        address="local",
        num_cpus=local_num_cpus(cfg, workers),
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        logging_level=console.ray_logging_level(),
        log_to_driver=True,
    )


def job_env_vars() -> dict[str, str]:
    """The env vars of the Ray job this driver runs in (its submitted runtime env)."""
    import json

    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")  # set by Ray's job supervisor
    if not raw:
        return {}
    try:
        runtime_env = json.loads(raw).get("runtime_env") or {}
    except ValueError:
        return {}
    return dict(runtime_env.get("env_vars") or {})


def gcs_host_port(address: str) -> tuple[str, int] | None:
    """The GCS's host and port in ``RAY_ADDRESS``; None where Ray resolves it itself
    (``auto``, ``ray://``, the Jobs API's ``http://``) or the port is not a number."""
    if address == "auto" or "://" in address or ":" not in address:
        return None
    host, _, port = address.rpartition(":")
    return (host, int(port)) if port.isdigit() else None


def refused(host_port: tuple[str, int]) -> str | None:
    """Why a TCP connection to ``host_port`` fails (refused, unreachable, an unknown
    host); None where something accepts it."""
    try:
        socket.create_connection(host_port, timeout=2).close()
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


REACH_S = 10.0  # a head that `ray start` is still bringing up answers within this


def check_reachable(address: str) -> None:
    """EnvironmentProblem with the fix where nothing answers at ``address``: ``ray.init``
    retries a dead GCS address without end (its warnings go to the run's log, the console
    stays silent), as a ``RAY_ADDRESS`` left over from a cluster that is gone has it."""
    if (found := gcs_host_port(address)) is None:
        return
    deadline = time.monotonic() + REACH_S
    while (why := refused(found)) and time.monotonic() < deadline:
        time.sleep(1.0)
    if not why:
        return
    host, port = found
    raise EnvironmentProblem(
        f"RAY_ADDRESS={address}: no Ray cluster answers there ({why}, for {REACH_S:.0f} s). "
        f"Start it (`ray start --head --port={port}` on {host}), set RAY_ADDRESS to a "
        "running cluster's head (its GCS, port 6379 unless `ray start --port` said "
        "otherwise; RAY_ADDRESS=auto finds one started on this machine), or unset "
        "RAY_ADDRESS to run on a private local Ray"
    )


def check_token(address: str) -> None:
    """EnvironmentProblem with the fix, at once, when the Ray at ``address`` wants a token
    that this process will not send: ``ray.init`` would retry for 20 s, then print a
    traceback.

    Ray sends its token only to a cluster it found itself (``auto``) or when
    ``RAY_AUTH_MODE=token``; ``ray start`` turns token auth on by default.
    """
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
        return
    # ``auto`` finds its token itself; Ray Client and the Jobs API have their own checks.
    # A closed port never gets here (check_reachable): the GCS client would wait 40 s on it.
    if gcs_host_port(address) is None:
        return
    import ray.exceptions
    from ray._raylet import GcsClient  # type: ignore[attr-defined]

    try:
        GcsClient(address=address)
    except ray.exceptions.AuthenticationError as exc:
        raise EnvironmentProblem(
            f"RAY_ADDRESS={address}: that Ray cluster requires token authentication "
            "(`ray start` turns it on) and this shell sends no token. Set "
            "RAY_AUTH_MODE=token; the token is read from RAY_AUTH_TOKEN or "
            "~/.ray/auth_token (where `ray start` wrote it on its host). For a Ray "
            "started on this machine, RAY_ADDRESS=auto finds both"
        ) from exc
    except Exception:  # any other refusal: ray.init says so in its own words
        return


def own_cluster_env() -> dict[str, str]:
    """Pin a private local Ray's GCS port and point ``RAY_ADDRESS`` at it, for this process
    and everything its raylet starts.

    Parts of Ray Train (its placement-group cleaner, the State API) find "the" cluster
    by looking for running GCS processes; with a second local Ray on the host (a sweep
    beside a training run) they fail with "Found multiple active Ray instances" and
    stopped trials' placement groups are never freed. An explicit address avoids that.
    """
    import socket

    from ray.util import get_node_ip_address

    with socket.socket() as probe:  # a free port now; Ray binds it a moment later
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    return {"RAY_GCS_SERVER_PORT": str(port), "RAY_ADDRESS": f"{get_node_ip_address()}:{port}"}
