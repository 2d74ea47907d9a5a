"""The files of a checkpoint the DeepSpeed engine wrote: which rank's ZeRO partition
each holds, and the model read out of them for export, one fp32 tensor at a time, from
the ranks' fp32 master partitions (ranged reads of only those, never the Adam moments
beside them)."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch

from raylift.strategies.zero_layout import (
    FP32,
    Located,
    locate,
)
from raylift.tensors.checkpoints import CheckpointError
from raylift.tensors.lazytorch import load_lazy
from raylift.tensors.streaming import LazyModel, Spec, saved_model

TAG = "state"  # one checkpoint per folder: a fixed tag, no 'latest' lookup needed

ENGINE_DIR = "engine"

# Per-rank ZeRO partition files DeepSpeed writes under <folder>/<tag>/ (one per DP rank).
# Any per-rank file of a ZeRO checkpoint: optimizer partitions, ZeRO-3's model states.
_RANK_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_")


def partitions(names: Iterable[str]) -> int | None:
    ranks = {r for n in names if (r := partition_of(n)) is not None}
    return max(ranks) + 1 if ranks else None


def partition_of(name: str) -> int | None:
    """The rank whose ZeRO partition the file ``name`` holds; None for a shared file."""
    match = _RANK_FILE.search(name.rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


def read_export(files: Any) -> LazyModel:
    """The model of a checkpoint this engine wrote, one fp32 tensor at a time: from the
    ranks' fp32 master partitions, ranged reads of only those (never the Adam moments
    beside them in each file); buffers and frozen weights from the model-states files."""
    folder = f"{ENGINE_DIR}/{TAG}"
    names = files.names(folder)
    models = sorted((n for n in names if n.endswith("model_states.pt")), key=rank_order)
    optim = sorted((n for n in names if n.endswith("optim_states.pt")), key=rank_order)
    if not models:
        raise CheckpointError(
            f"{files.directory}: not a raylift DeepSpeed checkpoint (no {folder}/"
            "*model_states.pt); pass a checkpoint-step* folder of a run with strategy deepspeed"
        )
    if not optim:  # stage 0 without a partitioned optimizer: the module is saved whole
        return saved_model(files, models[0], "module")
    states = [load_lazy(files.open(n)) for n in models]
    parts = [load_lazy(files.open(n))["optimizer_state_dict"] for n in optim]
    entries = _saved_buffers(states[0]) + _frozen(states) + _trainable(states[0], parts)
    return LazyModel(entries, dict(states[0].get("shared_params") or {}))


def rank_order(name: str) -> int:
    return partition_of(name) or 0


Entry = tuple[Spec, Callable[[], torch.Tensor]]


def _entry(name: str, shape: Any, dtype: torch.dtype, read: Callable[[], torch.Tensor]) -> Entry:
    return Spec(name, list(shape), torch.float32 if dtype.is_floating_point else dtype, name), read


def _saved_buffers(state: dict[str, Any]) -> list[Entry]:
    module = state["module"]
    return [
        _entry(n, module[n].shape, module[n].dtype, module[n].load)
        for n in state["buffer_names"] if n in module
    ]  # fmt: skip


def _frozen(states: list[dict[str, Any]]) -> list[Entry]:
    """Frozen weights: whole in the model states (ZeRO-1/2), or one fragment per rank's
    model-states file (ZeRO-3)."""
    shapes = states[0].get("frozen_param_shapes") or {}

    def read(name: str, shape: torch.Size) -> Callable[[], torch.Tensor]:
        frags = [s["frozen_param_fragments"][name] for s in states]
        return lambda: torch.cat([f.read() for f in frags])[: shape.numel()].view(shape)

    return [_entry(n, shape, torch.float32, read(n, shape)) for n, shape in shapes.items()]


def _trainable(state: dict[str, Any], parts: list[dict[str, Any]]) -> list[Entry]:
    """The trained weights out of each rank's fp32 partition (zero_layout)."""
    return [
        _entry(name, where.shape, torch.float32, functools.partial(_whole, where))
        for name, where in locate(state, parts).items()
    ]


def _whole(where: Located) -> torch.Tensor:
    return where.read(FP32).view(where.shape)
