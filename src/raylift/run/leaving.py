"""A node that is leaving: the restart after it is sized without it, and said on the console.

A drain for preemption (a spot reclaim, an autoscaler scaling in) comes with a deadline.
Ray Train tells the workers (``ray.train.get_preemption_info``), lets them train until
the deadline, then tears the group down and restarts it (a ``PreemptionError``, counted
apart from ``train.max_failures``). The loop saves at the notice and again just before
the deadline (:mod:`raylift.run.loop`), so no step is redone. What happens between the
teardown and the next step is this module's:

- An elastic restart is sized by what Ray Data's AutoscalingCoordinator reserved at its
  last look at the cluster, taken every 20 s. A node that is draining, or that died since,
  still counts there: the restart asks for a worker that cannot be placed (Ray places
  nothing new on a draining node) and waits out the worker-group start timeout, a minute
  by default, before it retries smaller. :func:`reserve_without_leaving` has the
  coordinator look again now, with the draining nodes and those whose raylet takes no
  connection left out, before Ray Train sizes the restart.
- Ray reports a preemption's restart to no ``UserCallback`` (its workers did not fail):
  :class:`Restarts` gives it the console line and the timing (:mod:`raylift.run.restarts`)
  a failure's restart gets from :class:`raylift.run.faults.FaultReporter`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

# Train V2's controller hooks: internal, pinned in tests/unit/test_ray_private.py.
from ray.train.v2._internal.execution.callback import ControllerCallback

from raylift.core import console
from raylift.tensors.checkpoints import newest_written

# How long a restart may wait for the coordinator to look at the nodes again; at worst
# (the call fails or is slow) the restart is sized as Ray would have sized it.
REFRESH_TIMEOUT_S = 10.0
_RESTART_STATES = ("RestartingState", "ReschedulingState")


class Restarts(ControllerCallback):
    """Runs in the Ray Train controller, at each restart of the worker group, whatever
    caused it: a worker's failure, a preemption, a group that could not be placed."""

    def __init__(
        self,
        run_dir: str,
        tracking: Any = None,
        run_id: str | None = None,
        elastic: bool = False,
    ):
        self.run_dir, self.tracking, self.run_id = run_dir, tracking, run_id
        self.elastic = elastic

    def after_controller_state_update(self, previous_state: Any, current_state: Any) -> None:
        if type(current_state).__name__ not in _RESTART_STATES:
            return
        error = getattr(current_state, "training_failed_error", None)
        info = getattr(error, "preemption_info", None)
        if info is not None:
            self._preempted(info)
        elif type(current_state).__name__ == "ReschedulingState":
            console.route_ray_process()
            print(
                "raylift: the workers could not all be placed in time: trying again, sized "
                "by the nodes there are now (scaling.placement_timeout_s bounds the tries)",
                flush=True,
            )
        if self.elastic:
            reserve_without_leaving()

    def _preempted(self, info: Any) -> None:
        if self.tracking is not None and self.run_id:
            # The restart's clock starts here, as a failure's does (raylift.run.restarts).
            self.tracking.fault.remote(self.run_id, time.time())
        console.route_ray_process()  # this line is raylift's, in the controller's process
        print(preemption_line(info, node_addresses(), newest_written(self.run_dir)), flush=True)


def preemption_line(info: Any, addresses: dict[str, str], checkpoint: str | None) -> str:
    """The console's line for a restart after a preemption (``info``: Ray's PreemptionInfo)."""
    nodes = ", ".join(
        f"{addresses.get(node, node[:12])} (rank {', '.join(map(str, ranks))})"
        for node, ranks in sorted(info.preempted_node_to_ranks.items())
    )
    start = checkpoint or "step 0 (no checkpoint was written yet)"
    return (
        f"raylift: node {nodes} reclaimed (drained for preemption): restarting the workers "
        f"from {start} (preemptions do not count against train.max_failures)"
    )


def node_addresses() -> dict[str, str]:
    """Each node's id (hex) -> its address, for the nodes Ray knows of."""
    import ray

    return {n["NodeID"]: n.get("NodeManagerAddress", "") for n in ray.nodes()}


def reserve_without_leaving() -> None:
    """Have the coordinator reserve for the restart from the nodes that stay: the live ones,
    less those draining and those whose raylet no longer answers. One look, not a standing
    change to the coordinator: its next regular look (within 20 s) counts every node Ray
    calls alive again, as Ray Data's own users expect, and by then the restart is placed."""
    import ray
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator,
    )

    try:
        alive = [n for n in ray.nodes() if n.get("Alive")]
        leaving = set(ray._private.state.state.get_draining_nodes()) | silent(alive)
        coordinator = get_or_create_autoscaling_coordinator()
        ray.get(coordinator.__ray_call__.remote(reserver(), leaving), timeout=REFRESH_TIMEOUT_S)
    except Exception as exc:  # the restart goes on with Ray's own view
        print(f"raylift: could not refresh the cluster's view before the restart: {exc}")


# A raylet that does not take a connection within this long counts as gone for the
# restart: one whose process died refuses at once, one whose host is gone times out.
RAYLET_ANSWER_S = 2.0


def silent(nodes: list[dict[str, Any]], timeout: float = RAYLET_ANSWER_S) -> set[str]:
    """The ids of the ``nodes`` (``ray.nodes()``'s records) whose raylet takes no TCP
    connection. Ray calls a node dead only after its health checks have failed for a
    while (about half a minute by default); a restart sized before then asks for a worker
    there and waits out Ray Train's worker-group start timeout. All nodes at once, so the
    look costs at most ``timeout``."""
    import socket
    from concurrent.futures import ThreadPoolExecutor

    def refuses(node: dict[str, Any]) -> bool:
        address = (node.get("NodeManagerAddress", ""), int(node.get("NodeManagerPort") or 0))
        if not all(address):
            return False  # nothing to ask: Ray's own view stands
        try:
            socket.create_connection(address, timeout=timeout).close()
            return False
        except OSError:
            return True

    if not nodes:
        return set()
    with ThreadPoolExecutor(max_workers=min(32, len(nodes))) as pool:
        gone = list(pool.map(refuses, nodes))
    return {n["NodeID"] for n, out in zip(nodes, gone, strict=True) if out}


def reserver() -> Callable[[Any, set[str]], None]:
    """What the coordinator runs in its own process (``__ray_call__``): made here, nested,
    so that it travels by value and that process imports nothing of raylift's."""

    def reserve(coordinator: Any, leaving: set[str]) -> None:
        # The coordinator's own tick (dead nodes out, requests merged, reservations made
        # again), then the reservations made once more without the nodes that leave.
        with coordinator._lock:
            coordinator._tick()
            if not leaving:
                return
            for nodes in coordinator._cluster_node_resources.values():
                for node in leaving:
                    nodes.pop(node, None)
            coordinator._refresh_resource_reservations()

    return reserve
