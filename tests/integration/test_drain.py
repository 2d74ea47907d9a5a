"""A node lost under an elastic run, on a Ray of two nodes on this host (``ray start
--head`` and a second ``ray start --address``), two ways:

- drained for preemption, as a cloud's reclaim notice reaches Ray (``ray drain-node
  --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds``), under HSDP: two
  CPUs and two workers a node, FSDP sharded within each node and replicated across the
  two. The run saves at the notice (to storage and to memory), trains on, saves once
  more before the deadline and waits there; Ray Train tears the group down at the
  deadline, and the restart is sized without the leaving node at its first try, and
  restores from memory (the whole copy the node that stays kept of its own), its mesh
  one replica: that node. No step is redone.
- its raylet SIGKILLed, with no notice, under DDP (one CPU and one worker a node). Ray
  calls the node dead only after its health checks have failed for a while; the restart
  is sized without it all the same (its
  raylet takes no connection), at its first try, from the newest memory snapshot: the
  lost node's part from the copy its peer (the head) holds.

Each on its own Ray, in its own temp dir, stopped by pid."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers import HANG_S, raylets_of, stop_ray_of, wait_until
from tests.integration.test_autoscaler import HELD, free_port
from tests.integration.test_train import OURS

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"
# The notice's lead, as a cloud gives it: long enough to train in and save twice (the
# restart waits for it to pass, so no longer than that).
DEADLINE_S = 20
RAY = str(Path(sys.executable).parent / "ray")
# A trained step's progress line ("step N/M"), not an evaluation's ("step N  eval"): an
# epoch's evaluation comes after the restart where the deadline fell on its last step.
STEP = re.compile(r"^epoch\s+\d+\s+step\s+(\d+)/")
SNAPSHOT_EVERY = 2  # steps between memory snapshots in the raylet's case
# Two workers a node of two CPUs (room beside them for Ray Data's reads), FSDP's mesh
# auto; the global batch kept at 2, 3 or 4 workers: 3 x 4 micro-batches a step.
HSDP = ["strategy.name=fsdp", "scaling.num_workers=[2,4]", "scaling.cpus_per_worker=0.8",
        "train.grad_accum=3", "data.batch_size=8"]  # fmt: skip
MESHES = ["raylift: mesh: replicate 2 (nodes) x shard 2 (workers per node) x tp 1",
          "raylift: mesh: replicate 1 x shard 2 (within a node) x tp 1"]  # fmt: skip


@contextlib.contextmanager
def two_nodes(
    root: Path, shell: dict[str, str], cpus: int = 1
) -> Iterator[tuple[dict[str, str], str, str]]:
    """A local Ray of a head and one more node, ``cpus`` CPUs each: the environment to reach
    it, the second node's id and the Ray's temp dir. Stopped by pid."""
    temp_dir = tempfile.mkdtemp(prefix="rl-dr-", dir="/tmp")  # short: unix socket paths
    gcs = free_port()
    env = {k: v for k, v in shell.items() if not k.startswith("RAY_")}
    env.update(RAY_AUTH_MODE="token", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    common = ["--node-ip-address=127.0.0.1", f"--num-cpus={cpus}", "--disable-usage-stats",
              f"--dashboard-agent-listen-port={free_port()}"]  # fmt: skip
    try:
        for args in (
            ["get-auth-token", "--generate"],
            ["start", "--head", f"--port={gcs}", f"--temp-dir={temp_dir}",
             "--dashboard-host=127.0.0.1", f"--dashboard-port={free_port()}", *common],
            ["start", f"--address=127.0.0.1:{gcs}", *common[:3],
             f"--dashboard-agent-listen-port={free_port()}"],
        ):  # fmt: skip
            done = subprocess.run([RAY, *args], env=env, cwd=root, capture_output=True,
                                  text=True, timeout=HANG_S)  # fmt: skip
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        raylets = wait_until(lambda: len(found := raylets_of(temp_dir)) == 2 and found,
                             "two raylets", seen=lambda: raylets_of(temp_dir))  # fmt: skip
        yield {**env, "RAY_ADDRESS": f"127.0.0.1:{gcs}"}, raylets[-1][1], temp_dir
    finally:
        stop_ray_of(temp_dir, timeout=3.0)
        shutil.rmtree(temp_dir, ignore_errors=True)


def drain(env: dict[str, str], node: str) -> None:
    args = [RAY, "drain-node", "--address", env["RAY_ADDRESS"], "--node-id", node,
            "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message",
            "spot instance reclaimed", "--deadline-remaining-seconds", str(DEADLINE_S)]  # fmt: skip
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stdout + done.stderr


def kill_raylet(temp_dir: str, node: str) -> None:
    (pid,) = [pid for pid, found in raylets_of(temp_dir) if found == node]
    os.kill(pid, signal.SIGKILL)


def elastic_run(
    root: Path,
    env: dict[str, str],
    name: str,
    fault: Callable[[], None],
    *extra: str,
    shrunk: str = "-> 1 workers",
) -> tuple[str, dict[str, float]]:
    """The elastic run, with ``fault`` done once it trains on both nodes; its console, and
    when the fault came and each step's line (``step N``). ``shrunk``: the console's words
    for the restart without the node, after which the run goes at full speed."""
    hold = root / "hold"
    hold.touch()
    run = subprocess.Popen(
        [sys.executable, "-m", "raylift.cli", "train", str(QUICKSTART), f"name={name}",
         f"storage={root / 'runs'}", f"tracking.uri=sqlite:///{root / 'mlflow.db'}", *HELD,
         f"task_args.hold={hold}", "scaling.num_workers=[1,2]", "scaling.cpus_per_worker=1",
         "train.max_epochs=10", "train.max_steps=100", "train.log_every_n_steps=1",
         "train.early_stopping=null", *extra],
        cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: list[str] = []
    when: dict[str, float] = {}
    try:
        for line in run.stdout:  # type: ignore[union-attr]
            lines.append(line)
            at = STEP.match(line)
            if at and int(at.group(1)) >= 3 and "fault" not in when:
                fault()
                when["fault"] = time.time()
            if shrunk in line:
                hold.unlink(missing_ok=True)  # the rest at full speed
            if at:
                when.setdefault(f"step {at.group(1)}", time.time())
        run.wait(timeout=HANG_S)
    finally:
        hold.unlink(missing_ok=True)
        if run.poll() is None:
            run.kill()
    out = "".join(lines)
    assert run.returncode == 0, out[-4000:]
    return out, when


@pytest.fixture(scope="module")
def drained(user_shell: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Storage checkpoints far apart: what the run keeps is the notice's and the deadline's."""
    root = tmp_path_factory.mktemp("drain")
    with two_nodes(root, user_shell, cpus=2) as (env, node, _):
        out, when = elastic_run(
            root, env, "drained", lambda: drain(env, node), "checkpoint.every_n_steps=1000",
            "checkpoint.memory.every_n_steps=20", *HSDP, shrunk="-> 2 workers",
        )  # fmt: skip
    return {"out": out, "when": when}


