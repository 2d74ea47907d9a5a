"""One checkpoint format for everything that must survive a restart.

A checkpoint folder holds the engine's sharded model and optimizer state
(``engine/``, written by every rank), the loop's state (``loop_state.pt``:
step, epoch, data position, LR schedule, early stopping, scaler; written by
rank 0) and each rank's RNG state. Everything is read back with
``torch.load(weights_only=True)``: no pickled code is ever executed.

Each rank ends its part with ``complete-rank<r>.json``, the size and xxh3-64 checksum
of every file it wrote. A checkpoint is intact when every rank's list is there and every file
has its listed size and checksum: a write that was cut off (a killed worker, a full
disk) or a file damaged since (a flipped block, a partial overwrite of the same size)
is caught before anything is loaded, and the resume falls back to the previous intact
one. xxh3 because it hashes at memory speed (about 9 GB/s on one core here, 4x zlib's
CRC-32): checking what was just written costs a few percent of writing it
(``benchmarks/checksum.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import random
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from raylift import storage
from raylift.context import WorkerContext
from raylift.strategies.base import Engine

FORMAT = 1
LOOP_FILE = "loop_state.pt"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used for resuming; the message says why and what to do."""


def _rng_file(rank: int) -> str:
    return f"rng-rank{rank}.pt"


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _as_tuple(obj: Any) -> Any:
    # random.setstate wants tuples all the way down; some loaders return lists.
    return tuple(_as_tuple(x) for x in obj) if isinstance(obj, (list, tuple)) else obj


def _done_file(rank: int) -> str:
    return f"complete-rank{rank}.json"


