"""Step-time breakdown, peaks, MFU and memory: the measuring pieces, without Ray."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from raylift.tasks import build_task
from raylift.tensors.metrics import (
    PHASES,
    PhaseClock,
    breakdown,
    cpu_peak_flops,
    gpu_peak_flops,
    measured_matmul_peak,
    memory_now,
    mfu,
    remember_best,
)
from tests.helpers import ListTracker, LocalReporter, make_config, make_trainer, run_ranks


def test_gpu_peaks_come_from_the_datasheet_table_by_name() -> None:
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989e12
    assert gpu_peak_flops("NVIDIA H100 PCIe", torch.bfloat16) == 756e12  # not the SXM part
    # fp32 runs on TF32 tensor cores only where torch allows it: the peak follows.
    assert gpu_peak_flops("NVIDIA A100-SXM4-40GB", torch.float32, tf32=True) == 156e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-40GB", torch.float32, tf32=False) == 19.5e12
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16, tf32=False) == 989e12
    assert gpu_peak_flops("NVIDIA A10G", torch.float16) == 70e12
    assert gpu_peak_flops("Tesla T4", torch.bfloat16) is None  # no bf16 tensor cores
    assert gpu_peak_flops("Some Future GPU", torch.bfloat16) is None


def test_cpu_peak_is_a_measured_matmul_rate() -> None:
    fp32 = measured_matmul_peak(torch.float32)
    assert 1e9 < fp32 < 1e13  # GFLOP/s to TFLOP/s: a CPU's range
    assert measured_matmul_peak(torch.float32) == fp32  # measured once per process


def test_the_cpu_peak_is_the_best_ever_measured_so_a_loaded_start_up_cannot_lower_it(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "peaks.json"
    quiet = cpu_peak_flops(torch.float32, cache)
    measured_matmul_peak.cache_clear()
    stop = threading.Event()

    def burn() -> None:
        x = torch.randn(256, 256)
        while not stop.is_set():
            x @ x

    hogs = [threading.Thread(target=burn) for _ in range(4)]
    for h in hogs:
        h.start()
    try:
        assert cpu_peak_flops(torch.float32, cache) >= quiet  # the cache holds the best
    finally:
        stop.set()
        for h in hogs:
            h.join()
    assert remember_best(cache, "k", 2.0) == 2.0 and remember_best(cache, "k", 1.0) == 2.0
    assert json.loads(cache.read_text())["k"] == 2.0


def test_mfu_is_achieved_flops_per_worker_over_the_peak() -> None:
    assert mfu(1000.0, 2, 6e6, 1e10) == pytest.approx(0.3)
    assert mfu(1000.0, 2, 6e6, None) != mfu(1000.0, 2, 6e6, None)  # NaN: peak unknown


def test_gpt_flops_per_sample_is_six_params_per_token() -> None:
    task = build_task("gpt", {"block_size": 16, "n_layer": 1, "n_head": 2, "d_model": 32})
    model = task.build_model()
    params = sum(p.numel() for p in model.parameters())
    assert task.flops_per_sample(model) == 6 * params * 16  # type: ignore[attr-defined]


def test_digits_flops_per_sample_counts_its_layers() -> None:
    task = build_task("digits", {"width": 8})
    conv = 64 * 8 * 9 + 64 * 16 * 9 * 8
    fc = 16 * 16 * 128 + 128 * 10
    assert task.flops_per_sample(task.build_model()) == 6 * (conv + fc)  # type: ignore[attr-defined]


class FakeClock:
    """A clock that moves only when told to: phase times are exact, whatever the load."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def test_phase_clock_times_each_phase_into_every_open_span() -> None:
    now = FakeClock()
    clock = PhaseClock(torch.device("cpu"), now=now)
    interval = clock.open()
    with clock.phase("forward"):
        now.advance(0.02)
    window = clock.open()
    with clock.phase("backward"):
        now.advance(0.03)
    clock.pause(0.5)
    clock.close(window)
    with clock.phase("optimizer"):
        now.advance(0.01)
    now.advance(0.54)  # outside any phase: "other"
    seen = interval.resolve()
    assert seen["forward"] == pytest.approx(0.02)
    assert seen["backward"] == pytest.approx(0.03)
    assert seen["optimizer"] == pytest.approx(0.01)
    assert window.resolve()["forward"] == 0.0 and window.resolve()["optimizer"] == 0.0
    assert interval.paused == window.paused == 0.5
    assert interval.elapsed() == pytest.approx(0.1)  # 0.6 s on the clock, 0.5 s paused


