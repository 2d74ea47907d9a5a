"""Config -> Ray Train ``TorchTrainer`` -> fit. The driver side of ``raylift train``.

What is the same for every rank is settled here, once: the shards are checked (or
prepared), ``strategy: auto`` and ``precision: auto`` are resolved, the MLflow run is
opened. The workers get
it all in one :class:`~raylift.run.worker.RunSpec`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from raylift.artifacts import mlmodel, tracking, tracking_service
from raylift.core import console, runlock, storage
from raylift.core.config import Config, ConfigError, EnvironmentProblem
from raylift.core.errors import RefusedPickle, first_line
from raylift.core.parsing import RUN_CONFIG
from raylift.core.startup import Startup
from raylift.core.storage import StorageError
from raylift.data.manifest import Manifest
from raylift.data.shards import cache_in_object_store, shards_for_run
from raylift.run.auto import resolve_auto
from raylift.run.check import before_workers, worker_resources, writable
from raylift.run.connect import WORKER_ENV, connect_ray
from raylift.run.failures import (
    caused_by,
    failure_message,
    nonfinite_message,
    placement_message,
    root_of,
)
from raylift.run.faults import FaultReporter
from raylift.run.leaving import Restarts
from raylift.run.probe import ProbeSettings
from raylift.run.snapshots import end_keepers, start_keepers
from raylift.run.worker import SHARED_MARKER, SPEC_KEY, RunSpec, run_id_of, worker_main
from raylift.tasks import build_task
from raylift.tensors.checkpoints import checkpoint_dirs
from raylift.tensors.preflight import check_for_config
from raylift.tensors.weights import absolute as weights_absolute
from raylift.validation import pin_hub_names, recorded_args


class RunFailed(RuntimeError):
    """The training run ended in an error; the message says where and why."""


class StorageFailed(RunFailed):
    """The run's storage failed it mid-run, its workers found a setting wrong (a resume
    on another base), or a checkpoint file they were to load was refused: exit 2, the fix
    is outside the code."""


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


def run_exists(where: str, name: str) -> bool:
    """True when a previous run under this name left checkpoints to resume from, in a
    local folder or an object store alike."""
    return bool(checkpoint_dirs(storage.join(where, name)))


START_TIMEOUT_VAR = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
# A user's own setting, read once: raylift sets the variable for each run it starts.
_USER_ATTEMPT_S = os.environ.get(START_TIMEOUT_VAR)


def placement_bounds(timeout_s: float, attempt_s: str | None = None) -> tuple[float, int]:
    """Ray Train's wait for one placement attempt (``attempt_s`` if the environment sets
    it, else at most a minute, Ray's default), and how many more attempts fit in
    ``timeout_s``. Between attempts an autoscaler may have added nodes."""
    attempt = min(float(attempt_s) if attempt_s else 60.0, timeout_s)
    return attempt, max(0, math.ceil(timeout_s / attempt) - 1)


def build_torch_trainer(
    cfg: Config, where: str, spec: RunSpec, callbacks: Sequence[Any] = ()
) -> Any:
    from ray.train import FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig

    # Train V2 callbacks, which ray.train's V1 type hints do not know.
    log = console.current_log()
    faults: Any = FaultReporter(
        cfg.train.max_failures,
        storage.join(where, cfg.name),
        spec.tracking,
        str(log) if log else None,
        spec.run_id,
        memory=spec.keepers is not None,
    )
    sc = cfg.scaling
    restarts: Any = Restarts(storage.join(where, cfg.name), spec.tracking, spec.run_id, sc.elastic)
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
            **ray_storage(where),
            checkpoint_config=checkpoint_config(cfg),
            # A worker group that cannot be placed is a "controller failure", which Ray
            # Train retries forever by default: bounded here by placement_timeout_s.
            failure_config=FailureConfig(  # type: ignore[call-arg]
                max_failures=cfg.train.max_failures, controller_failure_limit=retries
            ),
            worker_runtime_env={"env_vars": dict(WORKER_ENV)},
            # Ray Train's own records (a failure's tracebacks among them) go to its log
            # files; the console has raylift's account of them (raylift.run.faults).
            logging_config=LoggingConfig(log_level="WARNING" if console.verbose() else "CRITICAL"),
            callbacks=[faults, restarts, *callbacks],
        ),
    )


def ray_storage(where: str) -> dict[str, Any]:
    """Ray's storage arguments for ``where``: an object store through raylift's filesystem,
    which retries what a retry can fix where Ray's own would give up, with the path in it;
    a local folder as it is."""
    if not storage.is_remote(where):
        return {"storage_path": where}
    fs, path = storage.filesystem(where)
    return {"storage_path": path, "storage_filesystem": fs}


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
    begins here). ``lock``: hold the run's lock (:mod:`raylift.core.runlock`), on any storage.
    """
    run_dir = storage.join(storage.resolve(cfg.storage), cfg.name)
    if storage.is_remote(run_dir):
        # An object store's client logs each retry below Python (Arrow's S3 client on a
        # throttled upload of the run's lease): to the log from the first write on, named
        # on the console once the run starts (a refused storage stays one line).
        console.start_log(cfg.name, announce=False)
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
    run_dir = storage.join(where, cfg.name)
    before = recorded_args(run_dir) if resume else None  # a resume reads what it read
    cfg, pinned = pin_hub_names(cfg, before)  # one commit for every process, this run's record
    if pinned:
        log(pinned)
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
    recorded = record_config(cfg, run_dir)
    cfg = mlmodel.fetch_weights(cfg, run_dir, uri, log)  # models:/... into the run's folder
    trial = service is not None  # a sweep's trial: the sweep logs the best trial's model
    with tracking_for_run(uri, service) as (store, service):
        parent = {"mlflow.parentRunId": parent_run_id} if parent_run_id else {}
        tags = {**(extra_tags or {}), **parent}  # a sweep's trials are its children
        opened = open_run(store, cfg, where, resume, tags, manifest, recorded)
        startup.mark("mlflow")
        shared = shared_marker(where, cfg.name)
        keepers = start_keepers(cfg)  # ended with the run, or with this process
        spec = RunSpec(
            cfg, manifest.root, opened, uri, service, cache, probe, startup, shared, keepers
        )
        fit_started = time.time()
        try:
            result = fit(build_torch_trainer(cfg, where, spec, callbacks), spec, store)
        finally:
            end_keepers(keepers)
        run_id = run_id_of(spec)
        ckpt, metrics = closing_metrics(result, where, store, run_id, fit_started)
        log_goodput(service, store, run_id, int(metrics.get("step", 0)), log)
        final = {"raylift.final_checkpoint": ckpt} if ckpt else {}
        if "nonfinite_step" in metrics:
            store.end_run(run_id, "FAILED", final)
            raise RunFailed(nonfinite_message(cfg, metrics, ckpt))
        try:
            logged = None if trial else log_run_model(store, run_id, cfg, run_dir, log)
        finally:  # the training finished, whether or not its model could be logged
            store.end_run(run_id, "FINISHED", final)
    seconds = time.perf_counter() - started
    return TrainResult(cfg.name, metrics, ckpt, run_id, uri, seconds, cfg, logged)


