"""Saving a checkpoint without stopping training for its upload.

A save has two parts. Every rank writes its part to a folder on local disk (the engine's
shards, its RNG, rank 0 the loop state): the loop stops for this, as it must, since the
state is changing under it. Then the checksums and the upload to storage: with
``checkpoint.async`` (the default) a thread of each rank does this while the loop trains
on. A checkpoint becomes the run's (registered with Ray Train, named by the folder
listing as complete) only once every rank's part is in storage with its checksums: the
ranks agree on that at the next report point, or at the next save, which waits for the one
before it. A run killed during an upload leaves a checkpoint without every
``complete-rank*.json``, which a resume passes over for the previous one.
"""

from __future__ import annotations

import dataclasses
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from raylift import storage
from raylift.checkpoint import CheckpointError, seal_checkpoint, write_checkpoint
from raylift.context import WorkerContext
from raylift.strategies.base import Engine


@dataclasses.dataclass
class Save:
    """One checkpoint on its way to storage, as this rank sees it."""

    name: str
    step: int
    metrics: dict[str, float]
    folder: Path  # this rank's part, on local disk until it is uploaded
    items: dict[str, list[int]]
    dest: str
    started: float
    blocked: float = 0.0  # seconds the loop stopped for it
    written: int = 0  # bytes of all ranks' parts
    done_s: float | None = None  # seconds from start until this rank's part was in storage
    error: BaseException | None = None
    thread: threading.Thread | None = None

    def upload(self, rank: int) -> None:
        """Checksum this rank's part and copy it to storage, its completion list last."""
        try:
            listing = seal_checkpoint(self.folder, self.items)
            with storage.reaching(self.dest, f"saving {self.name}"):  # one line, exit 2
                storage.upload_folder(self.folder, self.dest)
                storage.write_text(storage.join(self.dest, f"complete-rank{rank}.json"), listing)
            self.done_s = time.perf_counter() - self.started
        except BaseException as exc:  # raised in the training thread when the ranks settle
            self.error = exc
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)

    def finished(self) -> bool:
        return self.thread is None or not self.thread.is_alive()


class Saver:
    """Writes a worker's checkpoints: the loop waits for the local write, a thread does
    the rest (``background``), and the checkpoint is registered once all ranks are done."""

    def __init__(self, engine: Engine, ctx: WorkerContext, background: bool):
        self.engine, self.ctx, self.background = engine, ctx, background
        self.pending: Save | None = None
        self.last_part = 0  # bytes of this rank's part of the last save

    def save(self, step: int, loop_state: dict[str, Any], metrics: dict[str, float]) -> None:
        """Collective: every rank writes its part and starts its upload."""
        started = time.perf_counter()
        self.settle(wait=True)  # one save in flight: this one waits for the one before
        rank = self.ctx.rank
        folder = storage.scratch_dir("ckpt")
        try:
            self._check_room(folder)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        try:
            items = write_checkpoint(folder, self.engine, loop_state, rank)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        name = f"checkpoint-step{step:08d}"
        job = Save(name, step, {**metrics, "step": float(step)}, folder, items,
                   self.ctx.reporter.destination(name), started)  # fmt: skip
        self.last_part = storage.bytes_under(folder)
        job.written = sum(self._gather(self.last_part))
        if self.background:
            job.thread = threading.Thread(
                target=job.upload, args=(rank,), name=f"raylift-upload-{name}", daemon=True
            )
            job.thread.start()
        else:
            job.upload(rank)
        job.blocked = time.perf_counter() - started
        self.pending = job
        if not self.background:
            self.settle(wait=True)

    def _check_room(self, folder: Path) -> None:
        """Refuse a save whose part cannot fit on this node's local disk, before writing
        a byte of it: the previous checkpoints stay as they are."""
        # The last part's size once there is one; before, what this rank holds.
        held = self.engine.model_state_bytes()
        need = self.last_part or held.get("params", 0) + held.get("optimizer", 0)
        free = shutil.disk_usage(folder).free
        if need > free:
            raise storage.StorageError(
                f"a checkpoint's part on rank {self.ctx.rank} needs about "
                f"{storage.size_text(need)} on this node's local disk ({folder.parent}) "
                f"before its upload, and {storage.size_text(free)} is free there: free "
                "space, or set TMPDIR to a larger disk on every node"
            )

    def settle(self, wait: bool) -> None:
        """Collective: register the save in flight if every rank's part is in storage
        (with ``wait``, once it is); raise the error any rank's upload hit."""
        job = self.pending
        if job is None:
            return
        if wait and job.thread is not None:
            job.thread.join()
        states = self._gather((job.finished(), job.done_s, _said(job.error)))
        if not all(done for done, _, _ in states):
            return
        self.pending = None
        failed = [(r, said) for r, (_, _, said) in enumerate(states) if said]
        if job.error is not None:
            raise job.error
        if failed:
            rank, said = failed[0]
            raise CheckpointError(f"rank {rank} could not save {job.name}: {said}")
        self.ctx.reporter.register(job.metrics, job.name)
        self._record(job, max(s for _, s, _ in states if s is not None))

    def _record(self, job: Save, save_s: float) -> None:
        metrics = {
            "checkpoint_blocked_s": job.blocked,
            "checkpoint_save_s": save_s,
            "checkpoint_bytes": float(job.written),
        }
        self.ctx.tracker.log_metrics(metrics, job.step)
        self.ctx.log(
            f"raylift: {job.name} saved: {job.written / 2**20:,.1f} MiB, complete in storage "
            f"{save_s:.2f} s after it began; training stopped {job.blocked:.2f} s for it"
        )

    def _gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (an object gather: any backend, no device)."""
        world = self.ctx.world_size
        if world == 1:
            return [value]
        import torch.distributed as dist

        out: list[Any] = [None] * world
        dist.all_gather_object(out, value)
        return out


def _said(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"
