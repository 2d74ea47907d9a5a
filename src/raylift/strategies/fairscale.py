"""fairscale: the OSS sharded optimizer with ShardedDataParallel (ZeRO-2 style).

Each rank keeps a full copy of the parameters; optimizer state is partitioned
across ranks, and gradients are reduced to the rank that owns each parameter's
optimizer state. fairscale's FSDP needs CUDA, so it is not offered here; the
``fsdp`` strategy (torch's FSDP2) covers parameter sharding on every device.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from raylift.core.config import Config
from raylift.strategies.base import (
    TorchEngine,
    Write,
    apply_activation_checkpointing,
    host_copy,
    written,
)
from raylift.strategies.registry import Parts, PlanRow, Shards, StrategySpec
from raylift.tensors.adapters import keep_trainable_fp32
from raylift.tensors.init import Initializer, write_in_place
from raylift.tensors.optim import implementation, optimizer_class_and_kwargs, param_groups
from raylift.tensors.pickles import load_torch
from raylift.tensors.precision import PRECISIONS, Precision
from raylift.tensors.ranged import Files
from raylift.tensors.streaming import LazyModel, saved_model

STATE_FILE = "consolidated.pt"


def problems(cfg: Config) -> list[str]:
    precision = PRECISIONS.get(cfg.precision)  # an unknown name is the config's to report
    if precision is not None and precision.use_scaler:
        return [
            f"precision: {cfg.precision!r} is not supported with strategy 'fairscale'; "
            "use bf16-mixed, or strategy fsdp / deepspeed for fp16"
        ]
    return []


def build_oss(model: nn.Module, cfg: Config) -> Any:
    from fairscale.optim import OSS

    cls, kwargs = optimizer_class_and_kwargs(cfg.optim)
    kwargs.update(implementation(cfg.optim.name, model.parameters()))
    return OSS(param_groups(model.named_parameters(), cfg.optim.weight_decay), optim=cls, **kwargs)


class ConsolidatedState:
    """The full optimizer state gathered on rank 0 and written with the model: a checkpoint
    that loads at any world size (each rank takes back its own partition)."""

    def __init__(self, module: nn.Module, optimizer: Any):
        self.module, self.optimizer = module, optimizer
        # A frozen base (adapters) is never saved: it comes from its own weights at start.
        self.frozen = {n for n, p in module.named_parameters() if not p.requires_grad}

    def save(self, folder: Path, copy: bool) -> Write:
        self.optimizer.consolidate_state_dict(recipient_rank=0)  # collective
        if dist.get_rank() != 0:
            return dict  # rank 0 writes the one file
        model = {k: v for k, v in self.module.state_dict().items() if k not in self.frozen}
        state = {"model": model, "optim": self.optimizer.state_dict()}
        if copy:
            state = host_copy(state)

        def write() -> dict[str, list[int]]:
            folder.mkdir(parents=True, exist_ok=True)
            torch.save(state, folder / STATE_FILE)
            return {}  # every rank reads the file whole: blocks of BLOCK bytes serve it

        return write if copy else written(write())

    def load(self, files: Files, folder: str) -> None:
        # One consolidated file: every rank reads it whole and keeps its own partition.
        with files.open(f"{folder}/{STATE_FILE}") as f:
            try:
                state = load_torch(cast(IO[bytes], f))
            except Exception as exc:  # torch's C++ reader hides a damaged block's error
                failed = getattr(f, "failed", None)
                if failed is not None:
                    raise failed from exc
                raise
        self.module.load_state_dict(state["model"], strict=not self.frozen)
        self.optimizer.load_state_dict(state["optim"])


def read_model(files: Any) -> LazyModel:
    """The model's tensors in a :class:`ConsolidatedState` checkpoint, read without the
    optimizer state saved beside them."""
    return saved_model(files, f"engine/{STATE_FILE}", "model")


def build_fairscale(
    model: nn.Module,
    cfg: Config,
    precision: Precision,
    device: torch.device,
    parts: Parts,
    init: Initializer,
) -> TorchEngine:
    from fairscale.nn.data_parallel import ShardedDataParallel

    init(write_in_place)
    if cfg.strategy.activation_checkpointing:
        apply_activation_checkpointing(parts.blocks)
    model = keep_trainable_fp32(model.to(device=device, dtype=precision.param_dtype))
    optimizer = build_oss(model, cfg)
    sharded = ShardedDataParallel(model, optimizer)
    return TorchEngine(
        sharded,
        model,
        optimizer,
        precision,
        device,
        cfg.train.grad_clip,
        pause_sync=sharded.no_sync,
        # Gradients must be zeroed, not set to None: with None, ShardedDataParallel's
        # reduce buffers go stale and training silently goes wrong on torch 2.x.
        grads_to_none=False,
        # Grads live on their owner rank only: OSS computes the global norm with a collective.
        clip=optimizer.clip_grad_norm,
        state_io=ConsolidatedState(model, optimizer),
    )


SPEC = StrategySpec(
    name="fairscale",
    state_format="fairscale",
    options=(),
    problems=problems,
    build=build_fairscale,
    read_export=read_model,
    # OSS partitions optimizer state; gradients and parameters stay whole.
    plan_rows=(
        PlanRow("fairscale", {"name": "fairscale"}, Shards(False, False, True), comm_rank=2),
    ),
    extras=("fairscale>=0.4.13",),
)
