"""The machine a benchmark ran on, for its report: CPU model, cores, GPU if any."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    info = Path("/proc/cpuinfo")
    if info.exists():
        for line in info.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def describe() -> str:
    parts = [f"{cpu_model()}, {os.cpu_count()} cores"]
    try:
        import torch

        if torch.cuda.is_available():
            parts.append(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}")
        else:
            parts.append("no GPU")
        parts.append(f"torch {torch.__version__}")
    except ImportError:
        pass
    return "; ".join(parts)
