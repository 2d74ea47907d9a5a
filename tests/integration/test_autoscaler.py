"""The cluster as it is: cluster/local-fake.yaml (Ray's fake_multinode autoscaler; the head
holds no worker), storage on the S3 server. `raylift check` before a run; `raylift submit`
trains a fixed-size run through the Jobs API, on nodes the autoscaler starts, with the
default tracking store; an elastic run starts with what there is room for and grows when
the autoscaler brings another node; the idle nodes go after. Its own Ray, in its own temp
dir, stopped by pid."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from raylift.launch import WORKER_ENV
from tests.helpers import stop_ray_of
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
    def __init__(self, root: Path, temp_dir: str, gcs: int, dashboard: int):
        self.root, self.temp_dir = root, temp_dir
        self.address, self.jobs = f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dashboard}"
        self.watch = root / "nodes.jsonl"
        self.hold = root / "hold"

    def env(self) -> dict[str, str]:
        """A user's shell on the head's host, pointed at this cluster."""
        env = {k: v for k, v in os.environ.items() if k not in WORKER_ENV}
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


@pytest.fixture(scope="module")
def cluster(
    own_rays: dict, s3_server: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FakeCluster]:
    """The fake autoscaling cluster, beside the other tests that start Rays of their own
    (``own_rays``, started first)."""
    root = tmp_path_factory.mktemp("fake-cluster")
    temp_dir = tempfile.mkdtemp(prefix="rl-fk-", dir="/tmp")  # short: unix socket paths
    gcs, dashboard = free_port(), free_port()
    config = yaml.safe_load(FAKE.read_text())
    config["provider"]["gcs_address"] = f"127.0.0.1:{gcs}"
    config["idle_timeout_minutes"] = IDLE_MINUTES
    (root / "fake.yaml").write_text(yaml.safe_dump(config))
    fake = FakeCluster(root, temp_dir, gcs, dashboard)
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
        token = subprocess.run([head[0], "get-auth-token", "--generate"], env=env,
                               capture_output=True, text=True, timeout=60)  # fmt: skip
        assert token.returncode == 0, token.stderr[-2000:]
        started = subprocess.run(head, env=env, capture_output=True, text=True, timeout=120)
        assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
        watcher = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "nodes_watch.py"), fake.address, str(fake.watch)],
            env=fake.env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        yield fake
    finally:
        if watcher is not None:
            watcher.kill()
        stop_ray_of(temp_dir, timeout=3.0)  # what is left after 3 s is killed: it is all Ray
        shutil.rmtree(temp_dir, ignore_errors=True)


def finish(proc: subprocess.Popen, what: str, timeout: float = 600) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"{what}:\n{out[-4000:]}"
    return str(out)


@pytest.fixture(scope="module")
def scenario(cluster: FakeCluster) -> dict[str, str]:
    """Everything the tests below look at, run once, in order; each step's console."""
    bucket = f"s3://runs/{cluster.root.name}"
    common = [f"storage={bucket}", "train.early_stopping=null", *HELD]
    out: dict[str, str] = {}
    check = [str(QUICKSTART), f"storage={bucket}", f"--cluster-config={cluster.root / 'fake.yaml'}"]
    right = cluster.raylift("check", *check)
    wrong = cluster.raylift("check", *check[:1], "storage=s3://no-such-bucket/runs", *check[2:])
    out["check"] = finish(right, "check")  # the two checks ran side by side
    out["check-wrong"], _ = wrong.communicate(timeout=300)
    out["check-wrong-code"] = str(wrong.returncode)
    # A fixed-size run (2 workers) through the Jobs API: the head holds no CPU, so its
    # workers land on nodes the autoscaler launches for it.
    out["submit"] = finish(
        cluster.raylift(
            # The fake nodes share this disk: the job runs in the repository itself. (A
            # shipped copy would be unpacked again, under the driver, by each new node.)
            "submit", "configs/quickstart.yaml", "--address", cluster.jobs, "--in-place", "train",
            "name=submitted", "train.max_steps=10", *common, f"task_args.hold={cluster.hold}",
            cwd=REPO,
        ),
        "raylift submit",
    )  # fmt: skip
    out["elastic"], out["grew_at"] = elastic_run(cluster, common)
    out["idle_since"] = str(time.time())
    return out


# The digits task whose every batch waits 0.5 s while a hold file exists: the elastic run
# cannot finish before its third node comes, however fast this machine trains.
HELD = ["task=tests.elastic_run:HeldDigits", "task_args={hold_s: 0.5, width: 32, dropout: 0.1}"]


