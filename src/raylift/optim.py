"""Optimizer and learning-rate schedule from the ``optim`` section."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from raylift.config import OptimConfig


def param_groups(params: Iterable[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    """Decay matrices only: decaying biases and norm gains hurts and buys nothing."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for _, p in params:
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def optimizer_class_and_kwargs(cfg: OptimConfig) -> tuple[type[torch.optim.Optimizer], dict]:
    """The torch optimizer class and its arguments besides the parameters: the one choice,
    whether raylift builds it or a wrapper (fairscale's OSS) does."""
    if cfg.name == "sgd":
        return torch.optim.SGD, {"lr": cfg.lr, "momentum": cfg.momentum}
    cls = torch.optim.AdamW if cfg.name == "adamw" else torch.optim.Adam
    return cls, {"lr": cfg.lr, "betas": (cfg.betas[0], cfg.betas[1])}


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    cls, kwargs = optimizer_class_and_kwargs(cfg)
    return cls(param_groups(model.named_parameters(), cfg.weight_decay), **kwargs)


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Linear warmup to 1, then cosine decay to ``min_lr_ratio`` at ``total_steps``."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    span = max(total_steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg, total_steps)
    )