def log_goodput(service: Any, store: Any, run_id: str, step: int, log: Any) -> None:
    """``goodput``, from the tracking actor's account of the run's restarts; a line too
    where there were any (each restart had its own, raylift.run.restarts)."""
    import ray

    facts = ray.get(service.goodput.remote(run_id, time.time()))
    if facts is None:  # no step was taken
        return
    store.log_batch(run_id, [("goodput", facts.share)], step, int(time.time() * 1000))
    if facts.restarts:
        log(f"raylift: {facts.line()}")


def open_run(
    store: Any, cfg: Config, where: str, resume: bool, tags: dict[str, str],
    manifest: Manifest, recorded: str,
) -> Any:  # fmt: skip
    """The MLflow run, started and described (``Store.open_run``): its id, or through
    the tracking actor the ObjectRef of its id.

    Through the actor nothing is waited for: the actor's start (MLflow's import, the
    store's schema check) overlaps Ray Train's start of the workers, which take the
    reference. Ray resolves a reference passed as an argument before the call runs, so
    every write lands in the run; rank 0 waits for the string before its first write
    (``worker.run_id_of``), so a run that could not be opened fails before training."""
    args = (cfg, where, resume, cfg.scaling.min_workers, tags, recorded.encode(),
            mlmodel.dataset_records(cfg, manifest))  # fmt: skip
    if isinstance(store, tracking_service.RemoteStore):
        return store.service.open_run.remote(*args)
    return store.open_run(*args)


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
    except RefusedPickle as exc:  # planted since the workers wrote it: nothing was logged
        raise StorageFailed(
            f"training run {cfg.name!r} finished; its model was not logged: {exc}"
        ) from exc
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
        yield tracking_service.RemoteStore(service), service
        return
    import ray

    client = ray.util.client.ray.is_connected()
    if tracking.is_local_store(uri) and client:
        raise EnvironmentProblem(
            f"tracking.uri: {uri} is a file on this machine, which the cluster's nodes "
            "cannot write to through a Ray Client (ray://) connection; set tracking.uri "
            "to an MLflow server (http://...), or run on the cluster with raylift submit"
        )
    service = tracking_service.start_service(uri)
    own = client or "mlflow" in sys.modules
    if own:
        service.warm.remote()  # MLflow imported there while Ray Train starts the workers
    try:
        store = tracking_service.Store(uri) if own else tracking_service.RemoteStore(service)
        yield store, service
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
    startup = startup or Startup.begin()
    task = build_task(cfg.task, cfg.task_args)

    check_for_config(cfg, task)  # headers only, before anything starts
    manifest = shards_for_run(cfg, task, log, connect=lambda: connect_ray(cfg))
    startup.mark("shards")
    connect_ray(cfg)
    startup.mark("ray")
    cache = cache_in_object_store(manifest, log) if cfg.data.cache else None
    counts = {s: manifest.rows(s) for s in manifest.splits}
    log(f"raylift: data {counts} rows from {manifest.root}; {cfg.scaling.num_workers} worker(s)")
    return manifest, cache


