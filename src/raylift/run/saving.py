"""Saving a checkpoint without stopping training for it.

A save has two parts. Every rank takes its part (the engine's shards, its RNG, rank 0
the loop state): the loop stops for this, as it must, since the state is changing under
it. With ``checkpoint.async`` (the default) that is a copy into host memory, and a thread
of each rank writes the part to a folder on local disk, checksums it and uploads it while
the loop trains on; without, the loop waits for all of it. A checkpoint becomes the run's
(registered with Ray Train, named by the folder listing as complete) only once every
rank's part is in storage with its checksums: the ranks agree on that at the next report
point, or at the next save, which waits for the one before it. A run killed during an
upload leaves a checkpoint without every ``complete-rank*.json``, which a resume passes
over for the previous one.
"""

from __future__ import annotations

import dataclasses
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from raylift.core import storage
from raylift.run.checkpointing import write_checkpoint
from raylift.run.context import WorkerContext
from raylift.strategies.base import Engine, Write
from raylift.tensors.checkpoints import CheckpointError, seal_checkpoint


@dataclasses.dataclass
class Save:
    """One checkpoint on its way to storage, as this rank sees it."""

    name: str
    step: int
    metrics: dict[str, float]
    folder: Path  # this rank's part, on local disk until it is uploaded
    write: Write | None  # writes the part into ``folder`` (from host memory, if copied)
    dest: str
    started: float
    blocked: float = 0.0  # seconds the loop stopped for it
    waited: float = 0.0  # of which waiting for the save before it to be complete
    part: int = 0  # bytes of this rank's part
    written: int = 0  # bytes of all ranks' parts
    done_s: float | None = None  # seconds from start until this rank's part was in storage
    error: BaseException | None = None
    thread: threading.Thread | None = None

    def upload(self, rank: int) -> None:
        """Write this rank's part, checksum it and copy it to storage, its completion
        list last."""
        try:
            assert self.write is not None
            items = self.write()
            self.write = None  # the host copy is freed once written
            self.part = storage.bytes_under(self.folder)
            listing = seal_checkpoint(self.folder, items)
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
    """Writes a worker's checkpoints: the loop waits for a copy of the state in host
    memory, a thread writes and uploads it (``background``; else the loop waits for all of
    it), and the checkpoint is registered once all ranks are done."""

    def __init__(self, engine: Engine, ctx: WorkerContext, background: bool):
        self.engine, self.ctx, self.background = engine, ctx, background
        self.pending: Save | None = None
        self.last_part = 0  # bytes of this rank's part of the last save

    def save(self, step: int, loop_state: dict[str, Any], metrics: dict[str, float]) -> None:
        """Collective: every rank takes its part and starts writing it."""
        started = time.perf_counter()
        self.settle(wait=True)  # one save in flight: this one waits for the one before
        waited = time.perf_counter() - started
        rank = self.ctx.rank
        folder = storage.scratch_dir("ckpt")
        try:
            self._check_room(folder)
            write = write_checkpoint(folder, self.engine, loop_state, rank, self.background)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        name = f"checkpoint-step{step:08d}"
        job = Save(name, step, {**metrics, "step": float(step)}, folder, write,
                   self.ctx.reporter.destination(name), started)  # fmt: skip
        if self.background:
            job.thread = threading.Thread(
                target=job.upload, args=(rank,), name=f"raylift-upload-{name}", daemon=True
            )
            job.thread.start()
        else:
            job.upload(rank)
        job.blocked, job.waited = time.perf_counter() - started, waited
        self.pending = job
        if not self.background:
            self.settle(wait=True)

    def _check_room(self, folder: Path) -> None:
        """Collective: refuse a save whose part cannot fit, on every rank, before taking
        a byte of it: the previous checkpoints stay as they are."""
        # The last part's size once there is one; before, what this rank holds.
        held = self.engine.model_state_bytes()
        need = self.last_part or held.get("params", 0) + held.get("optimizer", 0)
        problems = [p for p in self._gather(self._room_problem(folder, need)) if p]
        if problems:
            raise storage.StorageError(problems[0])

    def _room_problem(self, folder: Path, need: int) -> str | None:
        rank, size = self.ctx.rank, storage.size_text
        free = shutil.disk_usage(folder).free
        if need > free:
            return (
                f"a checkpoint's part on rank {rank} needs about {size(need)} on this "
                f"node's local disk ({folder.parent}) before its upload, and {size(free)} "
                "is free there: free space, or set TMPDIR to a larger disk on every node"
            )
        if not self.background:
            return None
        import psutil

        # The copy holds the part until it is written (the one before is freed by now).
        available = psutil.virtual_memory().available
        if need > available:
            return (
                f"checkpoint.async copies a checkpoint's part into host memory: rank {rank} "
                f"needs about {size(need)} for it and this node has {size(available)} "
                "available: set checkpoint.async: false (the loop then waits for each "
                "save), or run on nodes with more memory"
            )
        return None

    def settle(self, wait: bool) -> None:
        """Collective: register the save in flight if every rank's part is in storage
        (with ``wait``, once it is); raise the error any rank's upload hit."""
        job = self.pending
        if job is None:
            return
        if wait and job.thread is not None:
            job.thread.join()
        states = self._gather((job.finished(), job.done_s, _said(job.error), job.part))
        if not all(done for done, *_ in states):
            return
        self.pending = None
        self.last_part = job.part
        job.written = sum(part for *_, part in states)
        failed = [(r, said) for r, (_, _, said, _) in enumerate(states) if said]
        if job.error is not None:
            raise job.error
        if failed:
            rank, said = failed[0]
            raise CheckpointError(f"rank {rank} could not save {job.name}: {said}")
        self.ctx.reporter.register(job.metrics, job.name)
        self._record(job, max(s for _, s, _, _ in states if s is not None))

    def _record(self, job: Save, save_s: float) -> None:
        metrics = {
            "checkpoint_blocked_s": job.blocked,
            "checkpoint_wait_s": job.waited,
            "checkpoint_save_s": save_s,
            "checkpoint_bytes": float(job.written),
        }
        self.ctx.tracker.log_metrics(metrics, job.step)
        self.ctx.log(
            f"raylift: {job.name} saved: {job.written / 2**20:,.1f} MiB, complete in storage "
            f"{save_s:.2f} s after it began; training stopped {job.blocked:.2f} s for it"
            + _queued(job)
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


def _queued(job: Save) -> str:
    """What the console adds where most of a save's stop was the save before it: the
    storage takes longer than the steps between saves, and they queue."""
    if job.waited < 1.0 or job.waited < 0.5 * job.blocked:
        return ""
    return (
        f" ({job.waited:.2f} s of it waiting for the save before: checkpoints come faster "
        "than the storage takes them; raise checkpoint.every_n_steps)"
    )


def _said(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"
