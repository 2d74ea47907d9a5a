"""The driver side without Ray: what it settles once for every rank, and what it hands over."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest

from raylift.run.auto import WorkerFacts, resolve_auto, resolve_strategy
from raylift.run.connect import local_num_cpus, user_code_env
from raylift.run.launch import run_exists
from raylift.run.plan import GIB
from raylift.run.probe import ProbeSettings
from raylift.run.worker import RunSpec
from raylift.tensors.precision import DeviceFacts
from tests.helpers import make_config

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
GPT_TINY = {"task": "gpt", "task_args": {"max_bytes": 20_000}}


def test_strategy_auto_is_resolved_once_on_the_driver_and_said() -> None:
    cfg = make_config(**GPT_TINY, strategy={"name": "auto"}, scaling={"num_workers": 2})
    said: list[str] = []
    roomy = resolve_strategy(cfg, said.append, memory=64 * GIB)
    assert roomy.strategy.name == "ddp" and cfg.strategy.name == "auto"  # cfg itself untouched
    assert said == ["raylift: strategy auto -> " + str(roomy.strategy) + " (64.0 GiB per worker)"]
    with pytest.raises(ValueError, match="no strategy fits"):
        resolve_strategy(cfg, said.append, memory=1024)


def test_a_named_strategy_passes_through_without_asking_the_cluster() -> None:
    cfg = make_config(strategy={"name": "fsdp"})
    said: list[str] = []
    assert resolve_strategy(cfg, said.append) is cfg
    assert said == ["raylift: strategy fsdp"]


OLD_GPU = DeviceFacts("cuda", "Tesla V100", (7, 0))


def test_precision_auto_is_resolved_once_for_the_workers_device_and_said() -> None:
    cfg = make_config(precision="auto")
    said: list[str] = []
    facts = WorkerFacts(64 * GIB, DeviceFacts("cuda", "H100", (9, 0)))
    assert resolve_auto(cfg, said.append, facts).precision == "bf16-mixed"
    assert said[0] == (
        "raylift: precision auto -> bf16-mixed (H100 (compute capability 9.0) "
        "has bf16 tensor cores)"
    )
    assert resolve_auto(cfg, said.append, WorkerFacts(GIB, OLD_GPU)).precision == "16-mixed"


def test_precision_auto_steps_around_what_the_strategy_refuses() -> None:
    cfg = make_config(precision="auto", strategy={"name": "fairscale"})
    said: list[str] = []
    assert resolve_auto(cfg, said.append, WorkerFacts(GIB, OLD_GPU)).precision == "32"
    assert (
        "precision auto -> 32 (precision: '16-mixed' is not supported with strategy 'fairscale'"
        in said[0]
    )


def test_the_run_spec_is_one_typed_object_that_pickles() -> None:
    cfg = make_config()
    spec = RunSpec(cfg, "/tmp/shards", "run1", "sqlite:///x.db", None, probe=ProbeSettings(5))
    back = pickle.loads(pickle.dumps(spec))
    assert back == spec and back.config.strategy.name == "ddp"


def test_a_private_local_ray_has_a_slot_per_worker_and_one_for_ray_data() -> None:
    cfg = make_config(scaling={"num_workers": 6, "cpus_per_worker": 1.5})
    assert local_num_cpus(cfg) >= 10  # ceil(6 x 1.5) + 1
    assert local_num_cpus(cfg, workers=1) >= 3


def test_a_run_exists_where_it_left_a_checkpoint(tmp_path: Path) -> None:
    assert not run_exists(str(tmp_path), "mine")
    (tmp_path / "mine" / "checkpoint-step00000010").mkdir(parents=True)
    assert run_exists(str(tmp_path), "mine")


def test_only_user_code_outside_site_packages_travels() -> None:
    assert user_code_env("digits") == {}
    shipped = user_code_env("tests.bottlenecks:SlowInputDigits")
    assert shipped["py_modules"][0].endswith("tests")


def test_a_full_disk_is_named_with_the_fix() -> None:
    from raylift.run.failures import failure_message

    try:
        try:
            raise OSError(28, "No space left on device")
        except OSError as full:
            raise RuntimeError("Training failed due to a worker error") from full
    except RuntimeError as exc:
        said = failure_message(exc, make_config(storage="/mnt/small"))
    assert "the disk under storage '/mnt/small' is full" in said
    assert "newest complete checkpoint" in said


def test_placement_is_bounded_in_attempts_of_at_most_a_minute() -> None:
    from raylift.run.launch import placement_bounds

    assert placement_bounds(300.0) == (60.0, 4)  # 5 attempts of 60 s
    assert placement_bounds(5.0) == (5.0, 0)  # one attempt
    assert placement_bounds(90.0) == (60.0, 1)
    assert placement_bounds(300.0, "10") == (10.0, 29)  # the environment's attempt length


def test_a_ray_address_where_nothing_answers_stops_the_command_with_the_fix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``ray.init`` retries a dead GCS address without end, its warnings in the run's log
    and the console silent: a ``RAY_ADDRESS`` left from a cluster that is gone stops the
    command instead, exit 2, naming the address and the fix, before anything is written."""
    import socket

    from raylift.cli import main
    from raylift.run import connect

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]  # closed again below: nothing listens there
    address = f"127.0.0.1:{port}"
    monkeypatch.setenv("RAY_ADDRESS", address)
    monkeypatch.setattr(connect, "REACH_S", 0.0)  # refused is refused: no 10 s of retries
    monkeypatch.chdir(tmp_path)
    assert main(["prep", str(QUICKSTART), "data.shards=./shards"]) == 2
    err = capsys.readouterr().err
    said = f"raylift: RAY_ADDRESS={address}: no Ray cluster answers there (Connection refused"
    assert said in err
    assert f"`ray start --head --port={port}` on 127.0.0.1" in err and "unset RAY_ADDRESS" in err
    assert "Traceback" not in err and not (tmp_path / "shards").exists()
    # Where Ray resolves the address itself, it is left to Ray; where something listens,
    # the check passes at once.
    for resolved in ("auto", "ray://head:10001", "http://127.0.0.1:8265"):
        assert connect.gcs_host_port(resolved) is None
        connect.check_reachable(resolved)
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        connect.check_reachable(f"127.0.0.1:{listening.getsockname()[1]}")


