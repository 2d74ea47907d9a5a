"""The doctor's probe inside the loop: its windows, the trace it writes, how it counts syncs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from raylift.commands.doctor import doctor_config
from raylift.run.probe import PREFIX, DoctorProbe, trace_stats
from tests.helpers import ListTracker, LocalReporter, make_config, make_trainer


def test_trace_stats_count_host_syncs_but_not_the_optimizers_step_counters() -> None:
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(4, 8)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()  # reads its step counter with .item() on the CPU: not a sync
            opt.zero_grad()
            loss.item()  # the per-step sync the guides warn about
    stats = trace_stats(prof, 5, 1.0)
    assert stats["syncs_per_step"] == pytest.approx(1.0)
    assert stats["profiled_comm_frac"] == 0.0


def test_probe_measures_a_window_then_profiles_one_and_writes_the_trace(tmp_path: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        cfg = doctor_config(make_config(train={"log_every_n_steps": 5}), 5)
        tracker = ListTracker()
        trainer = make_trainer(cfg, 0, 1, LocalReporter(tmp_path / "ck"), tracker)
        trainer.ctx.probe = DoctorProbe(5, str(tmp_path / "doctor"))
        final = trainer.run()
    finally:
        dist.destroy_process_group()
    assert trainer.state.step == 15
    assert final[PREFIX + "samples_per_s"] > 0
    assert final[PREFIX + "steps"] == 5.0
    assert final[PREFIX + "syncs_per_step"] >= 0
    assert 0 < final[PREFIX + "step_forward_frac"] < 1
    trace = json.loads((tmp_path / "doctor" / "trace-rank0.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::linear" in names or "aten::addmm" in names
    assert tracker.artifacts == ["doctor/trace-rank0.json"]
