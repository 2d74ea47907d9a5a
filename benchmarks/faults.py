"""What raylift does under each fault, in figures: a table for the README.

    python benchmarks/faults.py [--out DIR]

One small job throughout (the gpt task on 200 KB of the standard library's source, 2
layers, d_model 64, 2 CPU workers over gloo, fp32, constant LR, 24 steps, a checkpoint
every 4, Ray Train allowed one restart), on a local Ray this script starts. First the
job uninterrupted; then, each on its own run folder, one fault:

- a worker SIGKILLed mid-step (rank 1 at step 10);
- a worker SIGKILLed while a checkpoint is being written (the third save, step 12: a
  watcher kills a Train worker the moment a checkpoint's temp folder appears);
- a same-size corruption (bytes flipped in the middle of the newest checkpoint's largest
  file), then the same command rerun to a later step;
- the driver (`raylift train`) SIGKILLed once its step-12 checkpoint is on disk, then rerun;
- a second `raylift train` of the same name while the first runs;
- a NaN loss at step 10 under `train.on_nan: stop` and under `skip`;
- a full disk: the run folder on a tmpfs with room for about two checkpoints.

For each: what happened, steps lost (run again after the fault), the final `val_loss`
against the uninterrupted run's (within 2%?), and whether anything was lost or
corrupted (every checkpoint in the folder checked by `raylift verify`'s code, one MLflow
run per run). The tmpfs needs root (``mount``); without it that row says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from machine import describe  # noqa: E402
from results import save  # noqa: E402

from raylift.data.manifest import shard_root  # noqa: E402
from raylift.run.launch import RunFailed, TrainResult, train  # noqa: E402
from raylift.tasks import build_task  # noqa: E402
from raylift.tensors.checkpoints import checkpoint_dirs, verify_run  # noqa: E402
from raylift.validation import load_config  # noqa: E402

CONFIG = REPO / "configs" / "gpt-tiny.yaml"
STEPS, EVERY = 24, 4


@dataclasses.dataclass
class Row:
    fault: str
    happened: str
    lost: str
    val_loss: float | None
    intact: str


class Bench:
    def __init__(self, root: Path):
        self.root = root
        self.marker = root / "killed"
        self.reference: float | None = None

    def overrides(self, name: str, storage: Path | None = None, *extra: str) -> list[str]:
        return [
            "task=tests.flaky:KilledGPT",
            f"task_args.marker={self.marker}",
            "task_args.kill_at=10",
            "task_args.max_bytes=200000",
            "task_args.n_layer=2",
            "task_args.d_model=64",
            "task_args.block_size=64",
            "train.eval_every_n_steps=null",
            f"train.log_every_n_steps={EVERY}",
            f"train.max_steps={STEPS}",
            "train.max_failures=1",
            f"checkpoint.every_n_steps={EVERY}",
            "checkpoint.keep=3",
            "optim.warmup_steps=2",
            "optim.schedule=constant",
            "precision=32",
            f"name={name}",
            f"storage={storage or self.root / 'runs'}",
            f"tracking.uri=sqlite:///{self.root / 'mlflow.db'}",
            *extra,
        ]

    def train(self, name: str, *extra: str, storage: Path | None = None) -> TrainResult:
        return train(load_config(CONFIG, self.overrides(name, storage, *extra)), log=quiet)

    def cli(self, name: str, *extra: str, storage: Path | None = None) -> subprocess.Popen[str]:
        env = {**os.environ, "RAY_AUTH_MODE": "token", "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "raylift.cli", "train", str(CONFIG)]
        return subprocess.Popen(
            [*cmd, *self.overrides(name, storage, *extra)],
            cwd=self.root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def run_dir(self, name: str, storage: Path | None = None) -> Path:
        return (storage or self.root / "runs") / name

    def within(self, val_loss: float | None) -> str:
        if val_loss is None or self.reference is None:
            return "-"
        rel = abs(val_loss - self.reference) / self.reference
        return f"{val_loss:.4f} ({rel:.1%} off: {'yes' if rel <= 0.02 else 'no'})"


def quiet(line: str) -> None:
    if os.environ.get("RAYLIFT_VERBOSE"):
        print(line)


def intact(run_dir: Path) -> str:
    found = verify_run(str(run_dir))
    bad = [f"{Path(p).name}: {why.split(':')[0]}" for p, why in found if why]
    good = sum(1 for _, why in found if why is None)
    return f"{good} intact" + (f", {len(bad)} not ({'; '.join(bad)})" if bad else "")


def restart_tag(result: TrainResult) -> str:
    from mlflow.tracking import MlflowClient

    tags = MlflowClient(result.tracking_uri).get_run(result.run_id).data.tags
    return tags.get("raylift.restart.1", "no restart")


def last_metric(result: TrainResult, key: str) -> float:
    from mlflow.tracking import MlflowClient

    history = MlflowClient(result.tracking_uri).get_metric_history(result.run_id, key)
    return history[-1].value if history else float("nan")


def resumed_step(text: str) -> int:
    """The step of a restart tag (``step 8 from checkpoint-...``) or resume line (``resumed
    from ... at step 8``)."""
    found = re.search(r"at step (\d+)", text) or re.search(r"step (\d+) from", text)
    return int(found.group(1)) if found else -1


def final_val(out: str) -> float | None:
    """The val_loss on the CLI's closing ``finished`` line."""
    line = next((x for x in out.splitlines() if " finished in " in x), "")
    found = re.search(r"val_loss (\d+\.\d+)", line)
    return float(found.group(1)) if found else None


