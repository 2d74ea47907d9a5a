"""Each strategy's loss curve against DDP's on configs/gpt-tiny.yaml (2 workers, same seed).

    python benchmarks/strategy_curves.py [--steps 30] [--precision 32]

Runs the real per-worker loop in 2 processes over gloo (no Ray, so the data order is
identical for every strategy) and prints the largest relative difference of the
per-step training loss against DDP, and the model-state bytes rank 0 holds.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from results import save  # noqa: E402

sys.path.insert(0, str(REPO))

from raylift.validation import load_config  # noqa: E402
from tests.helpers import close_pools, run_ranks, train_and_record  # noqa: E402

STRATEGIES = {
    "ddp": ["strategy.name=ddp"],
    "fsdp": ["strategy.name=fsdp"],
    "fairscale": ["strategy.name=fairscale"],
    "zero1": ["strategy.name=deepspeed", "strategy.zero_stage=1"],
    "zero2": ["strategy.name=deepspeed", "strategy.zero_stage=2"],
    "zero3": ["strategy.name=deepspeed", "strategy.zero_stage=3"],
}


def main() -> None:
    args = argparse.ArgumentParser()
    args.add_argument("--steps", type=int, default=30)
    args.add_argument("--precision", default="32")
    args.add_argument("--only", nargs="*", default=list(STRATEGIES), help="strategies to run")
    args.add_argument("--no-clip", action="store_true", help="train.grad_clip=null")
    opts = args.parse_args()
    common = [
        f"train.max_steps={opts.steps}",
        "train.log_every_n_steps=1",
        "train.eval_every_n_steps=null",
        f"precision={opts.precision}",
        "checkpoint.every_n_steps=null",
        "task_args.dropout=0.0",
        *(["train.grad_clip=null"] if opts.no_clip else []),
    ]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in STRATEGIES.items():
            if name != "ddp" and name not in opts.only:
                continue
            cfg = load_config(REPO / "configs" / "gpt-tiny.yaml", [*common, *overrides])
            out = Path(tmp) / name / "loss.pt"
            try:
                run_ranks(2, Path(tmp), train_and_record, cfg.to_dict(), str(out))
            except BaseException:
                close_pools()  # else the spawned ranks keep the process from exiting
                raise
            results[name] = (
                torch.load(out, weights_only=True),
                torch.load(f"{out}.memory", weights_only=True),
            )
    close_pools()
    ref = results["ddp"][0]
    print(
        f"gpt-tiny, 2 workers, precision {opts.precision}, {opts.steps} steps, "
        f"grad_clip {'off' if opts.no_clip else 'on'}; "
        f"DDP loss {ref[1]:.4f} -> {ref[opts.steps]:.4f}"
    )
    print(f"{'strategy':<10}{'max rel diff vs ddp':>22}{'model state MiB/rank':>24}")
    rows = []
    for name, (curve, memory) in results.items():
        diff = max(abs(curve[s] - ref[s]) / abs(ref[s]) for s in ref)
        mib = memory["model_state_bytes_per_rank"] / 2**20
        print(f"{name:<10}{diff:>22.2e}{mib:>24.2f}")
        rows.append([name, f"{diff:.2e}", f"{mib:.2f}"])
    worst = max(rows[1:], key=lambda r: float(r[1]), default=rows[0])
    clip = "off" if opts.no_clip else "on"
    save(
        __file__,
        f"each strategy's loss curve against DDP's (gpt-tiny, 2 workers, precision "
        f"{opts.precision}, {opts.steps} steps, grad_clip {clip})",
        ["strategy", "max relative difference vs DDP", "model state MiB per rank"],
        rows,
        {
            "what": f"loss curves vs DDP, gpt-tiny, {opts.precision}, {opts.steps} steps, "
            f"clipping {clip}",
            "raylift": f"worst: {worst[0]} {worst[1]}",
            "baseline": f"DDP, loss {ref[1]:.4f} -> {ref[opts.steps]:.4f}",
            "ratio": f"{worst[1]} relative",
        },
        variant="noclip" if opts.no_clip else None,
    )


if __name__ == "__main__":
    main()
