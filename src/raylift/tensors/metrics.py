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
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from raylift.tensors.precision import cpu_name

DEVICE_PHASES = ("h2d", "forward", "backward", "optimizer")
PHASES = ("data_wait", *DEVICE_PHASES, "sync")

# Dense peak TFLOP/s (no sparsity) per GPU, by the marketing name's distinctive part:
# bf16/fp16 and tf32 on tensor cores, fp32 on the plain FP32 units. fp32 math runs on
# TF32 tensor cores only when torch allows it (torch.backends.cuda.matmul.allow_tf32),
# so the fp32 peak MFU is taken against depends on that setting: see ``math_key``.
GPU_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "A10G": {"bf16": 70.0, "fp16": 70.0, "tf32": 35.0, "fp32": 31.2},
    "A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "RTX 4090": {"bf16": 165.0, "fp16": 165.0, "tf32": 82.6, "fp32": 82.6},
    "V100": {"bf16": 0.0, "fp16": 125.0, "tf32": 0.0, "fp32": 15.7},
    "T4": {"bf16": 0.0, "fp16": 65.0, "tf32": 0.0, "fp32": 8.1},
}


def dtype_key(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


def math_key(dtype: torch.dtype, tf32: bool | None = None) -> str:
    """The math a CUDA matmul in ``dtype`` really runs: fp32 is TF32 only where allowed."""
    key = dtype_key(dtype)
    if tf32 is None:
        tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
    return "tf32" if key == "fp32" and tf32 else key


def gpu_peak_flops(name: str, dtype: torch.dtype, tf32: bool | None = None) -> float | None:
    """Peak FLOP/s of the GPU called ``name`` (``torch.cuda.get_device_name``) for the math
    ``dtype`` runs in (TF32 or not: torch's current setting when ``tf32`` is None); None if
    unknown. Longer names match first, so "H100 PCIe" is not read as the SXM part."""
    for key in sorted(GPU_PEAK_TFLOPS, key=len, reverse=True):
        if key.lower() in name.lower():
            peak = GPU_PEAK_TFLOPS[key][math_key(dtype, tf32)]
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


def cpu_peak_flops(dtype: torch.dtype, cache: Path | None = None) -> float:
    """An estimate of this CPU's peak: the best matmul rate over up to three sizes (as
    large as take under 50 ms a call), and over every earlier measurement on this
    machine with the same threads.

    One short measurement taken while other processes start up reads low, and every MFU
    after it then reads high; the best ever seen only rises towards the true peak.
    Cached in ``~/.cache/raylift/cpu-peaks.json`` (``cache`` overrides)."""
    measured, seconds = 0.0, 0.0
    for n in (256, 512, 1024):
        # 8x the work per doubling: a dtype the CPU only emulates (bf16, fp16 without
        # AVX-512 bf16/AMX) would take seconds at the larger sizes, so they are skipped.
        if seconds * 8 > 0.05:
            break
        rate = measured_matmul_peak(dtype, n)
        measured, seconds = max(measured, rate), 2.0 * n**3 / rate
    key = f"{cpu_name()} | {torch.get_num_threads()} threads | {dtype_key(dtype)}"
    return remember_best(cache or _peak_cache(), key, measured)


def _peak_cache() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "raylift" / "cpu-peaks.json"


def remember_best(path: Path, key: str, value: float) -> float:
    """``max(value, what path remembers for key)``, remembered; a cache that cannot be
    read or written is skipped, never an error."""
    try:
        known = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        known = {}
    best = max(value, float(known.get(key, 0.0)))
    if best > float(known.get(key, 0.0)):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_text(json.dumps({**known, key: best}, indent=1))
            tmp.replace(path)  # atomic: ranks of one host may write at once
        except OSError:
            pass
    return best


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float | None, str]:
    """The device's peak for ``dtype`` and where the number came from."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return gpu_peak_flops(name, dtype), f"{name} datasheet ({math_key(dtype)} dense)"
    return cpu_peak_flops(dtype), f"estimated: best {dtype_key(dtype)} matmul on this CPU"


SYSTEM = "system/"  # MLflow's prefix for system metrics: its UI shows them on their own tab


def system_now(device: torch.device) -> dict[str, float]:
    """This node's load under MLflow's system-metric names: CPU (since the previous call),
    memory, and the worker's GPU. Counters only: no device sync, no sampling thread, and
    no MLflow import in the worker (rank 0 logs them at each logging interval)."""
    import psutil

    vm = psutil.virtual_memory()
    out = {
        f"{SYSTEM}cpu_utilization_percentage": float(psutil.cpu_percent(interval=None)),
        f"{SYSTEM}system_memory_usage_megabytes": (vm.total - vm.available) / 2**20,
        f"{SYSTEM}system_memory_usage_percentage": float(vm.percent),
    }
    if device.type == "cuda":
        gpu = f"{SYSTEM}gpu_{device.index or 0}_"
        free, total = torch.cuda.mem_get_info(device)  # the whole GPU's, other processes too
        out[f"{gpu}memory_usage_megabytes"] = (total - free) / 2**20
        out[f"{gpu}memory_usage_percentage"] = 100.0 * (total - free) / total
        with contextlib.suppress(Exception):  # utilization needs NVML (pynvml), often absent
            out[f"{gpu}utilization_percentage"] = float(torch.cuda.utilization(device))
    return out


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


def achieved_flops(samples_per_s: float, world: int, flops_per_sample: float) -> float:
    """Model FLOP/s one worker achieves."""
    return samples_per_s / max(world, 1) * flops_per_sample


def mfu(samples_per_s: float, world: int, flops_per_sample: float, peak: float | None) -> float:
    """Model FLOPs utilisation of one worker; NaN when the peak is not known."""
    if not peak or flops_per_sample <= 0:
        return float("nan")
    return achieved_flops(samples_per_s, world, flops_per_sample) / peak


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
