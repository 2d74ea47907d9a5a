"""One checkpoint format for everything that must survive a restart.

A checkpoint folder holds the engine's sharded model and optimizer state
(``engine/``, written by every rank), the loop's state (``loop_state.pt``:
step, epoch, data position, LR schedule, early stopping, scaler; written by
rank 0) and each rank's RNG state. Everything is read back with
``torch.load(weights_only=True)``: no pickled code is ever executed.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

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


def save_checkpoint(directory: Path, engine: Engine, loop_state: dict[str, Any], rank: int) -> None:
    """Collective: every rank calls this with its own (possibly local) ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    engine.save(directory)
    torch.save(rng_state(), directory / _rng_file(rank))
    if rank == 0:
        state = {"format": FORMAT, **loop_state, "engine_extra": engine.extra_state()}
        # Written last: a folder without it is an incomplete checkpoint.
        torch.save(state, directory / LOOP_FILE)


def read_loop_state(directory: Path) -> dict[str, Any]:
    path = directory / LOOP_FILE
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {directory} is incomplete ({LOOP_FILE} is missing); delete that folder "
            "to resume from the previous checkpoint, or start a new run under another name"
        )
    try:
        state = torch.load(path, weights_only=True)
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
