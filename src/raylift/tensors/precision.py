"""Precision settings, resolved from the config's short string in one place.

Mixed precision uses the frameworks' own machinery (``torch.autocast`` and
``torch.amp.GradScaler``); ``bf16-true`` casts the model itself to bfloat16.
``auto`` picks, per device, the fastest precision that trains as well as fp32 does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from pathlib import Path

import torch

from raylift.core.config import AUTO


@dataclasses.dataclass(frozen=True)
class Precision:
    name: str
    autocast_dtype: torch.dtype | None  # None: no autocast
    param_dtype: torch.dtype  # dtype the model's weights are kept in
    use_scaler: bool  # fp16 gradients underflow without loss scaling
    # fp32 matmuls and convolutions on CUDA may run on TF32 tensor cores (10-bit
    # mantissa, ~8x the fp32 rate on an H100); ``32-true`` asks for exact fp32.
    tf32: bool = True

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

    def configure_matmul(self, device: torch.device) -> None:
        """Set this process's fp32 matmul math for ``device``: TF32 or exact (CUDA only;
        a CPU's fp32 matmul is always exact)."""
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = self.tf32
            torch.backends.cudnn.allow_tf32 = self.tf32


# Every precision the config accepts, by the name it is written with.
PRECISIONS = {
    "32": Precision("32", None, torch.float32, False),
    "32-true": Precision("32-true", None, torch.float32, False, tf32=False),
    "16-mixed": Precision("16-mixed", torch.float16, torch.float32, True),
    "bf16-mixed": Precision("bf16-mixed", torch.bfloat16, torch.float32, False),
    "bf16-true": Precision("bf16-true", None, torch.bfloat16, False),
}


ACCEPTED = (AUTO, *PRECISIONS)  # what the config's ``precision`` key may say


def resolve_precision(name: str, device: DeviceFacts | None = None) -> Precision:
    """The precision ``name`` names; ``auto`` is chosen for ``device`` (this host's
    first device when not given)."""
    if name == AUTO:
        name = choose(device or DeviceFacts.here())[0]
    try:
        return PRECISIONS[name]
    except KeyError:
        raise ValueError(f"precision: unknown {name!r}; choose one of {ACCEPTED}") from None


# ---------------------------------------------------------------- precision: auto

# CPU features that multiply bf16 natively. Without them bf16 autocast on a CPU is
# emulated and runs 4-7x slower than fp32 (measured on an AMD EPYC without them).
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
    """What ``precision: auto`` decides from, gathered where a worker runs."""

    kind: str  # "cuda" or "cpu"
    name: str
    capability: tuple[int, int] | None = None  # CUDA compute capability
    cpu_flags: frozenset[str] = frozenset()

    @staticmethod
    def here(use_gpu: bool | None = None) -> DeviceFacts:
        if use_gpu is None:
            use_gpu = torch.cuda.is_available()
        if use_gpu:
            major, minor = torch.cuda.get_device_capability(0)
            return DeviceFacts("cuda", torch.cuda.get_device_name(0), (major, minor))
        return DeviceFacts("cpu", cpu_name(), cpu_flags=_cpu_flags())


def choose(device: DeviceFacts) -> tuple[str, str]:
    """(precision, why) for ``device``: bf16-mixed where it computes bf16 fast,
    16-mixed on GPUs older than Ampere, fp32 elsewhere."""
    if device.kind == "cuda":
        cap = device.capability or (0, 0)
        if cap >= (8, 0):
            return (
                "bf16-mixed",
                f"{device.name} (compute capability {cap[0]}.{cap[1]}) has bf16 tensor cores",
            )
        return (
            "16-mixed",
            f"{device.name} (compute capability {cap[0]}.{cap[1]}) has no bf16 tensor cores",
        )
    native = sorted(set(BF16_CPU_FLAGS) & device.cpu_flags)
    if native:
        return "bf16-mixed", f"CPU {device.name} multiplies bf16 natively ({', '.join(native)})"
    return (
        "32",
        f"CPU {device.name} has no native bf16 ({' / '.join(BF16_CPU_FLAGS)}): emulated, slow",
    )


@functools.cache
def _cpu_flags() -> frozenset[str]:
    for line in _cpuinfo():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


@functools.cache
def cpu_name() -> str:
    for line in _cpuinfo():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    import platform

    return platform.processor() or platform.machine()


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:  # not Linux: no flags to read, so no bf16 is assumed
        return []
