"""Checkpoints from the worker's side: each rank writes its part of the engine's state
with the loop's and the RNG's, and a restore reads them back into the engine, at any
world size the engine can reshard to. The format itself is :mod:`raylift.tensors.checkpoints`."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch

from raylift.core import storage
from raylift.core.config import ConfigError
from raylift.run.context import WorkerContext, gather
from raylift.strategies import REGISTRY
from raylift.strategies.base import Engine, Write
from raylift.tensors.checkpoints import (
    FORMAT,
    LOOP_FILE,
    CheckpointError,
    CheckpointReader,
    RefusedPickle,
    agree_across,
    problem_of,
    rng_file,
    rng_state,
    same_base,
    set_rng_state,
)


def write_checkpoint(
    directory: Path, engine: Engine, loop_state: dict[str, Any], rank: int, copy: bool = False
) -> Write:
    """Collective: every rank takes its part for its own local ``directory``: the RNG and
    loop state written now (small), the engine's state too or, with ``copy``, copied to
    host memory for the returned call to write. That call returns where each item starts
    in the engine's files (:func:`seal_checkpoint` checksums by them)."""
    directory.mkdir(parents=True, exist_ok=True)
    write = engine.save(directory, copy)
    torch.save(rng_state(), directory / rng_file(rank))
    if rank == 0:
        state = {"format": FORMAT, **loop_state, "engine_extra": engine.extra_state()}
        torch.save(state, directory / LOOP_FILE)
    return write


def write_replica(
    directory: Path,
    engine: Engine,
    loop_state: dict[str, Any],
    rank: int,
    world: int,
    copy: bool = False,
) -> Write:
    """Collective: as :func:`write_checkpoint`, but each of the engine's replicas (one
    node's ranks) writes a whole checkpoint among its own ranks, every rank's RNG in it:
    any one node's parts restore the run. Each rank lists its part as its place in its
    replica (``done_file(replica.index(rank))``)."""
    directory.mkdir(parents=True, exist_ok=True)
    write = engine.save(directory, copy, replica=True)
    rngs = gather(world, rng_state())
    if replica_place(engine, rank) == 0:
        for r, rng in enumerate(rngs):
            torch.save(rng, directory / rng_file(r))
        writers = len(replica_of(engine, rank))
        state = {"format": FORMAT, **loop_state, "engine_extra": engine.extra_state()}
        torch.save({**state, "writers": writers}, directory / LOOP_FILE)
    return write


def replica_of(engine: Engine, rank: int) -> tuple[int, ...]:
    return next(ranks for ranks in engine.replicas if rank in ranks)


def replica_place(engine: Engine, rank: int) -> int:
    """``rank``'s place among its replica's ranks: the number its part is listed under."""
    return replica_of(engine, rank).index(rank)


def same_format(saved: object, strategy: str) -> bool:
    """Whether a checkpoint ``saved`` by one strategy holds state ``strategy`` can read:
    DDP's and FSDP's (any mesh) are both DCP, resharded as they load."""
    if saved == strategy:
        return True
    formats = {name: spec.state_format for name, spec in REGISTRY.items()}
    return saved in formats and formats[saved] == formats.get(strategy)


