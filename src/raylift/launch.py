"""Config -> Ray Train ``TorchTrainer`` -> fit. The driver side of ``raylift train``.

What is the same for every rank is settled here, once: the shards are checked (or
prepared), ``strategy: auto`` and ``precision: auto`` are resolved, the MLflow run is
opened. The workers get
it all in one :class:`~raylift.worker.RunSpec`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import math
import os
import re
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from raylift import console, mlmodel, runlock, storage, tracking
from raylift.check import alive_nodes, before_workers, writable
from raylift.config import AUTO, RUN_CONFIG, Config, ConfigError, EnvironmentProblem
from raylift.data.shards import Manifest
from raylift.errors import first_line
from raylift.precision import DeviceFacts, choose
from raylift.probe import ProbeSettings
from raylift.startup import Startup
from raylift.storage import StorageError
from raylift.tasks import BUILTINS
from raylift.weights import absolute as weights_absolute
from raylift.worker import SPEC_KEY, RunSpec, worker_main

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


class RunFailed(RuntimeError):
    """The training run ended in an error; the message says where and why."""


class StorageFailed(RunFailed):
    """The run's storage failed it mid-run, or its workers found a setting wrong (a
    resume on another base): exit 2, the fix is outside the code."""


@dataclasses.dataclass
class TrainResult:
    name: str
    metrics: dict[str, float]
    checkpoint: str | None
    run_id: str
    tracking_uri: str
    seconds: float
    config: Config  # as it ran: ``auto`` resolved
    model: mlmodel.LoggedModel | None = None  # tracking.log_model's, where one was logged


# ---------------------------------------------------------------- driver


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
    if ray.is_initialized():
        return
    env = dict(WORKER_ENV)
    # User tasks given as module:Class import from the current folder, as they would in Python.
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    if os.environ.get("RAY_ADDRESS"):
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


def check_token(address: str) -> None:
    """EnvironmentProblem with the fix, at once, when the Ray at ``address`` wants a token
    that this process will not send: ``ray.init`` would retry for 20 s, then print a
    traceback.

    Ray sends its token only to a cluster it found itself (``auto``) or when
    ``RAY_AUTH_MODE=token``; ``ray start`` turns token auth on by default.
    """
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "token" or address == "auto":
        return
    if "://" in address:  # Ray Client or the Jobs API: their own checks apply
        return
    import socket

    host, _, port = address.rpartition(":")
    try:  # the probe below waits 40 s where nothing listens: ray.init says that itself
        socket.create_connection((host, int(port)), timeout=2).close()
    except (OSError, ValueError):
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
    except Exception:  # unreachable, say: ray.init says so in its own words
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


def run_exists(where: str, name: str) -> bool:
    """True when a previous run under this name left checkpoints to resume from, in a
    local folder or an object store alike."""
    from raylift.checkpoint import checkpoint_dirs

    return bool(checkpoint_dirs(storage.join(where, name)))


START_TIMEOUT_VAR = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
# A user's own setting, read once: raylift sets the variable for each run it starts.
_USER_ATTEMPT_S = os.environ.get(START_TIMEOUT_VAR)


def worker_resources(cfg: Config) -> dict[str, float]:
    resources: dict[str, float] = {"CPU": cfg.scaling.cpus_per_worker}
    if cfg.scaling.use_gpu:
        resources["GPU"] = 1
    return resources


def placement_bounds(timeout_s: float, attempt_s: str | None = None) -> tuple[float, int]:
    """Ray Train's wait for one placement attempt (``attempt_s`` if the environment sets
    it, else at most a minute, Ray's default), and how many more attempts fit in
    ``timeout_s``. Between attempts an autoscaler may have added nodes."""
    attempt = min(float(attempt_s) if attempt_s else 60.0, timeout_s)
    return attempt, max(0, math.ceil(timeout_s / attempt) - 1)


def build_trainer(cfg: Config, where: str, spec: RunSpec, callbacks: Sequence[Any] = ()) -> Any:
    from ray.train import FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig

    from raylift.faults import FaultReporter

    # A Train V2 UserCallback, which ray.train's V1 type hints do not know.
    log = console.current_log()
    faults: Any = FaultReporter(
        cfg.train.max_failures,
        storage.join(where, cfg.name),
        spec.tracking,
        str(log) if log else None,
    )
    sc = cfg.scaling
    resources = worker_resources(cfg)
    start_timeout, retries = placement_bounds(sc.placement_timeout_s, _USER_ATTEMPT_S)
    # Ray Train propagates this variable from the driver's environment to its controller.
    os.environ[START_TIMEOUT_VAR] = str(start_timeout)
    if sc.elastic:
        # Waiting for room is what an elastic run does: it starts at the size that fits
        # and retries smaller; Ray counts those retries over the run's whole life.
        retries = -1
    workers: int | tuple[int, int] = (
        (sc.min_workers, sc.max_workers) if sc.elastic else sc.min_workers
    )
    return trainer_class()(
        worker_main,
        train_loop_config={SPEC_KEY: spec},
        torch_config=TorchConfig(backend="nccl" if sc.use_gpu else "gloo"),
        # ray.train's static types are Train V1's; these are Train V2's arguments.
        scaling_config=ScalingConfig(
            num_workers=workers,  # type: ignore[arg-type]
            use_gpu=sc.use_gpu,
            resources_per_worker=resources,
            elastic_resize_monitor_interval_s=sc.resize_interval_s,  # type: ignore[call-arg]
        ),
        run_config=RunConfig(  # type: ignore[call-arg]
            name=cfg.name,
            storage_path=where,
            checkpoint_config=checkpoint_config(cfg),
            # A worker group that cannot be placed is a "controller failure", which Ray
            # Train retries forever by default: bounded here by placement_timeout_s.
            failure_config=FailureConfig(  # type: ignore[call-arg]
                max_failures=cfg.train.max_failures, controller_failure_limit=retries
            ),
            worker_runtime_env={"env_vars": dict(WORKER_ENV)},
            # Ray Train's own records (a failure's tracebacks among them) go to its log
            # files; the console has raylift's account of them (raylift.faults).
            logging_config=LoggingConfig(log_level="WARNING" if console.verbose() else "CRITICAL"),
            callbacks=[faults, *callbacks],
        ),
    )


@functools.cache
def trainer_class() -> Any:
    """``TorchTrainer`` without Train V2's datasets callback when the run passes no Ray
    Dataset, as raylift's runs do (each worker reads its own shards). That callback
    starts a ``DatasetManager`` actor for every worker group all the same: a process,
    idle for the whole run, whose start costs about 1.5 CPU-seconds at every start and
    restart. Where Ray's internals differ, the trainer is Ray's own."""
    from ray.train.torch import TorchTrainer

    class Trainer(TorchTrainer):
        def _create_default_callbacks(self) -> list[Any]:
            # Train V2's method; ray.train's static types are Train V1's.
            callbacks: list[Any] = super()._create_default_callbacks()  # type: ignore[misc]
            if getattr(self, "datasets", None):
                return callbacks
            return [cb for cb in callbacks if type(cb).__name__ != "DatasetsCallback"]

    if not hasattr(TorchTrainer, "_create_default_callbacks"):
        return TorchTrainer
    return Trainer


def checkpoint_config(cfg: Config) -> Any:
    """Which checkpoints Ray keeps: the newest ``checkpoint.keep``; with
    ``tracking.log_model: best``, the ``keep`` best by the monitored metric instead, so
    the one to log is still there at the end (Ray always keeps the newest as well, which
    a resume starts from)."""
    from ray.train import CheckpointConfig

    if cfg.tracking.log_model != "best":
        return CheckpointConfig(num_to_keep=cfg.checkpoint.keep)
    metric, mode = mlmodel.monitored(cfg)
    return CheckpointConfig(
        num_to_keep=cfg.checkpoint.keep,
        checkpoint_score_attribute=metric,
        checkpoint_score_order=mode,
    )


def train(
    cfg: Config,
    log: Any = print,
    parent_run_id: str | None = None,
    callbacks: Sequence[Any] = (),
    extra_tags: dict[str, str] | None = None,
    probe: ProbeSettings | None = None,
    startup: Startup | None = None,
    lock: bool = True,
    service: Any = None,
) -> TrainResult:
    """Run ``cfg`` to completion on Ray; raises :class:`RunFailed` if training fails.

    A sweep's trial passes its parent MLflow run, Tune's report callback and the
    sweep's tracking actor (``service``); ``raylift doctor`` passes the settings of its
    probe; the CLI passes the start-up clock it began at its process's start (else it
    begins here). ``lock``: hold the run's lock (:mod:`raylift.runlock`), on any storage.
    """
    run_dir = storage.join(storage.resolve(cfg.storage), cfg.name)
    if lock:  # a sweep's trials run in the sweep's storage, which it checked
        writable(storage.resolve(cfg.storage), "storage")
    what = f"run {cfg.name!r}"
    hold = runlock.hold(run_dir, what, log, confirm=False) if lock else contextlib.nullcontext()
    with hold as held:
        return _train(cfg, log, parent_run_id, callbacks, extra_tags, probe, startup, held, service)


def _train(
    cfg: Config,
    log: Any,
    parent_run_id: str | None,
    callbacks: Sequence[Any],
    extra_tags: dict[str, str] | None,
    probe: ProbeSettings | None,
    startup: Startup | None,
    held: runlock.RunLock | None = None,
    service: Any = None,
) -> TrainResult:
    started = time.perf_counter()
    if startup is None:
        startup = Startup.begin()
        startup.mark("launch")
    os.environ.update(console.quiet_env())  # before MLflow's import reads its level
    where = storage.resolve(cfg.storage)
    resume = run_exists(where, cfg.name)
    uri = tracking.tracking_uri(cfg)
    log(
        f"raylift: run {cfg.name!r} -> {storage.join(where, cfg.name)}  "
        f"({'resuming from its latest checkpoint' if resume else 'new run'})"
    )
    log(f"raylift: MLflow tracking at {uri} (experiment {cfg.tracking.experiment!r})")
    if service is None and (problem := tracking.server_problem(uri)):
        raise EnvironmentProblem(problem)
    manifest, cache = prepare_data(cfg, log, startup)
    # Workers run in folders of their own: they get the paths this driver resolved.
    adapter = dataclasses.replace(
        cfg.model.adapter, weights=weights_absolute(cfg.model.adapter.weights)
    )
    model = dataclasses.replace(
        cfg.model, weights=weights_absolute(cfg.model.weights), adapter=adapter
    )
    cfg = dataclasses.replace(resolve_auto(cfg, log), storage=where, model=model)
    startup.mark("auto")
    problems = before_workers(cfg)  # a cluster of several nodes: storage and tracking
    if problems:
        raise EnvironmentProblem("; ".join(problems))
    if held is not None:
        held.confirm()  # before anything is written to the run's folder
    run_dir = storage.join(where, cfg.name)
    recorded = record_config(cfg, run_dir)
    cfg = mlmodel.fetch_weights(cfg, run_dir, uri, log)  # models:/... into the run's folder
    trial = service is not None  # a sweep's trial: the sweep logs the best trial's model
    with tracking_for_run(uri, service) as (store, service):
        parent = {"mlflow.parentRunId": parent_run_id} if parent_run_id else {}
        tags = {**(extra_tags or {}), **parent}  # a sweep's trials are its children
        run_id = store.start_run(cfg, where, resume, cfg.scaling.min_workers, tags)
        describe_run(store, run_id, cfg, manifest, recorded)
        startup.mark("mlflow")
        shared = shared_marker(where, cfg.name)
        spec = RunSpec(cfg, manifest.root, run_id, uri, service, cache, probe, startup, shared)
        fit_started = time.time()
        result = fit(build_trainer(cfg, where, spec, callbacks), spec, store)
        ckpt, metrics = closing_metrics(result, where, store, run_id, fit_started)
        final = {"raylift.final_checkpoint": ckpt} if ckpt else {}
        if "nonfinite_step" in metrics:
            store.end_run(run_id, "FAILED", final)
            raise RunFailed(_nonfinite_message(cfg, metrics, ckpt))
        try:
            logged = None if trial else log_run_model(store, run_id, cfg, run_dir, log)
        finally:  # the training finished, whether or not its model could be logged
            store.end_run(run_id, "FINISHED", final)
    seconds = time.perf_counter() - started
    return TrainResult(cfg.name, metrics, ckpt, run_id, uri, seconds, cfg, logged)


def describe_run(store: Any, run_id: str, cfg: Config, manifest: Any, recorded: str) -> None:
    """The run's config as it ran (an artifact) and the data it trains on (dataset inputs)."""
    store.log_artifact(run_id, RUN_CONFIG, recorded.encode(), None)
    store.log_datasets(run_id, mlmodel.dataset_records(cfg, manifest))


