"""A run whose ranks raise, on the session's local Ray: Ray Train's own WorkerGroupError,
from a real TorchTrainer of 2 CPU workers, as the driver's failure message reads it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from raylift.run.failures import failure_message
from tests.helpers import make_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def index_batch(rank: int) -> None:
    [0, 1, 2][rank + 3]  # every rank: IndexError, the same words


def both_ranks_raise(config: dict[str, Any]) -> None:
    import time

    import ray.train
    import torch.distributed as dist

    # Ray Train fails the group at the first poll of its ranks that finds an error, naming
    # the ranks that had failed by then. Its first poll comes as the ranks start; the
    # next, 2 s later: both raise together, between the two.
    dist.barrier()
    time.sleep(1.0)
    index_batch(ray.train.get_context().get_world_rank())


def rank_one_raises(config: dict[str, Any]) -> None:
    import ray.train

    if ray.train.get_context().get_world_rank() == 1:
        raise KeyError("rank one")
    # rank 0 returns at once, with no error: Ray Train's error has rank 1's alone


def ray_error(train: Any, where: Path) -> Exception:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        train,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            name=train.__name__,
            storage_path=str(where),
            failure_config=FailureConfig(max_failures=0),
        ),
    )
    with pytest.raises(Exception) as caught:
        trainer.fit()
    return caught.value


def test_ranks_that_raise_alike_are_named_with_their_one_traceback(
    ray_cluster: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ray.train.v2.api.exceptions import WorkerGroupError

    # Ray's own poll interval, not the session's 0.25 s (Ray Train passes the driver's
    # value to its controller): see both_ranks_raise.
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2")
    for attempt in range(3):  # two raises ms apart straddle a poll now and then: again
        error = ray_error(both_ranks_raise, tmp_path / str(attempt))
        if len(getattr(error, "worker_failures", {})) == 2:
            break
    assert isinstance(error, WorkerGroupError) and sorted(error.worker_failures) == [0, 1]
    said = failure_message(error, make_config(name="r"))
    assert said.splitlines()[0] == (
        "training run 'r' failed: worker ranks 0,1: IndexError: list index out of range"
    )
    assert said.count(", in index_batch") == 1 and said.count(", in both_ranks_raise") == 1
    assert said.count("\nIndexError: list index out of range\n") == 1, said
    assert "Error Snippet" not in said


def test_the_one_rank_that_raised_is_named_with_its_traceback(
    ray_cluster: str, tmp_path: Path
) -> None:
    error = ray_error(rank_one_raises, tmp_path)
    assert sorted(getattr(error, "worker_failures", {})) == [1], error
    said = failure_message(error, make_config(name="r"))
    lines = said.splitlines()
    assert lines[0] == "training run 'r' failed: worker rank 1: KeyError: 'rank one'"
    assert lines[1] == "Traceback (most recent call last):", said
    assert said.count(", in rank_one_raises") == 1
    assert "KeyError: 'rank one'" in lines[2:]
