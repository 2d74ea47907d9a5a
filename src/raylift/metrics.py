"""Where a step's time goes, throughput, MFU and memory, without a host sync per step.

The loop brackets each phase of a micro-step (host-to-device, forward, backward,
optimizer) with :meth:`PhaseClock.phase`. On the CPU the host clock is the truth
(ops run as they are called). On CUDA the host runs ahead of the device, so each
phase records a pair of CUDA events instead; the events are read only when the
logging interval syncs anyway. ``data_wait`` (blocked on the next batch) and
``sync`` (the loop's own logging collectives) are host-side by nature.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

DEVICE_PHASES = ("h2d", "forward", "backward", "optimizer")
PHASES = ("data_wait", *DEVICE_PHASES, "sync")

# Dense peak TFLOP/s (no sparsity) per GPU, by the marketing name's distinctive part.
# bf16/fp16 on tensor cores; fp32 is TF32 where the chip has it (torch uses TF32 for
# matmuls only when allowed, so fp32 MFU against it is conservative).
GPU_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 494.0},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 378.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 494.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "fp32": 183.0},
    "L4": {"bf16": 121.0, "fp16": 121.0, "fp32": 60.0},
    "A10G": {"bf16": 70.0, "fp16": 70.0, "fp32": 35.0},
    "A10": {"bf16": 125.0, "fp16": 125.0, "fp32": 62.5},
    "RTX 4090": {"bf16": 165.0, "fp16": 165.0, "fp32": 82.6},
    "V100": {"bf16": 0.0, "fp16": 125.0, "fp32": 15.7},
    "T4": {"bf16": 0.0, "fp16": 65.0, "fp32": 8.1},
}


def dtype_key(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


def gpu_peak_flops(name: str, dtype: torch.dtype) -> float | None:
    """Peak FLOP/s of the GPU called ``name`` (``torch.cuda.get_device_name``); None if unknown.

    Longer names match first, so "H100 PCIe" is not read as the SXM part."""
    for key in sorted(GPU_PEAK_TFLOPS, key=len, reverse=True):
        if key.lower() in name.lower():
            peak = GPU_PEAK_TFLOPS[key][dtype_key(dtype)]
            return peak * 1e12 if peak else None
    return None


@functools.lru_cache(maxsize=4)
def measured_matmul_peak(dtype: torch.dtype, n: int = 512, repeats: int = 5) -> float:
    """FLOP/s of a square matmul on this process's CPU threads: the CPU's practical peak."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    a @ b  # warm-up: first calls pick kernels and fault in pages
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - started)
    return 2.0 * n**3 / best


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float | None, str]:
    """The device's peak for ``dtype`` and where the number came from."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return gpu_peak_flops(name, dtype), f"{name} datasheet ({dtype_key(dtype)} dense)"
    return measured_matmul_peak(dtype), f"measured {dtype_key(dtype)} matmul on this CPU"


def memory_now(device: torch.device) -> dict[str, float]:
    """Host-side memory counters (no device sync); CUDA peak is reset for the next interval."""
    import psutil

    out = {"mem_rss_bytes": float(psutil.Process().memory_info().rss)}
    if device.type == "cuda":
        out["cuda_allocated_bytes"] = float(torch.cuda.memory_allocated(device))
        out["cuda_reserved_bytes"] = float(torch.cuda.memory_reserved(device))
        out["cuda_peak_allocated_bytes"] = float(torch.cuda.max_memory_allocated(device))
        out["cuda_total_bytes"] = float(torch.cuda.get_device_properties(device).total_memory)
        torch.cuda.reset_peak_memory_stats(device)
    return out


def _zero_phases() -> dict[str, float]:
    return dict.fromkeys(PHASES, 0.0)


Clock = Callable[[], float]  # seconds; time.perf_counter, or a test's own


@dataclasses.dataclass
class StepTimes:
    """Seconds per phase over one span of steps (a logging interval, a doctor window)."""

    now: Clock = time.perf_counter
    samples: int = 0
    steps: int = 0
    started: float = -1.0  # when the span opened, on ``now``'s scale
    paused: float = 0.0  # eval and checkpoints: not training time
    seconds: dict[str, float] = dataclasses.field(default_factory=_zero_phases)
    pending: list[tuple[str, Any, Any]] = dataclasses.field(default_factory=list)  # CUDA events

    def __post_init__(self) -> None:
        if self.started < 0:
            self.started = self.now()

    def elapsed(self) -> float:
        return max(self.now() - self.started - self.paused, 1e-9)

    def resolve(self) -> dict[str, float]:
        """Phase seconds, reading the CUDA events (the caller has synced the device)."""
        for phase, start, end in self.pending:
            end.synchronize()
            self.seconds[phase] += start.elapsed_time(end) / 1000.0
        self.pending.clear()
        return dict(self.seconds)


class PhaseClock:
    """Times phases into every open :class:`StepTimes`.

    Communication is not a phase: DDP's all-reduces overlap backward, and timing them
    per step from Python (a comm hook) slowed DDP on gpt-tiny by half on 2 CPU cores.
    ``raylift doctor`` reads collective time from its profiled window instead."""

    def __init__(self, device: torch.device, now: Clock = time.perf_counter):
        self.cuda = device.type == "cuda"
        self.now = now
        self.sinks: list[StepTimes] = []

    def open(self) -> StepTimes:
        times = StepTimes(now=self.now)
        self.sinks.append(times)
        return times

    def close(self, times: StepTimes) -> None:
        self.sinks.remove(times)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.cuda and name in DEVICE_PHASES:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            for sink in self.sinks:
                sink.pending.append((name, start, end))
            return
        started = self.now()
        yield
        self.add(name, self.now() - started)

    def drain(self) -> None:
        """Wait for the device's queued work (CUDA), at a point that syncs anyway.

        The wait is the device finishing phases its events already time; draining first
        keeps that time out of the host-side ``sync`` phase that follows."""
        if self.cuda:
            torch.cuda.synchronize()

    def add(self, name: str, seconds: float) -> None:
        for sink in self.sinks:
            sink.seconds[name] += seconds

    def pause(self, seconds: float) -> None:
        for sink in self.sinks:
            sink.paused += seconds

    def count_step(self, samples: int) -> None:
        for sink in self.sinks:
            sink.steps += 1
            sink.samples += samples


def breakdown(seconds: dict[str, float], elapsed: float) -> dict[str, float]:
    """Phase seconds -> ``step_<phase>_frac`` of the wall time; the rest is ``step_other_frac``
    (Python, kernel launches, waiting for the device)."""
    out = {f"step_{p}_frac": min(seconds.get(p, 0.0) / elapsed, 1.0) for p in PHASES}
    out["step_other_frac"] = max(1.0 - sum(out.values()), 0.0)
    return out


def mfu(samples_per_s: float, world: int, flops_per_sample: float, peak: float | None) -> float:
    """Model FLOPs utilisation of one worker; NaN when the peak is not known."""
    if not peak or flops_per_sample <= 0:
        return float("nan")
    return samples_per_s / max(world, 1) * flops_per_sample / peak


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_max(values: list[float], device: torch.device) -> list[float]:
    """The largest of each value over ranks: the slowest worker sets the pace."""
    if not (dist.is_available() and dist.is_initialized()):
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(v) for v in t.tolist()]
