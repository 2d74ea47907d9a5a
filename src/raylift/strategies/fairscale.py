"""fairscale: the OSS sharded optimizer with ShardedDataParallel (ZeRO-2 style).

Each rank keeps a full copy of the parameters; optimizer state is partitioned
across ranks, and gradients are reduced to the rank that owns each parameter's
optimizer state. fairscale's FSDP needs CUDA, so it is not offered here; the
``fsdp`` strategy (torch's FSDP2) covers parameter sharding on every device.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from raylift.config import Config
from raylift.optim import optimizer_class_and_kwargs, param_groups
from raylift.precision import Precision
from raylift.strategies.base import TorchEngine, apply_activation_checkpointing

STATE_FILE = "consolidated.pt"


def build_oss(model: nn.Module, cfg: Config) -> Any:
    from fairscale.optim import OSS

    cls, kwargs = optimizer_class_and_kwargs(cfg.optim)
    return OSS(param_groups(model.named_parameters(), cfg.optim.weight_decay), optim=cls, **kwargs)


class ConsolidatedState:
    """The full optimizer state gathered on rank 0 and written with the model: a checkpoint
    that loads at any world size (each rank takes back its own partition)."""

    def __init__(self, module: nn.Module, optimizer: Any):
        self.module, self.optimizer = module, optimizer

    def save(self, folder: Path) -> None:
        self.optimizer.consolidate_state_dict(recipient_rank=0)  # collective
        if dist.get_rank() == 0:
            folder.mkdir(parents=True, exist_ok=True)
            state = {"model": self.module.state_dict(), "optim": self.optimizer.state_dict()}
            torch.save(state, folder / STATE_FILE)

    def load(self, folder: Path) -> None:
        state = torch.load(folder / STATE_FILE, weights_only=True, map_location="cpu")
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])


def build_fairscale(
    model: nn.Module,
    cfg: Config,
    precision: Precision,
    device: torch.device,
    blocks: list[nn.Module],
) -> TorchEngine:
    from fairscale.nn.data_parallel import ShardedDataParallel

    if precision.use_scaler:
        raise ValueError(
            "precision: '16-mixed' is not supported with strategy 'fairscale'; "
            "use bf16-mixed, or strategy fsdp / deepspeed for fp16"
        )
    if cfg.strategy.activation_checkpointing:
        apply_activation_checkpointing(blocks)
    model = model.to(device=device, dtype=precision.param_dtype)
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
