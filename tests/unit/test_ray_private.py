"""What raylift uses of Ray that Ray does not promise, one test each.

pyproject.toml pins ray to 2.60.x. Where Ray 2.60 has a public API raylift uses it
(``ray.util.get_node_ip_address``, ``ray.exceptions``, Train's ``WorkerGroupError``
message); what is left is below. Each test fails naming the raylift code that depends
on it, so a Ray upgrade that changes one says what to mend:

- ``check.node_types``: the autoscaler's published node types,
  ``ray._private.state.state.get_cluster_config()`` (no public API lists them);
- ``connect.check_token``: ``ray._raylet.GcsClient`` raising ``AuthenticationError``, to
  name the fix before ``ray.init`` retries for 20 s;
- ``launch.trainer_class``: Train's ``TorchTrainer._create_default_callbacks``, to start no
  idle ``DatasetManager`` for a run without Ray Datasets (tests/unit/test_launch.py checks
  what it returns);
- ``faults._actor_id``: Train's ``WorkerHealthCheckFailedError`` keeps Ray's
  ``ActorDiedError`` as ``health_check_failure`` (its ``actor_id`` is public);
- ``faults.cause``: Train's wrapper of a user's exception keeps it as ``_base_exc``, and
  Ray's ``ActorDiedError`` text names the node as ``ip: ADDRESS``;
- ``worker.RayReporter``: Train's storage context (``get_context().get_storage()``, a
  DeveloperAPI) names where a checkpoint goes and its filesystem, so that raylift uploads
  the parts itself and records them with ``CheckpointUploadMode.NO_UPLOAD``;
- ``leaving.Restarts``: Train V2's ``ControllerCallback`` (internal; Train runs a
  ``RunConfig`` callback that is not a ``UserCallback`` as one of its own), its
  ``after_controller_state_update`` and the restart states ``RestartingState`` and
  ``ReschedulingState`` with their ``training_failed_error``;
- ``leaving.reserve_without_leaving``: Ray's draining nodes
  (``ray._private.state.state.get_draining_nodes``, as Train's own preemption watcher reads
  them) and Ray Data's AutoscalingCoordinator, which sizes an elastic restart: its
  ``get_or_create_autoscaling_coordinator``, and inside the actor (``__ray_call__``) its
  ``_lock``, ``_tick``, ``_cluster_node_resources`` and ``_refresh_resource_reservations``
  (tests/unit/test_leaving.py runs them on the real class);
- ``data.sources.estimated_bytes`` and ``reads_shuffled_files``: a Dataset's logical plan
  (``_logical_plan.dag``, its readers' ``shuffle_config_factory`` or
  ``datasource._shuffle``), to size a split and to
  know whether its files are read shuffled without running it. These need Ray Data
  datasets, so a running Ray: tests/integration/test_data.py checks both on real ones.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import raylift.run.faults


def needs(thing: object, what: str, user: str) -> None:
    assert thing is not None, f"Ray no longer has {what}: mend raylift's {user}"


def test_the_autoscalers_node_types_are_published_in_the_gcs_state() -> None:
    import ray._private.state

    state = getattr(ray._private.state, "state", None)
    get = getattr(state, "get_cluster_config", None)
    needs(get, "ray._private.state.state.get_cluster_config", "check.node_types")
    assert callable(get)


def test_the_token_check_has_rays_gcs_client_and_its_authentication_error() -> None:
    import ray.exceptions

    try:
        from ray._raylet import GcsClient  # type: ignore[attr-defined]
    except ImportError:
        GcsClient = None
    needs(GcsClient, "ray._raylet.GcsClient", "connect.check_token")
    needs(
        getattr(ray.exceptions, "AuthenticationError", None),
        "ray.exceptions.AuthenticationError",
        "connect.check_token",
    )
    # The client is compiled (no signature to read): that it raises AuthenticationError
    # for a token cluster is tests/integration/test_data.py's test of joining one.
    assert isinstance(GcsClient, type) and issubclass(ray.exceptions.AuthenticationError, Exception)


def test_trains_default_callbacks_can_be_overridden() -> None:
    from ray.train.torch import TorchTrainer

    needs(
        getattr(TorchTrainer, "_create_default_callbacks", None),
        "TorchTrainer._create_default_callbacks",
        "launch.trainer_class",
    )


def test_a_dead_workers_error_in_trains_health_check_keeps_its_actor_id() -> None:
    from ray.core.generated.common_pb2 import ActorDiedErrorContext
    from ray.exceptions import ActorDiedError
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError

    died = ActorDiedError(ActorDiedErrorContext(actor_id=b"\x02" * 16, pid=7))
    wrapped = WorkerHealthCheckFailedError("the worker's health check failed", died)
    assert raylift.run.faults._actor_id(wrapped) == died.actor_id == "02" * 16, (
        "Train's WorkerHealthCheckFailedError no longer keeps Ray's error as "
        "health_check_failure, or it lost actor_id: mend raylift.run.faults._actor_id"
    )


def test_a_users_exception_is_kept_in_trains_wrapper() -> None:
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback

    wrapped = UserExceptionWithTraceback(ValueError("the user's"), "Traceback ...")
    assert isinstance(getattr(wrapped, "_base_exc", None), ValueError), (
        "Train's UserExceptionWithTraceback no longer keeps the exception as _base_exc: "
        "mend raylift.run.faults.cause"
    )
    what, _ = raylift.run.faults.cause(wrapped)
    assert what == "ValueError: the user's"


def test_a_dead_actors_error_names_its_node_as_raylift_reads_it() -> None:
    from ray.core.generated.common_pb2 import ActorDiedErrorContext
    from ray.exceptions import ActorDiedError

    context = ActorDiedErrorContext(
        class_name="RayTrainWorker", actor_id=b"\x01" * 16, pid=4242,
        node_ip_address="10.1.2.3", error_message="Worker exit type: SYSTEM_ERROR",
    )  # fmt: skip
    error = ActorDiedError(context)
    _, node = raylift.run.faults.cause(error)
    assert node == "10.1.2.3", f"Ray's ActorDiedError text changed: mend faults._IP\n{error}"


SRC = Path(raylift.__file__).parent


def test_the_coordinator_that_sizes_elastic_restarts_can_be_told_who_leaves() -> None:
    import ray._private.state
    from ray.data._internal.cluster_autoscaler import default_autoscaling_coordinator as coord

    user = "leaving.reserve_without_leaving"
    draining = getattr(getattr(ray._private.state, "state", None), "get_draining_nodes", None)
    needs(draining, "ray._private.state.state.get_draining_nodes", user)
    get = getattr(coord, "get_or_create_autoscaling_coordinator", None)
    needs(get, "Ray Data's get_or_create_autoscaling_coordinator", user)
    actor = getattr(coord, "_AutoscalingCoordinatorActor", None)
    needs(actor, "Ray Data's _AutoscalingCoordinatorActor", user)
    for name in ("_tick", "_refresh_resource_reservations", "_update_cluster_node_resources"):
        needs(getattr(actor, name, None), f"_AutoscalingCoordinatorActor.{name}", user)
    init = inspect.getsource(actor.__init__)  # type: ignore[union-attr]
    assert "self._lock" in init and "self._cluster_node_resources" in init, f"mend {user}"
    # Ray Train's elastic policy sizes a restart from that same coordinator's reservation.
    from ray.train.v2._internal.execution.scaling_policy import (
        autoscaling_coordinator_client as client,
    )

    assert getattr(client, "get_or_create_autoscaling_coordinator", None) is get, (
        f"Ray Train sizes elastic restarts another way: mend raylift's {user}"
    )


def test_trains_controller_hands_its_restarts_to_a_controller_callback() -> None:
    from ray.train import PreemptionError, PreemptionInfo
    from ray.train.v2._internal.execution import callback
    from ray.train.v2._internal.execution.controller import controller, state
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    user = "leaving.Restarts"
    needs(getattr(callback, "ControllerCallback", None), "Train's ControllerCallback", user)
    hook = inspect.signature(callback.ControllerCallback.after_controller_state_update)
    assert list(hook.parameters) == ["self", "previous_state", "current_state"], f"mend {user}"
    assert "after_controller_state_update" in inspect.getsource(controller), f"mend {user}"
    # A RunConfig callback that is not a UserCallback joins Train's own callbacks.
    assert "not isinstance(cb, UserCallback)" in inspect.getsource(
        DataParallelTrainer._create_default_callbacks
    ), f"Train no longer runs RunConfig's internal callbacks: mend raylift's {user}"
    info = PreemptionInfo(deadline_ms=None, preempted_node_to_ranks={"n": [1]})
    for name in ("RestartingState", "ReschedulingState"):
        restart = getattr(state, name)(training_failed_error=PreemptionError(info))
        assert restart.training_failed_error.preemption_info is info, f"mend {user}"


# Every module of raylift that imports Ray (13 today), found by reading them all.
RAY_USERS = sorted(
    str(p.relative_to(SRC))
    for p in SRC.rglob("*.py")
    if re.search(r"^\s*(import ray\b|from ray[. ])", p.read_text(), re.MULTILINE)
)
# What the list at the top allows: private modules, and private names on Ray's objects.
ALLOWED = (
    "ray._private.state", "ray._raylet", "_create_default_callbacks", "_base_exc",
    "ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator",
    "ray.train.v2._internal.execution.callback",
    "health_check_failure", "_logical_plan", "_shuffle", "shuffle_config_factory",
)  # fmt: skip
PRIVATE = re.compile(
    r"ray\._private\.[\w.]+|ray\._raylet|ray\.train\.v2\._[\w.]+|ray\.data\._[\w.]+"
    r"|\._create_default\w*|\b_base_exc\b|\bhealth_check_failure\b|\._logical_plan\b"
    r"|\b_shuffle\b|shuffle_config_factory"
)


def test_every_module_that_imports_ray_is_scanned() -> None:
    assert len(RAY_USERS) >= 13, RAY_USERS
    assert {"run/launch.py", "run/worker.py", "data/sources.py", "data/shards.py"} <= set(RAY_USERS)


@pytest.mark.parametrize("module", RAY_USERS)
def test_no_other_private_ray_module_is_imported(module: str) -> None:
    """The list above is the whole list: a new private use is added there, with a test."""
    found = {m.group(0).lstrip(".") for m in PRIVATE.finditer((SRC / module).read_text())}
    unknown = {f for f in found if not any(f.startswith(a) or a in f for a in ALLOWED)}
    assert not unknown, f"private Ray used in {module} and not listed here: {sorted(unknown)}"


def test_trains_storage_context_names_a_checkpoints_path_and_filesystem() -> None:
    import ray.train
    from ray.train.v2._internal.execution.storage import StorageContext

    needs(
        getattr(ray.train, "CheckpointUploadMode", None)
        and ray.train.CheckpointUploadMode.NO_UPLOAD,
        "ray.train.CheckpointUploadMode.NO_UPLOAD",
        "worker.RayReporter.register",
    )
    # An attribute set in __init__, so read from its source.
    assert "self.storage_filesystem" in inspect.getsource(StorageContext.__init__), (
        "Ray no longer has StorageContext.storage_filesystem: mend raylift's "
        "worker.RayReporter.register"
    )
    build = getattr(StorageContext, "build_checkpoint_path_from_name", None)
    needs(build, "StorageContext.build_checkpoint_path_from_name", "worker.RayReporter")
    assert list(inspect.signature(build).parameters) == ["self", "checkpoint_name"]
    params = inspect.signature(ray.train.report).parameters
    needs(params.get("checkpoint_upload_mode"), "report(checkpoint_upload_mode=)", "worker")
    context = ray.train.get_context  # the DeveloperAPI get_storage() hangs off its result
    from ray.train.v2.api.context import TrainContext

    needs(getattr(TrainContext, "get_storage", None), "TrainContext.get_storage", "worker")
    assert callable(context)
