"""The doctor's probe: rides along in the training loop and measures two windows of steps.

After a warm-up window, a window measured by the loop's own phase clock over all ranks
(no profiler overhead), then a window profiled with ``torch.profiler`` on rank 0 (the
Chrome trace, host syncs per step, time in collectives). Findings are published as
``doctor_*`` metrics that ride along in every later report; the driver side
(:mod:`raylift.commands.doctor`) turns them into a verdict.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType

from raylift.core import storage
from raylift.run.context import StepView
from raylift.tensors.metrics import StepTimes, dtype_key, peak_flops

PREFIX = "doctor_"
SYNC_OPS = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize")
LAUNCH_APIS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
# Operators that make no kernel of their own: views, metadata, allocation.
NO_KERNEL_OPS = frozenset(
    f"aten::{name}"
    for name in (
        "detach", "view", "_unsafe_view", "alias", "t", "as_strided", "_reshape_alias",
        "reshape", "expand", "unsqueeze", "squeeze", "select", "slice", "transpose",
        "permute", "empty", "empty_strided", "empty_like", "lift_fresh", "resolve_conj",
        "resolve_neg", "split", "chunk", "unbind", "narrow", "to", "contiguous",
        "set_", "result_type", "is_nonzero",
    )
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ProbeSettings:
    """What the driver asks of the probe: ``steps`` per window, where the trace goes."""

    steps: int
    out_dir: str | None = None  # the run's doctor folder (local or a URI); None: MLflow only


class DoctorProbe:
    """A :class:`~raylift.run.context.Probe` that measures, then profiles, a window of steps."""

    def __init__(self, steps: int, out_dir: str | None):
        self.steps, self.out_dir = steps, out_dir
        self.window: StepTimes | None = None
        self.profiler: Any = None

    @classmethod
    def from_settings(cls, settings: ProbeSettings) -> DoctorProbe:
        return cls(settings.steps, settings.out_dir)

    def after_step(self, view: StepView) -> None:
        if view.step == self.steps:
            self.window = view.clock.open()
        elif view.step == 2 * self.steps and self.window is not None:
            self._measured(view, self.window)
            self.window = view.clock.open()
            self._start_profiler(view)
        elif view.step == 3 * self.steps and self.window is not None:
            self._profiled(view, self.window)
            self.window = None

    def _measured(self, view: StepView, window: StepTimes) -> None:
        view.clock.close(window)
        metrics = view.reduce(window)
        metrics.update(self._context(view))
        view.publish({PREFIX + k: v for k, v in metrics.items()})

    def _context(self, view: StepView) -> dict[str, float]:
        """What the verdict needs beyond the timings: peaks per dtype, memory limits."""
        import psutil

        out = {"world_size": float(view.world_size), "steps": float(self.steps)}
        for dtype in (torch.float32, torch.bfloat16):
            peak, _ = peak_flops(view.device, dtype)
            out[f"peak_{dtype_key(dtype)}_flops"] = peak or math.nan
        out["host_mem_bytes"] = float(psutil.virtual_memory().total)
        out["cuda"] = float(view.device.type == "cuda")
        return out

    def _start_profiler(self, view: StepView) -> None:
        if view.rank != 0:
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if view.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self.profiler = profile(activities=activities)
        self.profiler.start()

    def _profiled(self, view: StepView, window: StepTimes) -> None:
        view.clock.close(window)
        if self.profiler is None:
            return
        self.profiler.stop()
        stats = trace_stats(self.profiler, self.steps, window.elapsed())
        view.publish({PREFIX + k: v for k, v in stats.items()})
        with tempfile.TemporaryDirectory(prefix="raylift-doctor-") as tmp:
            trace = Path(tmp) / "trace-rank0.json"
            self.profiler.export_chrome_trace(str(trace))
            view.tracker.log_artifact(trace, "doctor")  # sends its bytes
            if self.out_dir:  # the run's folder, local or in an object store
                storage.write_bytes(storage.join(self.out_dir, trace.name), trace.read_bytes())
        self.profiler = None


def trace_stats(profiler: Any, steps: int, elapsed: float) -> dict[str, float]:
    """Host syncs per step and the share of time in collectives, from a profile of ``steps``.

    Syncs are ``.item()``-style reads and stream synchronisations, counted at their
    outermost call; the optimizer's own step counters (CPU tensors) are not syncs.
    Collective time is gloo's ops on the host, NCCL's kernels on the device."""
    syncs, comm_us = 0, 0.0
    for event in profiler.events():
        name = event.name
        if name in SYNC_OPS and not _inside(event, SYNC_OPS, "Optimizer.step"):
            syncs += 1
        elif name.startswith("gloo:") and not _inside(event, (), "gloo:"):
            comm_us += event.cpu_time_total
        elif "nccl" in name.lower() and event.device_type == DeviceType.CUDA:
            comm_us += float(event.self_device_time_total)
    return {
        "syncs_per_step": syncs / max(steps, 1),
        "profiled_comm_frac": min(comm_us / 1e6 / max(elapsed, 1e-9), 1.0),
    }


def launches(profiler: Any) -> int:
    """Kernel launches in a profile: the CUDA runtime's launch calls on a GPU; on a CPU,
    the innermost operators that compute (each would be a kernel on a GPU)."""
    events = profiler.events()
    cuda = sum(1 for e in events if e.name in LAUNCH_APIS)
    if cuda:
        return cuda
    return sum(
        1
        for e in events
        if e.name.startswith("aten::")
        and e.name not in NO_KERNEL_OPS
        and not any(c.name.startswith("aten::") for c in e.cpu_children)
    )


def syncs(profiler: Any) -> int:
    """Host syncs in a profile (see :func:`trace_stats`)."""
    return sum(
        1
        for e in profiler.events()
        if e.name in SYNC_OPS and not _inside(e, SYNC_OPS, "Optimizer.step")
    )


def _inside(event: Any, names: tuple[str, ...], prefix: str) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in names or parent.name.startswith(prefix):
            return True
        parent = parent.cpu_parent
    return False
