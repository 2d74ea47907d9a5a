"""Strategies turn (model, config, precision, device) into an :class:`Engine`."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from raylift.config import Config
from raylift.precision import Precision
from raylift.strategies.base import Engine, TorchEngine
from raylift.strategies.ddp import build_ddp
from raylift.strategies.deepspeed import build_deepspeed
from raylift.strategies.fairscale import build_fairscale
from raylift.strategies.fsdp import build_fsdp

# (model, config, precision, device, the model's repeated blocks) -> engine
Builder = Callable[[nn.Module, Config, Precision, torch.device, list[nn.Module]], Engine]

BUILDERS: dict[str, Builder] = {
    "ddp": build_ddp,
    "fsdp": build_fsdp,
    "fairscale": build_fairscale,
    "deepspeed": build_deepspeed,
}

__all__ = ["BUILDERS", "Engine", "TorchEngine", "build_engine"]


def build_engine(
    model: nn.Module,
    cfg: Config,
    precision: Precision,
    device: torch.device,
    blocks: list[nn.Module],
) -> Engine:
    try:
        builder = BUILDERS[cfg.strategy.name]
    except KeyError:
        raise ValueError(
            f"strategy.name: {cfg.strategy.name!r} has no engine; choose one of {sorted(BUILDERS)}"
        ) from None
    return builder(model, cfg, precision, device, blocks)
