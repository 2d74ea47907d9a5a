"""The run's newest state in the cluster's memory, on two nodes (``checkpoint.memory``).

Every ``checkpoint.memory.every_n_steps`` each rank takes its part of the state as for a
storage checkpoint (the same files, sealed with the same checksums:
:mod:`raylift.run.saving`) and hands it to two keepers: the one on its own node and the
one on another node of the run (its peer). A keeper is a zero-CPU Ray actor on its node,
made by the run's :class:`KeeperSet`, which the driver owns: the keepers live as long as
the run, not as long as the workers, and end with the driver (Ray ends the actors an
ended owner made), leaving nothing behind.

At a restart rank 0 asks every keeper it can reach what it holds (:func:`catalog`), and
the newest snapshot that every rank of its group finished is the candidate
(:func:`choose`). Where it is at least as new as the newest storage checkpoint, each rank
fetches every part (from its own node's keeper where it holds one) into a local folder
and restores from there as from storage: each block is checked against the checksum
recorded when it was taken, and an elastic restart with fewer workers reads the parts it
now owns. Otherwise, or where a block fails, the restart restores from storage, and the
console says which source it used and why. Storage checkpoints stay the durable ones:
snapshots are never registered with Ray, never exported, and gone with the run.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

from raylift.core import storage
from raylift.core.config import Config, ConfigError
from raylift.run.context import gather
from raylift.run.leaving import silent
from raylift.run.plan import optimizer_slots

# A keeper that does not say what it holds within this long is passed over at a restart:
# its node is gone or going (Ray calls a node dead only after half a minute of silence).
CATALOG_TIMEOUT_S = 3.0

Key = tuple[int, int]  # (step, rank)


@dataclasses.dataclass(frozen=True)
class Part:
    """One rank's part of a snapshot, as a keeper holds it."""

    world: int  # the ranks of the group that took the snapshot
    nbytes: int
    origin: str  # the node that took it: its keeper holds the first copy, a peer's the second
    # Where each node's ranks wrote a whole copy (HSDP): the ranks of this part's copy.
    replica: tuple[int, ...] = ()


class Keeper:
    """One node's memory: the parts of the newest ``keep`` snapshots its ranks and its
    peers' ranks handed it, as bytes by file name."""

    def __init__(self, keep: int):
        self.keep = keep
        self.parts: dict[Key, tuple[int, str, dict[str, bytes], tuple[int, ...]]] = {}

    def hold(
        self,
        step: int,
        rank: int,
        world: int,
        origin: str,
        files: dict[str, bytes],
        replica: tuple[int, ...] = (),
    ) -> int:
        """Keep ``rank``'s part of the snapshot at ``step`` (of ``world`` ranks), taken on
        the node ``origin``; ``replica``: the ranks of the whole copy it is part of."""
        self.parts[(step, rank)] = (world, origin, files, tuple(replica))
        newest = sorted({s for s, _ in self.parts}, reverse=True)[: self.keep]
        self.parts = {k: v for k, v in self.parts.items() if k[0] in newest}
        return sum(len(b) for b in files.values())

    def held(self) -> dict[Key, Part]:
        """What each part held is, by (step, rank)."""
        return {
            k: Part(w, sum(len(b) for b in f.values()), origin, replica)
            for k, (w, origin, f, replica) in self.parts.items()
        }

    def give(self, step: int, rank: int) -> dict[str, bytes]:
        return self.parts[(step, rank)][2]

    def forget_after(self, step: int) -> None:
        """A restart resumed at ``step``: the snapshots after it are of a past that was
        abandoned, and a later one of the same step must not meet their parts."""
        self.parts = {k: v for k, v in self.parts.items() if k[0] <= step}


