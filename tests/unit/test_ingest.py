"""The resumable batch stream: one global order per epoch, split by rank, without Ray."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from raylift.data.ingest import EpochOrder, MemoryStore, ShardSource, prefetched

ROWS = 1000  # groups of 128 with a short last one: uneven on purpose


def source(rank: int, world: int, batch: int = 16, seed: int = 7, **kw: object) -> ShardSource:
    cols = {
        "train": {"id": np.arange(ROWS), "x": np.arange(ROWS, dtype=np.uint8)},
        "val": {"id": np.arange(ROWS, ROWS + 203)},
    }
    return ShardSource(MemoryStore(cols, group_rows=128), rank, world, batch, 10, seed, **kw)  # type: ignore[arg-type]


def ids(batches: Iterator[dict[str, torch.Tensor]]) -> list[list[int]]:
    return [b["id"].tolist() for b in batches]


def global_stream(world: int, epoch: int, start_row: int = 0, **kw: object) -> list[int]:
    """Rows in the order the ranks consume them: step by step, rank by rank."""
    per_rank = [ids(source(r, world, **kw).train_batches(epoch, start_row)) for r in range(world)]
    return [i for step in zip(*per_rank, strict=True) for batch in step for i in batch]


def test_epoch_order_is_a_seeded_permutation_of_every_row() -> None:
    sizes = [128] * 7 + [104]
    a = EpochOrder(sizes, seed=3, epoch=0)
    rows = [(g, i) for g, lo, hi in a.pieces(0, a.total) for i in range(lo, hi)]
    assert len(rows) == sum(sizes) == len(set(rows))
    again = EpochOrder(sizes, seed=3, epoch=0)
    assert a.pieces(100, 400) == again.pieces(100, 400)
    assert list(a.groups) != list(EpochOrder(sizes, seed=3, epoch=1).groups)
    assert list(a.groups) != list(EpochOrder(sizes, seed=4, epoch=0).groups)
    assert list(EpochOrder(sizes, 3, 0, shuffle=False).groups) == list(range(8))


def test_ranks_split_one_epoch_without_overlap_and_the_order_ignores_world_size() -> None:
    one = global_stream(1, epoch=0)
    two = global_stream(2, epoch=0)
    assert len(set(two)) == len(two) == 1000 // 16 // 2 * 32  # equal counts, tail dropped
    assert two == one[: len(two)]  # the same global order at any world size
    assert global_stream(2, epoch=1) != two  # a new order each epoch
    assert sorted(global_stream(2, epoch=0, shuffle=False)) == list(range(len(two)))


def test_rows_inside_a_batch_come_from_shuffled_groups() -> None:
    first = ids(source(0, 1).train_batches(0))[0]
    assert first != sorted(first)  # rows permuted inside their group
    assert ids(source(0, 1).train_batches(0)) == ids(source(0, 1).train_batches(0))


def test_a_restart_continues_with_the_next_unseen_row_even_at_another_world_size() -> None:
    full = global_stream(1, epoch=2)
    seen_steps = 5
    before = global_stream(2, epoch=2)[: seen_steps * 32]
    start = seen_steps * 2 * 16  # rows consumed by both ranks: the saved data position
    after = global_stream(1, epoch=2, start_row=start)
    assert before + after == full  # nothing skipped, nothing repeated
    assert not set(before) & set(after)
    grown = global_stream(4, epoch=2, start_row=start)
    assert grown == full[start : start + len(grown)]


def test_remaining_batches_match_what_the_stream_yields() -> None:
    for world, start in ((1, 0), (2, 320), (3, 48)):
        s = source(0, world)
        assert len(list(s.train_batches(0, start))) == s.remaining_micro_batches(start)


def test_eval_covers_every_val_row_once_in_equal_batch_counts() -> None:
    for world in (1, 2, 3, 4):
        per_rank = [ids(source(r, world).eval_batches()) for r in range(world)]
        assert len({len(b) for b in per_rank}) == 1  # collectives line up across ranks
        rows = [i for batches in per_rank for b in batches for i in b]
        assert sorted(rows) == list(range(ROWS, ROWS + 203))
        assert all(len(b) > 0 for batches in per_rank for b in batches)


def test_prefetching_yields_the_same_batches_as_reading_inline() -> None:
    inline = ids(source(1, 2, prefetch_batches=0).train_batches(0))
    ahead = ids(source(1, 2, prefetch_batches=3).train_batches(0))
    assert inline == ahead


def test_prefetch_raises_the_producers_error_in_the_consumer() -> None:
    def items() -> Iterator[int]:
        yield 1
        raise OSError("shard unreadable")

    stream = prefetched(items(), 2)
    assert next(stream) == 1
    with pytest.raises(OSError, match="shard unreadable"):
        next(stream)


def test_closing_the_consumer_stops_the_prefetch_thread() -> None:
    def endless() -> Iterator[int]:
        i = 0
        while True:
            yield i
            i += 1

    before = threading.active_count()
    stream = prefetched(endless(), 2)
    next(stream)
    stream.close()
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() == before


def test_batches_are_writable_tensors_of_the_stored_dtype() -> None:
    batch = next(iter(source(0, 1, shuffle=False).train_batches(0)))
    assert batch["x"].dtype == torch.uint8 and batch["x"].shape == (16,)
    batch["x"] += 1  # torch owns writable memory, not arrow's read-only buffers


def test_a_task_transform_runs_per_batch_seeded_by_the_rows_place_in_the_epoch() -> None:
    def jitter(cols: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {**cols, "noise": rng.random(len(cols["id"]))}

    def noise_by_row(world: int, prefetch: int) -> dict[int, float]:
        out = {}
        for r in range(world):
            src = source(r, world, transform=jitter, prefetch_batches=prefetch)
            for b in src.train_batches(1):
                out.update(zip(b["id"].tolist(), b["noise"].tolist(), strict=True))
        return out

    one, two = noise_by_row(1, 0), noise_by_row(2, 4)
    assert one == two  # the same draw for the same rows, at any world size, prefetched or not
    assert len(set(one.values())) == len(one)  # and a fresh draw per row
    val = next(source(0, 1, transform=jitter).eval_batches())
    assert "noise" not in val  # evaluation sees the data as prepared


@pytest.mark.parametrize("start_row", [0, 96])
def test_a_tensor_parallel_group_reads_its_ranks_rows_as_one_batch(start_row: int) -> None:
    """Regrouped as reader i of 2, each taking 2 ranks' rows: batch k is ranks 2i and
    2i+1's batch k of data parallel over 4, in that order (raylift.run.loop splits it
    back into those two and trains on them in turn), also from a resumed position; every
    rank of the group reads the same."""
    for index in range(2):
        grouped = source(0, 4)
        grouped.regroup(index, 2, 2)
        assert grouped.rows_per_micro_batch == source(0, 4).rows_per_micro_batch
        got = ids(grouped.train_batches(1, start_row))
        ranks = [ids(source(r, 4).train_batches(1, start_row)) for r in (2 * index, 2 * index + 1)]
        assert got == [a + b for a, b in zip(*ranks, strict=True)]
        assert grouped.remaining_micro_batches(start_row) == len(got)
