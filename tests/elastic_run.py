"""An elastic run on a multi-node local cluster whose nodes arrive during the run.

    python tests/elastic_run.py WORKDIR

The head holds one worker; one more single-CPU node joins once the first checkpoint
exists. Prints the world sizes the run logged, one per line, as ``world_size N``.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def add_nodes_after_first_checkpoint(cluster: object, runs: Path, n: int) -> None:
    deadline = time.monotonic() + 300
    while not list(runs.glob("elastic/checkpoint-step*")) and time.monotonic() < deadline:
        time.sleep(0.5)
    for _ in range(n):
        cluster.add_node(num_cpus=1)  # type: ignore[attr-defined]


def main(work: Path) -> None:
    from ray.cluster_utils import Cluster

    from raylift.config import load_config
    from raylift.launch import WORKER_ENV, train

    os.chdir(work)
    os.environ.update(WORKER_ENV)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    os.environ["RAY_ADDRESS"] = cluster.address
    cfg = load_config(
        REPO / "configs" / "quickstart.yaml",
        [
            "name=elastic",
            "scaling.num_workers=[1,2]",
            "scaling.resize_interval_s=2",
            "train.max_failures=4",
            "train.max_epochs=60",
            "train.early_stopping=null",
            "checkpoint.every_n_steps=20",
            f"storage={work / 'runs'}",
        ],
    )
    import ray

    ray.init(address=cluster.address, runtime_env={"env_vars": dict(WORKER_ENV)})
    # Ray adds nodes only from the main thread: the run goes to a thread of its own.
    outcome: dict[str, object] = {}
    run = threading.Thread(target=lambda: outcome.update(result=train(cfg)), daemon=True)
    run.start()
    add_nodes_after_first_checkpoint(cluster, work / "runs", 1)
    run.join()
    ray.shutdown()
    cluster.shutdown()
    if "result" not in outcome:
        raise SystemExit("the elastic run failed; its error is above")
    result: Any = outcome["result"]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=result.tracking_uri)
    for m in client.get_metric_history(result.run_id, "world_size"):
        print(f"world_size {int(m.value)} step {m.step}")
    for m in client.get_metric_history(result.run_id, "global_batch"):
        print(f"global_batch {int(m.value)} step {m.step}")
    print(f"final step {int(result.metrics['step'])} val_acc {result.metrics['val_acc']:.4f}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