def log_run_model(
    store: Any, run_id: str, cfg: Config, run_dir: str, log: Any
) -> mlmodel.LoggedModel | None:
    """``tracking.log_model``: the trained weights as the run's MLflow model, after the
    last step. A failure here fails the command, the training itself kept: the MLflow
    run is FINISHED and ``raylift export`` still writes the weights."""
    if cfg.tracking.log_model == "none":
        return None
    try:
        return mlmodel.log_model(store, run_id, cfg, run_dir, cfg.tracking.log_model, log)
    except Exception as exc:
        raise RunFailed(
            f"training run {cfg.name!r} finished, but logging its model to MLflow failed: "
            f"{first_line(exc)}"
            f"\n  the checkpoints are in {run_dir}; `raylift export {run_dir} --out "
            "model.safetensors` writes the weights, or fix the cause and rerun to log them"
        ) from exc


@contextlib.contextmanager
def tracking_for_run(uri: str, service: Any = None) -> Iterator[tuple[Any, Any]]:
    """(the store this process writes through, the tracking actor the workers write to).

    The driver starts the actor on its own node (stopped after the run) and writes through
    it too: MLflow is imported once per run, in the actor, not also in the driver. A
    sweep's trial, which may run on any node, is handed the sweep's actor. A driver that
    has imported MLflow already (a notebook, a program calling :func:`train`) writes
    itself rather than wait for the actor's start; so does one on a Ray Client
    (``ray://``) connection, which is not on the actor's node (the model it logs is a
    folder on its own disk)."""
    if service is not None:
        yield tracking.RemoteStore(service), service
        return
    import ray

    client = ray.util.client.ray.is_connected()
    if tracking.is_local_store(uri) and client:
        raise EnvironmentProblem(
            f"tracking.uri: {uri} is a file on this machine, which the cluster's nodes "
            "cannot write to through a Ray Client (ray://) connection; set tracking.uri "
            "to an MLflow server (http://...), or run on the cluster with raylift submit"
        )
    service = tracking.start_service(uri)
    own = client or "mlflow" in sys.modules
    if own:
        service.warm.remote()  # MLflow imported there while Ray Train starts the workers
    try:
        yield (tracking.Store(uri) if own else tracking.RemoteStore(service)), service
    finally:
        ray.kill(service)


