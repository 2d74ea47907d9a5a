"""The worker side of a run: what every Ray Train worker does with the driver's :class:`RunSpec`.

The driver (:mod:`raylift.run.launch`) resolves everything that is the same for every
rank (the strategy ``auto`` chose, the prepared shards, the MLflow run) once and
hands it over in one typed object; each worker builds its data stream, tracker and
:class:`~raylift.run.loop.Trainer` from it, resumes if there is a checkpoint, and trains.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

from raylift.artifacts.tracking_service import RemoteStore, ServiceTracker
from raylift.core import console, storage
from raylift.core.config import Config, EnvironmentProblem
from raylift.core.startup import PREFIX, Startup, process_start
from raylift.data.ingest import ObjectStoreStore, ParquetStore, ShardSource
from raylift.data.manifest import read_manifest
from raylift.run.context import NullTracker, WorkerContext, gather
from raylift.run.faults import own_stderr
from raylift.run.loop import Trainer
from raylift.run.probe import DoctorProbe, ProbeSettings
from raylift.run.restarts import RestartWatch
from raylift.run.snapshots import Snapshots, remove, scratch_for
from raylift.tasks import build_task
from raylift.tensors.checkpoints import (
    CheckpointError,
    agree_across,
    check_listing,
    checkpoint_dirs,
    checkpoint_step,
    newest_complete,
    previous_complete,
    resume_point,
)

SPEC_KEY = "spec"  # the one key of Ray's train_loop_config


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """Everything the driver hands every worker."""

    config: Config  # strategy already resolved: never "auto" here
    shards: str  # the prepared shards' root
    # The MLflow run rank 0 writes to: its id, or the ObjectRef of the id while the
    # tracking actor opens it (raylift.run.launch.open_run); :func:`run_id_of` waits.
    run_id: Any
    tracking_uri: str
    tracking: Any  # the tracking actor on the driver's node (tracking_service.start_service)
    cache: dict[str, list[Any]] | None = None  # object-store refs per split (data.cache)
    probe: ProbeSettings | None = None  # raylift doctor's windows
    startup: Startup | None = None  # the driver's start-up phases; workers add theirs
    # A local storage folder: the token of the marker the driver wrote there, which every
    # worker must see (its node shares the folder); None for an object store.
    shared_token: str | None = None
    keepers: Any = None  # the run's KeeperSet (checkpoint.memory: raylift.run.snapshots)


def worker_main(loop_config: dict[str, Any]) -> None:
    """Entry point of every Ray Train worker."""
    import ray.train
    import ray.train.torch

    group_up = time.time()  # Ray Train started the processes and formed the group
    spec: RunSpec = loop_config[SPEC_KEY]
    startup = spec.startup
    if startup is not None:
        # Until this process existed, the time was Ray Train's (controller, placement);
        # since, this worker's imports and the process group Ray Train set up.
        startup.mark("controller", max(process_start(), startup.last()))
        startup.mark("worker")
    # Ray Train logs every report at INFO through the root logger; keep the console for raylift.
    logging.getLogger().setLevel(logging.WARNING)
    rt = ray.train.get_context()
    rank, world = rt.get_world_rank(), rt.get_world_size()
    console.route_ray_process(rank)  # its lines and the user's prints reach the console
    console.warnings_once()
    if rank == 0:  # the only rank that writes to the run
        spec = dataclasses.replace(spec, run_id=run_id_of(spec))
    free_node_scratch(rank)
    check_shared(spec)
    if rank == 0 and startup is not None and restarted(spec, startup):
        # Ray Train restarted the group after a failure: this command's start-up stands as
        # logged; measured from the command again, it would take in the training before.
        spec, startup = dataclasses.replace(spec, startup=None), None
    watch = RestartWatch(spec.tracking, spec.run_id, group_up) if rank == 0 else None
    trainer = build_trainer(spec, rank, world, ray.train.torch.get_device(), watch)
    try:
        resume(trainer, spec.config)
        if startup is not None:
            startup.mark("resume")
        trainer.run()
    finally:
        trainer.ctx.tracker.close()  # every metric in MLflow before the driver reads them


def run_id_of(spec: RunSpec) -> str:
    """The MLflow run's id, once the tracking actor has opened the run."""
    import ray

    return spec.run_id if isinstance(spec.run_id, str) else str(ray.get(spec.run_id))


def free_node_scratch(rank: int) -> None:
    """Free what killed workers on this node left in its temp folder (checkpoint staging,
    copies of weights): a node that keeps failing must not fill its disk."""
    removed, freed = storage.sweep_scratch()
    if removed:
        print(
            f"raylift: rank {rank}: removed {len(removed)} folder(s) that ended processes "
            f"left in {removed[0].parent}, freeing {freed / 2**20:,.1f} MiB",
            flush=True,
        )


SHARED_MARKER = ".raylift-driver"


