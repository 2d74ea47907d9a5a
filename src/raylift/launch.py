"""Config -> Ray Train ``TorchTrainer`` -> fit. The driver side of ``raylift train``."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from raylift import tracking
from raylift.config import Config, config_from_dict
from raylift.tasks import BUILTINS

# Environment every Ray process of a raylift run gets.
WORKER_ENV = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    # Ray Train collects reports by polling; 2 s per poll would stall every epoch-end report.
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25",
    "RAY_DATA_DISABLE_PROGRESS_BARS": "1",
    # Quiet by default: raylift prints its own progress lines; Ray's go to its log files.
    "RAY_DATA_LOG_LEVEL": "ERROR",
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
    "PYTHONWARNINGS": "ignore::DeprecationWarning",
}


class RunFailed(RuntimeError):
    """The training run ended in an error; the message says where and why."""


@dataclasses.dataclass
class TrainResult:
    name: str
    metrics: dict[str, float]
    checkpoint: str | None
    run_id: str
    tracking_uri: str
    seconds: float


# ---------------------------------------------------------------- driver


def resolve_storage(storage: str) -> str:
    """Ray wants an absolute path for local storage; URIs (s3://, gs://) pass through."""
    if "://" in storage:
        return storage
    return str(Path(storage).expanduser().resolve())


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

    if ray.is_initialized():
        return
    env = dict(WORKER_ENV)
    # User tasks given as module:Class import from the current folder, as they would in Python.
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    if os.environ.get("RAY_ADDRESS"):
        # Ray ships local modules only at the job level; every task and actor inherits them.
        code = user_code_env(cfg.task)
        try:
            ray.init(
                runtime_env={**code, "env_vars": env},
                logging_level=logging.WARNING,
                log_to_driver=True,
            )
        except ValueError:
            # Inside a Ray job whose runtime env already sets these (raylift submit does),
            # Ray refuses to merge the same keys twice: the job's own env applies.
            ray.init(runtime_env=code or None, logging_level=logging.WARNING, log_to_driver=True)
        return
    env["PYTHONPATH"] = os.pathsep.join(p for p in (cwd, os.environ.get("PYTHONPATH")) if p)
    os.environ.update(env)  # the local raylet, and so every worker, inherits these
    # The dashboard serves the State API, which Train uses to free placement groups; it
    # listens on 127.0.0.1 only.
    ray.init(
        address="local",
        num_cpus=local_num_cpus(cfg, workers),
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        logging_level=logging.WARNING,
        log_to_driver=True,
    )


def run_exists(storage: str, name: str) -> bool:
    """True when a previous run under this name left checkpoints to resume from."""
    if "://" in storage:
        return False  # remote storage: Ray Train decides, MLflow starts a fresh run
    return any((Path(storage) / name).glob("checkpoint-step*"))


def build_trainer(
    cfg: Config, storage: str, payload: dict[str, Any], callbacks: Sequence[Any] = ()
) -> Any:
    from ray.train import (
        CheckpointConfig,
        FailureConfig,
        LoggingConfig,
        RunConfig,
        ScalingConfig,
    )
    from ray.train.torch import TorchConfig, TorchTrainer

    sc = cfg.scaling
    resources: dict[str, float] = {"CPU": sc.cpus_per_worker}
    if sc.use_gpu:
        resources["GPU"] = 1
    workers: int | tuple[int, int] = (
        (sc.min_workers, sc.max_workers) if sc.elastic else sc.min_workers
    )
    return TorchTrainer(
        worker_main,
        train_loop_config=payload,
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
            storage_path=storage,
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep),
            failure_config=FailureConfig(max_failures=cfg.train.max_failures),
            worker_runtime_env={"env_vars": dict(WORKER_ENV)},
            logging_config=LoggingConfig(log_level="WARNING"),
            callbacks=list(callbacks),
        ),
    )


def train(
    cfg: Config,
    log: Any = print,
    parent_run_id: str | None = None,
    callbacks: Sequence[Any] = (),
    extra_tags: dict[str, str] | None = None,
    probe: dict[str, Any] | None = None,
) -> TrainResult:
    """Run ``cfg`` to completion on Ray; raises :class:`RunFailed` if training fails.

    A sweep's trial passes its parent MLflow run and Tune's report callback;
    ``raylift doctor`` passes the arguments of its :class:`~raylift.doctor.DoctorProbe`.
    """
    from raylift.data.shards import cache_in_object_store, shards_for_run
    from raylift.tasks import build_task

    started = time.perf_counter()
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    storage = resolve_storage(cfg.storage)
    resume = run_exists(storage, cfg.name)
    uri = tracking.tracking_uri(cfg)
    log(
        f"raylift: run {cfg.name!r} -> {storage}/{cfg.name}  "
        f"({'resuming from its latest checkpoint' if resume else 'new run'})"
    )
    log(f"raylift: MLflow tracking at {uri} (experiment {cfg.tracking.experiment!r})")
    task = build_task(cfg.task, cfg.task_args)
    # Shards are checked (or prepared) before any worker starts: a bad folder costs nothing.
    manifest = shards_for_run(cfg, task, log, connect=lambda: connect_ray(cfg))
    connect_ray(cfg)
    cache = cache_in_object_store(manifest, log) if cfg.data.cache else None
    counts = {s: manifest.rows(s) for s in manifest.splits}
    log(
        f"raylift: data {counts} rows from {manifest.root}; {cfg.scaling.num_workers} "
        f"worker(s), strategy {cfg.strategy.name}, precision {cfg.precision}"
    )
    tags = dict(extra_tags or {})
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    run_id = tracking.start_run(cfg, storage, resume, cfg.scaling.min_workers, tags)
    payload = {
        "config": cfg.to_dict(),
        "shards": manifest.root,
        "cache": cache,
        "run_id": run_id,
        "tracking_uri": uri,
        "probe": probe,
    }
    status, tags = "FAILED", {}
    try:
        result = build_trainer(cfg, storage, payload, callbacks).fit()
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    except Exception as exc:
        raise RunFailed(_failure_message(exc, cfg)) from exc
    finally:
        if status != "FINISHED":
            tracking.end_run(uri, run_id, status)
    ckpt = result.checkpoint.path if result.checkpoint else None
    if ckpt:
        tags["raylift.final_checkpoint"] = ckpt
    metrics = {
        k: float(v) for k, v in (result.metrics or {}).items() if isinstance(v, (int, float))
    }
    if "nonfinite_step" in metrics:
        tracking.end_run(uri, run_id, "FAILED", tags)
        raise RunFailed(_nonfinite_message(cfg, metrics, ckpt))
    tracking.end_run(uri, run_id, status, tags)
    return TrainResult(cfg.name, metrics, ckpt, run_id, uri, time.perf_counter() - started)


