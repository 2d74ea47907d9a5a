"""End to end on the session's local Ray: 2 CPU workers, DDP over gloo, real MLflow store."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from raylift.cli import main as cli_main
from raylift.core import storage
from raylift.core.startup import PHASES
from raylift.run.connect import WORKER_ENV
from raylift.run.launch import train
from raylift.validation import load_config
from tests.helpers import HANG_S, finish_output, wait_until
from tests.s3_faults import FLAKY, FaultProxy
from tests.worker_imports import DDP_WORKER, NOT_FOR_DDP

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"


def mlflow_run(tmp: Path, run_id: str):  # type: ignore[no-untyped-def]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}")
    return client, client.get_run(run_id)


def history(client, run_id: str, key: str) -> dict[int, float]:  # type: ignore[no-untyped-def]
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


@pytest.mark.slow
def test_a_nan_loss_under_stop_fails_the_run_through_ray(
    ray_cluster: str, in_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The stop is a report without a checkpoint, which Ray Train's result does not
    carry: the driver still sees it, exits 1 and keeps the last good checkpoint. By then
    rank 0 has built, trained, evaluated and saved under DDP: it has imported no package
    outside those a DDP run uses."""
    modules = in_tmp / "modules.txt"
    code = cli_main(
        [
            "train",
            str(QUICKSTART),
            "name=nan",
            "task=tests.flaky:NanDigits",
            f"task_args={{nan_at: 13, width: 8, modules: {modules}}}",
            "train.max_steps=20",
            "train.log_every_n_steps=5",
            "checkpoint.every_n_steps=10",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1, err
    assert "inf/NaN at step 13" in err and "checkpoint-step00000010" in err, err
    client, run = mlflow_run(in_tmp, find_only_run(in_tmp))
    assert run.info.status == "FAILED"
    assert list(history(client, run.info.run_id, "nonfinite_step").values()) == [13.0]
    imported = modules.read_text().split()
    packages = {m.split(".")[0] for m in imported if not m.startswith("_")}
    assert not packages & NOT_FOR_DDP, sorted(packages & NOT_FOR_DDP)
    assert packages <= DDP_WORKER, sorted(packages - DDP_WORKER)
    # The run's Train controller ends with it, though this process lives on: Ray Train's
    # SIGINT handler, which holds it, is not left behind.
    import ray
    from ray.util.state import list_actors

    mine = [("class_name", "=", "TrainController"), ("state", "=", "ALIVE"),
            ("job_id", "=", ray.get_runtime_context().get_job_id())]  # fmt: skip
    wait_until(lambda: not list_actors(filters=mine), "the failed run's controller to end",
               seen=lambda: list_actors(filters=mine))  # fmt: skip


def find_only_run(tmp: Path) -> str:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("raylift").experiment_id])
    return str(run.info.run_id)


# What raylift train prints: its own notes, and rank 0's progress lines.
# What a DDP worker of the digits task may import beside the standard library: raylift
# and the task's module, torch, Ray (Train, Data and what they import), and their
# dependencies; never the packages of other strategies, adapters, HF models or MLflow
# (metrics go through the tracking actor).
OURS = ("raylift: ", "epoch ", "model state held by rank 0", "early stopping at step")
STARTUP_KEYS = {f"startup/{p}_s" for p in PHASES}


