"""Step time and model-state bytes per rank of every strategy on a gpt config, world size 2.

    python benchmarks/strategies.py [--config configs/gpt-tiny.yaml] [--steps 40]
        [--precision bf16-mixed] [--only fsdp zero3]

Runs the real per-worker loop in 2 processes over gloo (no Ray: the same data order
for every strategy), logging every 10 steps. The step time is the median of the
logged intervals after the first (warm-up); model-state bytes are what rank 0 holds
after its first step (parameters, gradients, optimizer state; counted from the
tensors). Prints a table with both, and each as a ratio to DDP.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from machine import describe  # noqa: E402

sys.path.insert(0, str(REPO))
# DeepSpeed's CPU Adam (offload) is compiled once; share the tests' cache of it.
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "raylift-tests" / "torch_extensions")
)

from raylift.config import config_from_dict, load_config  # noqa: E402
from tests.helpers import ListTracker, LocalReporter, make_trainer, run_ranks  # noqa: E402

LOG_EVERY = 10
STRATEGIES = {
    "ddp": ["strategy.name=ddp"],
    "fsdp": ["strategy.name=fsdp"],
    "fairscale": ["strategy.name=fairscale"],
    "zero1": ["strategy.name=deepspeed", "strategy.zero_stage=1"],
    "zero2": ["strategy.name=deepspeed", "strategy.zero_stage=2"],
    "zero3": ["strategy.name=deepspeed", "strategy.zero_stage=3"],
    "zero3+offload": ["strategy.name=deepspeed", "strategy.zero_stage=3", "strategy.offload=true"],
}


def measure(rank: int, world: int, cfg_dict: dict, out: str) -> None:
    cfg = config_from_dict(cfg_dict)
    tracker = ListTracker()
    trainer = make_trainer(cfg, rank, world, LocalReporter(Path(out).parent / f"r{rank}"), tracker)
    trainer.run()
    if rank == 0:
        steps = tracker.series("step_time_s")
        torch.save({"step_time_s": [steps[s] for s in sorted(steps)][1:], **trainer.memory}, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "gpt-tiny.yaml"))
    parser.add_argument("--steps", type=int, default=40, help="a multiple of 10")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--only", nargs="*", default=list(STRATEGIES), help="strategies to run")
    opts = parser.parse_args()
    common = [
        f"train.max_steps={opts.steps}",
        f"train.log_every_n_steps={LOG_EVERY}",
        "train.eval_every_n_steps=null",
        f"precision={opts.precision}",
        "checkpoint.every_n_steps=null",
    ]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in STRATEGIES.items():
            if name != "ddp" and name not in opts.only:
                continue
            cfg = load_config(opts.config, [*common, *overrides])
            out = Path(tmp) / name / "m.pt"
            run_ranks(2, Path(tmp), measure, cfg.to_dict(), str(out))
            results[name] = torch.load(out, weights_only=True)
            ms = statistics.median(results[name]["step_time_s"]) * 1e3
            print(f"{name}: {ms:.1f} ms per step", flush=True)
    report(results, opts)


def report(results: dict, opts: argparse.Namespace) -> None:
    def step(name: str) -> float:
        return statistics.median(results[name]["step_time_s"])

    def held(name: str) -> float:
        return results[name]["model_state_bytes_per_rank"]

    print(
        f"\n{Path(opts.config).name}, world size 2, {opts.precision}, {opts.steps} steps "
        f"(median of {opts.steps // LOG_EVERY - 1} intervals of {LOG_EVERY}); "
        f"{describe()}"
    )
    print(
        f"{'strategy':<15}{'step (ms)':>11}{'vs ddp':>8}{'model state MiB/rank':>23}{'vs ddp':>8}"
    )
    for name in results:
        print(
            f"{name:<15}{step(name) * 1e3:>11.1f}{step(name) / step('ddp'):>7.2f}x"
            f"{held(name) / 2**20:>23.2f}{held(name) / held('ddp'):>7.2f}x"
        )


if __name__ == "__main__":
    main()
