"""Test tiers: unit (no Ray), integration (one local Ray per session), slow, gpu.

The suite's caches (mypy's, inductor's compiled kernels, any DeepSpeed op, whatever
would go under ~/.cache) live in ``RAYLIFT_TEST_CACHE``: ``.ci/run`` starts it empty, as
on a fresh machine; a developer's runs keep ~/.cache/raylift-tests between them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from raylift.core import stores
from tests.s3_faults import FaultProxy, start_moto, stop
from tests.survivors import MARK, left_behind, mark_suite

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("RAYLIFT_TEST_CACHE", Path.home() / ".cache" / "raylift-tests"))
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(CACHE / "torch_extensions"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(CACHE / "inductor"))
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
# Whatever else caches under ~/.cache (raylift's CPU peaks among it) starts where the rest does.
os.environ.setdefault("XDG_CACHE_HOME", str(CACHE / "xdg"))
# Ray starts its workers at niceness 15 (RAY_worker_niceness), below the other worker's unit
# tests: the suite's Rays, whose runs set its length, start theirs at the tests' own.
os.environ.setdefault("RAY_worker_niceness", "0")
_SHELL = dict(os.environ)  # as the suite started: before any fixture changes os.environ


# Two pytest-xdist workers share the 2 cores (pyproject: -n 2 --dist loadgroup); each is a
# session of its own. The tests on Ray are in the group "ray", which one worker runs in
# order, one at a time, each run of a test after the one before it: a 2-worker run fills
# the two cores by itself, and two at once (or a second Ray beside the first) leave each
# too little to keep Ray's own timers and the autoscaler's. First what must run alone (the
# doctor's verdicts rest on timings a busy machine would change: the other worker waits
# for them, in pytest_runtest_setup); then the tests on the session's Ray; last the
# scenarios that start Rays of their own (the fake autoscaling cluster, two commands that
# each start a local Ray, the GPU script's smoke run), with the session's Ray idle. The
# other worker runs the unit tests, one process (or one pair of ranks) at a time.
ALONE = ("test_doctor.py",)
OWN_RAY = ("test_autoscaler.py", "test_own_ray.py", "test_gpu_script.py", "test_drain.py")
ON_RAY = {"ray_cluster", "ray_jobs", "mlflow_server"}  # the group's fixtures


def lane(item: pytest.Item) -> int:
    name = item.path.name
    if name in ALONE and "integration" in item.path.parts:
        return 0
    if name in OWN_RAY:
        return 3
    return 1 if "integration" in item.path.parts else 2


def on_ray(item: pytest.Item) -> bool:
    return lane(item) != 2 or bool(ON_RAY & set(getattr(item, "fixturenames", ())))


def group(item: pytest.Item) -> str | None:
    """The item's xdist group: "ray", or None (any worker)."""
    return "ray" if on_ray(item) else None


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lane)  # stable: within a lane, as collected
    for item in items:
        if name := group(item):
            item.add_marker(pytest.mark.xdist_group(name))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config: pytest.Config) -> None:
    """In the controller (or a run without xdist), before any worker starts: the mark
    every process of this suite inherits (tests/survivors.py)."""
    if not hasattr(config, "workerinput"):
        mark_suite()


