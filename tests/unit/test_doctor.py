"""The doctor's verdicts, suggestions, trace reading and chart, without Ray."""

from __future__ import annotations

from pathlib import Path

import pytest

from raylift.commands.doctor import PREFIX, diagnose, doctor_config, draw_chart
from tests.helpers import make_config


def measured(**fracs: float) -> dict[str, float]:
    """A doctor run's metrics: the given step fractions, the rest in forward/backward."""
    base = {"data_wait": 0.02, "h2d": 0.01, "optimizer": 0.1, "sync": 0.02, "other": 0.05}
    base.update(fracs)
    rest = max(1.0 - sum(base.values()), 0.0)
    base.setdefault("forward", rest / 3)
    base.setdefault("backward", rest * 2 / 3)
    m = {f"{PREFIX}step_{k}_frac": v for k, v in base.items()}
    m[PREFIX + "data_wait_frac"] = base["data_wait"]
    m.update({PREFIX + "samples_per_s": 1000.0, PREFIX + "step_time_s": 0.05})
    m.update({PREFIX + "peak_fp32_flops": 1e11, PREFIX + "peak_bf16_flops": 2e11})
    m.update({PREFIX + "host_mem_bytes": 16e9, PREFIX + "world_size": 2.0})
    m[PREFIX + "mem_rss_bytes"] = 1e9
    return m


@pytest.mark.parametrize(
    "metrics, config, verdict, first",
    [
        (
            measured(data_wait=0.5),
            {"data": {"prefetch_batches": 0}},
            "input-bound",
            "data.prefetch_batches",
        ),
        (
            measured(sync=0.4),
            {"train": {"log_every_n_steps": 1}},
            "host-sync-bound",
            "train.log_every_n_steps",
        ),
        (
            {**measured(), PREFIX + "profiled_comm_frac": 0.5},
            {},
            "communication-bound",
            "train.grad_accum",
        ),
        (
            {**measured(), PREFIX + "mem_rss_bytes": 7.5e9},
            {},
            "memory-bound",
            "strategy.activation_checkpointing",
        ),
        (measured(other=0.5), {}, "cpu-bound", "data.batch_size"),
        (measured(), {"precision": "32"}, "compute-bound", "precision"),
        (measured(), {"precision": "bf16-mixed"}, "compute-bound", "data.batch_size"),
    ],
)
def test_each_bottleneck_gets_its_verdict_and_a_config_change_first(
    metrics: dict[str, float], config: dict, verdict: str, first: str
) -> None:
    d = diagnose(metrics, make_config(**config))
    assert d.verdict == verdict
    assert d.suggestions[0].key == first
    gains = [s.gain for s in d.suggestions if s.key != "code"]
    assert gains == sorted(gains, reverse=True)  # ranked by expected gain
    assert all(s.gain >= 0.9 for s in d.suggestions)
    assert f"forward {metrics[PREFIX + 'step_forward_frac']:.0%}" in d.evidence[0]


def test_bf16_on_a_device_without_fast_bf16_suggests_fp32() -> None:
    m = {**measured(), PREFIX + "peak_bf16_flops": 2e10}  # bf16 at a fifth of fp32
    d = diagnose(m, make_config(precision="bf16-mixed"))
    assert (d.suggestions[0].key, d.suggestions[0].value) == ("precision", "32")


def test_code_changes_come_after_config_changes() -> None:
    class WithTransform:
        def transform(self, cols: dict, rng: object) -> dict:
            return cols

    d = diagnose(measured(data_wait=0.6), make_config(), WithTransform())
    keys = [s.key for s in d.suggestions]
    assert "code" in keys and keys.index("code") == len(keys) - 1
    assert max(s.gain for s in d.suggestions) == d.suggestions[-1].gain  # biggest, but code


def test_chart_is_a_png_of_the_breakdown(tmp_path: Path) -> None:
    import matplotlib.image

    d = diagnose(measured(sync=0.4), make_config())
    path = draw_chart(d, measured(sync=0.4), tmp_path / "breakdown.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)
    assert image.shape[:2] == (418, 1100)  # 10 x 3.8 inches at 110 dpi
    assert image[..., :3].std() > 0.1  # something drawn, not a blank canvas


def test_doctor_config_is_a_fresh_short_run_of_the_same_config() -> None:
    cfg = make_config(name="mine", train={"max_epochs": 3, "log_every_n_steps": 7})
    run = doctor_config(cfg, 20)
    assert run.name.startswith("mine-doctor-")
    assert run.train.max_steps == 60 and run.train.early_stopping is None
    assert run.train.log_every_n_steps == 7  # logging is part of what is measured
    assert run.checkpoint.every_n_steps is None
    assert (run.strategy, run.precision, run.data) == (cfg.strategy, cfg.precision, cfg.data)
