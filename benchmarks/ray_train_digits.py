"""The hand-written DDP job of ``ddp_digits.py`` under a bare Ray Train ``TorchTrainer``.

    python benchmarks/ray_train_digits.py --steps 100 [--cuda]

What any Ray Train job pays before its first step, with nothing of raylift: Ray's
start (or, with ``RAY_ADDRESS``, joining a running Ray), Train's controller and its
placement group, 2 worker processes importing Ray Train and torch, and the process
group. ``benchmarks/launch.py`` runs it beside torchrun and ``raylift train``. Rank 0
prints the wall clock of its first optimizer step (``first_step_at``), as under torchrun,
and of its entry into the training function (``loop_at``); the driver, of the end of its
imports and Ray's start or connect (``connected_at``).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def loop(config: dict[str, Any]) -> None:
    import ray.train

    sys.path.insert(0, config["here"])
    from ddp_digits import train

    if ray.train.get_context().get_world_rank() == 0:
        print(f"loop_at {time.time():.3f}", flush=True)  # the process group is up
    os.environ["LOCAL_RANK"] = str(ray.train.get_context().get_local_rank())
    train(config["steps"], config["batch_size"], config["cuda"])


def main() -> None:
    sys.path.insert(0, str(HERE))
    from ddp_digits import parse_args

    args = parse_args("worker")
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    # RAY_ADDRESS set: join that Ray; else start one, as raylift does (never another's).
    ray.init(address=os.environ.get("RAY_ADDRESS") or "local", logging_level="ERROR")
    print(f"connected_at {time.time():.3f}", flush=True)  # imports done, Ray joined
    config = {"here": str(HERE), "steps": args.steps, "batch_size": args.batch_size}
    trainer = TorchTrainer(
        loop,
        train_loop_config={**config, "cuda": args.cuda},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=args.cuda),
        run_config=RunConfig(storage_path=tempfile.mkdtemp(prefix="rl-bare-train-")),
    )
    trainer.fit()
    ray.shutdown()


if __name__ == "__main__":
    main()