def test_the_token_probe_asks_the_gcs_only_without_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray sends its token to a cluster it found itself or under RAY_AUTH_MODE=token; only
    otherwise does the probe ask the GCS whether it wants one."""
    import socket

    import ray._raylet

    from raylift.run.connect import check_token

    probed: list[object] = []
    monkeypatch.setattr(ray._raylet, "GcsClient", lambda **kw: probed.append(kw))
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        address = f"127.0.0.1:{listening.getsockname()[1]}"
        monkeypatch.setenv("RAY_AUTH_MODE", "token")
        check_token(address)
        check_token("auto")
        assert probed == []
        monkeypatch.delenv("RAY_AUTH_MODE")
        check_token(address)
    assert probed == [{"address": address}]


def test_a_local_tracking_store_over_ray_client_stops_before_any_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through ray:// the driver is not on the cluster: no actor beside it can write its
    sqlite file, so the run stops, naming tracking.uri and the fix; a server is fine."""
    import ray.util.client

    from raylift.core.config import EnvironmentProblem
    from raylift.run.launch import tracking_for_run

    monkeypatch.setattr(ray.util.client.ray, "is_connected", lambda: True)
    with (
        pytest.raises(
            EnvironmentProblem, match=r"tracking\.uri: sqlite:////x/mlflow\.db .*http://"
        ),
        tracking_for_run("sqlite:////x/mlflow.db"),
    ):
        pass
    from raylift.artifacts.tracking import is_local_store

    assert is_local_store("sqlite:///a.db") and is_local_store("./mlruns")
    assert not is_local_store("http://127.0.0.1:5000")


