"""Memory snapshots without Ray: which snapshot a restart takes, and why; what a keeper
keeps; which node holds a rank's second copy; the refusal of a node that cannot hold them.
On a real Ray: tests/integration/test_snapshots.py and test_drain.py."""

from __future__ import annotations

import pytest

from raylift.run.snapshots import Keeper, Part, choose, peer_of, room_problem, snapshot_bytes
from tests.helpers import make_config

A, B, C = "node-a", "node-b", "node-c"


def held_by(parts: dict[str, list[tuple[int, int, int, str]]]) -> dict:
    """{node: [(step, rank, world, origin)]} -> what catalog() returns."""
    return {
        node: {(step, rank): Part(world, 1000, origin) for step, rank, world, origin in held}
        for node, held in parts.items()
    }


def test_the_newest_snapshot_complete_on_every_rank_wins_over_older_storage() -> None:
    # Two nodes, one rank each, every part on its own node and its peer: node B is lost
    # (its keeper answers no more), and node A holds both ranks' parts of steps 20 and 30.
    held = held_by({A: [(20, 0, 2, A), (20, 1, 2, B), (30, 0, 2, A), (30, 1, 2, B)]})
    choice, why = choose(held, storage_step=10)
    assert choice is not None and choice.step == 30 and choice.world == 2
    assert choice.holders == {0: [A], 1: [A]} and choice.nbytes == 2000
    assert choice.from_peer == (1,)  # rank 1's own node is gone: its peer's copy serves
    assert why == (
        "the memory snapshot at step 30 is complete on every rank and newer than storage's "
        "step 10; rank(s) [1] from the copy on their peer node (their own node's keeper is gone)"
    )


def test_a_snapshot_cut_off_on_one_rank_gives_way_to_the_one_before() -> None:
    # Step 40 was on its way when rank 1 died: only rank 0's part arrived.
    held = held_by({A: [(30, 0, 2, A), (30, 1, 2, B), (40, 0, 2, A)],
                    B: [(30, 0, 2, A), (30, 1, 2, B)]})  # fmt: skip
    choice, why = choose(held, storage_step=30)
    assert choice is not None and choice.step == 30 and choice.from_peer == ()
    assert why == "the memory snapshot at step 30 is complete on every rank"  # same step: memory


def test_storage_wins_where_it_is_newer_or_memory_lost_a_rank() -> None:
    held = held_by({A: [(20, 0, 2, A), (20, 1, 2, B)]})
    choice, why = choose(held, storage_step=25)
    assert choice is None and why == (
        "the newest complete memory snapshot (step 20) is older than the newest storage "
        "checkpoint (step 25)"
    )
    lost = held_by({A: [(20, 0, 3, A), (20, 1, 3, B)]})  # rank 2's node and its peer gone
    choice, why = choose(lost, storage_step=10)
    assert choice is None and "step 20 lacks the part of rank(s) [2]" in why
    assert choose({}, 10) == (
        None,
        "no memory snapshot is held (none was taken yet, or its keepers are gone)",
    )


def test_parts_of_two_group_sizes_at_one_step_never_make_a_snapshot() -> None:
    # Step 20 taken at 2 workers, abandoned, then again at 1 before the keepers forgot it.
    held = held_by({A: [(20, 0, 1, A), (20, 1, 2, B)]})
    choice, why = choose(held, storage_step=-1)
    assert choice is None and "groups of [1, 2] workers" in why


def copies_held(parts: dict[str, list[tuple[int, int]]]) -> dict:
    """{node: [(step, rank)]} of a 4-rank HSDP run whose nodes A (ranks 0, 1) and B
    (ranks 2, 3) each keep their own whole copy."""
    copy_of = {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}
    return {
        node: {(s, r): Part(4, 500, node, copy_of[r]) for s, r in held}
        for node, held in parts.items()
    }


