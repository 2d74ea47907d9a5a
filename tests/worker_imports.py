"""What a DDP worker has imported once it has trained: run in a fresh interpreter by
tests/unit/test_worker_imports.py (``python -m tests.worker_imports CONFIG``), which prints
the top-level packages in ``sys.modules`` as JSON.

It joins a process group of one, imports the module Ray Train runs in each worker (with
every raylift module it uses: the shard stream, the tracking actor's client), and trains
two steps of CONFIG under DDP with the worker's trainer, on the task's rows in memory."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch.distributed as dist


def main(config: str) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="raylift-imports-"))
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
    import raylift.run.worker  # noqa: F401  what Ray Train runs in each worker
    from raylift.validation import load_config
    from tests.helpers import ListTracker, LocalReporter, make_trainer

    cfg = load_config(config, ["train.max_steps=2", "strategy.name=ddp", f"storage={tmp}"])
    make_trainer(cfg, 0, 1, LocalReporter(tmp / "checkpoints"), ListTracker()).run()
    dist.destroy_process_group()
    print(json.dumps(sorted({m.split(".")[0] for m in sys.modules if not m.startswith("_")})))


if __name__ == "__main__":
    main(sys.argv[1])
