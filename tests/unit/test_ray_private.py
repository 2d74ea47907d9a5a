"""What raylift uses of Ray that Ray does not promise, one test each.

pyproject.toml pins ray to 2.60.x. Where Ray 2.60 has a public API raylift uses it
(``ray.util.get_node_ip_address``, ``ray.exceptions``, Train's ``WorkerGroupError``
message); what is left is below. Each test fails naming the raylift code that depends
on it, so a Ray upgrade that changes one says what to mend:

- ``check.node_types``: the autoscaler's published node types,
  ``ray._private.state.state.get_cluster_config()`` (no public API lists them);
- ``launch.check_token``: ``ray._raylet.GcsClient`` raising ``AuthenticationError``, to
  name the fix before ``ray.init`` retries for 20 s;
- ``launch.trainer_class``: Train's ``TorchTrainer._create_default_callbacks``, to start no
  idle ``DatasetManager`` for a run without Ray Datasets (tests/unit/test_launch.py checks
  what it returns);
- ``console.filter_worker_logs``: the driver's printer of forwarded lines,
  ``ray._private.ray_logging.global_worker_stdstream_dispatcher`` and
  ``ray._private.worker.print_to_stdstream``;
- ``console.warnings_to_ray_logs`` and ``console._ray_messages_file``: the node's logs
  folder, ``ray._private.worker.global_worker.node.get_logs_dir_path()``;
- ``faults.cause``: Train's wrapper of a user's exception keeps it as ``_base_exc``, and
  Ray's ``ActorDiedError`` text names the node as ``ip: ADDRESS``.
"""

from __future__ import annotations

import inspect

import pytest

import raylift.faults


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
    needs(GcsClient, "ray._raylet.GcsClient", "launch.check_token")
    needs(
        getattr(ray.exceptions, "AuthenticationError", None),
        "ray.exceptions.AuthenticationError",
        "launch.check_token",
    )
    assert "address" in inspect.signature(GcsClient.__init__).parameters or callable(GcsClient)


def test_trains_default_callbacks_can_be_overridden() -> None:
    from ray.train.torch import TorchTrainer

    needs(
        getattr(TorchTrainer, "_create_default_callbacks", None),
        "TorchTrainer._create_default_callbacks",
        "launch.trainer_class",
    )


def test_the_drivers_printer_of_forwarded_lines_can_be_swapped() -> None:
    import ray._private.ray_logging as ray_logging
    import ray._private.worker as ray_worker

    dispatcher = getattr(ray_logging, "global_worker_stdstream_dispatcher", None)
    needs(
        dispatcher, "ray_logging.global_worker_stdstream_dispatcher", "console.filter_worker_logs"
    )
    for method in ("add_handler", "remove_handler"):
        needs(getattr(dispatcher, method, None), f"the dispatcher's {method}", "console")
    assert isinstance(getattr(dispatcher, "handlers", None), (list, dict)), (
        "Ray's dispatcher keeps no .handlers: mend console.filter_worker_logs"
    )
    printer = getattr(ray_worker, "print_to_stdstream", None)
    needs(printer, "ray._private.worker.print_to_stdstream", "console.filter_worker_logs")
    assert list(inspect.signature(printer).parameters)[:2] == ["data", "ignore_prefix"], (
        "print_to_stdstream's arguments changed: mend console.filter_worker_logs"
    )


def test_a_nodes_logs_folder_is_known_to_its_workers() -> None:
    import ray._private.node
    import ray._private.worker as ray_worker

    needs(
        getattr(ray_worker, "global_worker", None), "ray._private.worker.global_worker", "console"
    )
    needs(
        getattr(ray._private.node.Node, "get_logs_dir_path", None),
        "Node.get_logs_dir_path",
        "console.warnings_to_ray_logs",
    )


def test_a_users_exception_is_kept_in_trains_wrapper() -> None:
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback

    wrapped = UserExceptionWithTraceback(ValueError("the user's"), "Traceback ...")
    assert isinstance(getattr(wrapped, "_base_exc", None), ValueError), (
        "Train's UserExceptionWithTraceback no longer keeps the exception as _base_exc: "
        "mend raylift.faults.cause"
    )
    what, _ = raylift.faults.cause(wrapped)
    assert what == "ValueError: the user's"


def test_a_dead_actors_error_names_its_node_as_raylift_reads_it() -> None:
    from ray.core.generated.common_pb2 import ActorDiedErrorContext
    from ray.exceptions import ActorDiedError

    context = ActorDiedErrorContext(
        class_name="RayTrainWorker", actor_id=b"\x01" * 16, pid=4242,
        node_ip_address="10.1.2.3", error_message="Worker exit type: SYSTEM_ERROR",
    )  # fmt: skip
    error = ActorDiedError(context)
    _, node = raylift.faults.cause(error)
    assert node == "10.1.2.3", f"Ray's ActorDiedError text changed: mend faults._IP\n{error}"


@pytest.mark.parametrize(
    "module", ["raylift.check", "raylift.launch", "raylift.faults", "raylift.console"]
)
def test_no_other_private_ray_module_is_imported(module: str) -> None:
    """The list above is the whole list: a new private use is added there, with a test."""
    import importlib

    source = inspect.getsource(importlib.import_module(module))
    allowed = {
        "ray._private.state", "ray._raylet", "ray._private.worker", "ray._private.ray_logging",
        "ray._private.node", "_create_default_callbacks", "_base_exc",
    }  # fmt: skip
    found = {
        token.strip("(:.,")
        for token in source.replace("\n", " ").split()
        if token.startswith(("ray._private.", "ray._raylet", "_create_default", "ray.train.v2._"))
        or "_base_exc" in token
    }
    unknown = {f for f in found if not any(f.startswith(a) or a in f for a in allowed)}
    assert not unknown, f"private Ray used in {module} and not listed here: {sorted(unknown)}"