def test_under_hsdp_one_nodes_whole_copy_restores_every_rank() -> None:
    both = copies_held({A: [(20, 0), (20, 1)], B: [(20, 2), (20, 3)]})
    choice, why = choose(both, storage_step=-1)
    assert choice is not None and choice.replica == (0, 1) and choice.world == 4
    assert choice.holders == {0: [A], 1: [A]} and choice.nbytes == 1000  # one copy fetched
    # A restart whose rank 0 is on B takes B's own copy: a fetch within the node.
    assert choose(both, storage_step=-1, near=B)[0].holders == {2: [B], 3: [B]}  # type: ignore[union-attr]
    # Node A gone: B's copy serves every rank, and nothing was ever sent to a peer.
    choice, why = choose(copies_held({B: [(20, 2), (20, 3)]}), storage_step=10)
    assert choice is not None and choice.holders == {2: [B], 3: [B]} and choice.gone == (0, 1)
    assert why == (
        "the memory snapshot at step 20 is whole in the copy of rank(s) [2, 3] and newer than "
        "storage's step 10 (each node keeps a whole copy under HSDP); the copy of rank(s) "
        "[0, 1] is gone with its node"
    )
    # Step 30 reached B only in part (rank 3's was on its way), A is gone: step 20 it is.
    cut = copies_held({B: [(20, 2), (20, 3), (30, 2)]})
    assert choose(cut, storage_step=-1)[0].step == 20  # type: ignore[union-attr]
    none = copies_held({A: [(30, 0)], B: [(30, 3)]})
    assert choose(none, storage_step=-1) == (None, (
        "no memory snapshot is complete on every rank (step 30 has no whole copy: each node's "
        "copy lacks a part (the copies of rank(s) [[0, 1], [2, 3]]), gone with its node or "
        "still on its way)"
    ))  # fmt: skip


def test_a_keeper_holds_the_newest_snapshots_and_forgets_an_abandoned_past() -> None:
    keeper = Keeper(keep=2)
    for step in (10, 20, 30):
        for rank in (0, 1):
            assert keeper.hold(step, rank, 2, A, {"engine/x": b"abc", "loop_state.pt": b"d"}) == 4
    assert sorted(keeper.held()) == [(20, 0), (20, 1), (30, 0), (30, 1)]
    assert keeper.held()[(30, 1)] == Part(2, 4, A)
    assert keeper.give(20, 1) == {"engine/x": b"abc", "loop_state.pt": b"d"}
    keeper.hold(30, 1, 2, A, {"x": b"ab"}, replica=(0, 1))  # part of a whole copy (HSDP)
    assert keeper.held()[(30, 1)] == Part(2, 2, A, (0, 1))
    keeper.forget_after(20)  # a restart resumed at step 20: step 30 was never trained to
    assert sorted(keeper.held()) == [(20, 0), (20, 1)]


def test_each_rank_has_its_second_copy_on_another_node() -> None:
    nodes = [A, A, B, B, C, C]  # ranks by node
    assert [peer_of(nodes, r) for r in range(6)] == [B, B, C, C, A, A]
    assert peer_of([A, A], 0) is None  # one node: no second copy to be had


def test_a_node_that_cannot_hold_its_snapshots_is_refused_with_both_numbers_and_the_fix() -> None:
    cfg = make_config(task="gpt", checkpoint={"memory": {"every_n_steps": 5}})
    assert snapshot_bytes(cfg, trainable=1_000_000) == 12_000_000  # fp32 weights + Adam's two
    assert room_problem(10 * 2**30, 20 * 2**30, keep=2) is None
    said = room_problem(30 * 2**30, 20 * 2**30, keep=2)
    assert said == (
        "checkpoint.memory: the keeper on this node would hold about 30.0 GiB of memory "
        "snapshots (2 kept and the one arriving, of its ranks' parts and a peer node's) and "
        "the node has 20.0 GiB available: lower checkpoint.memory.keep, set "
        "checkpoint.memory: null (storage checkpoints only), or run on nodes with more memory"
    )


@pytest.mark.parametrize("bad", [{"every_n_steps": 0}, {"keep": 0}])
def test_memory_settings_below_one_are_refused(bad: dict) -> None:
    from raylift.core.config import ConfigError

    with pytest.raises(ConfigError, match=r"checkpoint\.memory\.\w+: must be >= 1"):
        make_config(checkpoint={"memory": bad})