def save_checkpoint(directory: Path, engine: Engine, loop_state: dict[str, Any], rank: int) -> None:
    """Collective: every rank calls this with its own (possibly local) ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    engine.save(directory)
    torch.save(rng_state(), directory / _rng_file(rank))
    if rank == 0:
        state = {"format": FORMAT, **loop_state, "engine_extra": engine.extra_state()}
        torch.save(state, directory / LOOP_FILE)
    # Last: this rank's part counts only once every file it wrote is whole.
    listed = {
        str(p.relative_to(directory)): {"size": p.stat().st_size, "xxh3": file_digest(p)}
        for p in sorted(directory.rglob("*"))
        if p.is_file() and not p.name.startswith("complete-rank")
    }
    (directory / _done_file(rank)).write_text(json.dumps(listed, indent=0))


def file_digest(path: str | Path) -> str:
    """xxh3-64 of a file's bytes, local or in an object store, read one chunk at a time:
    the checksum's memory is one chunk (64 MiB), whatever the file's size."""
    import xxhash

    digest = xxhash.xxh3_64()
    for chunk in storage.read_chunks(str(path)):
        digest.update(chunk)
    return digest.hexdigest()


Verifier = Callable[[str], None]


def verify_checkpoint(directory: str, share: tuple[int, int] = (0, 1)) -> None:
    """Raise :class:`CheckpointError` unless every rank finished writing ``directory``
    (a local folder or a URI).

    Pure file checks. Every file's size is checked; its checksum only where it falls in
    ``share`` (``(index, count)``: every ``count``-th file from the ``index``-th), so the
    workers of a resume each read a part of the checkpoint (``verify_together``).
    """
    state = read_loop_state(directory)
    world = int(state.get("world_size", 1))
    sizes = dict(storage.files_under(directory))  # one listing for every size check
    for rank in range(world):
        done = _done_file(rank)
        text = storage.read_text(storage.join(directory, done))
        if text is None:
            raise CheckpointError(
                f"checkpoint {directory} is incomplete: rank {rank} of {world} never "
                f"finished writing it ({done} is missing)"
            )
        try:
            listed_files = json.loads(text)
        except ValueError as exc:  # cut off mid-write: a disk that filled up, a killed copy
            raise CheckpointError(
                f"checkpoint {directory} is incomplete: rank {rank}'s {done} is unreadable ({exc})"
            ) from exc
        for i, (name, listed) in enumerate(sorted(listed_files.items())):
            mine = (i + rank) % share[1] == share[0]  # each rank's files spread over readers
            _verify_file(directory, name, listed, sizes.get(name), rank, digest=mine)


def verify_together(rank: int, world: int) -> Verifier:
    """A collective ``verify_checkpoint``: each of ``world`` ranks reads 1/world of the
    files, and every rank gets the first problem any of them found (the same verdict
    on all, as a resume needs): N ranks read the checkpoint once between them, not N
    times."""

    if world == 1:
        return verify_checkpoint

    def verify(directory: str) -> None:
        import torch.distributed as dist

        try:
            verify_checkpoint(directory, (rank, world))
            problem = None
        except CheckpointError as exc:
            problem = str(exc)
        found: list[str | None] = [None] * world
        dist.all_gather_object(found, problem)
        first = next((p for p in found if p), None)
        if first:
            raise CheckpointError(first)

    return verify


def _verify_file(
    directory: str, name: str, listed: Any, have: int | None, rank: int, digest: bool
) -> None:
    """Size first (free: from the listing), then the checksum; lists from before
    checksums hold sizes only."""
    size, xxh3 = (listed, None) if isinstance(listed, int) else (listed["size"], listed["xxh3"])
    if have != size:
        raise CheckpointError(
            f"checkpoint {directory} is incomplete: {name} has "
            f"{'no file' if have is None else f'{have} bytes'}, rank {rank} wrote {size}"
        )
    if digest and xxh3 is not None and file_digest(storage.join(directory, name)) != xxh3:
        raise CheckpointError(
            f"checkpoint {directory} is corrupt: {name} does not match the checksum rank "
            f"{rank} recorded when it wrote it (same size, different content)"
        )


def checkpoint_step(path: str | Path) -> int:
    match = re.fullmatch(r"checkpoint-step(\d+)", storage.name(str(path)))
    return int(match.group(1)) if match else -1


def resume_point(
    latest: str, log: Callable[[str], None] = print, verify: Verifier = verify_checkpoint
) -> str:
    """``latest`` if it is complete, else the newest complete checkpoint before it.

    A checkpoint whose write was cut off, or that was damaged since, is reported and
    skipped rather than loaded.
    """
    try:
        verify(latest)
        return latest
    except CheckpointError as exc:
        log(f"raylift: {exc}; looking for the previous complete checkpoint")
    for candidate in reversed(checkpoint_dirs(storage.parent(latest))):
        if checkpoint_step(candidate) >= checkpoint_step(latest):
            continue
        try:
            verify(candidate)
        except CheckpointError as exc:
            log(f"raylift: {exc}; skipping it")
            continue
        log(f"raylift: resuming from {candidate}, the newest complete checkpoint")
        return candidate
    raise CheckpointError(
        f"no complete checkpoint to resume from beside {latest}; delete "
        f"{storage.parent(latest)} to start over, or start a new run under another name"
    )


def checkpoint_dirs(run_dir: str) -> list[str]:
    """A run folder's ``checkpoint-step*`` folders (local or URIs, as ``run_dir`` is),
    oldest first."""
    names = [n for n in storage.children(run_dir) if checkpoint_step(n) >= 0]
    return [storage.join(run_dir, n) for n in sorted(names, key=checkpoint_step)]


def verify_run(run_dir: str) -> list[tuple[str, str | None]]:
    """Every checkpoint of a run folder, oldest first, with its problem (None: intact)."""
    out: list[tuple[str, str | None]] = []
    for ckpt in checkpoint_dirs(run_dir):
        try:
            verify_checkpoint(ckpt)
            out.append((ckpt, None))
        except CheckpointError as exc:
            out.append((ckpt, str(exc)))
    return out


def newest_complete(
    run_dir: str, log: Callable[[str], None] = print, verify: Verifier = verify_checkpoint
) -> str | None:
    """The newest complete checkpoint in a run folder (local or a URI), or None if it has none.

    Ray registers a checkpoint only after its controller polls the report; a worker
    killed in between leaves a complete checkpoint that Ray does not hand back, so the
    folder, not Ray's record, says where a run resumes.
    """
    found = [p for p in checkpoint_dirs(run_dir) if storage.is_file(storage.join(p, LOOP_FILE))]
    if not found:
        return None
    try:
        return resume_point(found[-1], log, verify)
    except CheckpointError:
        return None


def newest_written(run_dir: str) -> str | None:
    """The newest checkpoint every rank finished writing, by a listing alone (no file is
    read but the loop state): where a restart will resume, as far as a glance tells."""
    for candidate in reversed(checkpoint_dirs(run_dir)):
        names = {name for name, _ in storage.files_under(candidate)}
        if LOOP_FILE not in names:
            continue
        try:
            world = int(read_loop_state(candidate).get("world_size", 1))
        except CheckpointError:  # cut off (a full disk): the restart passes over it too
            continue
        if all(_done_file(r) in names for r in range(world)):
            return candidate
    return None


def read_loop_state(directory: str | Path) -> dict[str, Any]:
    data = storage.read_bytes(storage.join(str(directory), LOOP_FILE))
    if data is None:
        raise CheckpointError(
            f"checkpoint {directory} is incomplete ({LOOP_FILE} is missing); delete that folder "
            "to resume from the previous checkpoint, or start a new run under another name"
        )
    try:
        state = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint {directory} is corrupt ({LOOP_FILE}: {exc}); delete that folder to "
            "resume from the previous checkpoint, or start a new run under another name"
        ) from exc
    if state.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint {directory} has format {state.get('format')}, "
            f"this raylift reads format {FORMAT}"
        )
    return dict(state)


def load_checkpoint(directory: Path, engine: Engine, rank: int, strategy: str) -> dict[str, Any]:
    """Restore ``engine`` and this rank's RNG; return the loop state saved with them."""
    state = read_loop_state(directory)
    if state.get("strategy") != strategy:
        raise CheckpointError(
            f"checkpoint {directory} was written by strategy {state.get('strategy')!r} but this "
            f"run uses {strategy!r}; set strategy.name back, or start a new run under another name"
        )
    try:
        engine.load(directory)
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint {directory}: model/optimizer state unreadable ({exc})"
        ) from exc
    engine.load_extra_state(state.pop("engine_extra", {}))
    rng_path = directory / _rng_file(rank)
    # After a change of world size a new rank has no RNG file; it keeps its fresh seed.
    if rng_path.is_file():
        set_rng_state(torch.load(rng_path, weights_only=True))
    return state


