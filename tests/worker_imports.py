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

# Libraries a run imports only where it uses them: a strategy, a task or an adapter that
# needs one, or the driver (MLflow's client; a worker logs through the tracking actor).
NOT_FOR_DDP = {"deepspeed", "fairscale", "transformers", "peft", "mlflow", "safetensors",
               "datasets", "huggingface_hub", "sklearn", "tokenizers"}  # fmt: skip
# Every package a DDP worker of the quickstart may hold: Ray's, torch's and raylift's own
# (xxhash checksums its checkpoints).
DDP_WORKER = set(sys.stdlib_module_names) | {
    "raylift", "tests", "torch", "torchgen", "sympy", "mpmath", "numpy", "ray", "pandas",
    "pyarrow", "fsspec", "dateutil", "six", "yaml", "psutil", "packaging", "filelock",
    "cloudpickle", "msgpack", "google", "pydantic", "pydantic_core", "annotated_types",
    "typing_extensions", "typing_inspection", "anyio", "starlette", "click", "colorama",
    "colorful", "colorful_orig", "rich", "requests", "urllib3", "idna", "certifi",
    "charset_normalizer", "jsonschema", "jsonschema_specifications", "referencing", "rpds",
    "rfc3339_validator", "jsonpointer", "attr", "attrs", "tqdm", "wcwidth", "cython_runtime",
    "xxhash",
}  # fmt: skip


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
