"""raylift's per-worker loop against a plain hand-written PyTorch loop, one process.

    python benchmarks/overhead.py [--steps 60] [--repeats 5] [--precision bf16-mixed]

Same task (configs/gpt-tiny.yaml's model, smaller corpus), same data in memory, same
batch, precision, optimizer and clipping. Both loops keep their batches as uint8 and
finish them on the device. Each repeat times ``--steps`` optimizer steps after a warm-up;
the loops alternate so both see the same machine load. raylift logs every 20 steps, as
configs/gpt-tiny.yaml does (each log is one host sync). Prints the median step time of
each, their ratio, and the median of the per-repeat ratios raylift / plain (goal: <= 1.03).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from machine import describe  # noqa: E402

sys.path.insert(0, str(REPO))

from raylift.config import Config, load_config  # noqa: E402
from raylift.loop import seed_everything  # noqa: E402
from raylift.precision import resolve_precision  # noqa: E402
from raylift.tasks import build_task  # noqa: E402
from tests.helpers import LocalReporter, init_pg, make_trainer, tensors  # noqa: E402

WARMUP = 20


class StepClock:
    """A tracker that notes the wall clock whenever the loop logs a training interval."""

    def __init__(self) -> None:
        self.at: dict[int, float] = {}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if "train_loss" in metrics:
            self.at[step] = time.perf_counter()

    def set_tags(self, tags: dict[str, str]) -> None:
        pass

    def log_artifact(self, path: Path, folder: str) -> None:
        pass


def raylift_step_time(cfg: Config, data: dict, steps: int, tmp: Path) -> float:
    clock = StepClock()
    trainer = make_trainer(cfg, 0, 1, LocalReporter(tmp), clock, data)
    trainer.run()
    return (clock.at[WARMUP + steps] - clock.at[WARMUP]) / steps


def plain_step_time(cfg: Config, data: dict, steps: int) -> float:
    """The loop a user writes by hand: no engine, no hooks, one sync at the end."""
    task = build_task(cfg.task, cfg.task_args)
    seed_everything(cfg.train.seed)
    model: nn.Module = task.build_model()
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay
    )
    precision = resolve_precision(cfg.precision)
    train, b = data["train"], cfg.data.batch_size
    device = torch.device("cpu")
    started = 0.0
    for step in range(WARMUP + steps):
        if step == WARMUP:
            started = time.perf_counter()
        raw = {k: v[step * b : (step + 1) * b] for k, v in train.items()}
        batch = task.finish(raw, precision.input_dtype)
        with precision.autocast(device):
            loss = task.loss(model, batch)
        loss.backward()
        if cfg.train.grad_clip:
            nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    float(loss.detach())  # wait for the last step, as the raylift loop's last log does
    return (time.perf_counter() - started) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="a multiple of 20")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--precision", default="bf16-mixed")
    args = parser.parse_args()
    if args.steps % WARMUP:
        parser.error(f"--steps must be a multiple of {WARMUP}: the loop logs every {WARMUP}")
    total = WARMUP + args.steps
    cfg = load_config(
        REPO / "configs" / "gpt-tiny.yaml",
        [
            f"precision={args.precision}",
            "task_args.max_bytes=1000000",
            f"train.max_steps={total}",
            f"train.log_every_n_steps={WARMUP}",
            "train.eval_every_n_steps=null",
            "optim.warmup_steps=0",
            "checkpoint.every_n_steps=null",
            "scaling.num_workers=1",
        ],
    )
    data = tensors(build_task(cfg.task, cfg.task_args))
    # The raylift loop shuffles nothing here (an in-memory source in storage order).
    rows = len(next(iter(data["train"].values())))
    if rows < total * cfg.data.batch_size:
        raise SystemExit(f"need {total * cfg.data.batch_size} rows, have {rows}")
    ours, plain = [], []
    with tempfile.TemporaryDirectory() as tmp:
        init_pg(0, 1, str(Path(tmp) / "pg"))
        try:
            for r in range(args.repeats):
                plain.append(plain_step_time(cfg, data, args.steps))
                ours.append(raylift_step_time(cfg, data, args.steps, Path(tmp) / f"r{r}"))
                ms = plain[-1] * 1e3, ours[-1] * 1e3
                print(f"repeat {r}: plain {ms[0]:.2f} ms  raylift {ms[1]:.2f} ms", flush=True)
        finally:
            dist.destroy_process_group()
    a, b = statistics.median(ours), statistics.median(plain)
    # Each repeat runs both loops back to back: the ratio within a repeat cancels the
    # machine's drift between repeats (on a shared VM, CPU steal comes and goes).
    paired = statistics.median(o / p for o, p in zip(ours, plain, strict=True))
    print(describe())
    print(
        f"median step time over {args.repeats} repeats of {args.steps} steps "
        f"({cfg.precision}, batch {cfg.data.batch_size}, {torch.get_num_threads()} threads): "
        f"plain {b * 1e3:.2f} ms, raylift {a * 1e3:.2f} ms, ratio {a / b:.3f}; "
        f"median of the per-repeat ratios {paired:.3f}"
    )


if __name__ == "__main__":
    main()