def check_shared(spec: RunSpec) -> None:
    """A worker on a node the autoscaler added after the driver's check: its local storage
    folder must be the driver's (shared), or nothing it writes is where the run looks."""
    if spec.shared_token is None:
        return
    marker = storage.join(spec.config.storage, spec.config.name, SHARED_MARKER)
    if storage.read_text(marker) != spec.shared_token:
        import ray.util

        raise EnvironmentProblem(
            f"storage: {spec.config.storage} is a folder on the driver's machine that this "
            f"worker's node ({ray.util.get_node_ip_address()}) does not see: on a cluster set "
            "storage to s3://..., gs://... or a folder every node mounts (NFS)"
        )


def restarted(spec: RunSpec, startup: Startup) -> bool:
    return logged_startup_since(RemoteStore(spec.tracking), spec.run_id, startup.origin)


def logged_startup_since(store: Any, run_id: str, origin: float) -> bool:
    """True when the run's MLflow metrics hold a start-up total logged after ``origin``."""
    return store.metric_since(run_id, f"{PREFIX}total_s", origin) is not None


def build_trainer(
    spec: RunSpec, rank: int, world: int, device: Any, restarts: RestartWatch | None = None
) -> Any:
    cfg = spec.config
    task = build_task(cfg.task, cfg.task_args)
    source = build_source(spec, task, rank, world, device)
    if spec.startup is not None:
        spec.startup.mark("data")
    ctx = WorkerContext(
        rank=rank,
        world_size=world,
        device=device,
        source=source,
        reporter=RayReporter(storage.resolve(cfg.storage)),
        tracker=ServiceTracker(spec.tracking, spec.run_id) if rank == 0 else NullTracker(),
        log=print0(rank),
        probe=_probe(spec.probe),
        startup=spec.startup,
        heartbeat=register_process(spec.tracking, rank),
        restarts=restarts,
        keepers=_snapshots(spec, rank, world),
    )
    trainer = Trainer(cfg, task, ctx)
    if isinstance(ctx.keepers, Snapshots):  # refused before any step where a node cannot hold them
        ctx.keepers.use_replicas(trainer.engine.replicas)
        ctx.keepers.check_room(cfg, trainable_count(trainer.engine.eval_model))
    if spec.startup is not None:
        spec.startup.mark("build")
    return trainer


def _snapshots(spec: RunSpec, rank: int, world: int) -> Snapshots | None:
    if spec.keepers is None or spec.config.checkpoint.memory is None:
        return None
    return Snapshots(spec.keepers, rank, world)


def trainable_count(module: Any) -> int:
    """Trainable parameters of the whole model, whatever shards it: a DTensor counts its
    global size, a ZeRO-3 parameter its ``ds_numel``; a tied weight once."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters() if p.requires_grad)


def register_process(tracking: Any, rank: int) -> Any:
    """This worker process, known to the tracking actor (no wait) so that a crash can be
    reported with its stderr; returns the heartbeat that sends its node's memory."""
    import os
    import socket

    import psutil
    import ray

    actor_id = ray.get_runtime_context().get_actor_id()
    if tracking is None or actor_id is None:
        return lambda: None
    record = {
        "rank": rank,
        "pid": os.getpid(),
        "node_id": ray.get_runtime_context().get_node_id(),
        "ip": ray.util.get_node_ip_address(),
        "host": socket.gethostname(),
        "stderr": own_stderr(),
    }
    tracking.worker_started.remote(actor_id, record)

    def heartbeat() -> None:
        vm = psutil.virtual_memory()
        tracking.worker_memory.remote(actor_id, float(vm.total - vm.available), float(vm.total))

    heartbeat()  # a crash before the first logging interval has its node's memory too
    return heartbeat