def cli_env() -> dict[str, str]:
    # A second driver joining the session's cluster uses its token.
    # The session's Ray was started with raylift's worker environment; a user's shell has none.
    env = {k: v for k, v in os.environ.items() if k not in WORKER_ENV}
    return {**env, "RAY_AUTH_MODE": "token", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def kill_storage(s3_server: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """One storage on the S3 server for the kill test: the killed run prepares the shards,
    the runs after it reuse them."""
    return f"s3://runs/{tmp_path_factory.mktemp('kill-runs').name}"


def kill_overrides(storage: str, marker: Path) -> list[str]:
    return [
        "task=tests.flaky:KilledGPT",
        f"task_args.marker={marker}",
        "task_args.kill_at=6",
        "task_args.max_bytes=200000",
        "task_args.n_layer=2",
        "task_args.d_model=64",
        "task_args.block_size=64",
        "train.eval_every_n_steps=null",
        "train.log_every_n_steps=4",
        "train.max_steps=12",
        "train.max_failures=1",
        "checkpoint.every_n_steps=2",
        "task_args.stall_from=4",
        "optim.warmup_steps=2",
        "precision=32",
        # No assertion reads a logged model here (export is tested on the resumed run).
        "tracking.log_model=none",
        f"storage={storage}",
    ]


def uninterrupted(tmp: Path, kill_storage: str, marker: Path) -> subprocess.Popen[str]:
    """The run without a kill, on DDP (in fp32 every strategy follows DDP's curve to ~1e-6,
    test_strategies), after the killed run in its storage: ``marker`` (the kill's, which
    exists by then) kills nothing and stalls no upload, and the same task arguments reuse
    the shards the killed run prepared. It checkpoints only at its end: saves change no
    step. Run as a user's script or notebook runs it: ``raylift.train(raylift.load_config(...))``
    after ``import ray``."""
    assert marker.exists(), "the kill's marker, written by the killed run"
    overrides = [*kill_overrides(kill_storage, marker), "name=clean", "checkpoint.every_n_steps=12",
                 f"tracking.uri=sqlite:///{tmp / 'mlflow.db'}"]  # fmt: skip
    script = tmp / "train.py"
    script.write_text(
        "import ray  # before raylift, as a notebook that used Ray already has\n"
        "import raylift\n"
        f"cfg = raylift.load_config({str(REPO / 'configs' / 'gpt-tiny.yaml')!r}, {overrides!r})\n"
        "result = raylift.train(cfg)\n"
        "print('script: trained to step', int(result.metrics['step']))\n"
    )
    return subprocess.Popen(
        [sys.executable, str(script)], cwd=tmp, env=cli_env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def val_loss_of(proc: subprocess.Popen[str], tmp: Path) -> float:
    """The script's run's val_loss; its console holds raylift's lines and the script's
    own, none with Ray's ``(RayTrainWorker pid=...)`` prefix (the CLI alone was quiet)."""
    out, _ = finish_output(proc, "the uninterrupted run")
    assert proc.returncode == 0, out[-3000:]
    lines = out.splitlines()
    assert "script: trained to step 12" in lines, lines[-10:]
    assert any(line.startswith("epoch ") for line in lines), lines
    foreign = [line for line in lines if not line.startswith((*OURS, "script: "))]
    assert not foreign, foreign
    _, run = mlflow_run(tmp, find_only_run(tmp))
    return float(run.data.metrics["val_loss"])


@pytest.mark.slow
def test_a_killed_worker_on_object_storage_is_one_line_and_the_run_resumes_where_it_was(
    ray_cluster: str, in_tmp: Path, kill_storage: str, tmp_path_factory: pytest.TempPathFactory,
    s3_faults: FaultProxy,
) -> None:  # fmt: skip
    """Storage on the S3 server, ZeRO-2, the store throttling and dropping connections
    throughout (FLAKY). SIGKILL of rank 1 mid-run, while the step-4
    checkpoint is still uploading (async; its completion lists never written): one
    console line says so and Ray restarts the group from the newest complete checkpoint,
    step 2's; the run ends where an
    uninterrupted one (DDP, from a user's script: its console is raylift's and the
    script's) does, in one MLflow run; a second writer of the run is refused
    meanwhile. Then it resumes on 1 worker and logs its model to MLflow's artifacts in the
    store, verifies and exports from s3://, the logged model is the exported one, and a
    damaged newest checkpoint in the store is found and passed over."""
    with s3_faults.faults(seed=2, **FLAKY) as injected:
        killed_and_resumed(in_tmp, kill_storage, tmp_path_factory)
    print(f"faults injected: {dict(injected)}")  # shown with -s, for the record
    assert injected["throttle"] > 0 and injected["drop"] > 0, injected


def killed_and_resumed(
    in_tmp: Path, kill_storage: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from mlflow.tracking import MlflowClient

    # The run's MLflow artifacts (its config, its model) go to the store as well.
    MlflowClient(f"sqlite:///{in_tmp / 'mlflow.db'}").create_experiment(
        "raylift", artifact_location=f"{kill_storage}/mlflow"
    )
    marker = in_tmp / "killed"
    zero2 = ["strategy.name=deepspeed", "strategy.zero_stage=2"]  # its console, under Ray
    common = [
        str(REPO / "configs" / "gpt-tiny.yaml"),
        *kill_overrides(kill_storage, marker),
        *zero2,
    ]
    run = f"{kill_storage}/kill"
    cmd = [sys.executable, "-m", "raylift.cli", "train", *common, "name=kill"]
    killed = subprocess.Popen(
        cmd, cwd=in_tmp, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    wait_until(lambda: storage.is_file(f"{run}/.raylift-lock") or killed.poll() is not None,
               f"the run's lease in {run}", seen=lambda: storage.children(run))  # fmt: skip
    second = subprocess.run(
        cmd, cwd=in_tmp, env=cli_env(), capture_output=True, text=True, timeout=HANG_S
    )
    out, _ = finish_output(killed, "the killed run")
    assert killed.returncode == 0, out[-3000:]
    assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
    assert f"run 'kill' is already running: pid {killed.pid}" in second.stderr
    assert marker.read_text().startswith("killed pid"), "rank 1 was never killed"
    # The console: raylift's lines only (and the end of the dead process's stderr); the
    # crash names how it died and its node's memory, the fault line what raylift does.
    lines = out.splitlines()
    assert not [line for line in lines if not line.startswith((*OURS, "    "))], out
    crashes = [ln for ln in lines if "without a Python error" in ln and "failed:" not in ln]
    assert len(crashes) == 1, out[-4000:]
    (crash,) = crashes
    assert (
        crash.startswith("raylift: worker rank 1 on node ")
        and "SIGKILL, often the kernel's OOM killer; node " in crash
    )
    assert re.search(r"had [\d.]+ of [\d.]+ GiB in use at its last logging interval", crash), crash
    (where,) = [line for line in lines if line.startswith("raylift: its stderr: ")]
    stderr_file = where.split("its stderr: ")[1].split(" on node ")[0]
    run_log = where.split("this run's log: ")[1]
    assert Path(stderr_file).is_file() and Path(run_log).is_file(), where
    (fault,) = [line for line in lines if "failed:" in line]
    assert fault.startswith("raylift: worker rank 1 on node ") and "(pid " in fault
    assert fault.endswith(
        f"restarting the workers from {run}/checkpoint-step00000002 (restart 1 of 1)"
    )
    assert f"resumed from {run}/checkpoint-step00000002 at step 2" in out
    assert f"raylift: checkpoint {run}/checkpoint-step00000012" in out
    run_id = re.search(r"MLflow run (\w+)", out).group(1)  # type: ignore[union-attr]
    client, mlrun = mlflow_run(in_tmp, run_id)
    # After the killed run, not beside it: two 2-worker runs at once are more than 2 cores.
    clean = tmp_path_factory.mktemp("clean")
    reference = uninterrupted(clean, kill_storage, marker)
    assert mlrun.data.metrics["val_loss"] == pytest.approx(val_loss_of(reference, clean), rel=0.02)
    assert history(client, run_id, "restarts") == {2: 1.0}
    # What the restart cost, by phase: a line once the run was back at the step it had
    # reached before the kill, the phases at that step in MLflow, the run's goodput.
    (cost,) = [ln for ln in lines if ln.startswith("raylift: restart 1 cost ")]
    ((back, redone),) = history(client, run_id, "restart/steps_redone").items()
    assert back >= 3 and redone == back - 2, (back, redone)  # from step 2's checkpoint
    assert cost.endswith(f"back at step {back} after redoing {int(redone)} step(s)"), cost
    phases = {k: history(client, run_id, f"restart/{k}_s")[back] for k in ("group_up", "build",
              "restore", "first_step", "recovered")}  # fmt: skip
    assert 0 < phases["group_up"] < phases["recovered"], phases
    assert phases["recovered"] >= sum(v for k, v in phases.items() if k != "recovered"), phases
    ((end, goodput),) = history(client, run_id, "goodput").items()
    assert end == 12 and 0 < goodput < 1, goodput
    assert f"raylift: goodput {goodput:.2f}: 1 restart(s) cost " in out
    # Killed at step 6 with step 4's upload cut off: restarted from step 2.
    assert mlrun.data.tags["raylift.restart.1"].startswith("step 2 from checkpoint-step00000002")
    # The start-up is the command's, logged once at its first step, not again by the restart.
    assert list(history(client, run_id, "startup/total_s")) == [1]
    resumed = [
        "name=kill",
        "train.max_steps=16",
        "scaling.num_workers=1",
        "tracking.log_model=final",
    ]
    gpt = load_config(*common[:1], [*common[1:], *resumed])
    smaller = train(gpt)
    assert smaller.run_id == run_id and smaller.metrics["step"] == 16 and smaller.model
    # One MLflow run across the kill and the rerun; nothing logged twice; what changed is tagged.
    assert sorted(history(client, run_id, "train_loss")) == [4, 8, 12, 16]
    assert sorted(history(client, run_id, "startup/total_s")) == [1, 13]  # the rerun's
    assert history(client, run_id, "goodput")[16] == 1.0  # the rerun lost nothing
    _, mlrun = mlflow_run(in_tmp, run_id)
    assert mlrun.data.tags["raylift.resume_override.train.max_steps"] == "16"
    bpb = history(client, run_id, "val_bpb")
    assert bpb[0] > 7.0 and bpb[16] < bpb[0] - 1.0  # from ~8 bits (uniform) down
    assert history(client, run_id, "tokens_per_s")
    # From the store: verify and export exit 0; a damaged newest checkpoint is found.
    assert cli_main(["verify", run]) == 0
    assert cli_main(["export", run, "--out", str(in_tmp / "model.pt")]) == 0
    exported = torch.load(in_tmp / "model.pt", weights_only=True)
    assert len(exported) > 0
    logged = logged_from_store(in_tmp, smaller.model.model_id, kill_storage)
    assert logged.keys() <= exported.keys() and all(
        torch.equal(exported[k], v) for k, v in logged.items()
    )
    newest = f"{run}/checkpoint-step00000016"
    victim = f"{newest}/loop_state.pt"
    damaged = bytearray(storage.read_bytes(victim) or b"")
    damaged[len(damaged) // 2] ^= 0xFF
    storage.write_bytes(victim, bytes(damaged))
    assert cli_main(["verify", run]) == 1  # only older ones intact: a rerun resumes from 12


def logged_from_store(folder: Path, model_id: str, bucket_folder: str) -> dict[str, torch.Tensor]:
    """The logged model's weights, downloaded from its artifacts in the store."""
    import mlflow
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file

    client = MlflowClient(tracking_uri=f"sqlite:///{folder / 'mlflow.db'}")
    location = client.get_logged_model(model_id).artifact_location
    assert location.startswith(f"{bucket_folder}/mlflow/"), location
    where = mlflow.artifacts.download_artifacts(artifact_uri=location, dst_path=str(folder / "m"))
    return load_file(str(next(Path(where).rglob("model.safetensors"))))


SIGNALS = {"segv": "SIGSEGV (Segmentation fault)", "abort": "SIGABRT (Aborted)"}


@pytest.mark.slow
def test_a_worker_that_crashes_is_named_with_its_signal_its_stack_and_its_logs(
    ray_cluster: str, in_tmp: Path
) -> None:
    """Rank 1 crashes in the user's code at step 5, by a read of address 0, and again in
    the restarted workers by os.abort(): for each, the console names the rank, node and
    signal, shows the end of the process's stderr (its faulthandler dump, which names the
    user's frame for a segfault) and two log files that exist; the first is restarted,
    the second ends the run; the user's print in build_model shows once per rank and
    attempt; nothing else shows."""
    task_args = f"task_args={{how: 'segv,abort', width: 8, marker: {in_tmp / 'crashes'}}}"
    cmd = [sys.executable, "-m", "raylift.cli", "train", str(QUICKSTART), "name=crash",
           "task=tests.flaky:CrashingDigits", task_args, "train.max_failures=1",
           "train.max_steps=10", "tracking.log_model=none"]  # fmt: skip
    done = subprocess.run(
        cmd, cwd=in_tmp, env=cli_env(), capture_output=True, text=True, timeout=HANG_S
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    lines = out.splitlines()
    stderr_lines = [line for line in lines if line.startswith("raylift: its stderr: ")]
    assert len(stderr_lines) == 2, out[-3000:]
    for how, signal in SIGNALS.items():
        crash_shown(lines, how, signal)
    for where in stderr_lines:
        stderr_file = where.split("its stderr: ")[1].split(" on node ")[0]
        run_log = where.split("this run's log: ")[1]
        assert Path(stderr_file).is_file() and Path(run_log).is_file(), where
    assert f"raylift: the log of everything else (Ray, torch, libraries): {run_log}" in lines
    assert "Fatal Python error" in Path(run_log).read_text()  # forwarded there whole
    faults = [ln for ln in lines if "failed:" in ln and not ln.startswith("raylift: training run")]
    assert len(faults) == 2, faults
    assert "died by SIGSEGV" in faults[0] and "no restarts left" not in faults[0], faults
    assert "died by SIGABRT" in faults[1] and "no restarts left" in faults[1], faults
    (final,) = [line for line in lines if line.startswith("raylift: training run 'crash' failed")]
    assert "worker rank 1 on node " in final and f"died by {SIGNALS['abort']}" in final, final
    for rank in (0, 1):
        assert lines.count(f"[rank {rank}] user: building the model") == 2, lines
    foreign = [ln for ln in lines if not ln.startswith((*OURS, "    ", "[rank ", "  fix "))]
    assert not foreign, foreign


def crash_shown(lines: list[str], how: str, signal: str) -> None:
    """One crash line for ``signal``, followed by the end of the process's stderr."""
    (crash,) = [line for line in lines if f"died by {signal}:" in line]
    assert crash.startswith("raylift: worker rank 1 on node "), crash
    tail = lines[lines.index(crash) + 1 :]
    tail = tail[: next(i for i, line in enumerate(tail) if not line.startswith("    "))]
    assert 0 < len(tail) <= 20 and f"    Fatal Python error: {signal.split('(')[1][:-1]}" in tail
    if how == "segv":
        assert any('tests/flaky.py", line' in line and " in crash" in line for line in tail), tail