def _alone_done_marker() -> Path:
    """A file both workers name alike: the alone tests' worker writes it when they are done."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", f"solo-{os.getpid()}")
    return Path(tempfile.gettempdir()) / f"raylift-tests-{run}-alone-done"


_WAITED: list[bool] = []


@pytest.hookimpl(tryfirst=True)  # before the item's fixtures: a module's runs start there
def pytest_runtest_setup(item: pytest.Item) -> None:
    """On the other worker: wait until the alone tests are done (at most an hour, should
    their worker die)."""
    import time

    if _WAITED or lane(item) == 0 or group(item) == "ray":
        return
    _WAITED.append(True)
    if not any(lane(other) == 0 for other in item.session.items):
        return
    marker, deadline = _alone_done_marker(), time.monotonic() + 3600
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.5)


@pytest.fixture(scope="module")
def _alone_module_done() -> Iterator[None]:
    yield
    _alone_done_marker().touch()  # also when they failed: the rest goes on


SESSION: dict[str, str] = {}  # what the session's Ray was started with


@pytest.hookimpl(trylast=True)  # after xdist has stopped its workers
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from tests.helpers import close_pools, stop_fork_server

    close_pools()  # the ranks the unit tests shared
    stop_fork_server()
    _alone_done_marker().unlink(missing_ok=True)
    if hasattr(session.config, "workerinput"):
        return
    # The controller, once every worker has ended: nothing the suite started may outlive it.
    left = left_behind(os.environ[MARK])
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        title = f"{len(left)} process(es) the suite left running, now killed"
        if reporter is not None:
            reporter.write_sep("=", title, red=True)
            for line in left:
                reporter.write_line(line, red=True)
        else:
            print(title, *left, sep="\n")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def ddp_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """DDP on 2 gloo ranks, ``GPT_SMALL`` in fp32 and bf16-mixed: the loss curves, model-state
    bytes and probe logits every other strategy is held to (trained once per session)."""
    from raylift.core.parsing import merge
    from tests.helpers import GPT_SMALL, make_config, run_ranks, train_runs

    tmp = tmp_path_factory.mktemp("ddp-reference")
    runs = {
        p: make_config(**merge(GPT_SMALL, {"strategy": {"name": "ddp"}, "precision": p})).to_dict()
        for p in ("32", "bf16-mixed")
    }
    run_ranks(2, tmp, train_runs, runs, str(tmp / "out.pt"))
    return torch.load(tmp / "out.pt", weights_only=True)


@pytest.fixture(scope="session")
def ray_jobs(ray_cluster: str) -> str:
    """The Jobs API (dashboard) of the session's Ray, on 127.0.0.1. Its job agent listens
    on Ray's fixed port, which ``ray.init`` cannot change: where another Ray on this host
    held it as the session's started, every submission is refused ("No available agent")
    and the tests say so, with the holder."""
    if SESSION.get("agent_port_holder"):
        pytest.fail(
            f"the session's Ray has no job agent: port {SESSION['agent_port']} was held by "
            f"{SESSION['agent_port_holder']} when it started (another Ray on this host?); "
            "stop it (`ray stop`) and run the suite again"
        )
    return SESSION["dashboard"]


def _port_holder(port: int) -> str | None:
    """Who listens on ``port`` on this host (a process, or "a process" where it is not
    ours to see), or None where the port is free."""
    import psutil

    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
            try:
                proc = psutil.Process(conn.pid)
                return f"pid {conn.pid} ({' '.join(proc.cmdline())[:120]})"
            except (psutil.Error, TypeError, ValueError):
                return "a process"
    return None


BUCKETS = ("runs", "data")
CLIENT_RETRIES = {"AWS_RETRY_MODE": "standard", "AWS_MAX_ATTEMPTS": str(stores.ATTEMPTS)}


@pytest.fixture(scope="session")
def s3_faults() -> Iterator[FaultProxy]:
    """An S3 server on 127.0.0.1 (moto's server mode, as Ray's own storage tests use)
    behind the proxy every S3 client of the session goes through (tests/s3_faults.py): it
    injects no fault until a test sets its rates. Stopped by its pid."""
    server, endpoint = start_moto()
    proxy = FaultProxy(endpoint)
    try:
        yield proxy
    finally:
        proxy.close()
        stop(server)


@pytest.fixture(scope="session")
def s3_server(s3_faults: FaultProxy) -> Iterator[str]:
    """The session's S3 server (through ``s3_faults``) with the buckets ``runs`` and
    ``data``; the AWS variables point this process, and every process it starts (the
    session's Ray too), at it."""
    env = {
        "AWS_ENDPOINT_URL": s3_faults.endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
    }
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import boto3

    s3 = boto3.client("s3")
    for bucket in BUCKETS:
        s3.create_bucket(Bucket=bucket)
    try:
        yield s3_faults.endpoint
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def mlflow_server(s3_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real MLflow tracking server on 127.0.0.1: a sqlite backend store and its artifacts
    in the S3 server (``s3://runs/mlflow-artifacts``, served through the server's proxy).
    Stopped by its process group (the server runs its workers as children)."""
    import signal
    import subprocess
    import sys
    import time
    import urllib.request

    folder = tmp_path_factory.mktemp("mlflow-server")
    port = _free_port()
    exe = str(Path(sys.executable).with_name("mlflow"))
    # No job runner: it serves MLflow's GenAI jobs, which no test uses, and its consumer
    # polls for them (about 30 CPU-seconds over a suite on this 2-core machine).
    # Its boto3 retries as a server in front of a flaky store should (docs/clusters.md).
    env = {**os.environ, "MLFLOW_S3_ENDPOINT_URL": s3_server,
           "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **CLIENT_RETRIES}  # fmt: skip
    log_file = open(folder / "server.log", "w")  # noqa: SIM115 (the server's, closed at stop)
    server = subprocess.Popen(
        [exe, "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
         "--artifacts-destination", "s3://runs/mlflow-artifacts"],
        env=env, stdout=log_file, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    log = (folder / "server.log").read_text()[-3000:]
                    raise RuntimeError(f"MLflow server not up on {url}:\n{log}") from None
                time.sleep(0.5)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log_file.close()


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="session")
def ray_cluster(s3_server: str) -> Iterator[str]:
    """One local Ray for the whole session, in its own temp dir, with RAY_ADDRESS pointing
    at it; started after the S3 server, so its workers reach it too."""
    import ray
    from ray._private import ray_constants

    from raylift.run.connect import WORKER_ENV

    os.environ.update(WORKER_ENV)  # the raylet inherits these, so every worker does
    # Ray's log monitor lists the logs folder every 0.1 s below 1000 files, every 0.5 s
    # above. The session's folder gathers hundreds of worker logs: with 600, its monitor
    # spent 11.6% of a core listing them ten times a second, 5.3% at twice a second. A new
    # file's first lines reach the driver up to 0.5 s later; followed files', as before.
    os.environ["RAY_LOG_MONITOR_MANY_FILES_THRESHOLD"] = "0"
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p
    )
    temp_dir = tempfile.mkdtemp(prefix="rl-ray-", dir="/tmp")  # short: unix socket paths
    agent_port = ray_constants.DEFAULT_DASHBOARD_AGENT_LISTEN_PORT
    SESSION.update(agent_port=str(agent_port), agent_port_holder=_port_holder(agent_port) or "")
    ctx = ray.init(
        address="local",
        num_cpus=4,
        _temp_dir=temp_dir,
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        logging_level="WARNING",
    )
    address = ctx.address_info["gcs_address"]
    SESSION["dashboard"] = f"http://{ctx.dashboard_url}"
    previous = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = address
    try:
        yield address
    finally:
        from tests.helpers import stop_ray_of

        ray.shutdown()
        # What Ray's shutdown leaves (a Train controller was seen alive hours after its
        # Ray) is stopped by pid: every process that names the session's temp dir.
        stop_ray_of(temp_dir)
        if previous is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = previous
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def user_shell(s3_server: str) -> dict[str, str]:
    """A user's shell: the environment the suite started with (not the session Ray's
    address or worker settings), with the S3 server's variables and the suite's mark."""
    aws = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    return {**_SHELL, **aws, MARK: os.environ[MARK]}


@pytest.fixture(autouse=True)
def _lanes(request: pytest.FixtureRequest) -> None:
    item = request.node
    if lane(item) == 0:
        request.getfixturevalue("_alone_module_done")
    elif group(item) == "ray":
        _alone_done_marker().touch()  # no alone test selected, or they ran: say so


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run in a fresh folder: the default MLflow store and ./runs land there."""
    monkeypatch.chdir(tmp_path)
    return tmp_path
