"""What each of 2 workers holds of a model too large to copy freely: peak RSS against the plan.

    python benchmarks/memory.py [--d-model 1024] [--layers 8] [--zero-d-model 640 --zero-layers 10]
        [--part all|peaks|zero]

Part 1, peak host memory: a gpt of about ``12 * layers * d_model**2`` parameters (100M
by default: 400 MiB of fp32 weights), SGD with momentum (one state tensor per
parameter: DDP holds 3x the weights, a half share 1.5x), 3 steps on 2 CPU ranks
over gloo, under ``ddp``, ``fsdp`` and ``deepspeed`` ZeRO-3. Each rank's peak RSS
above its resident set before the model was built (``VmHWM`` after a reset; imports
and data are in the baseline) is compared with what ``raylift plan`` predicts for one
rank (model states, the sharding strategies' gathered blocks and buckets, and
activations), with the full model's fp32 weights, and with the full training state
DDP holds (weights, gradients, momentum).

Part 2, ZeRO's accounting: a gpt of at least 50M parameters with fp32 AdamW under
``ddp`` and ZeRO-1/2/3 (ZeRO-1 also with ``grad_accum: 2``), the model-state bytes
rank 0 holds after its first step (counted from the tensors) as a fraction of DDP's,
against the ZeRO paper's 0.75, 0.625 and 0.5 for 2 ranks.

Each measured run follows a tiny warm-up run of the same strategy in the same
process, so the code it imports is in the baseline.

Memory, not time: the numbers do not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from machine import describe  # noqa: E402
from results import save  # noqa: E402

sys.path.insert(0, str(REPO))
from raylift.core.parsing import merge  # noqa: E402
from raylift.run.plan import count_params  # noqa: E402
from tests.helpers import config_from_dict  # noqa: E402
from tests.memory import (  # noqa: E402
    MIB,
    ZERO3,
    full_model_bytes,
    gpt_config,
    measure,
    planned_bytes,
)

PEAKS = {
    "ddp": {"name": "ddp"},
    "fsdp": {"name": "fsdp"},
    "zero3": {"name": "deepspeed", "zero_stage": 3, "config": ZERO3},
}
# name -> (strategy, the paper's share of DDP's bytes, train.grad_accum). DeepSpeed's
# stage 1 reduces gradients to the partition inside backward when every micro-batch is
# an optimizer step, as stage 2 does; it keeps them whole only between the micro-batches
# of an accumulation, the case the paper's 0.75 describes: measured both ways.
ZERO = {
    "ddp": ({"name": "ddp"}, 1.0, 1),
    "zero1": ({"name": "deepspeed", "zero_stage": 1}, 0.75, 1),
    "zero1-accum2": ({"name": "deepspeed", "zero_stage": 1}, 0.75, 2),
    "zero2": ({"name": "deepspeed", "zero_stage": 2}, 0.625, 1),
    "zero3": ({"name": "deepspeed", "zero_stage": 3, "config": ZERO3}, 0.5, 1),
}


def peaks(d_model: int, layers: int) -> None:
    runs = {name: gpt_config(s, d_model, layers) for name, s in PEAKS.items()}
    found = measure(list(runs.values()))
    cfg = config_from_dict(runs["ddp"])
    full = full_model_bytes(cfg)
    print(
        f"\npeak RSS per rank: gpt of {count_params(cfg) / 1e6:.1f}M parameters "
        f"({full / MIB:.0f} MiB of fp32 weights), SGD + momentum, 2 ranks, MiB above the "
        "resident set before the build"
    )
    print(
        f"{'strategy':<10}{'rank 0':>9}{'rank 1':>9}{'plan':>9}{'peak/plan':>11}"
        f"{'/weights':>10}{'/DDP state':>12}"
    )
    rows = []
    for (name, cfg_dict), ranks in zip(runs.items(), found, strict=True):
        plan = planned_bytes(config_from_dict(cfg_dict))["total"]
        grew = [r["peak"] - r["base"] for r in ranks]
        worst = max(grew)
        print(
            f"{name:<10}{grew[0] / MIB:>9.0f}{grew[1] / MIB:>9.0f}{plan / MIB:>9.0f}"
            f"{worst / plan:>10.2f}x{worst / full:>9.2f}x{worst / (3 * full):>11.2f}x"
        )
        rows.append([name, f"{grew[0] / MIB:.0f}", f"{grew[1] / MIB:.0f}", f"{plan / MIB:.0f}",
                     f"{worst / plan:.2f}x", f"{worst / (3 * full):.2f}x"])  # fmt: skip
    fsdp = next(r for r in rows if r[0] == "fsdp")
    save(
        "memory.py",
        f"peak host memory per rank against the plan (gpt of {count_params(cfg) / 1e6:.0f}M "
        "parameters, SGD + momentum, 2 ranks)",
        ["strategy", "rank 0 MiB", "rank 1 MiB", "plan MiB", "peak / plan", "of DDP's state"],
        rows,
        {"what": f"peak RSS per rank, {count_params(cfg) / 1e6:.0f}M-parameter gpt, fsdp",
         "raylift": f"{max(float(fsdp[1]), float(fsdp[2])):.0f} MiB",
         "baseline": f"the plan {fsdp[3]} MiB", "ratio": fsdp[4]},
    )  # fmt: skip


def zero_accounting(d_model: int, layers: int) -> None:
    runs = {
        name: merge(gpt_config(s, d_model, layers, optim="adamw"), {"train": {"grad_accum": ga}})
        for name, (s, _, ga) in ZERO.items()
    }
    found = measure(list(runs.values()))
    n = count_params(config_from_dict(runs["ddp"]))
    ddp = found[0][0]["states"]["model_state_bytes_per_rank"]
    print(
        f"\nmodel-state bytes rank 0 holds: gpt of {n / 1e6:.1f}M parameters, fp32 AdamW, 2 ranks"
    )
    print(f"{'strategy':<14}{'MiB':>9}{'of DDP':>9}{'ZeRO paper':>12}{'off by':>9}")
    for (name, (_, paper, _)), ranks in zip(ZERO.items(), found, strict=True):
        held = ranks[0]["states"]["model_state_bytes_per_rank"]
        ratio = held / ddp
        print(f"{name:<14}{held / MIB:>9.0f}{ratio:>9.3f}{paper:>12.3f}{ratio / paper - 1:>+8.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--zero-d-model", type=int, default=640)
    parser.add_argument("--zero-layers", type=int, default=10)
    parser.add_argument("--part", choices=("all", "peaks", "zero"), default="all")
    opts = parser.parse_args()
    print(describe())
    if opts.part in ("all", "peaks"):
        peaks(opts.d_model, opts.layers)
    if opts.part in ("all", "zero"):
        zero_accounting(opts.zero_d_model, opts.zero_layers)


if __name__ == "__main__":
    main()