def closing_metrics(
    result: Any, where: str, store: Any, run_id: str, fit_started: float
) -> tuple[str | None, dict[str, float]]:
    """The run's final checkpoint (its URI) and metrics."""
    # Ray's checkpoint path drops an object store's scheme: given back, so it can be used.
    ckpt = storage.as_uri(result.checkpoint.path, like=where) if result.checkpoint else None
    metrics = {
        k: float(v) for k, v in (result.metrics or {}).items() if isinstance(v, (int, float))
    }
    # Ray Train's result carries the metrics of the latest checkpoint's report, not of a
    # later report without one (the final evaluation after the last checkpoint, the stop
    # on a NaN loss): rank 0 logged those to MLflow, which has the last word.
    metrics.update(store.latest_metrics(run_id, ("val_", "train_")))
    bad = store.metric_since(run_id, "nonfinite_step", fit_started)
    if bad is not None:
        metrics["nonfinite_step"] = bad
    return ckpt, metrics


def shared_marker(where: str, name: str) -> str | None:
    """For local storage, a marker in the run's folder that every worker must see (the
    folder is shared by its node); its token. None for an object store."""
    if storage.is_remote(where):
        return None
    import uuid

    from raylift.worker import SHARED_MARKER

    token = uuid.uuid4().hex
    storage.write_text(storage.join(where, name, SHARED_MARKER), token)
    return token


