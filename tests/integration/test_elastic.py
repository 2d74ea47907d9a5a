"""Elastic growth on a multi-node local cluster (``ray.cluster_utils.Cluster``), in a
process of its own so it never meets the session's Ray."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.elastic_run import EPOCHS

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def elastic_scenario(tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, str(REPO / "tests" / "elastic_run.py"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_an_elastic_run_shrinks_when_a_node_goes_and_grows_when_one_comes(
    own_rays: dict,
) -> None:
    """Run beside the autoscaler test (conftest.own_rays)."""
    done = own_rays["elastic"].result(timeout=900)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    worlds = [int(line.split()[1]) for line in out.splitlines() if line.startswith("world_size")]
    batches = {int(line.split()[1]) for line in out.splitlines() if line.startswith("global_batch")}
    # Two workers, one after the node went, two again after one came.
    changes = [w for i, w in enumerate(worlds) if i == 0 or worlds[i - 1] != w]
    assert changes == [2, 1, 2], worlds
    assert batches == {64}  # 32 x 2 accumulated on 1 worker, 32 x 1 on each of 2
    restarts = [line for line in out.splitlines() if line.startswith("restart ")]
    assert "2 -> 1 workers" in restarts[0] and "1 -> 2 workers" in restarts[-1], restarts
    assert "lifted the hold" in out  # the run finished after it grew back, not before
    final = next(line for line in out.splitlines() if line.startswith("final step"))
    assert int(final.split()[2]) == EPOCHS * (1438 // 64)  # every planned step, at either size
    assert float(final.split()[-1]) > 0.9
