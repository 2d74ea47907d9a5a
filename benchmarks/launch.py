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

On the running Ray, each launch is watched from outside (``cpu_by_process.py``): the
CPU-seconds each process spent from the command to the first step (the driver, Ray
Train's controller, each worker, each helper actor, Ray's daemons), raylift beside Ray
Train alone. After each pair, a 1-trial sweep (``raylift tune``, the same job for a few
steps) gives a sweep trial's start-up phases, from the trial's call of raylift's
training to its first step.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from subprocess import PIPE
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from cpu_by_process import Sampler, median_rows, spent, split, worker_pids  # noqa: E402
from machine import describe  # noqa: E402
from results import save  # noqa: E402

from raylift.core.startup import PHASES, from_metrics  # noqa: E402

QUICKSTART = REPO / "configs" / "quickstart.yaml"
SWEEP = REPO / "configs" / "sweep-digits.yaml"
RAYLIFT = [sys.executable, "-m", "raylift.cli"]


@dataclasses.dataclass
class Timed:
    """One launch: wall clocks of its start, first step and exit, the command's pid, and
    what else it printed or logged (``marks``: wall clocks; ``phases``: raylift's)."""

    started: float
    first: float
    ended: float
    pid: int
    out: str = ""  # its stdout
    marks: dict[str, float] = dataclasses.field(default_factory=dict)
    phases: dict[str, float] = dataclasses.field(default_factory=dict)

    def seconds(self) -> tuple[float, float]:
        """(to first step, to exit) in seconds."""
        return self.first - self.started, self.ended - self.started


def run_torchrun(steps: int, port: int, gpu: bool) -> Timed:
    torchrun = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port)]
    return run_script([*torchrun, str(REPO / "benchmarks" / "ddp_digits.py")], steps, gpu)


def run_bare(steps: int, gpu: bool, env: dict[str, str]) -> Timed:
    """The same job under a bare Ray Train ``TorchTrainer`` (joins ``env``'s RAY_ADDRESS)."""
    return run_script([str(REPO / "benchmarks" / "ray_train_digits.py")], steps, gpu, env)


def spawn(args: list[str], env: dict[str, str] | None, cwd: Path | None = None) -> Timed:
    """Run ``args`` to its end (its first step unknown yet); a failure ends the benchmark."""
    started = time.time()
    with subprocess.Popen(args, stdout=PIPE, stderr=PIPE, text=True, env=env, cwd=cwd) as proc:
        out, err = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"{' '.join(args[:4])} failed:\n{out[-2000:]}\n{err[-2000:]}")
    return Timed(started, 0.0, time.time(), proc.pid, out)


def run_script(args: list[str], steps: int, gpu: bool, env: dict[str, str] | None = None) -> Timed:
    """A script that prints ``first_step_at`` (and maybe ``loop_at``, ``connected_at``)."""
    run = spawn([sys.executable, *args, "--steps", str(steps), *(["--cuda"] if gpu else [])], env)
    run.marks = {k: float(v) for k, v in re.findall(r"(\w+_at) (\S+)", run.out)}
    run.first = run.marks["first_step_at"]
    return run


BREAKDOWN: dict[str, list[dict[str, float]]] = {}  # launcher -> each run's startup phases


def run_raylift(
    home: Path, steps: int, name: str, env: dict[str, str], gpu: bool, launcher: str
) -> Timed:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{home / 'mlflow.db'}"
    extra = [
        f"train.max_steps={steps}",
        "train.max_epochs=1000",
        "train.early_stopping=null",
        "checkpoint.every_n_steps=null",
        f"scaling.use_gpu={str(gpu).lower()}",
    ]
    run = raylift_timed(home, name, env, extra)
    run_id = re.search(r"MLflow run (\w+)", run.out).group(1)  # type: ignore[union-attr]
    (first,) = MlflowClient(uri).get_metric_history(run_id, "model_state_bytes_per_rank")
    logged = MlflowClient(uri).get_run(run_id).data.metrics
    run.first, run.phases = first.timestamp / 1000, from_metrics(logged)
    BREAKDOWN.setdefault(launcher, []).append(run.phases)
    return run


