"""What a lost worker or node costs a run: goodput, the time to train again and steps redone,
against the same job without faults and against Ray Train alone.

    python benchmarks/goodput.py [--steps 1200] [--after-s 30] [--kills 3]

Every run is on a Ray of two nodes on this host, started for it (``ray start --head``
and a second ``ray start --address``, one CPU each, each in this script's temp dir, so
that a node can be drained or killed), with one worker per node. The job: gpt-tiny
(``configs/gpt-tiny.yaml``), fp32, elastic (``scaling.num_workers: [1, 2]``), a storage
checkpoint every 50 steps written asynchronously and a memory snapshot every
``--memory-every`` steps (``checkpoint.memory``; one run without, for comparison),
``--steps`` steps, a console line every step (as Ray Train alone's below: the first step
after a restart is seen when it is taken). The faults, each in a run of its own:

- none: the reference;
- a Ray Train worker SIGKILLed ``--after-s`` seconds after each start of training,
  ``--kills`` times;
- the second node drained for preemption, ``--after-s`` s into training, with a 30-s
  deadline (``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION``), as a cloud's
  reclaim notice reaches Ray;
- the second node's raylet SIGKILLed ``--after-s`` s into training: the node gone with no
  notice.

Beside them, the same worker kills under a bare ``TorchTrainer`` (``ray_train_gpt.py``:
gpt-tiny's shape in plain torch, ``FailureConfig``, checkpoints of its own every 50
steps): the restart floor of Ray Train alone, measured in the same invocation.

For each: the training's wall time (first step to last), goodput as the time the
uninterrupted run trained over the time this one did, raylift's own ``goodput`` (the
share of the training's wall time spent on steps that count), per failure the time from
the fault to the first step of the group that trained on and the stop before that step,
the steps redone and where each restart restored
from. The restart phases are raylift's ``restart N cost`` lines. The JSON goes to
``benchmarks/results/goodput.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from machine import describe  # noqa: E402
from results import save  # noqa: E402

from tests.helpers import raylets_of, stop_ray_of  # noqa: E402  (the suite's own, by pid)

CONFIG = REPO / "configs" / "gpt-tiny.yaml"
RAY = str(Path(sys.executable).parent / "ray")
STEP = re.compile(r"^epoch\s+\d+\s+step\s+(\d+)/")  # a training interval's line, not eval's
GAP_S = 2.0  # between two logged steps, a stop: the group is restarting
RESTART = re.compile(
    r"raylift: restart (\d+) cost ([\d.]+) s: .*?(\d[\d,.]*) MiB restored from (\w+)"
    r".*?\(([\d.]+) GB/s\).*after redoing (\d+) step"
)
DRAIN_DEADLINE_S = 30


def gpus() -> int:
    """One GPU per node where the host has two or more (NCCL wants a device per rank);
    else the CPU, and the results say so."""
    import torch

    return 1 if torch.cuda.device_count() >= 2 else 0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclasses.dataclass
class Cluster:
    env: dict[str, str]
    temp_dir: str
    second: str  # the second node's id


@contextlib.contextmanager
def two_nodes() -> Iterator[Cluster]:
    """A Ray of a head and one more node on this host, one CPU each; stopped by pid."""
    temp_dir = tempfile.mkdtemp(prefix="rl-gp-", dir="/tmp")
    gcs = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_AUTH_MODE="token", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    node = ["--node-ip-address=127.0.0.1", "--num-cpus=1", f"--num-gpus={gpus()}",
            "--disable-usage-stats"]  # fmt: skip
    try:
        for args in (
            ["get-auth-token", "--generate"],
            ["start", "--head", f"--port={gcs}", f"--temp-dir={temp_dir}", *node,
             "--dashboard-host=127.0.0.1", f"--dashboard-port={free_port()}",
             f"--dashboard-agent-listen-port={free_port()}"],
            ["start", f"--address=127.0.0.1:{gcs}", *node,
             f"--dashboard-agent-listen-port={free_port()}"],
        ):  # fmt: skip
            done = subprocess.run([RAY, *args], env=env, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"ray {args[0]}: {done.stdout[-2000:]}{done.stderr[-2000:]}")
        while len(raylets_of(temp_dir)) < 2:
            time.sleep(0.5)
        yield Cluster(
            {**env, "RAY_ADDRESS": f"127.0.0.1:{gcs}"}, temp_dir, raylets_of(temp_dir)[-1][1]
        )
    finally:
        stop_ray_of(temp_dir, timeout=5.0)
        shutil.rmtree(temp_dir, ignore_errors=True)


def kill_a_worker(cluster: Cluster) -> str:
    """SIGKILL one Ray Train worker (the newest): as the OOM killer or a crash would."""
    workers = [
        p for p in psutil.process_iter(["name", "cmdline", "create_time"])
        if "RayTrainWorker" in " ".join(p.info["cmdline"] or []) + (p.info["name"] or "")
    ]  # fmt: skip
    victim = max(workers, key=lambda p: p.info["create_time"])
    victim.send_signal(signal.SIGKILL)
    return f"worker pid {victim.pid} SIGKILLed"


def drain(cluster: Cluster) -> str:
    args = [RAY, "drain-node", "--address", cluster.env["RAY_ADDRESS"], "--node-id",
            cluster.second, "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message",
            "spot instance reclaimed", "--deadline-remaining-seconds",
            str(DRAIN_DEADLINE_S)]  # fmt: skip
    done = subprocess.run(args, env=cluster.env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(done.stdout + done.stderr)
    return f"node drained, deadline in {DRAIN_DEADLINE_S} s"


def kill_raylet(cluster: Cluster) -> str:
    pid = next(pid for pid, node in raylets_of(cluster.temp_dir) if node == cluster.second)
    os.kill(pid, signal.SIGKILL)
    return f"raylet pid {pid} SIGKILLed"


@dataclasses.dataclass
class Outcome:
    name: str
    train_s: float  # first step to last
    faults: list[tuple[float, str]]  # when, what
    steps: list[tuple[float, int]]  # each logged step, when
    restarts: list[dict[str, Any]]
    goodput_logged: float | None
    out: str

    def stalls(self) -> list[tuple[float, float]]:
        """For each fault: (from it to the first step of the group that trained on after
        it, the stop between the last step before that one and it). A stop is a gap of
        more than ``GAP_S`` between two logged steps: the restart."""
        out = []
        for at, _ in self.faults:
            found = next(
                (
                    (t - at, t - self.steps[i - 1][0])
                    for i, (t, _) in enumerate(self.steps)
                    if i and t > at and t - self.steps[i - 1][0] > GAP_S
                ),
                (float("nan"), float("nan")),
            )
            out.append(found)
        return out

    def redone(self) -> int:
        """Steps trained more than once: raylift's own count on its restart lines; for a
        run that logs every step, each time the step went back, by how much."""
        if self.restarts:
            return sum(r["redone"] for r in self.restarts)
        redone, prev = 0, 0
        for _, step in self.steps:
            if step <= prev:
                redone += prev - step + 1
            prev = step
        return redone


def faulted(
    lines: Iterator[str],
    fault: Callable[[], str] | None,
    after_s: float,
    times: int,
    step_of: Callable[[str], int | None],
) -> tuple[list[str], list[tuple[float, int]], list[tuple[float, str]]]:
    """Read a run's lines as they come; ``after_s`` after each start of training (its first
    step, and the first step more than a second after each fault: the new group's) do
    ``fault``, ``times`` times. The lines, each step's (time, step), each fault's (time,
    what)."""
    seen: list[str] = []
    steps: list[tuple[float, int]] = []
    faults: list[tuple[float, str]] = []
    timers: list[threading.Timer] = []

    def strike() -> None:
        faults.append((time.time(), fault()))  # type: ignore[misc]

    for line in lines:
        now = time.time()
        seen.append(line)
        step = step_of(line)
        if step is None:
            continue
        steps.append((now, step))
        started = not timers or (len(faults) == len(timers) and now > faults[-1][0] + 1.0)
        if fault is not None and started and len(timers) < times:
            timers.append(threading.Timer(after_s, strike))
            timers[-1].start()
    for timer in timers:
        timer.cancel()
    return seen, steps, faults


def raylift_run(
    cluster: Cluster, root: Path, name: str, opts: argparse.Namespace,
    fault: Callable[[], str] | None = None, times: int = 1, memory: bool = True,
) -> Outcome:  # fmt: skip
    snapshots = [f"checkpoint.memory.every_n_steps={opts.memory_every}"] if memory else []
    overrides = [*snapshots,
        f"name={name}", f"storage={root / 'runs'}", f"tracking.uri=sqlite:///{root / 'mlflow.db'}",
        "precision=32", "scaling.num_workers=[1,2]", "scaling.cpus_per_worker=1",
        f"train.max_steps={opts.steps}", "train.max_epochs=1000", "train.log_every_n_steps=1",
        "train.eval_every_n_steps=null", "train.max_failures=4", "checkpoint.every_n_steps=50",
        "checkpoint.async=true", "checkpoint.keep=2", f"scaling.use_gpu={bool(gpus())}",
    ]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "raylift.cli", "train", str(CONFIG), *overrides], cwd=root,
        env=cluster.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip

    def step_of(line: str) -> int | None:
        found = STEP.match(line)
        return int(found.group(1)) if found else None

    lines, steps, faults = faulted(proc.stdout, fault, opts.after_s, times, step_of)  # type: ignore[arg-type]
    proc.wait()
    out = "".join(lines)
    if proc.returncode:
        raise RuntimeError(f"raylift run {name} failed:\n{out[-4000:]}")
    restarts = [
        {"restart": int(m[0]), "cost_s": float(m[1]), "mib": float(m[2].replace(",", "")),
         "source": m[3], "gbps": float(m[4]), "redone": int(m[5])}
        for m in RESTART.findall(out)
    ]  # fmt: skip
    logged = re.search(r"raylift: goodput ([\d.]+)", out)
    return Outcome(
        name, steps[-1][0] - steps[0][0], faults, steps, restarts,
        float(logged.group(1)) if logged else None, out,
    )  # fmt: skip


def tail(path: Path, proc: subprocess.Popen[str]) -> Iterator[str]:
    """The lines appended to ``path`` while ``proc`` runs."""
    seen = 0
    while True:
        ended = proc.poll() is not None
        text = path.read_text() if path.exists() else ""
        complete = text[: text.rfind("\n") + 1]
        yield from complete[seen:].splitlines(keepends=True)
        seen = len(complete)
        if ended:
            return
        time.sleep(0.1)


def bare_run(
    cluster: Cluster, root: Path, name: str, opts: argparse.Namespace,
    fault: Callable[[], str] | None = None, times: int = 1, memory: bool = False,
) -> Outcome:  # fmt: skip
    progress = root / f"{name}.progress"
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "benchmarks" / "ray_train_gpt.py"), "--steps",
         str(opts.steps), "--every", "50", "--progress", str(progress), "--storage",
         str(root / "bare"), *(["--cuda"] if gpus() else [])],
        env=cluster.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    lines, steps, faults = faulted(
        tail(progress, proc), fault, opts.after_s, times, lambda line: int(line.split()[0])
    )
    if proc.returncode:
        raise RuntimeError(f"Ray Train alone ({name}) failed: exit {proc.returncode}")
    return Outcome(name, steps[-1][0] - steps[0][0], faults, steps, [], None, "".join(lines))


def row(o: Outcome, clean: Outcome) -> list[Any]:
    stalls = o.stalls()
    restores = ", ".join(f"{r['source']} {r['gbps']:.2f} GB/s" for r in o.restarts) or "-"
    return [
        o.name,
        f"{o.train_s:.1f}",
        f"{clean.train_s / o.train_s:.2f}",
        "-" if o.goodput_logged is None else f"{o.goodput_logged:.2f}",
        "; ".join(what for _, what in o.faults) or "-",
        ", ".join(f"{d:.1f}" for d, _ in stalls) or "-",
        ", ".join(f"{g:.1f}" for _, g in stalls) or "-",
        str(o.redone()),
        restores,
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--after-s", type=float, default=30.0)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument(
        "--memory-every",
        type=int,
        default=10,
        help="steps between memory snapshots (checkpoint.memory)",
    )
    parser.add_argument(
        "--runs",
        nargs="*",
        default=list(RUNS),
        choices=list(RUNS),
        help="which runs (clean, kill and Ray Train alone's two always run)",
    )
    opts = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rl-goodput-"))
    where = "a GPU per node" if gpus() else "the CPU (gloo; CUDA wants 2 GPUs here, 1 per node)"
    print(f"goodput under faults on {describe()}, on {where}; gpt-tiny, {opts.steps} steps")
    runs: dict[str, Outcome] = {}
    always = ("clean", "kill", "bare-clean", "bare-kill")  # the table's headline compares them
    plan = [p for p in RUNS.values() if p[0] in always or p[0] in opts.runs]
    for i, (key, label, runner, make_fault, kills, memory) in enumerate(plan):
        name = label.format(kills=opts.kills, every=opts.memory_every)
        with two_nodes() as cluster:
            fault = make_fault(cluster) if make_fault else None
            times = opts.kills if kills else 1
            runs[key] = runner(cluster, root, f"run{i}", opts, fault, times, memory)
        o = runs[key]
        o.name = name  # the table's label; f"run{i}" was the run's own name
        stalls = [f"{d:.1f} s ({g:.1f} s stop)" for d, g in o.stalls()]
        print(f"{name}: trained {o.train_s:.1f} s; faults {[w for _, w in o.faults]}; "
              f"to the next step {stalls}; redone {o.redone()}")  # fmt: skip
        for line in o.out.splitlines():
            if line.startswith(("raylift: restart ", "raylift: goodput", "raylift: node ")):
                print(f"    {line}")
    report(runs, plan, opts)


# key: (label, runner, fault, killed --kills times, with memory snapshots)
RUNS: dict[str, tuple[str, str, Any, Any, bool, bool]] = {
    "clean": ("clean", "raylift, no fault", raylift_run, None, False, True),
    "clean-storage": ("clean-storage", "raylift, no fault, storage only", raylift_run, None,
                      False, False),
    "kill": ("kill", "raylift, a worker SIGKILLed {kills}x", raylift_run,
             lambda c: lambda: kill_a_worker(c), True, True),
    "kill-storage": ("kill-storage", "raylift, a worker SIGKILLed {kills}x, storage only",
                     raylift_run, lambda c: lambda: kill_a_worker(c), True, False),
    "drain": ("drain", "raylift, a node drained (30 s notice)", raylift_run,
              lambda c: lambda: drain(c), False, True),
    "raylet": ("raylet", "raylift, a node's raylet SIGKILLed", raylift_run,
               lambda c: lambda: kill_raylet(c), False, True),
    "bare-clean": ("bare-clean", "Ray Train alone, no fault", bare_run, None, False, False),
    "bare-kill": ("bare-kill", "Ray Train alone, a worker SIGKILLed {kills}x", bare_run,
                  lambda c: lambda: kill_a_worker(c), True, False),
}  # fmt: skip


def report(runs: dict[str, Outcome], plan: list[Any], opts: argparse.Namespace) -> None:
    keys = [p[0] for p in plan]
    clean, bare_clean = runs["clean"], runs["bare-clean"]
    plain = runs.get("clean-storage", clean)  # the same job without memory snapshots

    def reference(key: str) -> Outcome:
        return bare_clean if key.startswith("bare") else plain if "storage" in key else clean

    rows = [row(runs[k], reference(k)) for k in keys]
    kill, bare_kill = runs["kill"], runs["bare-kill"]
    ours = sum(d for d, _ in kill.stalls()) / len(kill.faults)
    floor = sum(d for d, _ in bare_kill.stalls()) / len(bare_kill.faults)
    phases = [
        [runs[k].name,
         *[line for line in runs[k].out.splitlines() if line.startswith("raylift: restart ")]]
        for k in keys if runs[k].restarts
    ]  # fmt: skip
    save(
        __file__,
        f"goodput under faults: gpt-tiny, {opts.steps} steps, 2 workers on 2 nodes, fp32, "
        + ("a GPU each" if gpus() else "CPU")
        + f"; raylift with a memory snapshot every {opts.memory_every} steps unless it says",
        ["run", "training s", "goodput (clean s / this s)", "raylift's goodput", "faults",
         "fault to the next step s", "the stop s", "steps redone", "restores"],
        rows,
        {
            "what": f"a worker SIGKILLed {opts.after_s:.0f} s after each start of training, "
            f"{opts.kills}x (gpt-tiny, a memory snapshot every {opts.memory_every} steps): "
            "goodput, fault to the next step, steps redone",
            "raylift": f"{clean.train_s / kill.train_s:.2f} ({plain.train_s / kill.train_s:.2f} "
            f"against the job without snapshots), {ours:.1f} s, {kill.redone()}",
            "baseline": f"Ray Train alone {bare_clean.train_s / bare_kill.train_s:.2f}, "
            f"{floor:.1f} s, {bare_kill.redone()}",
            "ratio": f"{ours - floor:+.1f} s per failure",
        },
        notes="Fault to the next step: from the fault to the first step logged by the group "
        "that trained on (both log every step); the stop: "
        "from the last step logged before that one (for a drain, the restart at its "
        f"deadline). A stop is a gap of more than {GAP_S:.0f} s between logged steps. Steps "
        "redone: raylift's own count (its restart lines); Ray Train alone's from its steps "
        "going back. After a drain or a raylet kill the run goes on with one worker of two, "
        "so its training time grows with the capacity lost: there raylift's goodput, which "
        "counts only the restarts' time, is the measure. The storage-only rows are against "
        "the no-fault run without snapshots, the others against the one with them (their "
        "cost is the two no-fault runs' difference). Each restart's phases are "
        "raylift's own line.",
        tables=[{"title": "raylift's restart lines", "columns": ["run", "lines"],
                 "rows": [[p[0], " | ".join(p[1:])] for p in phases]}],
    )  # fmt: skip


if __name__ == "__main__":
    main()