def record_config(cfg: Config, run_dir: str) -> str:
    """The config as this run runs it (overrides applied, ``auto`` resolved, storage made
    absolute, secrets masked) in its folder: ``export``, ``verify`` and ``doctor`` read
    it from there, and a later command can name the folder instead of the YAML."""
    ran = dataclasses.replace(cfg, storage=storage.resolve(cfg.storage))
    text = tracking.redacted_yaml(ran)
    storage.write_text(storage.join(run_dir, RUN_CONFIG), text)
    return text


def prepare_data(
    cfg: Config, log: Any = print, startup: Startup | None = None
) -> tuple[Manifest, dict[str, list[Any]] | None]:
    """The shards' manifest, checked (or prepared) before any worker starts, so a bad
    folder costs nothing; and their object-store refs where ``data.cache`` asks for them."""
    from raylift.data.shards import cache_in_object_store, shards_for_run
    from raylift.tasks import build_task

    startup = startup or Startup.begin()
    task = build_task(cfg.task, cfg.task_args)
    from raylift.weights import check_for_config

    check_for_config(cfg, task)  # headers only, before anything starts
    manifest = shards_for_run(cfg, task, log, connect=lambda: connect_ray(cfg))
    startup.mark("shards")
    connect_ray(cfg)
    startup.mark("ray")
    cache = cache_in_object_store(manifest, log) if cfg.data.cache else None
    counts = {s: manifest.rows(s) for s in manifest.splits}
    log(f"raylift: data {counts} rows from {manifest.root}; {cfg.scaling.num_workers} worker(s)")
    return manifest, cache