def raylift_train(
    home: Path, name: str, env: dict[str, str], extra: list[str], config: Path = QUICKSTART
) -> str:
    """``raylift train`` on ``config`` from ``home``'s shards; returns its stdout."""
    return raylift_timed(home, name, env, extra, config).out


def raylift_timed(
    home: Path, name: str, env: dict[str, str], extra: list[str], config: Path = QUICKSTART
) -> Timed:
    return spawn([*RAYLIFT, "train", *run_args(home, name, config), *extra], env, home)


def run_args(home: Path, name: str, config: Path) -> list[str]:
    """The config and where a run in ``home`` keeps everything."""
    return [
        str(config),
        f"name={name}",
        f"storage={home / 'runs'}",
        f"data.shards={home / 'shards'}",
        f"tracking.uri=sqlite:///{home / 'mlflow.db'}",
    ]


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
        times["torchrun"].append(run_torchrun(opts.steps, 29600 + r, opts.gpu).seconds())
        fresh = run_raylift(home, opts.steps, f"fresh{r}", env, opts.gpu, "raylift")
        times["raylift"].append(fresh.seconds())
        times[bare].append(run_bare(opts.steps, opts.gpu, env).seconds())
        print(
            f"repeat {r}: "
            + "  ".join(f"{k} {v[-1][0]:.1f}/{v[-1][1]:.1f} s" for k, v in times.items()),
            flush=True,
        )
    address, ray = start_head(home)
    joined = {**env, "RAY_ADDRESS": address, "RAY_AUTH_MODE": "token"}
    cpu: dict[str, list[dict[str, float]]] = {"raylift": [], bare: []}
    try:
        ours, theirs = "raylift on a running Ray", f"{bare} on a running Ray"
        times[ours], times[theirs] = [], []
        for r in range(opts.repeats):
            with Sampler() as seen:
                run = run_raylift(home, opts.steps, f"joined{r}", joined, opts.gpu, "joined")
            times[ours].append(run.seconds())
            cpu["raylift"].append(by_process(seen, run, phase_end(run, "ray"),
                                             phase_end(run, "worker")))  # fmt: skip
            with Sampler() as seen:
                run = run_bare(opts.steps, opts.gpu, joined)
            times[theirs].append(run.seconds())
            cpu[bare].append(by_process(seen, run, run.marks["connected_at"],
                                        run.marks["loop_at"]))  # fmt: skip
            BREAKDOWN.setdefault("trial", []).append(tune_trial(home, f"sweep{r}", joined))
    finally:
        ray.shutdown()  # type: ignore[attr-defined]
        shutil.rmtree(home, ignore_errors=True)
    report(times, opts, cpu)


def phase_end(run: Timed, phase: str) -> float:
    """The wall clock at which raylift's start-up ``phase`` ended in ``run``."""
    phases = list(PHASES)
    return run.started + sum(run.phases.get(p, 0.0) for p in phases[: phases.index(phase) + 1])


DRIVER_CUT = "  driver, to connected to Ray (imports, config, Ray start or connect)"
WORKER_CUT = (
    "  both workers together, to the training function (process start, imports, process group)"
)
WALL = "(wall clock, to the first step)"


def by_process(seen: Sampler, run: Timed, connected: float, in_loop: float) -> dict[str, float]:
    """CPU-seconds of each process from the command to the first step, and the driver's
    up to ``connected`` and the workers' up to ``in_loop`` (rank 0 in the training function)."""
    rows = spent(seen, run.pid, run.started, run.first)
    rows["total"] = sum(rows.values())
    rows[DRIVER_CUT] = split(seen, [run.pid], run.started, connected, run.first)[0]
    rows[WORKER_CUT] = split(seen, worker_pids(seen), run.started, in_loop, run.first)[0]
    rows[WALL] = run.first - run.started
    return rows


def one_data_sweep(home: Path) -> Path:
    """configs/sweep-digits.yaml searching the optimizer's values only: its trials read the
    quickstart's prepared shards (a model width it searches too is part of their key)."""
    import yaml

    cfg = yaml.safe_load(SWEEP.read_text())
    cfg["tune"]["space"] = {k: v for k, v in cfg["tune"]["space"].items() if k.startswith("optim.")}
    out = home / "sweep.yaml"
    out.write_text(yaml.safe_dump(cfg))
    return out


