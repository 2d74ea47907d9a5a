"""Time from command to first optimizer step, and to exit: ``raylift train`` against torchrun.

    python benchmarks/launch.py [--steps 100] [--repeats 3] [--gpu]

The same job on the same 2 workers over gloo: the quickstart (digits CNN, batch 32 per
worker, bf16 autocast, AdamW) for ``--steps`` steps, run three ways, interleaved:

- torchrun: ``torchrun --nproc-per-node 2 benchmarks/ddp_digits.py``, a hand-written DDP
  script that loads the data from scikit-learn and prints the time of its first step;
- raylift, fresh: ``raylift train configs/quickstart.yaml`` with the shards prepared
  beforehand (``raylift prep``, not timed); it starts its own local Ray;
- raylift, joining a running Ray: the same with ``RAY_ADDRESS`` set to a Ray head this
  script started beforehand, as on a cluster;
- Ray Train alone, fresh and joining: the torchrun script's job under a bare
  ``TorchTrainer`` (``ray_train_digits.py``): what any Ray Train job pays, the floor
  under raylift's own start-up.

raylift's first step is the timestamp of the metric rank 0 logs to MLflow right after
it (``model_state_bytes_per_rank``). raylift also evaluates at step 0 and at each epoch
end and writes a final checkpoint; the script does none of these. Prints the median of
each and the ratios to torchrun (goals, time to first step: <= 2.0x torchrun with a fresh
Ray, <= 1.3x joining one), then the median of each start-up phase raylift logged.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from machine import describe  # noqa: E402
from results import save  # noqa: E402

from raylift.core.startup import PHASES, from_metrics  # noqa: E402

QUICKSTART = REPO / "configs" / "quickstart.yaml"
RAYLIFT = [sys.executable, "-m", "raylift.cli"]


def run_torchrun(steps: int, port: int, gpu: bool) -> tuple[float, float]:
    torchrun = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port)]
    return run_script([*torchrun, str(REPO / "benchmarks" / "ddp_digits.py")], steps, gpu)


def run_bare(steps: int, gpu: bool, env: dict[str, str]) -> tuple[float, float]:
    """The same job under a bare Ray Train ``TorchTrainer`` (joins ``env``'s RAY_ADDRESS)."""
    return run_script([str(REPO / "benchmarks" / "ray_train_digits.py")], steps, gpu, env)


def run_script(
    args: list[str], steps: int, gpu: bool, env: dict[str, str] | None = None
) -> tuple[float, float]:
    """(to first step, to exit) in seconds of a script that prints ``first_step_at``."""
    started = time.time()
    out = subprocess.run(
        [sys.executable, *args, "--steps", str(steps), *(["--cuda"] if gpu else [])],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    ).stdout
    ended = time.time()
    first = float(re.search(r"first_step_at (\S+)", out).group(1))  # type: ignore[union-attr]
    return first - started, ended - started


BREAKDOWN: dict[str, list[dict[str, float]]] = {}  # launcher -> each run's startup phases


def run_raylift(
    home: Path, steps: int, name: str, env: dict[str, str], gpu: bool, launcher: str
) -> tuple[float, float]:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{home / 'mlflow.db'}"
    extra = [
        f"train.max_steps={steps}",
        "train.max_epochs=1000",
        "train.early_stopping=null",
        "checkpoint.every_n_steps=null",
        f"scaling.use_gpu={str(gpu).lower()}",
    ]
    started = time.time()
    out = raylift_train(home, name, env, extra)
    ended = time.time()
    run_id = re.search(r"MLflow run (\w+)", out).group(1)  # type: ignore[union-attr]
    (first,) = MlflowClient(uri).get_metric_history(run_id, "model_state_bytes_per_rank")
    logged = MlflowClient(uri).get_run(run_id).data.metrics
    BREAKDOWN.setdefault(launcher, []).append(from_metrics(logged))
    return first.timestamp / 1000 - started, ended - started


def raylift_train(
    home: Path, name: str, env: dict[str, str], extra: list[str], config: Path = QUICKSTART
) -> str:
    """``raylift train`` on ``config`` from ``home``'s shards; returns its stdout."""
    args = [
        "train",
        str(config),
        f"name={name}",
        f"storage={home / 'runs'}",
        f"data.shards={home / 'shards'}",
        f"tracking.uri=sqlite:///{home / 'mlflow.db'}",
        *extra,
    ]
    proc = subprocess.run([*RAYLIFT, *args], capture_output=True, text=True, env=env, cwd=home)
    if proc.returncode:
        raise SystemExit(f"raylift train failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc.stdout


def prep_shards(
    home: Path, env: dict[str, str], config: Path = QUICKSTART, extra: tuple[str, ...] = ()
) -> None:
    """``raylift prep`` of ``config`` into ``home/shards`` (once per dataset)."""
    subprocess.run(
        [*RAYLIFT, "prep", str(config), f"data.shards={home / 'shards'}", *extra],
        check=True,
        capture_output=True,
        env=env,
        cwd=home,
    )


def start_head(home: Path) -> tuple[str, object]:
    """A local Ray head in this process, its own temp dir, as a cluster would have running."""
    import ray

    from raylift.run.connect import WORKER_ENV

    os.environ.update(WORKER_ENV)
    ctx = ray.init(
        address="local",
        num_cpus=(os.cpu_count() or 1) + 1,
        _temp_dir=str(home / "ray"),
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        logging_level="ERROR",
    )
    return ctx.address_info["gcs_address"], ray


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpu", action="store_true", help="one GPU per worker, NCCL, both")
    opts = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="rl-launch-", dir="/tmp"))  # short: Ray's sockets
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    prep_shards(home, env)
    bare = "Ray Train alone"
    times: dict[str, list[tuple[float, float]]] = {"torchrun": [], "raylift": [], bare: []}
    for r in range(opts.repeats):
        times["torchrun"].append(run_torchrun(opts.steps, 29600 + r, opts.gpu))
        fresh = run_raylift(home, opts.steps, f"fresh{r}", env, opts.gpu, "raylift")
        times["raylift"].append(fresh)
        times[bare].append(run_bare(opts.steps, opts.gpu, env))
        print(
            f"repeat {r}: "
            + "  ".join(f"{k} {v[-1][0]:.1f}/{v[-1][1]:.1f} s" for k, v in times.items()),
            flush=True,
        )
    address, ray = start_head(home)
    joined = {**env, "RAY_ADDRESS": address, "RAY_AUTH_MODE": "token"}
    try:
        ours, theirs = "raylift on a running Ray", f"{bare} on a running Ray"
        times[ours], times[theirs] = [], []
        for r in range(opts.repeats):
            run = run_raylift(home, opts.steps, f"joined{r}", joined, opts.gpu, "joined")
            times[ours].append(run)
            times[theirs].append(run_bare(opts.steps, opts.gpu, joined))
    finally:
        ray.shutdown()  # type: ignore[attr-defined]
        shutil.rmtree(home, ignore_errors=True)
    report(times, opts)