def fit(trainer: Any, spec: RunSpec, store: Any) -> Any:
    """``trainer.fit()``; the MLflow run is closed as failed or killed if it does not finish."""
    status = "FAILED"
    try:
        result = trainer.fit()
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    except Exception as exc:
        if _caused_by(exc, "WorkerGroupStartupTimeoutError"):
            raise RunFailed(placement_message(spec.config)) from exc
        said = _failure_message(exc, spec.config, spec.tracking)
        refused = _root(exc, StorageError) or _root(exc, ConfigError)
        failed = StorageFailed if refused else RunFailed
        raise failed(said) from exc
    finally:
        if status != "FINISHED":
            store.end_run(spec.run_id, status)
    return result


# ---------------------------------------------------------------- auto


@dataclasses.dataclass(frozen=True)
class WorkerFacts:
    """What one worker-shaped slot of the cluster has: the ``auto`` settings' inputs."""

    memory: int  # bytes one worker may use: its GPU's, or its share of its host's
    device: DeviceFacts


def resolve_auto(cfg: Config, log: Any = print, facts: WorkerFacts | None = None) -> Config:
    """``cfg`` with ``strategy: auto`` and ``precision: auto`` replaced by what they
    resolve to, once for the run, from one worker slot's facts (measured when not given)."""
    if AUTO in (cfg.strategy.name, cfg.precision) and facts is None:
        facts = worker_facts(cfg)
    cfg = resolve_auto_precision(cfg, log, facts)
    return resolve_strategy(cfg, log, facts.memory if facts else None)


def resolve_auto_precision(cfg: Config, log: Any, facts: WorkerFacts | None) -> Config:
    from raylift.strategies import config_problems

    if cfg.precision != AUTO or facts is None:
        log(f"raylift: precision {cfg.precision}")
        return cfg
    name, why = choose(facts.device)
    resolved = dataclasses.replace(cfg, precision=name)
    refused = config_problems(resolved)
    if refused:  # e.g. a strategy that cannot scale fp16 losses: fp32 always trains
        name, why = "32", refused[0]
        resolved = dataclasses.replace(cfg, precision=name)
        if config_problems(resolved):
            raise ConfigError([f"precision: auto resolved to no precision this run accepts: {why}"])
    log(f"raylift: precision auto -> {name} ({why})")
    return resolved


def resolve_strategy(cfg: Config, log: Any = print, memory: int | None = None) -> Config:
    """``cfg`` with ``strategy: auto`` replaced by what it resolves to.

    Planned at the smallest world size the run may have, so the choice fits at every
    size an elastic run passes through. ``memory`` is one worker's (measured on a
    worker-shaped slot of the cluster when not given)."""
    from raylift.plan import resolve_auto as plan_auto

    if cfg.strategy.name != AUTO:
        log(f"raylift: strategy {cfg.strategy.name}")
        return cfg
    world = cfg.scaling.min_workers
    memory = worker_facts(cfg).memory if memory is None else memory
    strategy = plan_auto(cfg, world, memory)
    log(f"raylift: strategy auto -> {strategy} ({memory / 2**30:.1f} GiB per worker)")
    return dataclasses.replace(cfg, strategy=strategy)