def test_the_trainer_starts_no_dataset_manager_for_a_run_without_ray_datasets() -> None:
    """Train V2 starts an idle DatasetManager actor per worker group even with no Ray
    Dataset; raylift's workers read their own shards, so its trainer leaves that out and
    keeps every other default callback (placement-group cleanup, metrics, the backend)."""
    from ray.train import RunConfig, ScalingConfig

    from raylift.run.launch import trainer_class

    trainer = trainer_class()(
        lambda config: None,
        scaling_config=ScalingConfig(num_workers=1),
        run_config=RunConfig(storage_path="/tmp/raylift-unused"),
    )
    names = [type(cb).__name__ for cb in trainer._create_default_callbacks()]
    assert "DatasetsCallback" not in names
    assert {"BackendSetupCallback", "PlacementGroupCleanerCallback"} <= set(names), names
    trainer.datasets = {"train": object()}  # a run that passes datasets keeps Ray's path
    assert "DatasetsCallback" in [type(cb).__name__ for cb in trainer._create_default_callbacks()]


def rays_error(raised: dict[int, BaseException]) -> Exception:
    """The WorkerGroupError Ray Train's controller raises for these ranks' exceptions,
    made by Ray's own code: each wrapped with its traceback as a worker wraps it, the
    message grouped by Ray's poll status, the exceptions unwrapped, as they come back."""
    import traceback

    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback
    from ray.train.v2._internal.execution.worker_group.poll import (
        WorkerGroupPollStatus,
        WorkerStatus,
    )

    def wrapped(exc: BaseException) -> UserExceptionWithTraceback:
        return UserExceptionWithTraceback(exc, "".join(traceback.format_exception(exc)))

    statuses = {r: WorkerStatus(running=False, error=wrapped(e)) for r, e in raised.items()}
    return WorkerGroupPollStatus(statuses).get_worker_group_error()


def raised(call: Any, *args: Any) -> BaseException:
    try:
        call(*args)
    except Exception as exc:
        return exc
    raise AssertionError("it did not raise")


def load_batch(step: int) -> None:
    raise IndexError(f"index {step} is out of bounds for axis 0 with size 3")


def build_head() -> None:
    raise KeyError("head")


def test_ranks_that_fail_differently_each_show_their_traceback_under_their_ranks() -> None:
    from raylift.run.failures import failure_message

    group = rays_error(
        {
            0: raised(load_batch, 3),
            1: raised(build_head),
            2: raised(load_batch, 4),  # alike but for a number: Ray groups it
        }
    )
    said = failure_message(group, make_config(name="r"))
    head, *lines = said.splitlines()
    assert head == (
        "training run 'r' failed: worker rank 0: IndexError: index 3 is out of bounds for "
        "axis 0 with size 3; ranks 0-2 failed, with 2 different errors"
    )
    assert lines.index("[ranks 0,2]") < lines.index("[rank 1]")
    assert said.count("in load_batch") == 1 and said.count("in build_head") == 1
    assert said.count("IndexError: index 3 is out of bounds") == 2  # the head, its traceback
    assert "KeyError: 'head'" in lines and "Error Snippet" not in said
    assert lines[-1].startswith("  fix the cause and rerun")


def test_ranks_that_fail_alike_are_named_with_their_one_traceback() -> None:
    from raylift.run.failures import failure_message

    group = rays_error({r: raised(load_batch, 3) for r in (0, 1, 2, 3, 5)})
    said = failure_message(group, make_config(name="r"))
    assert said.splitlines()[0] == (
        "training run 'r' failed: worker ranks 0-3,5: IndexError: index 3 is out of bounds "
        "for axis 0 with size 3"
    )
    assert said.count("in load_batch") == 1 and said.splitlines()[1].startswith("Traceback")


