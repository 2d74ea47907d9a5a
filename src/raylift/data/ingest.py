"""Per-worker batch sources: what the loop iterates, with the data position it resumes from."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch

from raylift.tasks.base import Batch


class BatchSource(Protocol):
    def micro_batches_per_epoch(self) -> int:
        """Training batches this rank gets per epoch (the same on every rank)."""
        ...

    def train_batches(self, epoch: int) -> Iterator[Batch]: ...

    def eval_batches(self) -> Iterator[Batch]: ...


def to_device(batch: Batch, device: torch.device) -> Batch:
    """Host -> device. On CUDA the batch comes from pinned memory, so the copy is asynchronous."""
    if device.type == "cpu":
        return batch
    return {k: v.to(device, non_blocking=device.type == "cuda") for k, v in batch.items()}


class RayShardSource:
    """This worker's split of the trainer's ``datasets``, streamed with prefetching."""

    def __init__(
        self,
        rows: int,
        world_size: int,
        batch_size: int,
        eval_batch_size: int,
        prefetch_batches: int,
        shuffle_buffer: int,
        seed: int,
        pin_memory: bool,
    ):
        self.rows, self.world_size = rows, world_size
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.prefetch, self.shuffle_buffer, self.seed = prefetch_batches, shuffle_buffer, seed
        self.pin_memory = pin_memory

    def micro_batches_per_epoch(self) -> int:
        # The split is equal across ranks, so every rank runs the same number of steps.
        return (self.rows // self.world_size) // self.batch_size

    def train_batches(self, epoch: int) -> Iterator[Batch]:
        import ray.train

        shard = ray.train.get_dataset_shard("train")
        shuffle = self.shuffle_buffer > 0
        yield from shard.iter_torch_batches(
            batch_size=self.batch_size,
            prefetch_batches=self.prefetch,
            drop_last=True,
            local_shuffle_buffer_size=self.shuffle_buffer if shuffle else None,
            local_shuffle_seed=self.seed * 100_003 + epoch if shuffle else None,
            device="cpu",
            pin_memory=self.pin_memory,
        )

    def eval_batches(self) -> Iterator[Batch]:
        import ray.train

        shard = ray.train.get_dataset_shard("val")
        yield from shard.iter_torch_batches(
            batch_size=self.eval_batch_size,
            prefetch_batches=self.prefetch,
            device="cpu",
            pin_memory=self.pin_memory,
        )


class TensorSource:
    """In-memory columns split evenly by rank, in order: for single-process runs and tests."""

    def __init__(
        self,
        train: Batch,
        val: Batch,
        rank: int,
        world_size: int,
        batch_size: int,
        eval_batch_size: int,
    ):
        self.train, self.val = (
            self._slice(train, rank, world_size),
            self._slice(val, rank, world_size),
        )
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size

    @staticmethod
    def _slice(cols: Batch, rank: int, world: int) -> Batch:
        n = len(next(iter(cols.values()))) // world
        return {k: v[rank * n : (rank + 1) * n] for k, v in cols.items()}

    def micro_batches_per_epoch(self) -> int:
        return len(next(iter(self.train.values()))) // self.batch_size

    def _batches(self, cols: Batch, size: int, drop_last: bool) -> Iterator[Batch]:
        n = len(next(iter(cols.values())))
        stop = n - n % size if drop_last else n
        for i in range(0, stop, size):
            yield {k: v[i : i + size] for k, v in cols.items()}

    def train_batches(self, epoch: int) -> Iterator[Batch]:
        return self._batches(self.train, self.batch_size, drop_last=True)

    def eval_batches(self) -> Iterator[Batch]:
        return self._batches(self.val, self.eval_batch_size, drop_last=False)
