"""The engine seam: what the training loop asks of every strategy.

An engine owns the wrapped model and its optimizer and knows how to run one
micro-step's backward, one optimizer step, and how to save and load its
sharded state. The loop never branches on the strategy.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from raylift.precision import Precision


class Engine(Protocol):
    model: nn.Module  # call this in training forward passes
    optimizer: torch.optim.Optimizer
    precision: Precision

    @property
    def eval_model(self) -> nn.Module: ...

    def sync(self, enabled: bool) -> contextlib.AbstractContextManager[None]:
        """Gradient synchronisation on (last micro-step) or off (accumulating)."""
        ...

    def autocast(self) -> contextlib.AbstractContextManager[None]: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self) -> torch.Tensor | None:
        """Clip, step, zero grads; returns the pre-clip gradient norm when clipping."""
        ...

    def save(self, directory: Path) -> None:
        """Collective: every rank writes its part of model + optimizer state."""
        ...

    def load(self, directory: Path) -> None: ...

    def extra_state(self) -> dict[str, Any]: ...

    def load_extra_state(self, state: dict[str, Any]) -> None: ...


class TorchEngine:
    """Engine for torch-native wrappers (DDP today): autocast, GradScaler, clipping, DCP state."""

    def __init__(
        self,
        model: nn.Module,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        precision: Precision,
        device: torch.device,
        grad_clip: float | None,
    ):
        self.model, self.module, self.optimizer = model, module, optimizer
        self.precision, self.device, self.grad_clip = precision, device, grad_clip
        self.scaler = precision.grad_scaler(device)

    @property
    def eval_model(self) -> nn.Module:
        # The bare module: DDP's forward would broadcast buffers, a collective eval doesn't need.
        return self.module

    def sync(self, enabled: bool) -> contextlib.AbstractContextManager[None]:
        no_sync = getattr(self.model, "no_sync", None)
        if enabled or no_sync is None:
            return contextlib.nullcontext()
        return no_sync()

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        return self.precision.autocast(self.device)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self) -> torch.Tensor | None:
        norm = None
        if self.grad_clip is not None:
            if self.scaler:
                self.scaler.unscale_(self.optimizer)
            norm = nn.utils.clip_grad_norm_(self.module.parameters(), self.grad_clip)
        if self.scaler:
            # Skips the update (and lowers the scale) when a gradient is inf/NaN.
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def save(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(directory / "engine"))

    def load(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(directory / "engine"))
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )

    def extra_state(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()} if self.scaler else {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        if self.scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