def worker_facts(cfg: Config) -> WorkerFacts:
    """Measured where a worker would run: here when the cluster is this one node (a
    local Ray), else by a task placed like a worker, on a GPU node when the run uses
    GPUs. The local answer skips a worker process's start and imports: seconds."""
    import ray

    sc = cfg.scaling
    here = ray.get_runtime_context().get_node_id()
    nodes = alive_nodes()
    alone = len(nodes) == 1 and nodes[0]["NodeID"] == here
    if alone and (not sc.use_gpu or nodes[0]["Resources"].get("GPU", 0) >= 1):
        return _worker_facts(sc.use_gpu, sc.min_workers, sc.cpus_per_worker)
    probe = ray.remote(_worker_facts).options(num_cpus=0.01, num_gpus=1 if sc.use_gpu else 0)
    return ray.get(probe.remote(sc.use_gpu, sc.min_workers, sc.cpus_per_worker))


def _worker_facts(use_gpu: bool, world: int, cpus_per_worker: float) -> WorkerFacts:
    import psutil
    import ray

    device = DeviceFacts.here(use_gpu)
    if use_gpu:
        import torch

        return WorkerFacts(int(torch.cuda.get_device_properties(0).total_memory), device)
    here = ray.get_runtime_context().get_node_id()
    cpus = next(n["Resources"].get("CPU", 1) for n in ray.nodes() if n["NodeID"] == here)
    per_node = max(1, min(world, int(cpus // cpus_per_worker)))  # CPU workers share the host
    return WorkerFacts(int(psutil.virtual_memory().total // per_node), device)


def _nonfinite_message(cfg: Config, metrics: dict[str, float], ckpt: str | None) -> str:
    return (
        f"training run {cfg.name!r} stopped: the loss became inf/NaN at step "
        f"{int(metrics['nonfinite_step'])} (train.on_nan: stop); the last good checkpoint is "
        f"{ckpt or 'none'}. Lower optim.lr, set train.grad_clip, use precision bf16-mixed "
        "instead of 16-mixed, or set train.on_nan=skip to step over bad batches"
    )


def _caused_by(exc: BaseException, name: str) -> bool:
    """Whether an exception named ``name`` is in ``exc``'s chain, or is the controller
    failure Ray Train's ``ControllerError`` wraps."""
    seen: BaseException | None = exc
    while seen is not None:
        inner = getattr(seen, "controller_failure", None)
        if name in (type(seen).__name__, type(inner).__name__):
            return True
        seen = seen.__cause__
    return False


def placement_message(cfg: Config) -> str:
    """What the run waited for, what the cluster has, and what holds the rest."""
    import ray

    want = worker_resources(cfg)
    n = cfg.scaling.min_workers
    total, free = ray.cluster_resources(), ray.available_resources()
    needed = ", ".join(f"{k} {v * n:g}" for k, v in want.items())
    has = ", ".join(f"{k} {total.get(k, 0):g} ({free.get(k, 0):g} free)" for k in want)
    held = [
        f"    placement group {pg.get('name') or pid[:8]}: "
        + ", ".join(f"{k} {v:g}" for k, v in _bundle_sum(pg).items() if k in want)
        for pid, pg in ray.util.placement_group_table().items()
        if pg.get("state") == "CREATED"
    ]
    return (
        f"training run {cfg.name!r} failed: its {n} worker(s) of {want} could not be placed "
        f"within scaling.placement_timeout_s={cfg.scaling.placement_timeout_s:g} s.\n"
        f"  it needs {needed}; the cluster has {has}.\n"
        + ("  held by:\n" + "\n".join(held) + "\n" if held else "")
        + "  lower scaling.num_workers or scaling.cpus_per_worker, stop what holds the "
        "resources, add nodes, or raise scaling.placement_timeout_s for a slow autoscaler"
    )


def _bundle_sum(pg: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for bundle in pg.get("bundles", {}).values():
        for k, v in bundle.items():
            out[k] = out.get(k, 0.0) + v
    return out


def _failure_message(exc: BaseException, cfg: Config, tracking: Any = None) -> str:
    group = _worker_group_error(exc)
    if group is not None:  # which ranks, and their tracebacks: printed here, once
        root, what, trace = _group_failure(group, tracking)
        head = f"training run {cfg.name!r} failed: {what}"
    else:
        root = exc
        while root.__cause__ is not None:
            root = root.__cause__
        text = str(root).strip().splitlines()
        trace, head = "", f"training run {cfg.name!r} failed: {text[-1] if text else root!r}"
    if (refused := _root(exc, StorageError)) is not None:
        return f"training run {cfg.name!r} failed: {refused}"
    if isinstance(wrong := _root(exc, ConfigError), ConfigError):  # found by the workers
        return f"training run {cfg.name!r} failed: {'; '.join(wrong.problems)}"
    if "No space left on device" in str(root) or getattr(root, "errno", None) == errno.ENOSPC:
        return (
            f"training run {cfg.name!r} failed: the disk under storage {cfg.storage!r} is full "
            f"({str(root).strip().splitlines()[-1]})\n  free space there or set storage "
            "elsewhere, then rerun the same command: it resumes from the newest complete "
            "checkpoint, skipping the cut-off one"
        )
    return (
        f"{head}\n"
        + (f"{trace}\n" if trace else "")
        + "  fix the cause and rerun the same command to resume from the latest checkpoint"
    )


def _root(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    """A ``kind`` in ``exc``'s chain, or kept by Ray Train's wrapper of a worker's error."""
    group = _worker_group_error(exc)
    if group is not None:
        from raylift.faults import primary

        _, failed = primary(dict(group.worker_failures))
        exc = getattr(failed, "_base_exc", failed)
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, kind):
            return seen
        seen = seen.__cause__
    return None


def _worker_group_error(exc: BaseException) -> Any:
    """Ray Train's WorkerGroupError (rank -> exception) anywhere in ``exc``'s chain."""
    seen: BaseException | None = exc
    while seen is not None:
        if getattr(seen, "worker_failures", None):
            return seen
        seen = seen.__cause__
    return None


# Ray Train's message: one line of its own, then a snippet per group of ranks whose errors
# read alike but for numbers, headed "[Rank 0,1 Error Snippet]:" (its poll.py).
_SNIPPET = re.compile(r"^\[Ranks? ([\d, -]+) Error Snippet\]:\n", re.MULTILINE)


def _snippets(group: Any) -> list[tuple[list[int], str]]:
    """(ranks, traceback) for each distinct error Ray Train kept a traceback of: the
    ranks' exceptions come back to the driver without theirs."""
    parts = _SNIPPET.split(str(group))  # Ray's line, then each snippet's ranks and text
    return [(_ranks(r), t.strip()) for r, t in zip(parts[1::2], parts[2::2], strict=True)]


def _ranks(text: str) -> list[int]:
    """``0,1`` (Ray's), or ``0-3,5``: ranges, should a later Ray write them."""
    out: list[int] = []
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        out.extend(range(int(low), int(high or low) + 1))
    return out


def _label(ranks: Sequence[int]) -> str:
    """``rank 3``, ``ranks 0,1``, or ``ranks 0-63``: a run's many ranks in a line."""
    spans: list[list[int]] = []
    for r in sorted(set(ranks)):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    parts = [f"{a}" if a == b else f"{a},{b}" if b == a + 1 else f"{a}-{b}" for a, b in spans]
    return ("rank " if len(set(ranks)) == 1 else "ranks ") + ",".join(parts)


def _group_failure(group: Any, tracking: Any) -> tuple[BaseException, str, str]:
    """(the first failed rank's exception, which ranks failed and how, their tracebacks)."""
    from raylift.faults import Crash, cause, died, primary

    rank, failed = primary(dict(group.worker_failures))
    what, node = cause(failed)
    where = f" on node {node}" if node else ""
    if died(failed):
        # A dead process has no traceback of its own (the controller showed the end of its
        # stderr), and the other ranks' errors are what its death did to them.
        crash = Crash.find(failed, tracking, rank)
        return failed, f"worker rank {rank}{where}: {crash.how() if crash else what}", ""
    snippets = _snippets(group)
    if len(snippets) == 1:  # every failed rank alike: all named, the traceback once
        ranks, trace = snippets[0]
        return failed, f"worker {_label(ranks)}{where}: {what}", trace
    head = f"worker rank {rank}{where}: {what}"
    if not snippets:  # a message Ray no longer writes as it did: the line alone
        return failed, head, ""
    everyone = [r for ranks, _ in snippets for r in ranks]
    head += f"; {_label(everyone)} failed, with {len(snippets)} different errors"
    return failed, head, "\n".join(f"[{_label(ranks)}]\n{trace}" for ranks, trace in snippets)