def load_checkpoint(
    reader: CheckpointReader,
    engine: Engine,
    rank: int,
    strategy: str,
    base: dict[str, str] | None = None,
    adapter: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Restore ``engine`` and this rank's RNG; return the loop state saved with them.
    ``base``: what the run's adapters train on (:func:`raylift.tensors.weights.base_of`);
    ``adapter``: what they are (:func:`raylift.tensors.adapters.meaning`)."""
    directory = reader.directory
    state = reader.loop_state()
    if not same_format(state.get("strategy"), strategy):
        raise CheckpointError(
            f"checkpoint {directory} was written by strategy {state.get('strategy')!r} but this "
            f"run uses {strategy!r}; set strategy.name back, or start a new run under another name"
        )
    same_base(directory, state.get("base"), base)
    same_adapters(directory, state.get("adapter"), adapter)
    try:
        engine.load(reader)
    except (CheckpointError, RefusedPickle):
        raise
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint {directory}: model/optimizer state unreadable ({exc})"
        ) from exc
    engine.load_extra_state(state.pop("engine_extra", {}))
    # After a change of world size a new rank has no RNG file; it keeps its fresh seed.
    if reader.has(rng_file(rank)):
        set_rng_state(reader.load(rng_file(rank)))
    return state


def same_adapters(
    directory: str, saved: dict[str, Any] | None, adapter: dict[str, Any] | None
) -> None:
    """ConfigError where ``model.adapter`` would give the checkpoint's adapters another
    meaning (another scale, DoRA on or off, other layers). Checkpoints that recorded
    nothing (older ones) are not compared."""
    if saved is None or adapter is None:
        return
    changed = [key for key in saved if saved[key] != adapter.get(key)]
    if changed:
        was = ", ".join(f"{key}: {saved[key]!r}" for key in changed)
        now = ", ".join(f"{key}: {adapter.get(key)!r}" for key in changed)
        raise ConfigError([
            f"model.adapter: checkpoint {directory} trained adapters with {was}; this run "
            f"has {now}. Set model.adapter back, or start a new run under another name"
        ])  # fmt: skip


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


class Checkpointer:
    """Reads a worker's checkpoints back (:class:`raylift.run.saving.Saver` writes them)."""

    def __init__(
        self,
        engine: Engine,
        ctx: WorkerContext,
        strategy: str,
        base: dict[str, str] | None = None,
        adapter: dict[str, Any] | None = None,
    ):
        self.engine, self.ctx, self.strategy, self.base = engine, ctx, strategy, base
        self.adapter = adapter
        self.bytes_read = 0  # by every rank together, in the last restore

    def restore(self, directory: str) -> dict[str, Any]:
        """Load the engine and this rank's RNG, each rank reading only what it needs; the
        loop state saved with them. Collective: all ranks load, or all raise."""
        agree = agree_across(self.ctx.world_size)
        started = time.perf_counter()
        try:
            reader = CheckpointReader(directory, agree)
            saved, problem = (
                load_checkpoint(
                    reader, self.engine, self.ctx.rank, self.strategy, self.base, self.adapter
                ),
                None,
            )
        except (CheckpointError, RefusedPickle) as exc:
            # A refused file stays one on every rank: the resume never passes over it.
            reader, saved, problem = None, {}, problem_of(exc)
        agree(problem)
        read = self.bytes_read = sum(gather(self.ctx.world_size, reader.read if reader else 0))
        total = sum(f.size for f in reader.files.values()) if reader else 0
        seconds = time.perf_counter() - started  # the slowest rank's: the gather waited for it
        self.ctx.log(
            f"raylift: restore read {read / 2**20:,.1f} MiB of the checkpoint's "
            f"{total / 2**20:,.1f} MiB in {seconds:.2f} s ({read / max(seconds, 1e-9) / 1e9:.3g} "
            f"GB/s, {self.ctx.world_size} ranks together)"
        )
        return saved

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


# Before a leaving node's deadline the last save must be in storage with room to spare:
# the save and a logging interval (the loop looks at the deadline once per interval) take
# this many times as long as they last did, plus this many seconds.
LAST_SAVE_SAFETY = 1.5
LAST_SAVE_SLACK_S = 2.0
# How long past the deadline a run that saved for it waits for Ray's restart before it
# concludes that the node stays and trains on.
HOLD_PAST_DEADLINE_S = 120.0


@dataclasses.dataclass
class Leaving:
    """A node of the run is leaving (drained for preemption, with a deadline): a checkpoint
    at the notice; then training goes on, and when only one more save fits before the
    deadline, that save and a wait for Ray's restart. No step is redone, and the window
    before the deadline is trained in. Where Ray names no deadline, training goes on after
    the notice's checkpoint until Ray stops it."""

    noticed: bool = False
    held: bool = False
    save_s: float = 0.0  # the longest save so far, until it was in storage
    looked: float = dataclasses.field(default_factory=time.monotonic)

    def look(self, left: float | None) -> tuple[bool, bool]:
        """(save now, then hold) for ``left``, the seconds until the node goes (None: no
        node is leaving). Every rank gets the same ``left`` (rank 0's clock), so every
        rank decides alike: the save is collective."""
        now = time.monotonic()
        interval, self.looked = now - self.looked, now
        if left is None or self.held:
            return False, False
        first, self.noticed = not self.noticed, True
        near = left <= LAST_SAVE_SAFETY * (self.save_s + interval) + LAST_SAVE_SLACK_S
        return first or near, near  # the notice's save; then one when the next may not fit

    def saved(self, seconds: float) -> None:
        self.save_s = max(self.save_s, seconds)

    def hold(self, left: float, log: Any) -> None:
        """Wait for Ray to stop the workers at the deadline; if it does not, train on."""
        self.held = True
        time.sleep(max(0.0, left) + HOLD_PAST_DEADLINE_S)
        log(
            f"raylift: the leaving node was still here {HOLD_PAST_DEADLINE_S:.0f} s after its "
            "deadline and Ray had not stopped the workers: training on"
        )