def test_rank_groups_are_read_as_ray_writes_them_and_ranges_should_it_write_them() -> None:
    from raylift.run.failures import _label, _ranks

    assert _ranks("0,1") == [0, 1] and _ranks("7") == [7]
    assert _ranks("0-3, 5") == [0, 1, 2, 3, 5]
    assert _label([1]) == "rank 1" and _label([1, 0]) == "ranks 0,1"
    assert _label([0, 1, 2, 4, 5, 9]) == "ranks 0-2,4,5,9"


def test_a_failed_runs_message_and_tracebacks_go_to_the_runs_log_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What ``raylift train`` prints of a failed run: on the console and in its log file."""
    import io
    import sys

    from raylift.cli import _run_error
    from raylift.core import console
    from raylift.run.launch import RunFailed, failure_message

    screen, log = io.StringIO(), tmp_path / "run.log"
    monkeypatch.setattr(sys, "stderr", console.Router(screen, console.DriverSink(log)))
    said = failure_message(rays_error({0: raised(build_head)}), make_config(name="r"))
    assert _run_error(RunFailed(said)) == 1
    assert "in build_head" in said
    assert screen.getvalue() == log.read_text() == f"raylift: {said}\n"


def test_a_run_mlflow_could_not_open_is_named_as_the_cause(ray_cluster: str) -> None:
    """The MLflow run opens in the tracking actor beside the workers' start: where it
    could not, the run's error is MLflow's (exit 2), not rank 0's wait for the id; a run
    that opened is closed as the status says."""
    import dataclasses

    import ray
    from mlflow.exceptions import MlflowException

    from raylift.core.config import EnvironmentProblem
    from raylift.run.launch import end_unfinished

    @ray.remote(num_cpus=0)
    def refuse() -> str:
        raise MlflowException("Cannot create a run in deleted experiment 'raylift'")

    uri = "http://127.0.0.1:5000"
    spec = RunSpec(make_config(), "shards", refuse.remote(), uri, None)
    ended: list[tuple[str, str]] = []

    class Store:
        def end_run(self, run_id: str, status: str) -> None:
            ended.append((run_id, status))

    with pytest.raises(EnvironmentProblem) as refused:
        end_unfinished(Store(), spec, "FAILED")
    assert str(refused.value) == (
        f"tracking.uri: MLflow could not open the run in {uri}: MlflowException: "
        "Cannot create a run in deleted experiment 'raylift'"
    )
    assert ended == []
    end_unfinished(Store(), dataclasses.replace(spec, run_id=ray.put("abc")), "KILLED")
    end_unfinished(Store(), dataclasses.replace(spec, run_id="def"), "FAILED")
    assert ended == [("abc", "KILLED"), ("def", "FAILED")]


def test_a_ctrl_c_that_ray_trains_handler_turns_into_an_exit_is_seen_as_one() -> None:
    """Ray Train's SIGINT handler aborts the controller and the driver's wait ends in
    ``SystemExit(1)``: raylift still knows it was a Ctrl-C, whichever handler took it."""
    import os
    import signal

    from raylift.run.launch import sigint_seen

    def rays_handler(signum: int, frame: Any) -> None:
        pass  # Ray's aborts the run and returns; its ray.get then raises SystemExit(1)

    def users_handler(signum: int, frame: Any) -> None:
        pass

    previous = signal.signal(signal.SIGINT, users_handler)
    try:
        with sigint_seen() as interrupted:
            signal.signal(signal.SIGINT, rays_handler)  # as fit() registers Ray Train's
            assert not interrupted()
            os.kill(os.getpid(), signal.SIGINT)
            assert interrupted()
        # Ray Train's handler (it holds the run's controller) is gone with the run.
        assert signal.getsignal(signal.SIGINT) is users_handler
        with sigint_seen() as interrupted:  # a fresh scope: the last one's signal is not seen
            assert not interrupted()
        assert signal.set_wakeup_fd(-1) == -1  # given back as it was found
    finally:
        signal.signal(signal.SIGINT, previous)
