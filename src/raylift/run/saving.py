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
from raylift.run.checkpointing import replica_place, write_checkpoint, write_replica
from raylift.run.context import MemoryKeepers, WorkerContext, gather
from raylift.strategies.base import Engine, Write
from raylift.tensors.checkpoints import CheckpointError, done_file, seal_checkpoint


@dataclasses.dataclass
class Whole:
    """This rank's part of its replica's whole copy of the state (HSDP: one node's ranks
    hold it), for the memory snapshot alone."""

    folder: Path
    write: Write | None
    place: int  # this rank's place in its replica: its part is listed under that number


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
    to_storage: bool = True  # False: a memory snapshot alone
    keepers: MemoryKeepers | None = None  # the run's memory, where it takes this one too
    held: bool = False  # this rank's part is with its keepers
    memory_error: BaseException | None = None  # why not: never the run's end
    whole: Whole | None = None  # what the keepers get instead of ``folder``'s part

    def upload(self, rank: int) -> None:
        """Write this rank's part, checksum it, hand it to the keepers and copy it to
        storage, its completion list last."""
        try:
            if self.whole is not None:
                self._whole_to_memory(self.whole)
            if self.write is not None:
                self._write(rank)
            self.done_s = time.perf_counter() - self.started
        except BaseException as exc:  # raised in the training thread when the ranks settle
            self.error = exc
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)
            if self.whole is not None:
                shutil.rmtree(self.whole.folder, ignore_errors=True)

    def _write(self, rank: int) -> None:
        assert self.write is not None
        items = self.write()
        self.write = None  # the host copy is freed once written
        self.part = storage.bytes_under(self.folder)
        listing = seal_checkpoint(self.folder, items)
        if self.keepers is not None and self.whole is None:
            self._to_memory(rank, listing, self.folder)
        if self.to_storage:
            with storage.reaching(self.dest, f"saving {self.name}"):  # one line, exit 2
                storage.upload_folder(self.folder, self.dest)
                storage.write_text(storage.join(self.dest, done_file(rank)), listing)

    def _whole_to_memory(self, whole: Whole) -> None:
        assert whole.write is not None
        items = whole.write()
        whole.write = None
        self.part = storage.bytes_under(whole.folder)
        self._to_memory(whole.place, seal_checkpoint(whole.folder, items), whole.folder)

    def _to_memory(self, listed_as: int, listing: str, folder: Path) -> None:
        """The part with its completion list to the keepers; a keeper lost on the way
        costs this snapshot, not the run (storage checkpoints go on)."""
        assert self.keepers is not None
        done = folder / done_file(listed_as)
        done.write_text(listing)
        try:
            self.keepers.send(self.step, folder)
            self.held = True
        except Exception as exc:
            self.memory_error = exc
        finally:
            done.unlink()  # an upload to storage sends the list last, on its own

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
        self.snapshots = 0  # memory snapshots every rank's keepers hold

    def save(
        self,
        step: int,
        loop_state: dict[str, Any],
        metrics: dict[str, float],
        to_storage: bool = True,
    ) -> None:
        """Collective: every rank takes its part and starts writing it: to storage and,
        where the run keeps memory snapshots (``ctx.keepers``), to them too, from one copy;
        ``to_storage`` False: a memory snapshot alone."""
        started = time.perf_counter()
        self.settle(wait=True)  # one save in flight: this one waits for the one before
        waited = time.perf_counter() - started
        rank, keepers = self.ctx.rank, self.ctx.keepers
        # Where each node's ranks hold a whole copy (HSDP), the keepers get that instead.
        by_copy = keepers is not None and bool(keepers.replica)
        folder = storage.scratch_dir("ckpt")
        write, whole = None, None
        try:
            self._check_room(folder)
            if to_storage or not by_copy:
                write = write_checkpoint(folder, self.engine, loop_state, rank, self.background)
            if by_copy:
                whole = self._whole(loop_state)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        name = f"checkpoint-step{step:08d}"
        if not to_storage:
            name = f"memory snapshot at step {step}"
        dest = self.ctx.reporter.destination(name) if to_storage else ""
        job = Save(name, step, {**metrics, "step": float(step)}, folder, write, dest, started,
                   to_storage=to_storage, keepers=keepers, whole=whole)  # fmt: skip
        if self.background:
            job.thread = threading.Thread(
                target=job.upload, args=(rank,), name=f"raylift-upload-step{step}", daemon=True
            )
            job.thread.start()
        else:
            job.upload(rank)
        job.blocked, job.waited = time.perf_counter() - started, waited
        self.pending = job
        if not self.background:
            self.settle(wait=True)

    def _whole(self, loop_state: dict[str, Any]) -> Whole:
        """Collective: this rank's part of its replica's whole copy, for the keepers."""
        folder = storage.scratch_dir("snapshot-part")
        try:
            world, copy = self.ctx.world_size, self.background
            write = write_replica(folder, self.engine, loop_state, self.ctx.rank, world, copy)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return Whole(folder, write, replica_place(self.engine, self.ctx.rank))

    def _check_room(self, folder: Path) -> None:
        """Collective: refuse a save whose part cannot fit, on every rank, before taking
        a byte of it: the previous checkpoints stay as they are."""
        # The last part's size once there is one; before, what this rank holds.
        held = self.engine.model_state_bytes()
        need = self.last_part or held.get("params", 0) + held.get("optimizer", 0)
        problems = [p for p in gather(self.ctx.world_size, self._room_problem(folder, need)) if p]
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
        said = (job.finished(), job.done_s, _said(job.error), job.part, job.held)
        states = gather(self.ctx.world_size, said)
        if not all(done for done, *_ in states):
            return
        self.pending = None
        self.last_part = job.part
        job.written = sum(state[3] for state in states)
        failed = [(r, said) for r, (_, _, said, _, _) in enumerate(states) if said]
        if job.error is not None:
            raise job.error
        if failed:
            rank, said = failed[0]
            raise CheckpointError(f"rank {rank} could not save {job.name}: {said}")
        save_s = max(state[1] for state in states if state[1] is not None)
        if job.keepers is not None:
            self._held(job, all(state[4] for state in states), save_s)
        if job.to_storage:
            self.ctx.reporter.register(job.metrics, job.name)
            self._record(job, save_s)

    def _held(self, job: Save, everywhere: bool, save_s: float) -> None:
        """A memory snapshot whose parts every rank handed over: logged, and said on the
        console the first time (and whenever one is not kept)."""
        assert job.keepers is not None
        if not everywhere:
            said = _said(job.memory_error) or "another rank's keeper did not take its part"
            self.ctx.log(f"raylift: the memory snapshot at step {job.step} is not kept ({said})")
            return
        self.snapshots += 1
        metrics = {"snapshot_blocked_s": job.blocked, "snapshot_s": save_s}
        self.ctx.tracker.log_metrics({**metrics, "snapshot_bytes": float(job.written)}, job.step)
        if self.snapshots == 1:
            self.ctx.log(
                f"raylift: memory snapshot at step {job.step}: {job.written / 2**20:,.1f} MiB "
                f"held on {job.keepers.where()} {save_s:.2f} s after it began; training "
                f"stopped {job.blocked:.2f} s for it (then every checkpoint.memory.every_n_steps)"
            )

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