class KeeperSet:
    """The run's keepers, one per node, each made on first request (a node the autoscaler
    adds later gets its own). An actor the driver owns; the keepers are its."""

    def __init__(self, keep: int):
        self.keep = keep
        self.keepers: dict[str, Any] = {}

    def keeper(self, node_id: str) -> Any:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if node_id not in self.keepers:
            on_node = NodeAffinitySchedulingStrategy(node_id, soft=False)
            actor = ray.remote(num_cpus=0, max_restarts=0)(Keeper)
            self.keepers[node_id] = actor.options(scheduling_strategy=on_node).remote(self.keep)
        return self.keepers[node_id]

    def all(self) -> dict[str, Any]:
        return dict(self.keepers)


def start_keepers(cfg: Config) -> Any:
    """The driver's :class:`KeeperSet` for a run with ``checkpoint.memory``, on this node;
    None without."""
    memory = cfg.checkpoint.memory
    if memory is None:
        return None
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(num_cpus=0)(KeeperSet).options(scheduling_strategy=here).remote(memory.keep)


def end_keepers(keepers: Any) -> None:
    """The run is over: its keepers and what they hold go (the KeeperSet's end ends them)."""
    if keepers is not None:
        import ray

        ray.kill(keepers)


def peer_of(nodes: list[str], rank: int) -> str | None:
    """The node that keeps ``rank``'s second copy: the next of the run's nodes after its
    own, in a fixed order; None where the run has one node."""
    distinct = sorted(set(nodes))
    if len(distinct) == 1:
        return None
    return distinct[(distinct.index(nodes[rank]) + 1) % len(distinct)]


@dataclasses.dataclass(frozen=True)
class Choice:
    step: int
    world: int
    holders: dict[int, list[str]]  # rank -> the nodes whose keepers hold its part
    nbytes: int  # of every rank's part together
    from_peer: tuple[int, ...] = ()  # ranks whose own node's keeper is gone: the peer's copy
    replica: tuple[int, ...] = ()  # the ranks of the whole copy it is (HSDP), where it is one
    gone: tuple[int, ...] = ()  # the ranks whose own node's whole copy is not: gone with it


Held = dict[str, dict[Key, Part]]  # what each node's keeper holds


def choose(held: Held, storage_step: int, near: str = "") -> tuple[Choice | None, str]:
    """The snapshot to restore from, given what each node's keeper holds and the newest
    storage checkpoint's step (-1: none), with why; None and why not where it is storage.
    ``near``: the node whose own whole copy (HSDP) is preferred: the restarted rank 0's,
    which stays, where another copy's node may be leaving."""
    steps = sorted({s for parts in held.values() for s, _ in parts}, reverse=True)
    if not steps:
        return None, "no memory snapshot is held (none was taken yet, or its keepers are gone)"
    missing = ""
    for step in steps:
        choice, missing = _complete(held, step, near)
        if choice is None:
            continue
        if step < storage_step:
            return None, (
                f"the newest complete memory snapshot (step {step}) is older than the newest "
                f"storage checkpoint (step {storage_step})"
            )
        newer = f" and newer than storage's step {storage_step}" if step > storage_step else ""
        if choice.replica:
            return choice, _whole_said(choice, newer)
        peer = (
            f"; rank(s) {list(choice.from_peer)} from the copy on their peer node (their own "
            "node's keeper is gone)"
            if choice.from_peer
            else ""
        )
        return choice, f"the memory snapshot at step {step} is complete on every rank{newer}{peer}"
    return None, f"no memory snapshot is complete on every rank ({missing})"


def _complete(held: Held, step: int, near: str = "") -> tuple[Choice | None, str]:
    holders: dict[int, list[str]] = {}
    worlds, sizes, origins = set(), {}, {}
    for node, parts in sorted(held.items()):
        for (s, rank), part in parts.items():
            if s == step:
                holders.setdefault(rank, []).append(node)
                worlds.add(part.world)
                sizes[rank], origins[rank] = part.nbytes, part.origin
    if len(worlds) != 1:
        return None, f"step {step}'s parts come from groups of {sorted(worlds)} workers"
    world = worlds.pop()
    copies = {p.replica for parts in held.values() for (s, _), p in parts.items() if s == step}
    if copies != {()}:
        copies.discard(())
        return _whole_copy(step, world, holders, sizes, sorted(copies, key=_by(near, holders)))
    lost = [r for r in range(world) if r not in holders]
    if lost:
        return None, (
            f"step {step} lacks the part of rank(s) {lost}: the node that took it and its "
            "peer are gone, or it was still on its way"
        )
    peer = tuple(r for r in range(world) if origins[r] not in holders[r])
    return Choice(step, world, holders, sum(sizes.values()), peer), ""


