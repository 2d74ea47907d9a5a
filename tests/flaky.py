"""Tasks that fail on purpose, for fault-injection tests (imported by Ray workers)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from raylift.tasks.base import Batch
from raylift.tasks.digits import DigitsTask
from raylift.tasks.gpt import GPTTask


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


class NanDigits(DigitsTask):
    """Digits whose ``nan_at``-th training loss is NaN, as a bad batch or an overflow makes it.
    With ``modules``, rank 0 writes there the modules its process has imported by then
    (the run has built, trained, evaluated and saved a checkpoint)."""

    def __init__(self, nan_at: int = 13, modules: str = "", **kwargs: object):
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.nan_at, self.calls, self.modules = nan_at, 0, modules

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        self.calls += 1
        loss = super().loss(model, batch)
        if self.calls == self.nan_at and self.modules and dist.get_rank() == 0:
            Path(self.modules).write_text("\n".join(sorted(sys.modules)))
        return loss * float("nan") if self.calls == self.nan_at else loss


class KilledGPT(GPTTask):
    """The gpt task, except that rank 1's worker process is SIGKILLed at its ``kill_at``-th
    training loss, unless ``marker`` exists; the killing writes it, so a restart lives.
    With ``nan_at``, that loss call (on every rank) is NaN instead. With ``stall_from``,
    until then every upload of a checkpoint of that step or later stalls between its
    files and its completion list, as a slow store keeps an async save in flight."""

    def __init__(
        self, marker: str, kill_at: int = 6, nan_at: int = 0, stall_from: int = 0,
        **kwargs: object,
    ):  # fmt: skip
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.marker, self.kill_at, self.nan_at, self.calls = Path(marker), kill_at, nan_at, 0
        if stall_from and not self.marker.exists():
            stall_uploads(stall_from)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.kill_at and dist.get_rank() == 1 and not self.marker.exists():
            self.marker.write_text(f"killed pid {os.getpid()}")
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no goodbye: as the OOM killer does
        loss = super().loss(model, batch)
        return loss * float("nan") if self.calls == self.nan_at else loss


class BrokenDigits(DigitsTask):
    """The digits task with a bug in its loss at the ``break_at``-th call on rank 0, as a
    user's own code might raise."""

    def __init__(self, break_at: int = 3, **kwargs: object):
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.break_at, self.calls = break_at, 0

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.break_at and dist.get_rank() == 0:
            raise ValueError(f"shapes do not match at call {self.calls}: a bug in the task")
        return super().loss(model, batch)


class CrashingDigits(DigitsTask):
    """Digits whose ``build_model`` prints a line on every rank, and whose rank 1 crashes
    at its ``crash_at``-th training loss as a user's native code would: ``segv`` reads
    address 0 (``ctypes.string_at(0)``), ``abort`` calls ``os.abort()``. ``how`` may name
    several, comma-separated: each attempt of the run crashes the next way (``marker``
    counts the attempts that crashed)."""

    def __init__(self, how: str = "segv", crash_at: int = 5, marker: str = "", **kwargs: object):
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.how, self.crash_at, self.marker, self.calls = how.split(","), crash_at, marker, 0

    def build_model(self) -> nn.Module:
        print("user: building the model")  # raylift adds the rank
        return super().build_model()

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.crash_at and dist.get_rank() == 1:
            crash(self._next_way())
        return super().loss(model, batch)

    def _next_way(self) -> str:
        if not self.marker:
            return self.how[0]
        path = Path(self.marker)
        done = int(path.read_text()) if path.exists() else 0
        path.write_text(str(done + 1))
        return self.how[min(done, len(self.how) - 1)]


def crash(how: str) -> None:
    if how == "abort":
        os.abort()
    import ctypes

    ctypes.string_at(0)


def stall_uploads(from_step: int) -> None:
    """In this process, every upload of ``checkpoint-step<N>`` with N >= ``from_step``
    writes its files and then waits for ten minutes (the process is killed first)."""
    import time

    from raylift.core import storage
    from raylift.tensors.checkpoints import checkpoint_step

    upload = storage.upload_folder

    def stalled(local: Path, dest: str) -> None:
        upload(local, dest)
        if checkpoint_step(dest) >= from_step:
            time.sleep(600)

    storage.upload_folder = stalled  # type: ignore[assignment]
