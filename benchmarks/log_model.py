"""What ``tracking.log_model: final`` adds to a run: the trained weights consolidated and
logged as the run's MLflow model, after the last step.

    python benchmarks/log_model.py [--repeats 3] [--d-model 1024] [--layers 8]

Two runs train here on 2 ranks over gloo (CUDA when present), each keeping its final
checkpoint: the quickstart's digits model for its 200 steps, and the 101M-parameter gpt
of ``benchmarks/memory.py`` (d_model 1024, 8 layers) for 3 steps. Then
``raylift.artifacts.mlmodel.log_model`` logs each checkpoint to a local sqlite MLflow store, as the
driver does at a run's end (consolidate, write safetensors, record the config, upload),
``--repeats`` times. Printed: the size logged, the median seconds, and that time as a
share of the training it follows (measured in the same process).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from machine import describe  # noqa: E402
from results import save  # noqa: E402

sys.path.insert(0, str(REPO))
from raylift.artifacts import mlmodel, tracking_service  # noqa: E402
from raylift.core.parsing import merge  # noqa: E402
from raylift.run.launch import record_config  # noqa: E402
from raylift.run.plan import count_params  # noqa: E402
from raylift.validation import load_config  # noqa: E402
from tests.helpers import close_pools, config_from_dict, run_ranks, train_keep_checkpoints  # noqa: E402
from tests.memory import gpt_config  # noqa: E402


def train(cfg_dict: dict, root: Path) -> float:
    """Seconds to train ``cfg_dict`` to its end on 2 ranks, its checkpoints in ``root``."""
    started = time.perf_counter()
    run_ranks(2, root, train_keep_checkpoints, cfg_dict, str(root))
    return time.perf_counter() - started


def log_times(cfg_dict: dict, run_dir: Path, repeats: int) -> tuple[list[float], int]:
    """Seconds each ``log_model`` took, and the bytes it logged."""
    cfg = config_from_dict(cfg_dict)
    record_config(cfg, str(run_dir))
    store = tracking_service.Store(f"sqlite:///{run_dir.parent / 'mlflow.db'}")
    seconds, size = [], 0
    for _ in range(repeats):
        run_id = store.start_run(cfg, str(run_dir.parent), False, 2)
        logged = mlmodel.log_model(store, run_id, cfg, str(run_dir), "final", lambda _: None)
        assert logged is not None, "the run left no checkpoint"
        seconds.append(logged.seconds)
        size = logged.bytes
    return seconds, size


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--repeats", type=int, default=3)
    args.add_argument("--d-model", type=int, default=1024)
    args.add_argument("--layers", type=int, default=8)
    opts = args.parse_args()
    quick = load_config(REPO / "configs" / "quickstart.yaml", ["precision=32"]).to_dict()
    quick = merge(quick, {"train": {"early_stopping": None, "max_steps": 200}})
    big = merge(gpt_config({"name": "ddp"}, opts.d_model, opts.layers), {"train": {"max_steps": 3}})
    print(f"log_model.py on {describe()}; {opts.repeats} repeats, medians")
    print(f"{'run':<34}{'logged MiB':>12}{'log s':>9}{'train s':>10}{'log / train':>13}")
    rows: list[list[str]] = []
    for label, cfg_dict in (("quickstart (digits, 200 steps)", quick), ("gpt", big)):
        params = count_params(config_from_dict(cfg_dict))
        if label == "gpt":
            label = f"gpt {params / 1e6:.0f}M params, 3 steps"
        with tempfile.TemporaryDirectory(prefix="raylift-bench-") as tmp:
            run_dir = Path(tmp) / "run"
            trained = train(cfg_dict, run_dir)
            seconds, size = log_times(cfg_dict, run_dir, opts.repeats)
        median = statistics.median(seconds)
        print(
            f"{label:<34}{size / 2**20:>12.1f}{median:>9.2f}{trained:>10.1f}"
            f"{median / trained:>13.3f}"
        )
        rows.append([label, f"{size / 2**20:.1f}", f"{median:.2f}", f"{trained:.1f}",
                     f"{median / trained:.3f}"])  # fmt: skip
    close_pools()
    big_row = rows[-1]
    save(
        __file__,
        "what logging the trained model to MLflow adds to a run",
        ["run", "logged MiB", "log s (median)", "train s", "log / train"],
        rows,
        {
            "what": f"`tracking.log_model: final` on {big_row[0]}",
            "raylift": f"{big_row[2]} s for {big_row[1]} MiB",
            "baseline": f"the training it follows, {big_row[3]} s",
            "ratio": f"{big_row[4]}x",
        },
        notes=f"Median of {opts.repeats} logs of each run's final checkpoint to a local "
        "sqlite store: consolidate, write safetensors, record the config, upload.",
    )


if __name__ == "__main__":
    main()