def _by(near: str, holders: dict[int, list[str]]) -> Any:
    """Copies held on ``near`` first, then by their ranks."""
    return lambda ranks: (not all(near in holders.get(r, []) for r in ranks), ranks)


def _whole_copy(
    step: int,
    world: int,
    holders: dict[int, list[str]],
    sizes: dict[int, int],
    copies: list[tuple[int, ...]],
) -> tuple[Choice | None, str]:
    """The first whole copy (HSDP: one node's ranks wrote it) every part of which is held;
    the others that lack one were lost with their node."""
    whole = [ranks for ranks in copies if all(r in holders for r in ranks)]
    if not whole:
        return None, (
            f"step {step} has no whole copy: each node's copy lacks a part (the copies of "
            f"rank(s) {[list(c) for c in copies]}), gone with its node or still on its way"
        )
    ranks = whole[0]
    gone = tuple(r for r in range(world) if not any(r in c for c in whole))
    chosen = {r: holders[r] for r in ranks}
    return Choice(step, world, chosen, sum(sizes[r] for r in ranks), (), ranks, gone), ""


def _whole_said(choice: Choice, newer: str) -> str:
    lost = f"; the copy of rank(s) {list(choice.gone)} is gone with its node" if choice.gone else ""
    return (
        f"the memory snapshot at step {choice.step} is whole in the copy of rank(s) "
        f"{list(choice.replica)}{newer} (each node keeps a whole copy under HSDP){lost}"
    )


def reachable(keepers: dict[str, Any]) -> dict[str, Any]:
    """The keepers on nodes Ray calls alive whose raylet still takes a connection."""
    import ray

    alive = [n for n in ray.nodes() if n.get("Alive") and n["NodeID"] in keepers]
    nodes = {n["NodeID"] for n in alive} - silent(alive)
    return {node: keepers[node] for node in nodes}


def catalog(keepers: dict[str, Any]) -> Held:
    """What each reachable keeper holds, by node. Keepers on nodes whose raylet takes no
    connection, or that do not answer within :data:`CATALOG_TIMEOUT_S`, are passed over."""
    import ray

    asked = {keeper.held.remote(): node for node, keeper in reachable(keepers).items()}
    ready, _ = ray.wait(list(asked), num_returns=len(asked), timeout=CATALOG_TIMEOUT_S)
    out = {}
    for ref in ready:
        try:
            out[asked[ref]] = ray.get(ref)
        except Exception:  # the keeper died with its node: its parts are gone
            continue
    return out


