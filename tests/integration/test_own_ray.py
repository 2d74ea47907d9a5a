"""Two raylift commands on one host, each starting its own local Ray as a user's would
(no RAY_ADDRESS), beside the session's Ray: an ASHA sweep and the quickstart both
finish, the sweep's trials stop early and land in MLflow, the quickstart's console
holds raylift's lines only, and what its Ray listens on is known."""

from __future__ import annotations

import http.client
import ipaddress
import json
import re
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.helpers import HANG_S, finish_output

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
OURS = ("raylift: ", "epoch ", "model state held by rank 0", "early stopping at step")
# What ray 2.60 binds to every interface whatever it is told (the README's Security
# section names them): its C++ servers, the driver's and workers' core-worker servers,
# its agents and metrics exporters, and the process group's store in the workers.
RAY_PROCESSES = ("gcs_server", "raylet", "ray::")


def own_ray_env(shell: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in shell.items() if not k.startswith("RAY_ADDRESS")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def command(tmp: Path, verb: str, config: str, name: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "raylift.cli",
        verb,
        str(REPO / "configs" / config),
        f"name={name}",
        "train.max_epochs=1",
        "train.max_steps=10",
        f"storage={tmp / name}",  # each its own shards: the two prepare at once
        f"tracking.uri=sqlite:///{tmp / f'{name}.db'}",
        *extra,
    ]


def listeners(root: int) -> dict[tuple[str, int], psutil.Process]:
    """The listening TCP sockets of ``root`` and everything under it."""
    try:
        tree = {p.pid: p for p in [psutil.Process(root), *psutil.Process(root).children(True)]}
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for conn in psutil.net_connections(kind="inet"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in tree:
            out[(conn.laddr.ip, conn.laddr.port)] = tree[conn.pid]
    return out


def is_ray_process(proc: psutil.Process, driver: int) -> bool:
    try:
        name, cmdline = proc.name(), " ".join(proc.cmdline())
    except psutil.NoSuchProcess:
        return True  # gone between the two reads: a worker that finished
    return proc.pid == driver or name.startswith(RAY_PROCESSES) or "/ray/" in cmdline


def serves_jobs_api(port: int) -> bool:
    """Whether the port answers the dashboard's version query, with the token Ray made."""
    token = (Path.home() / ".ray" / "auth_token").read_text().strip()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/api/version", headers={"Authorization": f"Bearer {token}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=2) as r:
            return "ray_version" in json.loads(r.read())
    except (OSError, ValueError, http.client.HTTPException):
        return False


def watch(
    run: subprocess.Popen[str],
) -> tuple[dict[tuple[str, int], psutil.Process], list[tuple[str, int]]]:
    """Every listening socket the run's process tree opened, and which of them served the
    Jobs API (probed while the run's Ray is up). A run still going after ``HANG_S`` is a
    hang: it is killed, and its output tells why."""
    seen: dict[tuple[str, int], psutil.Process] = {}
    jobs: list[tuple[str, int]] = []
    ceiling = time.monotonic() + HANG_S
    while run.poll() is None and time.monotonic() < ceiling:
        now = listeners(run.pid)
        jobs += [addr for addr in now.keys() - seen.keys() if serves_jobs_api(addr[1])]
        seen.update(now)
        time.sleep(1.0)
    return seen, jobs


EPOCHS = 4  # ASHA's rungs (grace period 1, reduction factor 3) are then epochs 1 and 3
# One learning rate that learns and two that barely move: whichever order their epoch-1
# results arrive in, ASHA has a good result to hold the second poor one to, and stops
# it there. Sampled rates left that to chance: some sweeps stopped nothing. One trial at
# a time: beside the other command's run, that is all the two cores hold.
RATES = [3.0e-3, 1.0e-5, 1.0e-5]
TRIALS = len(RATES)
ASHA = ["tune.num_samples=1", "tune.max_concurrent=1", f"train.max_epochs={EPOCHS}",
        "train.max_steps=null"]  # fmt: skip


def asha_config(tmp: Path) -> str:
    """The shipped digits sweep with its search space replaced by a grid of ``RATES``."""
    import yaml

    cfg = yaml.safe_load((REPO / "configs" / "sweep-digits.yaml").read_text())
    cfg["tune"]["space"] = {"optim.lr": {"grid": RATES}}
    path = tmp / "sweep-asha.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def trial_table(out: str) -> list[dict[str, str]]:
    """The trial table ``raylift tune`` prints: id, status, epochs and why it stopped."""
    rows = []
    for line in out.splitlines():
        cells = line.split()
        if cells and re.fullmatch(r"\w+_\d{5}", cells[0]):
            rows.append(
                {"trial": cells[0], "status": cells[1], "epochs": cells[-2], "stopped": cells[-1]}
            )
    return rows


def check_asha_sweep(tmp: Path, out: str) -> None:
    """ASHA stopped trials early, every trial has its MLflow child under the sweep's run,
    and the best trial's config is written for `raylift train`."""
    from mlflow.tracking import MlflowClient

    from raylift.validation import load_config

    rows = trial_table(out)
    assert len(rows) == TRIALS and all(r["status"] == "TERMINATED" for r in rows), out[-3000:]
    # ASHA stops a trial only at a rung; which ones depends on the order their results
    # arrive in, so the count is held to a floor (RATES makes it at least one).
    stopped = [float(r["epochs"]) for r in rows if r["stopped"] == "scheduler"]
    assert stopped and set(stopped) <= {1.0, 3.0}, rows
    assert all(float(r["epochs"]) == EPOCHS for r in rows if r["stopped"] == "-"), rows
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'side-sweep.db'}")
    runs = client.search_runs([client.get_experiment_by_name("raylift").experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == TRIALS
    assert {c.info.status for c in children} <= {"FINISHED", "KILLED"}
    best_id = parent.data.tags["raylift.best_trial"]
    best_child = next(c for c in children if c.data.tags["raylift.trial_id"] == best_id)
    assert best_child.data.metrics["val_acc"] >= 0.9
    found = re.search(r"raylift: best config: (\S+)", out)
    assert found, out[-2000:]
    best = load_config(found.group(1))  # what `raylift train` would load
    assert best.scaling.num_workers == 2 and best.tune is None
    assert best.optim.lr == pytest.approx(float(parent.data.tags["raylift.best.optim.lr"]))
    # The sweep's model is the best trial's, logged to the sweep's run; trials log none.
    logged = re.search(r"raylift: model logged to MLflow as models:/(\S+) ", out)
    assert logged, out[-2000:]
    model = client.get_logged_model(logged.group(1))
    assert model.source_run_id == parent.info.run_id
    assert f"{best_id}/checkpoint-step" in model.tags["raylift.checkpoint"], model.tags
    assert out.count("model logged to MLflow") == 1


def side_by_side(tmp_path: Path, shell: dict[str, str]) -> dict[str, Any]:
    """The sweep (an ASHA sweep of distributed trials) and the run, started together from
    a user's ``shell``; what they printed and what the run's process tree listened on."""
    sweep = subprocess.Popen(
        command(tmp_path, "tune", asha_config(tmp_path), "side-sweep", *ASHA),
        cwd=tmp_path, env=own_ray_env(shell), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    time.sleep(2)  # the two start up side by side
    run = subprocess.Popen(
        command(tmp_path, "train", "quickstart.yaml", "side-run"),
        cwd=tmp_path, env=own_ray_env(shell), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        # Both pipes read while the run is watched: a full pipe would stop its writer.
        with ThreadPoolExecutor(2) as readers:
            outputs = readers.submit(finish_output, run, "the quickstart on its own Ray")
            sweep_outputs = readers.submit(finish_output, sweep, "the sweep on its own Ray")
            seen, jobs = watch(run)
            (out, err), (swept, _) = outputs.result(), sweep_outputs.result()
    finally:
        for proc in (run, sweep):
            if proc.poll() is None:
                proc.kill()
    return {"run": run, "out": out, "err": err, "sweep": sweep, "swept": swept, "seen": seen,
            "jobs": jobs, "tmp": tmp_path}  # fmt: skip


@pytest.fixture(scope="module")
def side_by_side_runs(user_shell: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return side_by_side(tmp_path_factory.mktemp("own_ray"), user_shell)


def test_a_sweep_and_a_run_side_by_side_each_on_its_own_ray(side_by_side_runs: dict) -> None:
    got = side_by_side_runs
    run, out, err, sweep, swept = (got[k] for k in ("run", "out", "err", "sweep", "swept"))
    seen, jobs, tmp_path = got["seen"], got["jobs"], got["tmp"]
    assert run.returncode == 0, out[-3000:] + err[-3000:]
    assert sweep.returncode == 0, swept[-4000:]
    assert "finished" in out and "raylift: best config:" in swept, swept[-2000:]
    check_asha_sweep(tmp_path, swept)
    # The sweep's console: raylift's trial table, not Ray Tune's boxes or Ray's prefixes.
    assert "Configuration for experiment" not in swept and " pid=" not in swept, swept[-3000:]
    # A fresh local Ray, and not one line from Ray, MLflow or DeepSpeed on the console.
    lines = (out + err).splitlines()
    assert lines and not [line for line in lines if not line.startswith(OURS)], lines
    # The Jobs API (which runs anyone's code) answers on 127.0.0.1 and listens nowhere else;
    # whatever listens beyond loopback is one of Ray's own processes, guarded by its token.
    assert jobs and all(ipaddress.ip_address(ip).is_loopback for ip, _ in jobs), jobs
    outside = {a: p for a, p in seen.items() if not ipaddress.ip_address(a[0]).is_loopback}
    strangers = {a: p for a, p in outside.items() if not is_ray_process(p, run.pid)}
    assert not strangers, strangers
