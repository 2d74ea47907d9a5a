"""Precision settings, resolved from the config's short string in one place.

Mixed precision uses the frameworks' own machinery (``torch.autocast`` and
``torch.amp.GradScaler``); ``bf16-true`` casts the model itself to bfloat16.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch


@dataclasses.dataclass(frozen=True)
class Precision:
    name: str
    autocast_dtype: torch.dtype | None  # None: no autocast
    param_dtype: torch.dtype  # dtype the model's weights are kept in
    use_scaler: bool  # fp16 gradients underflow without loss scaling

    @property
    def compute_dtype(self) -> torch.dtype:
        """Dtype the matrix multiplies run in: autocast's if any, else the weights'."""
        return self.autocast_dtype or self.param_dtype

    @property
    def input_dtype(self) -> torch.dtype:
        """Floating dtype the task's ``finish`` should produce: autocast casts inside ops."""
        return self.param_dtype

    @contextlib.contextmanager
    def autocast(self, device: torch.device) -> Iterator[None]:
        if self.autocast_dtype is None:
            yield
            return
        with torch.autocast(device_type=device.type, dtype=self.autocast_dtype):
            yield

    def grad_scaler(self, device: torch.device) -> torch.amp.GradScaler | None:
        return torch.amp.GradScaler(device.type) if self.use_scaler else None


# Every precision the config accepts, by the name it is written with.
PRECISIONS = {
    "32": Precision("32", None, torch.float32, False),
    "16-mixed": Precision("16-mixed", torch.float16, torch.float32, True),
    "bf16-mixed": Precision("bf16-mixed", torch.bfloat16, torch.float32, False),
    "bf16-true": Precision("bf16-true", None, torch.bfloat16, False),
}


def resolve_precision(name: str) -> Precision:
    try:
        return PRECISIONS[name]
    except KeyError:
        raise ValueError(
            f"precision: unknown {name!r}; choose one of {tuple(PRECISIONS)}"
        ) from None
