"""FSDP's device mesh, built from where Ray put the workers.

Three dimensions, named as torchtitan and Accelerate name them: ``dp_replicate`` (whole
copies of the sharded state, each reduced with the others once a step), ``dp_shard`` (the
ranks one copy is sharded over) and ``tp`` (tensor parallel). Each is a number or
``auto``. With every one ``auto`` a run on one node shards over all its workers, and a run
over several nodes shards within each node and replicates across them (HSDP): the
all-gathers and reduce-scatters of every layer stay on the fast links inside a node, and
only one all-reduce of the gradient shards a step crosses the slow ones.

Ranks are laid out node by node, whatever order Ray numbered them in, so that a shard
group (and a tensor-parallel group) is a node's workers. Which node each rank is on is
asked of Ray at every build, so an elastic restart builds its mesh from the nodes left.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from raylift.core.config import AUTO, Config

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

KEYS = ("dp_replicate", "dp_shard", "tp")
DIMS = ("replicate", "shard", "tp")


class MeshError(ValueError):
    """The mesh asked for does not fit the workers Ray placed: the numbers and the fix."""


@dataclasses.dataclass(frozen=True)
class DataView:
    """A rank's place among the data readers: ``index`` of ``count``, each reading the
    rows of ``group`` ranks (a tensor-parallel group) and training on them as ``group``
    micro-batches in turn, so the step's rows and loss are those of ``count x group``
    ranks of data parallel."""

    index: int
    count: int
    group: int


@dataclasses.dataclass(frozen=True)
class Mesh:
    replicate: int
    shard: int
    tp: int
    # The world's ranks in mesh order (replicate-major, tp fastest): one node's together.
    order: tuple[int, ...]
    nodes: tuple[str, ...]  # the node of each rank, by rank
    note: str = ""  # why the mesh is not the one asked for, where it is not

    @property
    def hsdp(self) -> bool:
        return self.replicate > 1

    def groups(self, dim: str) -> list[list[int]]:
        """The rank groups along ``dim``: the ranks that talk to each other over it."""
        import numpy as np

        grid = np.array(self.order).reshape(self.replicate, self.shard, self.tp)
        moved = np.moveaxis(grid, DIMS.index(dim), -1)
        return [list(map(int, g)) for g in moved.reshape(-1, moved.shape[-1])]

    def crosses_nodes(self, dim: str) -> bool:
        return any(len({self.nodes[r] for r in g}) > 1 for g in self.groups(dim))

    def line(self) -> str:
        """``mesh: replicate 2 (nodes) x shard 2 (workers per node) x tp 1``"""
        per_node = self.shard * self.tp == len(self.order) // max(len(set(self.nodes)), 1)
        by_node = per_node and not self.crosses_nodes("shard") and not self.crosses_nodes("tp")
        rep = "(nodes)" if self.hsdp and by_node else self._where("replicate")
        shard = "(workers per node)" if self.hsdp and by_node else self._where("shard")
        tp = f"tp {self.tp} {self._where('tp')}".rstrip()
        text = f"mesh: replicate {self.replicate} {rep} x shard {self.shard} {shard} x {tp}"
        return text.replace("  ", " ") + (f"; {self.note}" if self.note else "")

    def _where(self, dim: str) -> str:
        size = getattr(self, dim)
        if size == 1:
            return ""
        return "(across nodes)" if self.crosses_nodes(dim) else "(within a node)"

    def replicas(self) -> tuple[tuple[int, ...], ...]:
        """The ranks of each whole copy of the state, where each copy is one node's ranks
        and each node holds one (HSDP by node); () otherwise, where no node's ranks hold
        the whole state among themselves."""
        if not self.hsdp:
            return ()
        copies = [sorted(row) for row in _rows(self.order, self.replicate)]
        homes = [{self.nodes[r] for r in ranks} for ranks in copies]
        if any(len(h) != 1 for h in homes) or len(set().union(*homes)) != len(copies):
            return ()
        return tuple(tuple(ranks) for ranks in copies)

    def data_view(self, rank: int) -> DataView:
        """Which data ``rank`` reads: its tensor-parallel group's rows, as one reader of
        ``replicate x shard`` (the group's ranks all see the same batches)."""
        place = self.order.index(rank)
        return DataView(place // self.tp, len(self.order) // self.tp, self.tp)

    def device_mesh(self, device_type: str) -> DeviceMesh:
        """The 3-D device mesh (collective: every rank calls it)."""
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        grid = torch.tensor(self.order).view(self.replicate, self.shard, self.tp)
        return DeviceMesh(device_type, grid, mesh_dim_names=DIMS)


def _rows(order: Sequence[int], n: int) -> list[list[int]]:
    size = len(order) // n
    return [list(order[i * size : (i + 1) * size]) for i in range(n)]


def by_node(nodes: Sequence[str]) -> tuple[int, ...]:
    """The ranks ordered node by node (nodes in the order of their lowest rank)."""
    first: dict[str, int] = {}
    for rank, node in enumerate(nodes):
        first.setdefault(node, rank)
    return tuple(sorted(range(len(nodes)), key=lambda r: (first[nodes[r]], r)))


def counts(nodes: Sequence[str]) -> list[int]:
    """Workers on each node, nodes in the order of their lowest rank."""
    order = by_node(nodes)
    seen: dict[str, int] = {}
    for r in order:
        seen[nodes[r]] = seen.get(nodes[r], 0) + 1
    return list(seen.values())


def _sizes(value: int | str) -> int | None:
    return None if value == AUTO else int(value)


def resolve(strategy: Any, nodes: Sequence[str]) -> Mesh:
    """The mesh ``strategy`` (its ``dp_replicate``, ``dp_shard`` and ``tp``) asks for, over
    ranks on ``nodes`` (the node of each rank); :class:`MeshError` where it cannot be."""
    world = len(nodes)
    order = by_node(nodes)
    tp = _sizes(strategy.tp) or 1
    rep, shard = _sizes(strategy.dp_replicate), _sizes(strategy.dp_shard)
    if world % tp:
        raise MeshError(
            f"strategy.tp: {tp} does not divide the {world} workers; "
            f"set scaling.num_workers to a multiple of {tp}, or a smaller strategy.tp"
        )
    note = ""
    if shard is None:
        if rep is None:
            rep, note = _replicas(nodes, tp)
        shard = _quotient(world, rep, tp, "dp_replicate")
    elif rep is None:
        rep = _quotient(world, shard, tp, "dp_shard")
    if rep * shard * tp != world:
        raise MeshError(
            f"strategy: dp_replicate x dp_shard x tp = {rep} x {shard} x {tp} = "
            f"{rep * shard * tp}, but the run has {world} workers; make the product "
            f"{world}, or leave one of them auto"
        )
    mesh = Mesh(rep, shard, tp, order, tuple(nodes), note)
    if tp > 1 and mesh.crosses_nodes("tp"):
        raise MeshError(
            f"strategy.tp: a tensor-parallel group of {tp} would span nodes (workers per "
            f"node: {_listing(nodes)}); tensor parallelism needs a node's fast links: "
            "set strategy.tp to a divisor of the workers on every node"
        )
    return mesh


def _quotient(world: int, given: int, tp: int, key: str) -> int:
    if world % (given * tp):
        raise MeshError(
            f"strategy.{key}: {given} (x tp {tp}) does not divide the {world} workers; "
            f"choose a divisor of {world // tp}, or leave strategy.{key} auto"
        )
    return world // (given * tp)


def _replicas(nodes: Sequence[str], tp: int) -> tuple[int, str]:
    """``auto``'s replicas: one per node where every node has the same count, else 1 (full
    sharding) and why."""
    per_node = counts(nodes)
    if len(per_node) == 1:
        return 1, ""
    if len(set(per_node)) == 1:
        if per_node[0] % tp:
            raise MeshError(
                f"strategy.tp: {tp} does not divide the {per_node[0]} workers on each node; "
                "set strategy.tp to a divisor of the workers per node"
            )
        return len(per_node), ""
    return 1, (
        f"Ray placed the workers unevenly ({_listing(nodes)}), and HSDP needs the same "
        "number on every node: sharded over all of them instead; give each node the same "
        "number of workers (scaling.cpus_per_worker) for HSDP"
    )


def _listing(nodes: Sequence[str]) -> str:
    return ", ".join(f"{n} on node {i + 1}" for i, n in enumerate(counts(nodes)))


# The nodes of the ranks of a process group, asked once while it lives (its ranks never
# move): the mesh, ZeRO-3's hpZ (at its model's build and at its engine's) and the wire
# meter all ask at a start, and each asking is a collective.
_NODES: dict[int, list[str]] = {}


def node_of_ranks() -> list[str]:
    """The node each rank of the process group runs on (collective the first time a
    group asks). Ray's node id in a Ray worker; outside Ray (a plain process group), the
    host name."""
    import socket

    import torch.distributed as dist

    if not dist.is_initialized():  # one process, no group: a run of one worker
        return [socket.gethostname()]
    group = dist.group.WORLD
    key = id(group)
    if key not in _NODES or len(_NODES[key]) != dist.get_world_size():
        _NODES.clear()  # an older group's: gone
        _NODES[key] = _gathered()
    return list(_NODES[key])


def _gathered() -> list[str]:
    import socket

    import torch.distributed as dist

    own = socket.gethostname()
    try:
        import ray

        if ray.is_initialized():
            own = ray.get_runtime_context().get_node_id()
    except ImportError:
        pass
    nodes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, own)
    return [str(n) for n in nodes]


def problems(cfg: Config) -> list[str]:
    """What the config alone shows wrong with the mesh keys."""
    s, out = cfg.strategy, []
    for key in KEYS:
        value = getattr(s, key)
        if value != AUTO and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            out.append(f"strategy.{key}: an integer >= 1 or auto, got {value!r}")
    if out:
        return out
    sizes = [_sizes(getattr(s, k)) for k in KEYS]
    fixed = [v for v in sizes if v is not None]
    product = 1
    for v in fixed:
        product *= v
    sc = cfg.scaling
    if sc.elastic and len(fixed) == 3:
        out.append(
            "strategy: an elastic run's mesh is rebuilt from the workers it has at each "
            "restart; leave dp_replicate or dp_shard auto"
        )
    elif misfits := [n for n in range(sc.min_workers, sc.max_workers + 1) if n % product]:
        names = " x ".join(f"{k} {v}" for k, v in zip(KEYS, sizes, strict=True) if v)
        counts = ", ".join(map(str, misfits))
        out.append(
            f"strategy: {names} = {product} does not divide scaling.num_workers "
            f"({counts}); make every worker count a multiple of {product}"
        )
    elif not sc.elastic and len(fixed) == 3 and product != sc.min_workers:
        out.append(
            f"strategy: dp_replicate x dp_shard x tp = {product}, but scaling.num_workers is "
            f"{sc.min_workers}; make them equal, or leave one of them auto"
        )
    return out