def set_node_cap(cluster: FakeCluster, cap: int) -> None:
    """How many worker nodes the autoscaler may run: it rereads its config every update,
    as a cloud's capacity (spot, quota) changes under a running cluster."""
    config = yaml.safe_load((cluster.root / "fake.yaml").read_text())
    config["max_workers"] = config["available_node_types"]["cpu_worker"]["max_workers"] = cap
    (cluster.root / "fake.yaml").write_text(yaml.safe_dump(config))


def elastic_run(cluster: FakeCluster, common: list[str]) -> tuple[str, str]:
    """``num_workers: [1, 3]`` (its shards ready) while the cloud has room for 2 nodes: it
    starts on what is there; then room for a third appears, the autoscaler launches it,
    and the run grows to 3 from its checkpoint. Its batches wait while the hold file
    exists, until the run has grown; then the rest runs at full speed."""
    set_node_cap(cluster, 2)
    cluster.hold.touch()
    proc = cluster.raylift(
        "train", str(QUICKSTART), "name=elastic", *common, f"task_args.hold={cluster.hold}",
        "scaling.num_workers=[1,3]", "scaling.resize_interval_s=5", "train.grad_accum=2",
        "train.max_failures=5", "train.max_epochs=4", "checkpoint.every_n_steps=5",
        "train.log_every_n_steps=5",
    )  # fmt: skip
    lines: list[str] = []
    grew_at = ""
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if line.startswith("epoch ") and cluster.hold.exists() and not grew_at:
                set_node_cap(cluster, 3)  # training, on at most 2 nodes: room for one more
            if re.search(r"-> 3 workers", line) and not grew_at:
                grew_at = str(time.time())
                cluster.hold.unlink()
        proc.wait(timeout=600)
    finally:
        cluster.hold.unlink(missing_ok=True)
        set_node_cap(cluster, 3)
    out = "".join(lines)
    assert proc.returncode == 0, f"the elastic run:\n{out[-4000:]}"
    return out, grew_at


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


def test_an_elastic_run_grows_onto_the_node_the_autoscaler_brings(
    cluster: FakeCluster, scenario: dict
) -> None:
    """It started on what there was room for (at most 2 nodes), grew to 3 workers from its
    checkpoint when the third node came, kept its global batch, and trained every step."""
    out = scenario["elastic"]
    assert not quiet(out), quiet(out)
    assert scenario["grew_at"], out[-3000:]
    assert "finished" in out and "at step 28" in out, out[-3000:]  # 4 epochs of 7 steps
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{cluster.root / 'mlflow.db'}")
    exp = client.get_experiment_by_name("raylift")
    (run,) = client.search_runs([exp.experiment_id], "tags.`mlflow.runName` = 'elastic'")
    sizes = [int(m.value) for m in client.get_metric_history(run.info.run_id, "world_size")]
    batches = {m.value for m in client.get_metric_history(run.info.run_id, "global_batch")}
    assert sizes[0] <= 2 and sizes[-1] == 3 and sizes == sorted(sizes), sizes
    assert batches == {192.0}, batches  # 32 x 3 accumulated on 2 workers, 32 x 2 on 3
    grew = re.findall(r"resumed from (\S+) .*; (\d) -> (\d) workers", out)
    start = cluster.history()[0][0]
    print(f"elastic world sizes in order {sizes}; resizes {grew}; "
          f"grew to 3 {float(scenario['grew_at']) - start:.0f} s after the head")  # fmt: skip
    # One resize, said once: the fake nodes share a logs folder and each forwards it.
    assert len(grew) == 1 and grew[0][0].startswith("s3://runs/"), grew


def test_submit_trains_through_the_jobs_api_with_s3_and_the_drivers_store(
    scenario: dict,
) -> None:
    out = scenario["submit"]
    assert "SUCCEEDED" in out, out[-3000:]
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


def test_the_idle_nodes_go_after_the_runs(cluster: FakeCluster, scenario: dict) -> None:
    deadline = time.time() + 180
    while time.time() < deadline:
        _, nodes = cluster.history()[-1]
        if all(cpus == 0 for cpus in nodes.values()):
            break
        time.sleep(2)
    history = cluster.history()
    first_seen: dict[str, float] = {}
    last_seen: dict[str, float] = {}
    for t, nodes in history:
        for n, cpus in nodes.items():
            if cpus > 0:
                first_seen.setdefault(n, t)
                last_seen[n] = t
    print(
        f"nodes launched: {len(first_seen)}; "
        + "; ".join(
            f"{n[-6:]} up {first_seen[n] - history[0][0]:.0f} s, gone "
            f"{last_seen[n] - history[0][0]:.0f} s after the head"
            for n in sorted(first_seen, key=first_seen.get)  # type: ignore[arg-type]
        )
    )
    _, nodes = history[-1]
    assert all(cpus == 0 for cpus in nodes.values()), nodes  # the head alone again
