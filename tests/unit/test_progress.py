"""A logging interval's reduction, throughput, MFU and console line, in one process."""

from __future__ import annotations

import pytest
import torch

from raylift.run.context import WorkerContext
from raylift.run.progress import Interval, IntervalMeter, Rates, console_line
from raylift.tensors.metrics import PHASES, PhaseClock


class Ticks:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def meter(now: Ticks, rates: Rates) -> IntervalMeter:
    ctx = WorkerContext(0, 1, torch.device("cpu"), source=None, reporter=None, log=lambda s: None)  # type: ignore[arg-type]
    return IntervalMeter(ctx, PhaseClock(ctx.device, now), rates)


def test_an_interval_sums_finite_losses_and_counts_the_bad_ones_out() -> None:
    interval = Interval.fresh(PhaseClock(torch.device("cpu")))
    assert interval.first_bad_step() == -1.0
    for step, value in ((7, 1.0), (8, 3.0), (9, float("nan")), (10, float("inf"))):
        interval.add(torch.tensor(value), step)
    assert interval.micro_batches == 4
    loss_sum, finite, bad = interval.summary()
    assert float(loss_sum) == 4.0 and float(finite) == 2.0
    assert bad == 9.0 and interval.first_bad_step() == 9.0


def test_reduce_gives_throughput_mfu_and_the_breakdown_of_the_interval() -> None:
    now = Ticks()
    m = meter(
        now, Rates(global_batch=64, flops_per_sample=1e6, tokens_per_sample=8, peak_flops=1e9)
    )
    clock = m.clock
    for _ in range(4):  # 4 steps of 0.5 s: 0.1 s waiting, 0.4 s forward
        with clock.phase("data_wait"):
            now.t += 0.1
        with clock.phase("forward"):
            now.t += 0.4
        clock.count_step(64)
    ending = m.rotate()
    sums, metrics, maxes = m.reduce(ending.times, [torch.tensor(6.0)], [7.0])
    assert sums == [6.0] and maxes == [7.0]
    assert metrics["step_time_s"] == pytest.approx(0.5)
    assert metrics["samples_per_s"] == pytest.approx(128.0)
    assert metrics["tokens_per_s"] == pytest.approx(1024.0)
    assert metrics["mfu"] == pytest.approx(128 * 1e6 / 1e9)
    assert metrics["data_wait_frac"] == pytest.approx(0.2)
    assert metrics["step_forward_frac"] == pytest.approx(0.8)
    assert sum(metrics[f"step_{p}_frac"] for p in PHASES) + metrics["step_other_frac"] == 1.0
    assert metrics["mem_rss_bytes"] > 0


def test_mfu_never_exceeds_one_and_an_underestimated_peak_is_raised() -> None:
    now = Ticks()
    # A peak measured low (a busy start-up): 128 samples/s x 1e6 FLOP is 1.28e8 FLOP/s.
    m = meter(
        now, Rates(global_batch=64, flops_per_sample=1e6, tokens_per_sample=0, peak_flops=1e8)
    )
    for expected in (1.0, 0.5):
        for _ in range(4):
            with m.clock.phase("forward"):
                now.t += 0.5 / expected  # the second interval runs at half the speed
            m.clock.count_step(64)
        _, metrics, _ = m.reduce(m.rotate().times, [], [])
        assert metrics["mfu"] == pytest.approx(expected)  # against the achieved 1.28e8
    assert m.rates.peak_flops == pytest.approx(1.28e8)


def test_no_mfu_where_the_peak_or_the_flops_are_unknown() -> None:
    now = Ticks()
    m = meter(
        now, Rates(global_batch=8, flops_per_sample=0.0, tokens_per_sample=0, peak_flops=None)
    )
    now.t += 1.0
    m.clock.count_step(8)
    _, metrics, _ = m.reduce(m.rotate().times, [], [])
    assert "mfu" not in metrics and "tokens_per_s" not in metrics


def test_console_line_shows_progress_rate_and_eta() -> None:
    m = {
        "train_loss": 1.25,
        "lr": 3e-4,
        "samples_per_s": 1234.0,
        "data_wait_frac": 0.03,
        "step_time_s": 0.5,
        "mfu": 0.066,
    }
    line = console_line(m, epoch=1, step=25, total_steps=145)
    expected = "epoch 1 step 25/145 loss 1.2500 lr 3.00e-04 1,234 samples/s mfu 6.6% data wait 3%"
    assert line.split() == [*expected.split(), "eta", "1:00"]