# ---------------------------------------------------------------- the faults


def uninterrupted(b: Bench) -> Row:
    b.marker.write_text("no kill")
    result = b.train("clean")
    b.reference = result.metrics["val_loss"]
    return Row(
        "none (the reference)",
        f"ran to step {int(result.metrics['step'])}",
        "0",
        b.reference,
        intact(b.run_dir("clean")),
    )


def worker_killed(b: Bench) -> Row:
    b.marker.unlink(missing_ok=True)
    result = b.train("worker-kill")
    tag = restart_tag(result)
    lost = 10 - resumed_step(tag)
    return Row(
        "worker SIGKILL mid-step (rank 1, step 10)",
        f"Ray Train restarted the group: {tag}",
        f"{lost} (redone)",
        result.metrics["val_loss"],
        intact(b.run_dir("worker-kill")),
    )


def killed_in_checkpoint(b: Bench) -> Row:
    b.marker.write_text("no kill")
    stop = threading.Event()
    note: list[str] = []
    watcher = threading.Thread(target=kill_at_third_save, args=(b.run_dir("ckpt-kill"), stop, note))
    watcher.start()
    try:
        result = b.train("ckpt-kill")
    finally:
        stop.set()
        watcher.join()
    tag = restart_tag(result)
    lost = 12 - resumed_step(tag) if note else 0
    happened = f"{note[0] if note else 'the kill never landed'}; {tag}"
    return Row(
        "worker SIGKILL during a checkpoint write (step 12)",
        happened,
        f"{lost} (redone)",
        result.metrics["val_loss"],
        intact(b.run_dir("ckpt-kill")),
    )


def kill_at_third_save(run_dir: Path, stop: threading.Event, note: list[str]) -> None:
    """SIGKILL one Train worker as soon as a save has written files to its temp folder,
    once two complete checkpoints are in the run folder: the step-12 save is under way."""
    import psutil

    tmp = Path(tempfile.gettempdir())
    before = set(tmp.glob("raylift-ckpt-*"))
    while not stop.is_set():
        saved = [c for c in ckpts(run_dir) if len(list(c.glob("complete-rank*"))) == 2]
        fresh = set(tmp.glob("raylift-ckpt-*")) - before
        if len(saved) < 2:
            before |= fresh
        elif written := [f for d in fresh for f in d.rglob("*") if f.is_file()]:
            workers = [
                p for p in psutil.process_iter(["name"]) if "RayTrainW" in (p.info["name"] or "")
            ]
            if workers:
                workers[0].send_signal(signal.SIGKILL)
                note.append(
                    f"killed pid {workers[0].pid} once its ranks' saves had "
                    f"{len(written)} file(s) in their temp folders"
                )
                return
        time.sleep(0.002)


