"""A leaving node, without a running Ray: the restart's reservation made without it, on
Ray Data's own coordinator class and counted by Ray Train's own elastic policy; the line
a preemption's restart prints. The drain itself, on a Ray of two nodes, is
tests/integration/test_drain.py."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
from unittest import mock

import pytest

from raylift.run.leaving import preemption_line, reserver, silent

HEAD, LEAVING = "aa" * 28, "bb" * 28
NODES = [
    {"NodeID": HEAD, "Alive": True, "Resources": {"CPU": 2.0, "memory": 1e9}},
    {"NodeID": LEAVING, "Alive": True, "Resources": {"CPU": 2.0, "memory": 1e9}},
]


def coordinator_and_policy():  # type: ignore[no-untyped-def]
    """Ray Data's coordinator (its class, in this process) with two live nodes, and Ray
    Train's elastic policy for ``num_workers: [1, 2]`` of 2 CPUs each."""
    import ray
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        _AutoscalingCoordinatorActor,
    )
    from ray.train import ScalingConfig
    from ray.train.v2._internal.execution.scaling_policy.elastic import ElasticScalingPolicy

    # No tick thread, which the class starts where this process has joined a Ray (an xdist
    # worker that also ran the session's Ray tests): only the calls below look at the nodes.
    with mock.patch.object(ray, "is_initialized", return_value=False):
        coordinator = _AutoscalingCoordinatorActor(
            send_resources_request=lambda *args: None, get_cluster_nodes=lambda: NODES
        )
    coordinator.request_resources("train", [{"CPU": 2.0}, {"CPU": 2.0}], expire_after_s=600)
    config = ScalingConfig(num_workers=(1, 2), resources_per_worker={"CPU": 2.0})
    return coordinator, ElasticScalingPolicy(config)


def test_the_restart_is_reserved_without_the_draining_node() -> None:
    coordinator, policy = coordinator_and_policy()
    both = coordinator.get_reserved_resources("train", recompute=True)
    assert set(both) == {HEAD, LEAVING}
    assert policy._count_possible_workers(both) == 2  # what Ray alone restarts with

    reserver()(coordinator, {LEAVING})
    staying = coordinator.get_reserved_resources("train")
    assert set(staying) == {HEAD}, staying
    assert policy._count_possible_workers(staying) == 1  # the restart fits what stays

    reserver()(coordinator, set())  # no node leaving: the coordinator's own look
    assert set(coordinator.get_reserved_resources("train")) == {HEAD, LEAVING}


def test_the_reserver_travels_by_value() -> None:
    """The coordinator's process need not import raylift: the function unpickles and runs
    where raylift cannot be imported at all."""
    import cloudpickle

    data = cloudpickle.dumps(reserver())
    script = textwrap.dedent(
        """
        import pickle, sys, threading
        sys.modules["raylift"] = None  # any import of raylift fails
        reserve = pickle.loads(sys.stdin.buffer.read())

        class Coordinator:
            _lock = threading.RLock()
            _cluster_node_resources = {None: {"a": {"CPU": 1}, "b": {"CPU": 1}}}
            def _tick(self): pass
            def _refresh_resource_reservations(self):
                print(sorted(self._cluster_node_resources[None]))

        reserve(Coordinator(), {"b"})
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], input=data, capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().strip() == "['a']"
    with pytest.raises(AttributeError):  # by reference it would name a module attribute
        pickle.dumps(reserver())


def test_a_preemptions_restart_names_the_node_its_ranks_and_the_checkpoint() -> None:
    from ray.train import PreemptionInfo

    info = PreemptionInfo(deadline_ms=None, preempted_node_to_ranks={LEAVING: [1, 3]})
    line = preemption_line(info, {LEAVING: "10.0.0.7"}, "s3://runs/x/checkpoint-step00000040")
    assert line == (
        "raylift: node 10.0.0.7 (rank 1, 3) reclaimed (drained for preemption): restarting "
        "the workers from s3://runs/x/checkpoint-step00000040 (preemptions do not count "
        "against train.max_failures)"
    )
    assert "from step 0 (no checkpoint" in preemption_line(info, {}, None)


def test_a_node_whose_raylet_takes_no_connection_counts_as_gone() -> None:
    """A raylet that listens answers; one whose process died (its port closed) refuses at
    once; a node with no address to ask keeps Ray's own view."""
    import socket

    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        nodes = [
            {"NodeID": "up", "NodeManagerAddress": "127.0.0.1",
             "NodeManagerPort": listening.getsockname()[1]},
            {"NodeID": "dead", "NodeManagerAddress": "127.0.0.1",
             "NodeManagerPort": closed.getsockname()[1]},
            {"NodeID": "unknown", "NodeManagerAddress": "", "NodeManagerPort": 0},
        ]  # fmt: skip
        assert silent(nodes) == {"dead"}
    assert silent([]) == set()