def build_source(spec: RunSpec, task: Any, rank: int, world: int, device: Any) -> Any:
    """This rank's stream of the prepared shards (or of their copy in the object store)."""
    manifest = read_manifest(spec.shards)
    if manifest is None:
        raise RuntimeError(f"the shards at {spec.shards} vanished after the run started")
    store = ObjectStoreStore(manifest, spec.cache) if spec.cache else ParquetStore(manifest)
    d, cfg = spec.config.data, spec.config
    return ShardSource(
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


def resume(trainer: Any, cfg: Config) -> None:
    """Restore the newest complete checkpoint in the run's folder, local or in an object
    store (Ray's record of it too, where that is newer)."""
    log = trainer.ctx.log
    run_dir = storage.join(cfg.storage, cfg.name)  # resolved by the driver
    found = _newest(run_dir, log, newest_complete(run_dir, log, check_listing))
    keepers = trainer.ctx.keepers
    if isinstance(keepers, Snapshots) and from_memory(trainer, keepers, found):
        return
    restore_newest(trainer, run_dir, found)
    if isinstance(keepers, Snapshots):
        keepers.forget_after(trainer.state.step)


def from_memory(trainer: Any, keepers: Snapshots, found: str | None) -> bool:
    """Restore from the run's newest memory snapshot where one is complete on every rank
    and at least as new as storage's ``found``; False (and why, once) otherwise. Collective."""
    choice, why = keepers.find(checkpoint_step(found) if found else -1)
    if choice is None:
        if found is not None or "none was taken" not in why:
            trainer.ctx.log(f"raylift: restoring from storage: {why}")
        return False
    if trainer.ctx.restarts is not None:
        trainer.ctx.restarts.restoring()  # the fetch is part of the restore
    folder = scratch_for(choice.step)
    try:
        fetched = _fetch(trainer, keepers, choice, folder)
        trainer.restore(folder, memory=(choice.step, fetched))
    except CheckpointError as exc:
        trainer.ctx.log(f"raylift: restoring from storage: the memory snapshot failed ({exc})")
        return False
    finally:
        remove(folder)
    trainer.ctx.log(f"raylift: restored from memory: {why}")
    keepers.forget_after(choice.step)
    return True


def _fetch(trainer: Any, keepers: Snapshots, choice: Any, folder: Any) -> int:
    """Collective: every rank's copy of the snapshot's parts, or every rank raises."""
    agree, fetched, problem = agree_across(trainer.ctx.world_size), 0, None
    try:
        fetched = keepers.fetch(choice, folder)
    except Exception as exc:  # a keeper lost since it was asked: storage it is
        problem = f"a keeper holding it is gone ({type(exc).__name__}: {exc})"
    agree(problem)
    return sum(gather(trainer.ctx.world_size, fetched))


def restore_newest(trainer: Any, run_dir: str, found: str | None) -> None:
    """Restore ``found``; where its bytes fail their checksums as they are read (a
    damaged newest checkpoint), the complete one before it, and so on."""
    log = trainer.ctx.log
    while found is not None:
        try:
            trainer.restore(found)  # the same verdict on every rank
            return
        except CheckpointError as exc:
            log(f"raylift: {exc}; looking for the previous complete checkpoint")
            # Part of the state may be loaded already: no fresh start from a mix of both.
            found = previous_complete(found, log, check_listing)
    if checkpoint_dirs(run_dir):
        log(f"raylift: no complete checkpoint under {run_dir}; starting from step 0")


def _newest(run_dir: str, log: Any, found: str | None) -> str | None:
    """Ray registers a checkpoint only when its controller polls the report: a worker
    killed in between leaves a newer complete one in the folder, which wins."""
    import ray.train

    handed = ray.train.get_checkpoint()
    if handed is None:
        return found
    registered = storage.as_uri(handed.path, like=run_dir)
    if found is None or checkpoint_step(registered) > checkpoint_step(found):
        return resume_point(registered, log, check_listing)  # Ray's record, checked too
    if checkpoint_step(found) > checkpoint_step(registered):
        log(f"raylift: {storage.name(found)} is complete in {run_dir}, newer than Ray's record")
    return found


def _probe(settings: ProbeSettings | None) -> Any:
    if settings is None:
        return None

    return DoctorProbe.from_settings(settings)


class RayReporter:
    """Metrics and checkpoints to Ray Train (both are collectives there); a checkpoint
    that the store refuses is a :class:`~raylift.core.storage.StorageError` naming ``where``."""

    def __init__(self, where: str = ""):
        self.where = where

    def report(self, metrics: dict[str, float]) -> None:
        import ray.train

        ray.train.report(metrics)

    def destination(self, name: str) -> str:
        """Ray Train's own path for the checkpoint (under the run's folder in storage), as
        a URI where storage is one."""
        import ray.train

        path = ray.train.get_context().get_storage().build_checkpoint_path_from_name(name)
        return storage.as_uri(path, like=self.where)

    def register(self, metrics: dict[str, float], name: str) -> None:
        """raylift uploaded the parts itself (checksums, completion lists last): Ray
        records the folder where it is, copying nothing."""
        import ray.train

        ctx = ray.train.get_context().get_storage()
        ckpt = ray.train.Checkpoint(
            ctx.build_checkpoint_path_from_name(name), filesystem=ctx.storage_filesystem
        )
        with storage.reaching(self.where, f"recording {name}"):
            ray.train.report(
                metrics,
                checkpoint=ckpt,
                checkpoint_dir_name=name,
                checkpoint_upload_mode=ray.train.CheckpointUploadMode.NO_UPLOAD,
                delete_local_checkpoint_after_upload=False,  # it is the checkpoint in storage
            )

    def leaving_in(self) -> float | None:
        import ray.train
        from ray.train.collective import broadcast_from_rank_zero

        info = ray.train.get_preemption_info()  # rank 0's, on every rank
        if info is None:
            return None
        if info.deadline_ms is None:
            return math.inf
        # One clock for every rank: whether to save is a collective decision.
        return float(broadcast_from_rank_zero(info.deadline_ms / 1000 - time.time()))


def print0(rank: int) -> Any:
    """``print`` on rank 0, nothing elsewhere: rank logic stays out of the loop."""

    def log(line: str) -> None:
        if rank == 0:
            print(line, flush=True)

    return log