def corrupted(b: Bench) -> Row:
    b.marker.write_text("no kill")
    b.train("damaged", "train.max_steps=16")
    newest = ckpts(b.run_dir("damaged"))[-1]
    victim = max((p for p in newest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    flip_middle(victim)
    again = b.cli("damaged")
    out, _ = again.communicate(timeout=900)
    said = next((x for x in out.splitlines() if "checksum" in x), "no warning")
    said = said[said.find("raylift:") :]
    step = resumed_step(out[out.find("resumed from") :]) if "resumed from" in out else -1
    return Row(
        f"same-size corruption of {newest.name}/{victim.name}, then rerun",
        f"rerun exit {again.returncode}: {said.strip()[:160]}; resumed at step {step}",
        f"{16 - step} (redone)",
        final_val(out),
        intact(b.run_dir("damaged")),
    )


def ckpts(run_dir: Path) -> list[Path]:
    """The run's checkpoint folders, oldest first (raylift names them by path strings)."""
    return [Path(c) for c in checkpoint_dirs(str(run_dir))]


def flip_middle(path: Path, n: int = 4096) -> None:
    with path.open("r+b") as f:
        f.seek(path.stat().st_size // 2)
        block = f.read(n)
        f.seek(path.stat().st_size // 2)
        f.write(bytes(255 - x for x in block))


def driver_killed(b: Bench) -> Row:
    b.marker.write_text("no kill")
    run_dir = b.run_dir("driver-kill")
    first = b.cli("driver-kill")
    wait_for(lambda: (run_dir / "checkpoint-step00000012" / "complete-rank1.json").exists())
    first.send_signal(signal.SIGKILL)
    first.wait()
    time.sleep(5)  # Ray notices the job's driver is gone and ends its actors
    again = b.cli("driver-kill")
    out, _ = again.communicate(timeout=900)
    took_over = "taking over the lock" in out
    step = resumed_step(out[out.find("resumed from") :]) if "resumed from" in out else -1
    return Row(
        "driver SIGKILL after the step-12 checkpoint, then rerun",
        f"rerun exit {again.returncode}; stale lock "
        f"{'taken over, said so' if took_over else 'not mentioned'}; resumed at step {step}",
        f"{12 - step} after the checkpoint",
        final_val(out),
        intact(run_dir),
    )


def wait_for(done: Callable[[], bool], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError("the fault's moment never came")
        time.sleep(0.05)


def same_name(b: Bench) -> Row:
    b.marker.write_text("no kill")
    first = b.cli("twice")
    wait_for(lambda: any(b.run_dir("twice").glob("checkpoint-step*")))
    started = time.monotonic()
    second = b.cli("twice")
    said, _ = second.communicate(timeout=300)
    seconds = time.monotonic() - started
    out, _ = first.communicate(timeout=900)
    why = next((line for line in said.splitlines() if "already running" in line), said[-200:])
    return Row(
        "a second `raylift train` of the same name while the first runs",
        f"second: exit {second.returncode} after {seconds:.1f} s ({why.strip()[:120]}); "
        f"first: exit {first.returncode}",
        "0",
        final_val(out),
        intact(b.run_dir("twice")),
    )


def nan(b: Bench, mode: str) -> Row:
    b.marker.write_text("no kill")
    name = f"nan-{mode}"
    try:
        result = b.train(name, "task_args.nan_at=10", f"train.on_nan={mode}")
    except RunFailed as exc:
        first = str(exc).splitlines()[0]
        return Row(
            f"NaN loss at step 10, `on_nan: {mode}`",
            f"stopped: {first[:150]}",
            "-",
            None,
            intact(b.run_dir(name)),
        )
    skipped = int(last_metric(result, "skipped_steps"))
    return Row(
        f"NaN loss at step 10, `on_nan: {mode}`",
        f"ran to step {int(result.metrics['step'])}, skipped_steps {skipped}",
        "0",
        result.metrics["val_loss"],
        intact(b.run_dir(name)),
    )


def full_disk(b: Bench) -> Row:
    b.marker.write_text("no kill")
    one = sum(p.stat().st_size for p in ckpts(b.run_dir("clean"))[-1].rglob("*"))
    mount = b.root / "small-disk"
    mount.mkdir()
    size = int(2.5 * one) // 4096 * 4096
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if made.returncode:
        return Row(
            "full disk during a checkpoint", f"not run: {made.stderr.strip()}", "-", None, "-"
        )
    # The shards the first run prepared: only the run folder is on the small disk.
    cfg = load_config(CONFIG, b.overrides("full"))
    shards = shard_root(cfg, build_task(cfg.task, cfg.task_args))[0]
    try:
        try:
            b.train("full", f"data.shards={shards}", storage=mount)
            happened = "finished (the disk was big enough)"
        except RunFailed as exc:
            happened = f"exit 1: {str(exc).splitlines()[0][:150]}"
        return Row(
            f"full disk (run folder on a {size / 2**20:.1f} MiB tmpfs, {one / 2**20:.1f} MiB "
            "per checkpoint)",
            happened,
            "-",
            None,
            intact(b.run_dir("full", mount)),
        )
    finally:
        subprocess.run(["umount", str(mount)], check=False)


# ---------------------------------------------------------------- driver


def start_ray(root: Path) -> Any:
    import ray

    from raylift.run.connect import WORKER_ENV

    os.environ.update(WORKER_ENV)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p
    )
    ctx = ray.init(
        address="local",
        num_cpus=4,
        _temp_dir=str(root / "ray"),
        logging_level="ERROR",
        include_dashboard=True,
        dashboard_host="127.0.0.1",
    )
    os.environ["RAY_ADDRESS"] = ctx.address_info["gcs_address"]
    return ray


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out", type=Path, default=None, help="keep the runs here (default: a temp dir)"
    )
    args = ap.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="rl-faults-", dir="/tmp"))
    root.mkdir(parents=True, exist_ok=True)
    ray = start_ray(root)
    b = Bench(root)
    rows = []
    scenarios: list[Callable[[], Row]] = [
        lambda: uninterrupted(b),
        lambda: worker_killed(b),
        lambda: killed_in_checkpoint(b),
        lambda: corrupted(b),
        lambda: driver_killed(b),
        lambda: same_name(b),
        lambda: nan(b, "stop"),
        lambda: nan(b, "skip"),
        lambda: full_disk(b),
    ]
    try:
        for scenario in scenarios:
            started = time.monotonic()
            row = scenario()
            rows.append(row)
            print(f"[{time.monotonic() - started:5.0f} s] {row.fault}: {row.happened}", flush=True)
    finally:
        ray.shutdown()
    print(f"\n{describe()}; {STEPS} steps, a checkpoint every {EVERY}\n")
    print(
        "| fault | what happened | steps lost | final val_loss (within 2% of uninterrupted?) "
        "| checkpoints afterwards |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.fault} | {r.happened} | {r.lost} | {b.within(r.val_loss)} | {r.intact} |")
    finished = [b.within(r.val_loss) for r in rows[1:] if r.val_loss is not None]
    close = sum(w.endswith("yes)") for w in finished)
    save(
        __file__,
        f"each fault caused on purpose, and what raylift did ({STEPS} steps, a checkpoint "
        f"every {EVERY})",
        ["fault", "what happened", "steps lost", "final val_loss", "checkpoints afterwards"],
        [[r.fault, r.happened, r.lost, b.within(r.val_loss), r.intact] for r in rows],
        {"what": f"{len(rows) - 1} faults caused on purpose",
         "raylift": f"{close} of the {len(finished)} that trained on ended within 2% "
         "of its val_loss",
         "baseline": "the uninterrupted run", "ratio": "-"},
    )  # fmt: skip
    if not args.out:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
