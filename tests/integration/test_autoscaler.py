"""The cluster as it is: cluster/local-fake.yaml (Ray's fake_multinode autoscaler; the head
holds no worker), storage on the S3 server. `raylift check` before a run; `raylift submit`
trains a fixed-size run through the Jobs API, on nodes the autoscaler starts, with the
default tracking store; an elastic run starts with what there is room for, grows when the
autoscaler brings another node and shrinks when the cloud reclaims one; the idle nodes go
after. Its own Ray, in its own temp dir, stopped by pid."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from raylift.run.connect import WORKER_ENV
from tests.helpers import HANG_S, finish_output, stop_ray_of, wait_until
from tests.integration.test_train import OURS

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
FAKE = REPO / "cluster" / "local-fake.yaml"
QUICKSTART = REPO / "configs" / "quickstart.yaml"
IDLE_MINUTES = 0.25  # idle nodes go after 15 s, so the test sees them go


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class FakeCluster:
    def __init__(self, root: Path, temp_dir: str, gcs: int, dashboard: int, shell: dict[str, str]):
        self.root, self.temp_dir, self.shell = root, temp_dir, shell
        self.address, self.jobs = f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dashboard}"
        self.watch = root / "nodes.jsonl"
        self.hold = root / "hold"
        self.times: dict[str, float] = {}  # the scenario's timeline: when each thing happened

    def env(self) -> dict[str, str]:
        """A user's shell on the head's host, pointed at this cluster."""
        env = {k: v for k, v in self.shell.items() if k not in WORKER_ENV}
        return {
            **env,
            "RAY_ADDRESS": self.address,
            "RAY_AUTH_MODE": "token",
            "PYTHONPATH": str(REPO),
            "PYTHONUNBUFFERED": "1",
        }

    def raylift(
        self, *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "raylift.cli", *args],
            cwd=cwd or self.root, env={**self.env(), **(env or {})}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip

    def history(self) -> list[tuple[float, dict[str, float]]]:
        rows = [json.loads(line) for line in self.watch.read_text().splitlines() if line]
        return [(r["t"], r["nodes"]) for r in rows]


@contextlib.contextmanager
def fake_cluster(root: Path, shell: dict[str, str]) -> Iterator[FakeCluster]:
    """The fake autoscaling cluster, stopped by pid when done."""
    temp_dir = tempfile.mkdtemp(prefix="rl-fk-", dir="/tmp")  # short: unix socket paths
    gcs, dashboard = free_port(), free_port()
    config = yaml.safe_load(FAKE.read_text())
    config["provider"]["gcs_address"] = f"127.0.0.1:{gcs}"
    config["idle_timeout_minutes"] = IDLE_MINUTES
    (root / "fake.yaml").write_text(yaml.safe_dump(config))
    fake = FakeCluster(root, temp_dir, gcs, dashboard, shell)
    # RAYLIFT_HOME: where a submitted job's default MLflow store goes on the head.
    env = {**fake.env(), "RAY_FAKE_CLUSTER": "1", "RAYLIFT_HOME": str(root / "head-home")}
    env.pop("RAY_ADDRESS")
    head = [
        shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray",
        "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}",
        "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", "--num-cpus=0",
        f"--autoscaling-config={root / 'fake.yaml'}", f"--temp-dir={temp_dir}",
        # Ray's fixed default (52365) is taken by any other Ray on the host, and the head's
        # agent is the one that runs submitted jobs.
        f"--dashboard-agent-listen-port={free_port()}",
        "--disable-usage-stats",
    ]  # fmt: skip
    watcher = None
    try:
        # `ray start` with RAY_AUTH_MODE=token wants a token to exist (ray.init makes one;
        # on a fresh machine nothing has yet): made here as a user would, once per host.
        token = subprocess.run([head[0], "get-auth-token", "--generate"], env=env, cwd=root,
                               capture_output=True, text=True, timeout=HANG_S)  # fmt: skip
        assert token.returncode == 0, token.stderr[-2000:]
        fake.times["head started"] = time.time()
        started = subprocess.run(
            head, env=env, cwd=root, capture_output=True, text=True, timeout=HANG_S
        )
        fake.times["head up"] = time.time()
        assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
        watcher = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "nodes_watch.py"), fake.address, str(fake.watch)],
            env=fake.env(), cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        yield fake
    finally:
        if watcher is not None:
            watcher.kill()
        stop_ray_of(temp_dir, timeout=3.0)  # what is left after 3 s is killed: it is all Ray
        shutil.rmtree(temp_dir, ignore_errors=True)


def autoscaler_scenario(root: Path, shell: dict[str, str]) -> dict[str, Any]:
    """Everything the tests below look at, run once, in order: each step's console, the
    cluster's record of its nodes, and how long the idle nodes took to go. ``shell``: the
    environment a user's shell would have."""
    with fake_cluster(root, shell) as cluster:
        out: dict[str, Any] = {"cluster": cluster, **in_order(cluster)}
        wait_for_idle(cluster)
    return out


