"""Nothing on raylift's step path that a hand-written loop would not pay: kernel launches
and host syncs per step counted with the profiler (on CPU, each computing operator is
what would be a kernel launch on a GPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from raylift.run.loop import seed_everything
from raylift.run.probe import launches, syncs
from raylift.tasks import build_task
from raylift.tensors.optim import param_groups
from raylift.tensors.precision import resolve_precision
from tests.helpers import ListTracker, LocalReporter, init_pg, make_config, make_trainer, tensors

GPT = {
    "task": "gpt",
    "task_args": {"n_layer": 2, "d_model": 64, "n_head": 2, "block_size": 32, "max_bytes": 200000},
    "data": {"batch_size": 8},
    "precision": "32",
    "optim": {"warmup_steps": 0},
    "train": {"eval_every_n_steps": None, "max_epochs": 1, "grad_clip": 1.0},
    "checkpoint": {"every_n_steps": None},
}
START = 20  # steps before the counted window (warm-up, the model-state log at step 1): a log


class WindowTracker(ListTracker):
    """Profiles from the interval log at ``START`` to the next one: ``every`` steps and
    exactly one logging interval's end (its reduce and its sync)."""

    def __init__(self, every: int):
        super().__init__()
        self.every = every
        self.prof = profile(activities=[ProfilerActivity.CPU])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        super().log_metrics(metrics, step)
        if "train_loss" in metrics and step == START:
            self.prof.start()
        elif "train_loss" in metrics and step == START + self.every:
            self.prof.stop()


def raylift_counts(tmp: Path, every: int, data: dict[str, Any]) -> tuple[int, int]:
    train = {**GPT["train"], "log_every_n_steps": every, "max_steps": START + every}
    cfg = make_config(**{**GPT, "train": train})
    tracker = WindowTracker(every)
    make_trainer(cfg, 0, 1, LocalReporter(tmp), tracker, data).run()
    return launches(tracker.prof), syncs(tracker.prof)


def plain_counts(steps: int, data: dict[str, Any]) -> tuple[int, int]:
    """A hand-written single-device loop on the same model and batches (raylift, too,
    wraps nothing at world size 1): autocast, clip, ``zero_grad(set_to_none=True)``, no
    per-step sync."""
    cfg = make_config(**GPT)
    task = build_task(cfg.task, cfg.task_args)
    seed_everything(0)
    model = task.build_model()
    # Decay on matrices only, as nanoGPT and raylift do.
    opt = torch.optim.AdamW(param_groups(model.named_parameters(), 0.01), lr=1e-3)
    precision = resolve_precision(cfg.precision)
    b = cfg.data.batch_size

    def step(i: int) -> None:
        raw = {k: v[i * b : (i + 1) * b] for k, v in data["train"].items()}
        with precision.autocast(torch.device("cpu")):
            loss = task.loss(model, task.finish(raw, precision.input_dtype))
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for i in range(START):
        step(i)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(START, START + steps):
            step(i)
    return launches(prof), syncs(prof)


@pytest.mark.slow
def test_launches_and_syncs_per_step_match_a_hand_written_loop(tmp_path: Path) -> None:
    init_pg(0, 1, str(tmp_path / "pg"))
    try:
        data = tensors(build_task("gpt", GPT["task_args"]))
        (r10, s10), (r20, s20) = (raylift_counts(tmp_path / f"r{n}", n, data) for n in (10, 20))
        (p10, q10), (p20, q20) = (plain_counts(n, data) for n in (10, 20))
    finally:
        torch.distributed.destroy_process_group()
    ours, theirs = (r20 - r10) / 10, (p20 - p10) / 10
    assert theirs > 50  # the count sees the model's work
    # Per step: no more than the hand-written loop launches.
    assert ours <= theirs + 0.1, (ours, theirs)
    # Per logging interval: a constant (sum and check the kept losses, one collective
    # of times and losses, one of maxima), whatever the interval's length.
    per_interval = (r10 - p10) - 10 * (ours - theirs)
    assert per_interval <= 40, per_interval
    print(f"launches per step: raylift {ours}, hand-written {theirs}; per interval {per_interval}")
    # Syncs: none per step in either loop; raylift's few are the interval's log.
    assert q10 == q20 == 0
    assert s10 == s20 <= 4