def test_breakdown_fractions_add_up_to_one() -> None:
    fr = breakdown({"data_wait": 1.0, "forward": 2.0, "backward": 4.0}, elapsed=10.0)
    assert fr["step_backward_frac"] == pytest.approx(0.4)
    assert fr["step_other_frac"] == pytest.approx(0.3)
    assert sum(fr.values()) == pytest.approx(1.0)
    assert set(fr) == {f"step_{p}_frac" for p in PHASES} | {"step_other_frac"}


def test_memory_on_cpu_is_the_process_rss() -> None:
    mem = memory_now(torch.device("cpu"))
    assert set(mem) == {"mem_rss_bytes"}
    assert 50 * 2**20 < mem["mem_rss_bytes"] < 20 * 2**30


@pytest.mark.gpu
def test_cuda_phases_are_timed_with_events_and_memory_has_cuda_counters() -> None:
    device = torch.device("cuda")
    clock = PhaseClock(device)
    span = clock.open()
    x = torch.randn(4096, 4096, device=device)
    started = time.perf_counter()
    with clock.phase("forward"):
        for _ in range(20):
            x = x @ x / 64
    queued = time.perf_counter() - started
    seconds = span.resolve()["forward"]  # reads the events: waits for the device
    assert seconds > queued  # the host only queued the work; the events timed the device
    mem = memory_now(device)
    assert mem["cuda_peak_allocated_bytes"] >= 2 * 4096 * 4096 * 4
    assert mem["cuda_total_bytes"] > mem["cuda_reserved_bytes"] > 0


def _two_ranks_log(rank: int, world: int, out: str) -> None:
    cfg = make_config(train={"max_steps": 8, "log_every_n_steps": 4})
    tracker = ListTracker()
    trainer = make_trainer(cfg, rank, world, LocalReporter(Path(out) / f"r{rank}"), tracker)
    trainer.run()
    if rank == 0:
        torch.save(tracker.rows, out + "/rows.pt")


def test_every_log_interval_carries_the_breakdown_throughput_mfu_and_memory(
    tmp_path: Path,
) -> None:
    run_ranks(2, tmp_path, _two_ranks_log, str(tmp_path))
    rows = [m for _, m in torch.load(tmp_path / "rows.pt") if "train_loss" in m]
    assert len(rows) == 2
    for m in rows:
        fracs = [m[f"step_{p}_frac"] for p in PHASES] + [m["step_other_frac"]]
        assert sum(fracs) == pytest.approx(1.0, abs=1e-6)
        assert m["step_forward_frac"] > 0 and m["step_backward_frac"] > 0
        assert 0 < m["mfu"] < 1
        assert m["samples_per_s"] > 0 and m["step_time_s"] > 0
        assert m["mem_rss_bytes"] > 0


def _host_reads(tmp_path: Path, steps: int) -> float:
    """``.item()``-style reads outside the optimizer during a run of ``steps`` logged once."""
    from raylift.run.probe import trace_stats

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / f'pg{steps}'}", rank=0, world_size=1
    )
    try:
        cfg = make_config(train={"max_steps": steps, "log_every_n_steps": steps})
        trainer = make_trainer(cfg, 0, 1, LocalReporter(tmp_path / str(steps)))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            trainer.run()
    finally:
        dist.destroy_process_group()
    return trace_stats(prof, 1, 1.0)["syncs_per_step"]


def test_the_loop_reads_the_device_only_at_log_eval_and_checkpoint_points(tmp_path: Path) -> None:
    """No ``.item()`` per step: twice the steps, the same handful of host reads."""
    few, many = _host_reads(tmp_path, 10), _host_reads(tmp_path, 30)
    assert few == many, (few, many)
    assert many <= 12  # two evaluations, one log, the final checkpoint: 11 here