def wait_for_idle(cluster: FakeCluster, timeout: float = 900) -> None:
    """Until the head is alone again, or ``timeout`` (then the test of the idle nodes
    shows what was left): the idle nodes' going is recorded."""
    deadline = time.time() + timeout
    while time.time() < deadline and any(cpus for cpus in cluster.history()[-1][1].values()):
        time.sleep(2)


@pytest.fixture(scope="module")
def scenario(user_shell: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return autoscaler_scenario(tmp_path_factory.mktemp("autoscaler"), user_shell)


@pytest.fixture(scope="module")
def cluster(scenario: dict) -> FakeCluster:
    return scenario["cluster"]  # type: ignore[no-any-return]


def finish(proc: subprocess.Popen, what: str) -> str:
    out, _ = finish_output(proc, what)
    assert proc.returncode == 0, f"{what}:\n{out[-4000:]}"
    return str(out)


def finish_timed(cluster: FakeCluster, proc: subprocess.Popen, what: str, marks: dict) -> str:
    """``finish``, recording in the timeline when the first line matching each of
    ``marks`` (name -> pattern) came."""
    lines = []
    for line in proc.stdout:  # type: ignore[union-attr]
        lines.append(line)
        for name, pattern in marks.items():
            if name not in cluster.times and re.search(pattern, line):
                cluster.times[name] = time.time()
    proc.wait(timeout=HANG_S)  # its output has ended
    out = "".join(lines)
    assert proc.returncode == 0, f"{what}:\n{out[-4000:]}"
    return out


def in_order(cluster: FakeCluster) -> dict[str, str]:
    """The checks, the submitted run and the elastic run, in order; each one's console."""
    bucket = f"s3://runs/{cluster.root.name}"
    common = [f"storage={bucket}", "train.early_stopping=null", *HELD]
    out: dict[str, str] = {}
    check = [str(QUICKSTART), f"storage={bucket}", f"--cluster-config={cluster.root / 'fake.yaml'}"]
    right = cluster.raylift("check", *check)
    wrong = cluster.raylift("check", *check[:1], "storage=s3://no-such-bucket/runs", *check[2:])
    out["check"] = finish(right, "check")  # the two checks ran side by side
    out["check-wrong"], _ = finish_output(wrong, "check of a wrong bucket")
    out["check-wrong-code"] = str(wrong.returncode)
    # A fixed-size run (2 workers) through the Jobs API: the head holds no CPU, so its
    # workers land on nodes the autoscaler launches for it.
    out["submit"] = finish_timed(
        cluster,
        cluster.raylift(
            # The fake nodes share this disk: the job runs in the repository itself. (A
            # shipped copy would be unpacked again, under the driver, by each new node.)
            "submit", "configs/quickstart.yaml", "--address", cluster.jobs, "--in-place", "train",
            "name=submitted", "train.max_steps=10", *common, f"task_args.hold={cluster.hold}",
            cwd=REPO,
        ),
        "raylift submit",
        {"submit's first step": r"^epoch\s+\d+\s+step\s+\d+/"},
    )  # fmt: skip
    out.update(elastic_run(cluster, common))
    return out


# The digits task whose every batch waits 0.5 s while a hold file exists: held, the elastic
# run's 70 steps take at least 105 s on 2 workers (3 batches a step) and 70 s on 3, time
# for the cluster to grow and shrink under it; once the hold is lifted the rest runs at
# full speed.
HELD = ["task=tests.elastic_run:HeldDigits", "task_args={hold_s: 0.5, width: 32, dropout: 0.1}"]


def set_node_cap(cluster: FakeCluster, cap: int) -> None:
    """How many worker nodes the autoscaler may run: it rereads its config every update,
    as a cloud's capacity (spot, quota) changes under a running cluster."""
    config = yaml.safe_load((cluster.root / "fake.yaml").read_text())
    config["max_workers"] = config["available_node_types"]["cpu_worker"]["max_workers"] = cap
    (cluster.root / "fake.yaml").write_text(yaml.safe_dump(config))


def notice_a_reclaim(cluster: FakeCluster) -> str:
    """The cloud says it will take a worker node back (a spot reclaim notice): Ray's
    drain of the last worker node the cluster lists, for preemption, with a deadline, as
    Ray's autoscaler asks for it. Its id."""
    _, nodes = cluster.history()[-1]
    node = [n for n, cpus in nodes.items() if cpus > 0][-1]
    drain = [
        str(Path(sys.executable).parent / "ray"), "drain-node", "--address", cluster.address,
        "--node-id", node, "--reason", "DRAIN_NODE_REASON_PREEMPTION",
        "--reason-message", "spot instance reclaimed", "--deadline-remaining-seconds", "600",
    ]  # fmt: skip
    done = subprocess.run(drain, env=cluster.env(), capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stdout + done.stderr
    return node


def reclaim_a_node(cluster: FakeCluster, node: str) -> str:
    """The cloud takes worker node ``node`` back: its raylet gets SIGTERM, as a VM's
    shutdown sends it, and takes its workers with it."""
    import psutil

    for proc in psutil.process_iter(["name", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if proc.info["name"] == "raylet" and f"--node_id={node}" in cmdline:
            proc.terminate()
            return node
    raise AssertionError(f"no raylet of node {node}")


def elastic_run(cluster: FakeCluster, common: list[str]) -> dict[str, str]:
    """``num_workers: [1, 3]`` (its shards ready) while the cloud has room for 2 nodes: it
    starts on what is there. Room for a third appears; the autoscaler launches it and the
    run grows to 3 from its checkpoint. Then the room goes again and a node is reclaimed:
    the run goes on with 2. Its batches wait while the hold file exists, until it has
    shrunk; then the rest runs at full speed. What it printed, and when each came."""
    set_node_cap(cluster, 2)
    cluster.hold.touch()
    proc = cluster.raylift(
        "train", str(QUICKSTART), "name=elastic", *common, f"task_args.hold={cluster.hold}",
        # A try at placing the workers waits 10 s, not a minute: after the reclaim, the
        # first restart may still count the lost node.
        "scaling.num_workers=[1,3]", "scaling.resize_interval_s=5", "train.grad_accum=2",
        "scaling.placement_timeout_s=10",
        "train.max_failures=5", "train.max_epochs=10", "checkpoint.every_n_steps=5",
        "train.log_every_n_steps=5",
    )  # fmt: skip
    lines: list[str] = []
    seen: dict[str, str] = {"run": f"s3://runs/{cluster.root.name}/elastic"}
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            step(cluster, line, seen)
        proc.wait(timeout=HANG_S)
    finally:
        cluster.hold.unlink(missing_ok=True)
        set_node_cap(cluster, 3)
    out = "".join(lines)
    assert proc.returncode == 0, f"the elastic run:\n{out[-4000:]}"
    return {"elastic": out, **seen}


def step(cluster: FakeCluster, line: str, seen: dict[str, str]) -> None:
    """The cloud's side of the elastic run, driven by what the run prints. Lines of
    workers that stopped may still arrive after a restart's first ones: a line counts as
    the grown run's by its step."""
    at = re.search(r"\bstep\s+(\d+)", line)
    grown = re.search(r"at step (\d+) .*-> 3 workers", line)
    progress = re.match(r"epoch\s+\d+\s+step\s+(\d+)/", line)
    if progress and int(progress.group(1)) >= 5 and "capped" not in seen:
        # Trained and saved on at most 2 nodes (a group that grows before its first
        # checkpoint starts afresh, and says nothing): room for one more.
        set_node_cap(cluster, 3)
        seen["capped"] = str(time.time())
    elif grown and "grew_at" not in seen:
        seen["grew_at"], seen["grew_step"] = str(time.time()), grown.group(1)
    elif line.startswith("epoch ") and at and "grew_at" in seen and "noticed" not in seen:
        if int(at.group(1)) >= int(seen["grew_step"]) + 10:  # trained and saved at 3
            seen["noticed"] = notice_a_reclaim(cluster)  # the room goes after the notice
    elif line.startswith("raylift: preemption notice: checkpoint at step") and "noticed" in seen:
        if "reclaimed" not in seen:  # the run saves on the notice; then the node goes
            from raylift.tensors.checkpoints import newest_written

            seen["notice_line"] = line.strip()
            saved = f"{seen['run']}/checkpoint-step{int(line.split()[-1]):08d}"
            wait_until(lambda: newest_written(seen["run"]) == saved, f"{saved} written",
                       seen=lambda: newest_written(seen["run"]))  # fmt: skip
            set_node_cap(cluster, 2)  # the room goes, and the node with it
            seen["reclaimed"] = reclaim_a_node(cluster, seen["noticed"])
            seen["reclaimed_at"] = str(time.time())
    elif re.search(r"-> 2 workers", line) and "reclaimed" in seen:
        seen.setdefault("shrank_at", str(time.time()))
        cluster.hold.unlink(missing_ok=True)


def quiet(out: str) -> list[str]:
    return [line for line in out.splitlines() if not line.startswith(OURS)]


def test_check_says_the_run_can_start_and_names_a_wrong_bucket(scenario: dict) -> None:
    out = scenario["check"]
    print(f"\n{out}\n{scenario['check-wrong']}")  # the two tables, for the record
    assert "raylift: the run can start" in out, out
    assert "1 node(s) alive" in out  # the head alone: every worker node comes on demand
    assert "the autoscaler's node types up to 3 more" in out and "it fits" in out
    wrong = scenario["check-wrong"]
    assert scenario["check-wrong-code"] == "2", wrong
    assert "storage: the driver, node " in wrong and "cannot write a marker" in wrong, wrong
    assert "no-such-bucket" in wrong


def test_a_fixed_size_run_gets_its_workers_on_nodes_the_autoscaler_starts(
    cluster: FakeCluster, scenario: dict
) -> None:
    """The submitted run: 2 workers, and the head holds no CPU."""
    out = scenario["submit"]
    assert not quiet(out), quiet(out)
    assert out.count("model state held by rank 0") == 1, out  # once, not once per node
    assert "finished" in out and "at step 10" in out, out[-3000:]
    history = cluster.history()
    workers = {n for _, nodes in history for n, cpus in nodes.items() if cpus > 0}
    assert len(workers) >= 2, history[-1]  # the head has no CPU: these were launched


def test_an_elastic_run_grows_when_a_node_comes_and_shrinks_when_one_goes(
    cluster: FakeCluster, scenario: dict
) -> None:
    """It started on what there was room for (at most 2 nodes), grew to 3 workers from its
    checkpoint when the autoscaler brought a third node, saved at once when Ray gave notice
    that a node would be reclaimed (a drain for preemption) and went on with 2 from that
    checkpoint when it was, kept its global batch throughout, and trained every step."""
    out = scenario["elastic"]
    assert not quiet(out), quiet(out)
    assert scenario.get("shrank_at"), out[-3000:]
    assert "finished" in out and "at step 70" in out, out[-3000:]  # 10 epochs of 7 steps
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{cluster.root / 'mlflow.db'}")
    exp = client.get_experiment_by_name("raylift")
    (run,) = client.search_runs([exp.experiment_id], "tags.`mlflow.runName` = 'elastic'")
    sizes = [int(m.value) for m in client.get_metric_history(run.info.run_id, "world_size")]
    batches = {m.value for m in client.get_metric_history(run.info.run_id, "global_batch")}
    changes = [w for i, w in enumerate(sizes) if i == 0 or sizes[i - 1] != w]
    assert changes[0] <= 2 and changes[-2:] == [3, 2], sizes  # grew to 3, then back to 2
    assert changes[:-1] == sorted(changes[:-1]), sizes
    assert batches == {192.0}, batches  # 32 x 3 accumulated on 2 workers, 32 x 2 on 3
    resizes = re.findall(r"resumed from (\S+) .*; (\d) -> (\d) workers", out)
    start = cluster.history()[0][0]
    after = {
        k: f"{float(scenario[k]) - start:.0f} s" for k in ("grew_at", "reclaimed_at", "shrank_at")
    }
    print(f"elastic world sizes in order {sizes}; resizes {resizes}; after the head: {after}")
    # Each resize said once (the fake nodes share a logs folder and each forwards it), and
    # the reclaimed node's loss is one line that names where the run goes on from.
    assert [r[2] for r in resizes][-2:] == ["3", "2"], resizes
    notice = int(scenario["notice_line"].rsplit(" ", 1)[1])
    assert resizes[-1][0].endswith(f"checkpoint-step{notice:08d}"), (resizes, notice)
    assert [r[2] for r in resizes].count("3") == 1, resizes
    assert all(r[0].startswith("s3://runs/") for r in resizes), resizes
    (fault,) = [line for line in out.splitlines() if " failed: " in line]
    assert (
        fault.startswith("raylift: worker rank ")
        and "restarting the workers from s3://runs/" in fault
    ), fault


def test_submit_trains_through_the_jobs_api_with_s3_and_the_drivers_store(
    scenario: dict,
) -> None:
    out = scenario["submit"]
    assert "SUCCEEDED" in out, out[-3000:]
    assert "raylift-train-submitted-" in out  # the submission id names the verb and run
    assert "finished in" in out  # the job's own log, followed to the end
    found = re.search(r"MLflow tracking at sqlite:///(\S+) ", out)
    assert found, out[-3000:]
    db = Path(found.group(1))  # on the head's disk: the job's driver runs there
    assert db.parent.name == "head-home", db  # $RAYLIFT_HOME, not the job's own folder
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    (run,) = client.search_runs([client.get_experiment_by_name("raylift").experiment_id])
    assert run.info.status == "FINISHED"
    assert client.get_metric_history(run.info.run_id, "train_loss"), "rank 0's metrics"
    assert "raylift: checkpoint s3://runs/" in out
    # Its model beside the store, not in Ray's copy of the job's folder, deleted after it.
    assert run.info.artifact_uri.startswith((db.parent / "mlruns").as_uri()), run.info
    assert client.list_artifacts(run.info.run_id), "the run's artifacts"


def test_the_idle_nodes_go_after_the_runs(cluster: FakeCluster, scenario: dict) -> None:
    history = cluster.history()  # to when the head was alone again (or 3 minutes on)
    first_seen: dict[str, float] = {}
    last_seen: dict[str, float] = {}
    for t, nodes in history:
        for n, cpus in nodes.items():
            if cpus > 0:
                first_seen.setdefault(n, t)
                last_seen[n] = t
    start = cluster.times["head started"]
    timeline = [(t, name) for name, t in cluster.times.items()]
    for n in first_seen:
        timeline += [(first_seen[n], f"node {n[-6:]} up"), (last_seen[n], f"node {n[-6:]} gone")]
    print(f"nodes launched: {len(first_seen)}; timeline (s after `ray start --head`):")
    for t, name in sorted(timeline):
        print(f"  {t - start:6.0f}  {name}")
    _, nodes = history[-1]
    assert all(cpus == 0 for cpus in nodes.values()), nodes  # the head alone again