@contextlib.contextmanager
def sigint_seen() -> Iterator[Callable[[], bool]]:
    """Whether a SIGINT arrived inside, whichever Python handler took it: Ray Train's own
    (registered by ``fit()``) aborts the controller and leaves the driver a
    ``SystemExit(1)``, not a ``KeyboardInterrupt``. Python writes each signal's number to
    the wakeup fd before any handler runs. Off the main thread (a Tune trial), or where
    something else holds the wakeup fd, it answers False.

    The SIGINT handler is given back as it was: Ray Train leaves its own in place after
    ``fit()``, and that handler holds the run's controller, so the actor would outlive
    the run for as long as this process does, and a later Ctrl-C would abort a run that
    has ended and exit."""
    read, write = os.pipe()
    os.set_blocking(read, False)
    os.set_blocking(write, False)
    main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGINT) if main else None
    previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False) if main else -1
    if previous != -1:
        signal.set_wakeup_fd(previous)  # not ours to take
    got: list[int] = []

    def seen() -> bool:
        with contextlib.suppress(BlockingIOError):
            got.extend(os.read(read, 512))
        return signal.SIGINT in got

    try:
        yield seen
    finally:
        if main and previous == -1:
            signal.set_wakeup_fd(-1)
        if handler is not None:  # None: set outside Python, which cannot be set back
            signal.signal(signal.SIGINT, handler)
        os.close(read)
        os.close(write)


def fit(trainer: Any, spec: RunSpec, store: Any) -> Any:
    """``trainer.fit()``; the MLflow run is closed as failed or killed if it does not
    finish. A Ctrl-C reaches the caller as ``KeyboardInterrupt`` (the run is KILLED)."""
    status = "FAILED"
    try:
        with sigint_seen() as interrupted:
            try:
                result = trainer.fit()
            except SystemExit:
                if not interrupted():
                    raise
                raise KeyboardInterrupt from None
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    except Exception as exc:
        if caused_by(exc, "WorkerGroupStartupTimeoutError"):
            raise RunFailed(placement_message(spec.config)) from exc
        said = failure_message(exc, spec.config, spec.tracking)
        refused = (
            root_of(exc, StorageError)
            or root_of(exc, ConfigError)
            or root_of(exc, RefusedPickle)  # a planted checkpoint file: exit 2, as bad input
        )
        failed = StorageFailed if refused else RunFailed
        raise failed(said) from exc
    finally:
        if status != "FINISHED":
            end_unfinished(store, spec, status)
    return result


def end_unfinished(store: Any, spec: RunSpec, status: str) -> None:
    """Close the MLflow run as ``status``. Where the tracking actor could not open it
    (the run opens beside the workers' start: raylift.run.launch.open_run), that is why
    the workers failed, and the error says so rather than rank 0's symptom."""
    try:
        run_id = run_id_of(spec)
    except Exception as exc:
        raise EnvironmentProblem(
            f"tracking.uri: MLflow could not open the run in {spec.tracking_uri}: {first_line(exc)}"
        ) from exc
    store.end_run(run_id, status)


# ---------------------------------------------------------------- auto
