"""No rank holds more of the model than its share: each worker's peak RSS, measured in
fresh processes, against what ``raylift plan`` predicts for it (benchmarks/memory.py
runs the same at 100M parameters)."""

from __future__ import annotations

import pytest

from tests.helpers import config_from_dict
from tests.memory import ZERO3, full_model_bytes, gpt_config, measure, planned_bytes

STRATEGIES = {
    "ddp": {"name": "ddp"},
    "fsdp": {"name": "fsdp"},
    "zero3": {"name": "deepspeed", "zero_stage": 3, "config": ZERO3},
}


@pytest.mark.slow
def test_sharded_workers_peak_at_their_planned_share() -> None:
    # 25M parameters, 98 MiB of fp32 weights; SGD with momentum: DDP holds 3x that.
    runs = {name: gpt_config(s, d_model=640, n_layer=5) for name, s in STRATEGIES.items()}
    found = dict(zip(runs, measure(list(runs.values())), strict=True))
    full = full_model_bytes(config_from_dict(runs["ddp"]))
    ddp_state = 3 * full
    peaks = {name: max(r["peak"] - r["base"] for r in ranks) for name, ranks in found.items()}
    plan = {n: planned_bytes(config_from_dict(runs[n]))["total"] for n in ("fsdp", "zero3")}
    print({n: f"{peaks[n] / 2**20:.0f} MiB" for n in peaks}, {n: plan[n] / 2**20 for n in plan})
    for name in ("fsdp", "zero3"):
        assert 0.75 * plan[name] <= peaks[name] <= 1.25 * plan[name], (name, peaks, plan)
    assert peaks["fsdp"] < ddp_state, (peaks, ddp_state)
    # ZeRO-3's fixed transients weigh more at this size: under DDP's full state from
    # about 100M parameters (benchmarks/memory.py: 0.79x); here under DDP's own peak.
    assert peaks["zero3"] < peaks["ddp"], peaks
    assert peaks["ddp"] >= full, (peaks["ddp"], full)
    assert peaks["ddp"] > 1.5 * peaks["fsdp"], peaks