def report(times: dict[str, list[tuple[float, float]]], opts: argparse.Namespace) -> None:
    base_first = statistics.median(t[0] for t in times["torchrun"])
    base_end = statistics.median(t[1] for t in times["torchrun"])
    print(f"\n{describe()}; {opts.steps} steps, 2 workers, median of {opts.repeats}")
    print(f"{'launcher':<34}{'to first step':>15}{'ratio':>8}{'to exit':>11}{'ratio':>8}")
    rows = []
    for name, runs in times.items():
        first = statistics.median(t[0] for t in runs)
        end = statistics.median(t[1] for t in runs)
        print(
            f"{name:<34}{first:>13.1f} s{first / base_first:>7.2f}x"
            f"{end:>9.1f} s{end / base_end:>7.2f}x"
        )
        rows.append([name, f"{first:.1f} s", f"{first / base_first:.2f}x", f"{end:.1f} s",
                     f"{end / base_end:.2f}x"])  # fmt: skip
    ours = next((r for r in rows if r[0] == "raylift"), rows[-1])
    tables = [against_ray_train(times), phase_table()]
    save(
        __file__,
        f"seconds from the command to the first optimizer step, and to exit ({opts.steps} "
        "steps, 2 workers)",
        ["launcher", "to first step", "vs torchrun", "to exit", "vs torchrun"],
        rows,
        {"what": "command to first step, quickstart, 2 workers, fresh local Ray",
         "raylift": ours[1], "baseline": f"torchrun {base_first:.1f} s", "ratio": ours[2]},
        notes=f"Median of {opts.repeats} runs of each launcher.",
        tables=tables,
    )  # fmt: skip
    for t in tables:
        print(f"\n{t['title']}")
        for row in t["rows"]:
            print("  ".join(f"{c:>14}" if i else f"{c:<48}" for i, c in enumerate(row)))


def against_ray_train(times: dict[str, list[tuple[float, float]]]) -> dict[str, Any]:
    """raylift's time to the first step over the same job's under Ray Train alone."""
    joined = ("raylift on a running Ray", "Ray Train alone on a running Ray")
    pairs = {"fresh local Ray": ("raylift", "Ray Train alone"), "running Ray": joined}
    rows = []
    for what, (ours, theirs) in pairs.items():
        if ours in times and theirs in times:
            a, b = (statistics.median(t[0] for t in times[k]) for k in (ours, theirs))
            rows.append([what, f"{a:.1f} s", f"{b:.1f} s", f"{a / b:.2f}x ({a - b:+.1f} s)"])
    return {"title": "raylift against Ray Train alone, to the first step",
            "columns": ["Ray", "raylift", "Ray Train alone", "ratio"], "rows": rows}  # fmt: skip


def phase_table() -> dict[str, Any]:
    """The median of each start-up phase raylift logged (its ``startup/*`` metrics)."""
    runs = {"fresh local Ray": BREAKDOWN.get("raylift", []),
            "running Ray": BREAKDOWN.get("joined", [])}  # fmt: skip
    rows = []
    for phase, what in PHASES.items():
        cells = [statistics.median(r.get(phase, 0.0) for r in rs or [{}]) for rs in runs.values()]
        rows.append([what, *(f"{c:.1f} s" for c in cells)])
    totals = [statistics.median(sum(r.values()) for r in rs or [{}]) for rs in runs.values()]
    rows.append(["to the first step (phases add up)", *(f"{c:.1f} s" for c in totals)])
    return {"title": "raylift's start-up phases (its startup/* metrics), median seconds",
            "columns": ["phase", *runs], "rows": rows}  # fmt: skip


if __name__ == "__main__":
    main()
