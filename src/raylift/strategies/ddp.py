"""DistributedDataParallel: a full replica per rank, gradients all-reduced in buckets."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from raylift.core.config import Config
from raylift.strategies.base import TorchEngine, apply_activation_checkpointing, read_dcp_model
from raylift.strategies.registry import Parts, PlanRow, Shards, StrategySpec
from raylift.tensors.adapters import keep_trainable_fp32
from raylift.tensors.init import Initializer, write_in_place
from raylift.tensors.optim import build_optimizer
from raylift.tensors.precision import Precision


def problems(cfg: Config) -> list[str]:
    if cfg.strategy.bucket_cap_mb <= 0:
        return ["strategy.bucket_cap_mb: must be > 0 (MiB of gradients per all-reduce)"]
    return []


def build_ddp(
    model: nn.Module,
    cfg: Config,
    precision: Precision,
    device: torch.device,
    parts: Parts,
    init: Initializer,
) -> TorchEngine:
    init(write_in_place)
    if cfg.strategy.activation_checkpointing:
        apply_activation_checkpointing(parts.blocks)
    model = keep_trainable_fp32(model.to(device=device, dtype=precision.param_dtype))
    optimizer = build_optimizer(model, cfg.optim)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        # One device: nothing to all-reduce, so no wrapper copying grads into buckets
        # and launching a collective every step. The checkpoint is the same (DCP
        # drops DDP's ``module.`` prefix), so a run may resume at any world size.
        return TorchEngine(model, model, optimizer, precision, device, cfg.train.grad_clip)
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        find_unused_parameters=cfg.strategy.find_unused_parameters,
        bucket_cap_mb=cfg.strategy.bucket_cap_mb,
        # Local grads are written straight into the bucket views: no extra copy per step.
        gradient_as_bucket_view=True,
    )
    # Evaluate the bare module: DDP's forward would broadcast buffers, a collective
    # that evaluation does not need.
    return TorchEngine(
        ddp,
        model,
        optimizer,
        precision,
        device,
        cfg.train.grad_clip,
        pause_sync=ddp.no_sync,
        eval_module=model,
    )


SPEC = StrategySpec(
    name="ddp",
    options=("find_unused_parameters", "bucket_cap_mb"),
    problems=problems,
    build=build_ddp,
    read_export=read_dcp_model,
    plan_rows=(PlanRow("ddp", {"name": "ddp"}, Shards(False, False, False), comm_rank=0),),
    compile_whole=True,
)