# ---------------------------------------------------------------- the loop's side


@dataclasses.dataclass
class LoopState:
    """Where the loop is: saved in every checkpoint, restored on every restart."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches this rank ran in `epoch` (accumulation phase)
    epoch_rows: int = 0  # rows of `epoch`'s global order consumed by all ranks: the data position
    samples: int = 0  # global samples trained on
    best: float | None = None  # early stopping
    bad_evals: int = 0
    stopped_early: bool = False
    last_ckpt_step: int = -1
    restarts: int = 0  # resumes from a checkpoint: failures, resizes, reruns
    nonfinite_step: int = -1  # the step whose loss went inf/NaN (train.on_nan: stop)


STAGING = "raylift-ckpt-"
_swept = False


@contextlib.contextmanager
def staging() -> Iterator[Path]:
    """A local folder a rank writes its part of a checkpoint to before the report, named
    by its process. A worker that is killed mid-save (a SIGKILL, the OOM killer, a group
    torn down on a failure) cannot remove its own, a copy of its weights; so the first
    save of each process removes those of processes on this node that are gone."""
    global _swept
    if not _swept:
        _swept = True
        remove_orphans(Path(tempfile.gettempdir()))
    with tempfile.TemporaryDirectory(prefix=f"{STAGING}{os.getpid()}-") as tmp:
        yield Path(tmp)


def remove_orphans(root: Path) -> list[Path]:
    """Remove the staging folders under ``root`` whose process has ended; the removed."""
    gone = []
    for folder in root.glob(f"{STAGING}*-*"):
        pid = folder.name.removeprefix(STAGING).split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            gone.append(folder)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class Checkpointer:
    """Writes a worker's checkpoints through its reporter and reads them back."""

    def __init__(self, engine: Engine, ctx: WorkerContext, strategy: str):
        self.engine, self.ctx, self.strategy = engine, ctx, strategy
        self.preempt_saved = False

    def save(self, step: int, loop_state: dict[str, Any], metrics: dict[str, float]) -> None:
        """Collective: every rank writes its part, then reports it (Ray merges the parts)."""
        with staging() as tmp:
            save_checkpoint(tmp, self.engine, loop_state, self.ctx.rank)
            name = f"checkpoint-step{step:08d}"
            self.ctx.reporter.report({**metrics, "step": float(step)}, tmp, name)

    def restore(self, directory: Path) -> dict[str, Any]:
        """Load the engine and this rank's RNG; the loop state saved with them."""
        return load_checkpoint(directory, self.engine, self.ctx.rank, self.strategy)

    def record_restart(self, directory: str, state: LoopState, saved_world: int) -> None:
        """One ``restarts`` metric and one tag per resume, and a line that says from where."""
        now = self.ctx.world_size
        self.ctx.tracker.log_metrics({"restarts": float(state.restarts)}, state.step)
        self.ctx.tracker.set_tags(
            {
                f"raylift.restart.{state.restarts}": (
                    f"step {state.step} from {storage.name(directory)}: "
                    f"{saved_world} -> {now} workers"
                )
            }
        )
        self.ctx.log(
            f"raylift: resumed from {directory} at step {state.step} "
            f"(epoch {state.epoch}, row {state.epoch_rows} of its order; "
            f"{saved_world} -> {now} workers, restart {state.restarts})"
        )

    def preemption_notice(self, state: LoopState) -> bool:
        """True once, when a node is about to go (a spot reclaim) and the step is unsaved:
        saving now beats losing the interval. A collective on Ray: every rank asks."""
        if self.preempt_saved or not self.ctx.reporter.preempting():
            return False
        self.preempt_saved = True
        return state.step != state.last_ckpt_step