def tune_trial(home: Path, name: str, env: dict[str, str]) -> dict[str, float]:
    """A 1-trial sweep of the quickstart's job (2 workers, 5 steps) on the running Ray: the
    start-up phases its trial logged, from the trial's call of raylift's training to its
    first step (the trial's process start and Tune's are before it)."""
    from mlflow.tracking import MlflowClient

    sweep = [
        "tune.num_samples=1",
        "tune.max_concurrent=1",
        "tune.scaling.num_workers=2",
        "train.max_steps=5",
        "train.max_epochs=1000",
        "train.early_stopping=null",
        "checkpoint.every_n_steps=null",
    ]
    spawn([*RAYLIFT, "tune", *run_args(home, name, one_data_sweep(home)), *sweep], env, home)
    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    found = client.search_runs(
        [e.experiment_id for e in client.search_experiments()],
        f"tags.`raylift.sweep` = '{name}'",
    )
    (trial,) = [r for r in found if "raylift.trial_id" in r.data.tags]
    return from_metrics(trial.data.metrics)


def report(
    times: dict[str, list[tuple[float, float]]],
    opts: argparse.Namespace,
    cpu: dict[str, list[dict[str, float]]],
) -> None:
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
    tables = [against_ray_train(times), phase_table(), cpu_table(cpu)]
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
            "running Ray": BREAKDOWN.get("joined", []),
            "a sweep's trial, running Ray": BREAKDOWN.get("trial", [])}  # fmt: skip
    rows = []
    for phase, what in PHASES.items():
        cells = [statistics.median(r.get(phase, 0.0) for r in rs or [{}]) for rs in runs.values()]
        rows.append([what, *(f"{c:.1f} s" for c in cells)])
    totals = [statistics.median(sum(r.values()) for r in rs or [{}]) for rs in runs.values()]
    rows.append(["to the first step (phases add up)", *(f"{c:.1f} s" for c in totals)])
    return {"title": "raylift's start-up phases (its startup/* metrics), median seconds",
            "columns": ["phase", *runs], "rows": rows}  # fmt: skip


# What the helper actors and tasks are, by the class or function Ray names them by.
HELPERS = {
    "Store": "raylift's tracking actor (Store)",
    "_StatsActor": "Ray Data's stats actor",
    "_AutoscalingCoordinatorActor": "Ray Data's autoscaling coordinator",
}
CPU_TITLE = "CPU-seconds from the command to the first step, by process, on a running Ray, median"


def cpu_table(cpu: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Each process's CPU-seconds to the first step, raylift beside Ray Train alone."""
    medians = {k: median_rows(v) for k, v in cpu.items()}
    keys: list[str] = []
    for m in medians.values():
        keys += [k for k in m if k not in keys]
    rows = []
    for key in row_order(keys):
        name = key.removeprefix("actor or task ")
        name = HELPERS.get(name, f"actor or task {name}" if name != key else name)
        unit = "s" if key == WALL else "CPU-s"
        rows.append([name, *(f"{m.get(key, 0.0):.1f} {unit}" for m in medians.values())])
    return {"title": CPU_TITLE,
            "columns": ["process", *medians], "rows": rows}  # fmt: skip


def row_order(keys: list[str]) -> list[str]:
    """The driver, the controller, the workers, helpers, Ray's own, the total, the clock."""
    first = ["driver", DRIVER_CUT, "Train controller"]
    workers = sorted(k for k in keys if k.startswith("worker "))
    helpers = sorted(k for k in keys if k.startswith("actor or task "))
    rays = sorted(k for k in keys if k.startswith("Ray's "))
    known = {*first, *workers, WORKER_CUT, *helpers, *rays, "total", WALL}
    rest = sorted(k for k in keys if k not in known)
    ordered = [*first, *workers, WORKER_CUT, *helpers, *rays, *rest, "total", WALL]
    return [k for k in ordered if k in keys]


if __name__ == "__main__":
    main()