class Snapshots:
    """A rank's side of the run's memory snapshots. Made by every rank together."""

    def __init__(self, keepers: Any, rank: int, world: int):
        import ray

        self.keepers, self.rank, self.world = keepers, rank, world
        self.node = ray.get_runtime_context().get_node_id()
        self.nodes = gather(world, self.node)  # each rank's
        self.peer = peer_of(self.nodes, rank)
        holders = [self.node] if self.peer is None else [self.node, self.peer]
        self.holders = ray.get([keepers.keeper.remote(n) for n in holders])
        self.replica: tuple[int, ...] = ()

    def use_replicas(self, replicas: tuple[tuple[int, ...], ...]) -> None:
        """Where each node's ranks hold a whole copy of the state (HSDP by node), each node
        keeps its own copy and sends no part to a peer: any one node's copy restores the
        run, and a lost node's part is its replica's."""
        self.replica = next((ranks for ranks in replicas if self.rank in ranks), ())
        if self.replica:
            self.peer, self.holders = None, self.holders[:1]

    def send(self, step: int, folder: Path) -> int:
        """Hand this rank's part of the snapshot at ``step`` (its files under ``folder``,
        its completion list among them) to its keepers; returns its bytes once both hold it."""
        import ray

        paths = sorted(p for p in folder.rglob("*") if p.is_file())
        files = {str(p.relative_to(folder)): p.read_bytes() for p in paths}
        ref = ray.put(files)  # one copy in the object store, fetched by each keeper
        args = (step, self.rank, self.world, self.node, ref, self.replica)
        held = ray.get([k.hold.remote(*args) for k in self.holders])
        return int(held[0])

    def where(self) -> str:
        if self.replica:
            return "each node, a whole copy on each (HSDP's replicas)"
        return "this node only (one node)" if self.peer is None else "this node and a peer"

    def find(self, storage_step: int) -> tuple[Choice | None, str]:
        """Collective: the snapshot every rank restores from (rank 0 looks), or None, and why."""
        import ray

        found: tuple[Choice | None, str] = (None, "")
        if self.rank == 0:
            held = catalog(ray.get(self.keepers.all.remote()))
            found = choose(held, storage_step, near=self.node)
        return gather(self.world, found)[0]

    def fetch(self, choice: Choice, into: Path) -> int:
        """Every rank's part of ``choice`` into the folder ``into``, from this node's keeper
        where it holds it; returns the bytes fetched."""
        import ray

        keepers = ray.get(self.keepers.all.remote())
        refs = []
        for rank, nodes in sorted(choice.holders.items()):
            node = self.node if self.node in nodes else nodes[0]
            refs.append(keepers[node].give.remote(choice.step, rank))
        total = 0
        for files in ray.get(refs):
            for name, data in files.items():
                path = into / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
                total += len(data)
        return total

    def forget_after(self, step: int) -> None:
        """Rank 0, after a restore at ``step``: every keeper drops what is newer."""
        if self.rank == 0:
            import ray

            keepers = list(reachable(ray.get(self.keepers.all.remote())).values())
            # Waited for: another rank's next part must not arrive before it.
            ray.wait([k.forget_after.remote(step) for k in keepers], num_returns=len(keepers),
                     timeout=CATALOG_TIMEOUT_S)  # fmt: skip

    def check_room(self, cfg: Config, trainable: int) -> None:
        """Collective, before training: refuse a run whose snapshots a node cannot hold."""
        import psutil

        memory = cfg.checkpoint.memory
        assert memory is not None
        share = self._share()
        need = int((memory.keep + 1) * snapshot_bytes(cfg, trainable) * share)
        problem = room_problem(need, psutil.virtual_memory().available, memory.keep)
        said = problem and f"{problem} (rank {self.rank}'s node)"
        problems = [p for p in gather(self.world, said) if p]
        if problems:
            raise ConfigError(problems[:1])

    def _share(self) -> float:
        """The share of a snapshot this node holds: its ranks' parts and its peers'."""
        if self.replica:
            return 1.0  # its own whole copy
        peers = [peer_of(self.nodes, r) for r in range(self.world)]
        own = sum(n == self.node for n in self.nodes) + sum(p == self.node for p in peers)
        return own / self.world


def snapshot_bytes(cfg: Config, trainable: int) -> int:
    """About the bytes of one snapshot of every rank: the trainable weights and their
    optimizer state, in fp32 (a frozen base is never in it)."""
    return trainable * 4 * (1 + optimizer_slots(cfg))


def room_problem(need: int, available: int, keep: int) -> str | None:
    if need <= available:
        return None
    size = storage.size_text
    return (
        f"checkpoint.memory: the keeper on this node would hold about {size(need)} of memory "
        f"snapshots ({keep} kept and the one arriving, of its ranks' parts and a peer node's) "
        f"and the node has {size(available)} available: lower checkpoint.memory.keep, set "
        "checkpoint.memory: null (storage checkpoints only), or run on nodes with more memory"
    )


def scratch_for(step: int) -> Path:
    folder = storage.scratch_dir("snapshot")
    return folder / f"snapshot-step{step:08d}"


def remove(folder: Path) -> None:
    shutil.rmtree(folder.parent, ignore_errors=True)