def _nonfinite_message(cfg: Config, metrics: dict[str, float], ckpt: str | None) -> str:
    return (
        f"training run {cfg.name!r} stopped: the loss became inf/NaN at step "
        f"{int(metrics['nonfinite_step'])} (train.on_nan: stop); the last good checkpoint is "
        f"{ckpt or 'none'}. Lower optim.lr, set train.grad_clip, use precision bf16-mixed "
        "instead of 16-mixed, or set train.on_nan=skip to step over bad batches"
    )


def _failure_message(exc: BaseException, cfg: Config) -> str:
    root: BaseException = exc
    while root.__cause__ is not None:
        root = root.__cause__
    text = str(root).strip().splitlines()
    detail = text[-1] if text else type(root).__name__
    return (
        f"training run {cfg.name!r} failed: {detail}\n"
        f"  the full worker traceback is above; fix the cause and rerun the same command "
        f"to resume from the latest checkpoint"
    )


# ---------------------------------------------------------------- workers


def worker_main(payload: dict[str, Any]) -> None:
    """Entry point of every Ray Train worker."""
    import ray.train
    import ray.train.torch

    from raylift.checkpoint import newest_complete, resume_point
    from raylift.data.ingest import ObjectStoreStore, ParquetStore, ShardSource
    from raylift.data.shards import read_manifest
    from raylift.loop import NullTracker, Trainer, WorkerContext
    from raylift.tasks import build_task

    cfg = config_from_dict(payload["config"])
    # Ray Train logs every report at INFO through the root logger; keep the console for raylift.
    logging.getLogger().setLevel(logging.WARNING)
    rt = ray.train.get_context()
    rank, world = rt.get_world_rank(), rt.get_world_size()
    device = ray.train.torch.get_device()
    if cfg.strategy.name == "auto":
        cfg.strategy = _resolve_auto(cfg, world, device, rt.get_local_world_size())
        _print0(rank)(f"strategy auto -> {cfg.strategy}")
    manifest = read_manifest(payload["shards"])
    if manifest is None:
        raise RuntimeError(f"the shards at {payload['shards']} vanished after the run started")
    store = (
        ObjectStoreStore(manifest, payload["cache"]) if payload["cache"] else ParquetStore(manifest)
    )
    d = cfg.data
    task = build_task(cfg.task, cfg.task_args)
    source = ShardSource(
        store,
        rank,
        world,
        batch_size=d.batch_size,
        eval_batch_size=d.eval_batch_size or d.batch_size,
        seed=cfg.train.seed,
        prefetch_batches=d.prefetch_batches,
        pin_memory=device.type == "cuda",
        shuffle=d.shuffle,
        transform=getattr(task, "transform", None),
    )
    tracker = (
        tracking.MlflowTracker(payload["tracking_uri"], payload["run_id"])
        if rank == 0
        else NullTracker()
    )
    ctx = WorkerContext(
        rank=rank,
        world_size=world,
        device=device,
        source=source,
        reporter=RayReporter(),
        tracker=tracker,
        log=_print0(rank),
        probe=_probe(payload.get("probe")),
    )
    trainer = Trainer(cfg, task, ctx)
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            trainer.restore(resume_point(Path(directory), ctx.log))
    elif "://" not in cfg.storage:
        # A worker killed right after a checkpoint's report, before Ray's controller
        # registered it, leaves that checkpoint on disk only: resume from it all the same.
        found = newest_complete(Path(resolve_storage(cfg.storage)) / cfg.name, ctx.log)
        if found is not None:
            trainer.restore(found)
    trainer.run()


def _probe(args: dict[str, Any] | None) -> Any:
    if not args:
        return None
    from raylift.doctor import DoctorProbe

    return DoctorProbe(int(args["steps"]), args.get("out_dir") or None)


def _resolve_auto(cfg: Config, world: int, device: Any, local_world: int) -> Any:
    """Every rank plans from the same numbers (its device's memory), so all choose alike."""
    import psutil
    import torch

    from raylift.plan import resolve_auto

    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
    else:  # CPU workers share the host's memory
        memory = psutil.virtual_memory().total // max(local_world, 1)
    return resolve_auto(cfg, world, memory)


class RayReporter:
    def report(self, metrics: dict[str, float], checkpoint: Path | None, name: str | None) -> None:
        import ray.train

        ckpt = ray.train.Checkpoint.from_directory(str(checkpoint)) if checkpoint else None
        ray.train.report(metrics, checkpoint=ckpt, checkpoint_dir_name=name if ckpt else None)

    def preempting(self) -> bool:
        import ray.train

        return ray.train.get_preemption_info() is not None


def _print0(rank: int) -> Any:
    def log(line: str) -> None:
        if rank == 0:
            print(line, flush=True)

    return log