@pytest.fixture(scope="module")
def raylet_killed(user_shell: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("raylet-kill")
    with two_nodes(root, user_shell) as (env, node, temp_dir):
        out, when = elastic_run(
            root,
            env,
            "killed",
            lambda: kill_raylet(temp_dir, node),
            "checkpoint.every_n_steps=1000",
            f"checkpoint.memory.every_n_steps={SNAPSHOT_EVERY}",
            "train.max_failures=2",
        )
    return {"out": out, "when": when}


def test_a_drained_node_costs_no_step_and_no_placement_timeout(drained: dict) -> None:
    out, when = drained["out"], drained["when"]
    assert not [x for x in out.splitlines() if not x.startswith(OURS)], out
    notice = re.search(r"raylift: preemption notice: checkpoint at step (\d+)", out)
    last = re.search(
        r"raylift: the leaving node goes in \d+ s: checkpoint at step (\d+) saved", out
    )
    assert notice and last, out
    resumed = re.search(
        r"raylift: resumed from the run's memory snapshot at step (\d+) .*4 -> 2 work", out
    )
    assert resumed and int(resumed.group(1)) == int(last.group(1)), out
    # The deadline's save went to storage and to memory: the same step, from memory,
    # from the whole copy the node that stayed kept of its own (HSDP: no peer copies).
    assert re.search(
        rf"snapshot at step {last.group(1)} is whole in the copy of rank\(s\) \[\d, \d\]", out
    ), out
    assert "held on each node, a whole copy on each (HSDP's replicas)" in out, out
    assert re.search(r"MiB restored from memory in [\d.]+ s", out), out
    lines = out.splitlines()
    restart = next(i for i, x in enumerate(lines) if x.startswith("raylift: resumed from"))
    before = [int(m.group(1)) for x in lines[:restart] if (m := STEP.match(x))]
    after = [int(m.group(1)) for x in lines[restart:] if (m := STEP.match(x))]
    # No step is trained twice: the last one before the restart is the one it resumed at.
    assert max(before) == int(resumed.group(1)) and min(after) == max(before) + 1, (before, after)
    reclaimed = [x for x in lines if " reclaimed (drained for preemption): restarting" in x]
    assert len(reclaimed) == 1 and reclaimed[0].endswith("against train.max_failures)"), out
    # The restart was placed at its first try: Ray Train did not wait out its start timeout
    # for a worker on the leaving node, and tried no second size.
    assert "could not all be placed" not in out, out
    assert "restart 1 cost" in out and "after redoing 0 step(s)" in out, out
    # HSDP over both nodes, then one replica: the node that stayed.
    assert [x for x in lines if x.startswith("raylift: mesh:")] == MESHES, out
    sent, gone, back = when["fault"], when[f"step {max(before)}"], when[f"step {min(after)}"]
    marks = ("preemption notice", "leaving node goes", "reclaimed", "from memory", "restart 1",
             "mesh:")  # fmt: skip
    print("", *[x for x in lines if any(m in x for m in marks)], sep="\n")
    print(
        f"the drain's timeline, from the drain: the last step before the restart at "
        f"{gone - sent:.1f} s, the first after it at {back - sent:.1f} s "
        f"({back - gone:.1f} s between)"
    )


def test_a_node_whose_raylet_died_is_left_out_of_the_restart_at_once(raylet_killed: dict) -> None:
    """No notice: the workers on the node die with its raylet, and the run restarts with
    the worker that is left, at its first try, well before Ray's health checks call the
    node dead, from its newest memory snapshot (one every 2 steps; storage's every 1000):
    the lost node's part from its peer's copy."""
    out = raylet_killed["out"]
    assert not [x for x in out.splitlines() if not x.startswith(OURS)], out
    # The failure names the node that went, not only the surviving rank's broken collective.
    failed = [x for x in out.splitlines() if " failed" in x]
    assert len(failed) == 1 and "restarting the workers from " in failed[0], out
    assert re.match(
        r"raylift: node \S+ stopped answering \(its raylet takes no connection\) "
        r"with worker rank\(s\) \[\d\] on it; worker rank \d failed with it",
        failed[0],
    ), failed
    assert re.search(r"raylift: resumed from the run's memory snapshot at step \d+ .*2 -> 1 w", out)
    # Ray places either rank on the second node: its rank's part came from the head's keeper.
    assert re.search(
        r"raylift: restored from memory: the memory snapshot at step \d+ is complete on every "
        r"rank and newer than storage's step -1; rank\(s\) \[\d\] from the copy on their peer node",
        out,
    ), out
    assert "could not all be placed" not in out, out
    cost = re.search(
        r"raylift: restart 1 cost .* from memory .* after redoing (\d+) step\(s\)", out
    )
    # At most the steps since the newest snapshot complete on every rank: the one on its
    # way at the kill may not be.
    assert cost and int(cost.group(1)) <= 2 * SNAPSHOT_EVERY, out
    marks = (" failed", "restart 1 ", "from memory")
    print("", *[x for x in out.splitlines() if any(m in x for m in marks)], sep="\n")
