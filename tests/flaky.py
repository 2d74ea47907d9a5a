"""A task that fails once, mid-run, for fault-injection tests (imported by Ray workers)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from raylift.tasks.base import Batch
from raylift.tasks.digits import DigitsTask


class FlakyDigits(DigitsTask):
    """Digits, except the ``fail_at``-th loss raises, once: ``marker`` records that it did."""

    def __init__(self, marker: str, fail_at: int = 30, **kwargs: object):
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.marker, self.fail_at, self.calls = Path(marker), fail_at, 0

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_at and not self.marker.exists():
            self.marker.write_text("failed once")
            raise RuntimeError(f"injected failure at loss call {self.calls}")
        return super().loss(model, batch)
