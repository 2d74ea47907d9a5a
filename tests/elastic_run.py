"""An elastic run on a multi-node local cluster that loses a node and gets one back.

    python tests/elastic_run.py WORKDIR

The head and one more node hold one worker each, so the run starts on 2. Once the
first checkpoint exists the second node is removed (its worker dies with it): the
run restarts on 1 worker from that checkpoint. Once that smaller run has written a
checkpoint of its own, a node joins again and the run grows back to 2. Prints the
world sizes and global batches the run logged, one per line, and its final step.

Until the run has grown back, every batch waits while a hold file exists: the run
cannot finish before the cluster changes however fast this machine trains, and once
the hold is lifted the rest of it runs at full speed.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from raylift.tasks.digits import DigitsTask

Columns = dict[str, np.ndarray]

REPO = Path(__file__).resolve().parents[1]
EPOCHS = 15
HOLD_S = 0.05  # per batch while held: sets a floor on the run's length, not a duration


class HeldDigits(DigitsTask):
    """Digits whose batches wait ``HOLD_S`` while the file ``hold`` exists."""

    def __init__(self, hold: str = "", hold_s: float = HOLD_S, **kwargs: Any):
        super().__init__(**kwargs)
        self.hold, self.hold_s = Path(hold), hold_s

    def transform(self, batch: Columns, rng: np.random.Generator) -> Columns:
        if self.hold.exists():
            time.sleep(self.hold_s)
        return batch


def checkpoints(runs: Path) -> list[int]:
    return sorted(int(p.name[15:]) for p in runs.glob("elastic/checkpoint-step*"))


def wait_for(what: str, done: Any, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.25)


def lose_a_node_then_add_one(
    cluster: Any, node: Any, runs: Path, run: threading.Thread, hold: Path
) -> None:
    wait_for("the first checkpoint", lambda: checkpoints(runs) or not run.is_alive())
    at_loss = max(checkpoints(runs), default=0)
    cluster.remove_node(node)
    print(f"removed a node after checkpoint step {at_loss}", flush=True)
    seen: dict[int, int] = {}
    wait_for(
        "a checkpoint of the smaller run", lambda: 1 in worlds(runs, seen) or not run.is_alive()
    )
    cluster.add_node(num_cpus=1)
    print("added a node", flush=True)
    wait_for(
        "a checkpoint of the regrown run", lambda: grown(worlds(runs, seen)) or not run.is_alive()
    )
    hold.unlink()
    print("lifted the hold", flush=True)


def grown(seen: dict[int, int]) -> bool:
    """A checkpoint at 2 workers came after the last one at 1."""
    return seen.get(2, 0) > seen.get(1, 0) > 0


def worlds(runs: Path, seen: dict[int, int]) -> dict[int, int]:
    """``seen`` updated with the last step each world size wrote a complete checkpoint at
    (old checkpoints are pruned, so it keeps what earlier calls saw)."""
    import torch

    for done in runs.glob("elastic/checkpoint-step*/complete-rank0.json"):
        state = torch.load(done.parent / "loop_state.pt", weights_only=True)
        world, step = int(state["world_size"]), int(done.parent.name[15:])
        seen[world] = max(seen.get(world, 0), step)
    return seen


def main(work: Path) -> None:
    # Restart smaller soon after a loss instead of waiting a minute for the lost worker.
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = "10"
    from ray.cluster_utils import Cluster

    from raylift.config import load_config
    from raylift.launch import WORKER_ENV, train

    os.chdir(work)
    os.environ.update(WORKER_ENV)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    extra = cluster.add_node(num_cpus=1)
    os.environ["RAY_ADDRESS"] = cluster.address
    runs = work / "runs"
    hold = work / "hold"
    hold.touch()
    cfg = load_config(
        REPO / "configs" / "quickstart.yaml",
        [
            "name=elastic",
            "task=tests.elastic_run:HeldDigits",
            f"task_args.hold={hold}",
            "scaling.num_workers=[1,2]",
            "scaling.resize_interval_s=2",
            "train.max_failures=4",
            f"train.max_epochs={EPOCHS}",
            "train.early_stopping=null",
            "checkpoint.every_n_steps=20",
            "train.log_every_n_steps=10",
            f"storage={runs}",
        ],
    )
    import ray

    env = {**WORKER_ENV, "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "10"}
    ray.init(address=cluster.address, runtime_env={"env_vars": env})
    wait_for("both nodes", lambda: len([n for n in ray.nodes() if n["Alive"]]) == 2, 60)
    # Ray adds and removes nodes only from the main thread: the run goes to a thread.
    outcome: dict[str, object] = {}
    run = threading.Thread(target=lambda: outcome.update(result=train(cfg)), daemon=True)
    run.start()
    lose_a_node_then_add_one(cluster, extra, runs, run, hold)
    run.join()
    ray.shutdown()
    cluster.shutdown()
    if "result" not in outcome:
        raise SystemExit("the elastic run failed; its error is above")
    report(outcome["result"])


def report(result: Any) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=result.tracking_uri)
    for m in client.get_metric_history(result.run_id, "world_size"):
        print(f"world_size {int(m.value)} step {m.step}")
    for m in client.get_metric_history(result.run_id, "global_batch"):
        print(f"global_batch {int(m.value)} step {m.step}")
    tags = client.get_run(result.run_id).data.tags
    for key in sorted(k for k in tags if k.startswith("raylift.restart.")):
        print(f"restart {key}: {tags[key]}")
    print(f"final step {int(result.metrics['step'])} val_acc {result.metrics['val_acc']:.4f}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
