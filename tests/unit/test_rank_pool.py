"""The suite's pool of gloo ranks (tests.helpers.run_ranks): reused across jobs, and
replaced once a job leaves its ranks holding more process groups than MAX_GLOO_LOOPS, each
of whose gloo loop threads would wake 100 times a second for the rest of the session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from tests import helpers
from tests.helpers import MAX_GLOO_LOOPS, gloo_loops, run_ranks


def record(rank: int, world: int, out: str, groups: int) -> None:
    """Make ``groups`` new process groups, then write this rank's pid and gloo loops."""
    import os

    made = [dist.new_group(list(range(world)), backend="gloo") for _ in range(groups)]
    for group in made:  # each one used, as a mesh's are
        dist.barrier(group=group)
    Path(f"{out}-{rank}").write_text(f"{os.getpid()} {gloo_loops()}")


def pids(out: Path, world: int) -> list[int]:
    return [int(Path(f"{out}-{r}").read_text().split()[0]) for r in range(world)]


def test_a_pool_is_reused_until_its_ranks_hold_too_many_gloo_groups(tmp_path: Path) -> None:
    helpers.close_pools()  # this test's own pool, from its first job
    out = tmp_path / "rank"
    run_ranks(2, tmp_path, record, str(out), 0)
    first = pids(out, 2)
    loops = int(Path(f"{out}-0").read_text().split()[1])
    assert 1 <= loops <= MAX_GLOO_LOOPS, loops  # the world group's own
    run_ranks(2, tmp_path, record, str(out), 0)
    assert pids(out, 2) == first  # reused: no process start, no import, no new world
    run_ranks(2, tmp_path, record, str(out), MAX_GLOO_LOOPS)
    assert pids(out, 2) == first
    assert int(Path(f"{out}-0").read_text().split()[1]) > MAX_GLOO_LOOPS
    run_ranks(2, tmp_path, record, str(out), 0)
    fresh = pids(out, 2)
    assert not set(fresh) & set(first), (first, fresh)  # the retired ranks were replaced
    assert int(Path(f"{out}-0").read_text().split()[1]) == loops


def describe_rank(rank: int, world: int, out: str) -> None:
    """This rank's parent, whether the preloaded modules were there before the job's own
    imports, and the variable the test set before the pool started."""
    import json
    import os
    import sys

    preloaded = [m for m in helpers.PRELOAD if m in sys.modules]
    seen = {"parent": os.getppid(), "preloaded": preloaded,
            "mark": os.environ.get("RAYLIFT_POOL_TEST")}  # fmt: skip
    Path(f"{out}-{rank}").write_text(json.dumps(seen))


def test_ranks_are_forked_from_a_server_that_imported_their_modules_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank starts with torch, transformers, DeepSpeed and raylift already imported (by
    the fork server, once) and with the environment of the test that started its pool,
    as a spawned one would have."""
    import json
    import os

    helpers.close_pools()
    monkeypatch.setenv("RAYLIFT_POOL_TEST", "set before the pool")
    out = tmp_path / "rank"
    run_ranks(2, tmp_path, describe_rank, str(out))
    seen = [json.loads(Path(f"{out}-{r}").read_text()) for r in range(2)]
    (server,) = {s["parent"] for s in seen}  # both the server's children, not ours
    assert server != os.getpid()
    for s in seen:
        assert s["preloaded"] == helpers.PRELOAD and s["mark"] == "set before the pool", s
    helpers.close_pools()
    helpers.stop_fork_server()  # and a later pool starts another
    run_ranks(2, tmp_path, describe_rank, str(out))
    assert json.loads(Path(f"{out}-0").read_text())["parent"] != server
