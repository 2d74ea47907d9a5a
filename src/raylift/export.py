"""``raylift export``: a consolidated fp32 ``state_dict`` from a checkpoint of any strategy.

The result loads into the task's plain model with ``model.load_state_dict(...)``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from raylift.checkpoint import LOOP_FILE, CheckpointError, read_loop_state
from raylift.strategies import REGISTRY


def latest_checkpoint(path: Path) -> Path:
    """``path`` itself if it is a checkpoint, else the newest complete one inside it."""
    if (path / LOOP_FILE).is_file():
        return path
    found = sorted(p.parent for p in path.glob(f"checkpoint-step*/{LOOP_FILE}"))
    if not found:
        raise CheckpointError(
            f"{path}: no complete checkpoint here; pass a run folder (storage/name) "
            "or one of its checkpoint-step* folders"
        )
    return found[-1]


def consolidated_state_dict(path: Path) -> dict[str, torch.Tensor]:
    ckpt = latest_checkpoint(path)
    strategy = read_loop_state(ckpt).get("strategy", "")
    spec = REGISTRY.get(strategy)
    if spec is None:
        raise CheckpointError(f"{ckpt}: written by unknown strategy {strategy!r}")
    state = spec.read_export(ckpt / "engine")
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}


def export(path: Path, out: Path) -> tuple[Path, int]:
    """Write the consolidated fp32 state_dict to ``out``; returns (checkpoint used, tensors)."""
    ckpt = latest_checkpoint(path)
    state = consolidated_state_dict(ckpt)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, out)
    return ckpt, len(state)
