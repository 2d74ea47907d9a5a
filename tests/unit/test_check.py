"""raylift check's verdicts from node facts: storage, versions, fit (no Ray needed); the
probe's wait on the session's Ray, and GPU facts read without a visible GPU."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from raylift.run.check import NodeFacts, fit_check, node_types, storage_verdict, version_problems
from tests.helpers import HANG_S, make_config

REPO = Path(__file__).resolve().parents[2]
V = {"python": "3.11.7", "torch": "2.13.0", "ray": "2.60.0", "raylift": "0.1.0"}


def node(
    address: str, cpus: float = 1, problem: str | None = None, sees: bool = True, **v: str
) -> NodeFacts:
    return NodeFacts(address, address, cpus, 0, {**V, **v}, "-", "-", 0.0, problem, sees)


def test_a_run_fits_now_or_with_the_autoscalers_node_types() -> None:
    cfg = make_config(scaling={"num_workers": 3})
    head = [node("10.0.0.1", cpus=0)]
    line, problem = fit_check(cfg, head, node_types(str(REPO / "cluster" / "local-fake.yaml")))
    assert problem is None and "the autoscaler's node types up to 3 more" in line
    line, problem = fit_check(cfg, head, None)
    assert problem is not None and "pass --cluster-config" in problem
    assert "lower scaling.num_workers" in problem
    big = make_config(scaling={"num_workers": 2, "cpus_per_worker": 2})
    _, problem = fit_check(big, head, node_types(str(REPO / "cluster" / "local-fake.yaml")))
    assert problem is not None and "fewer than 2" in problem  # no node type has 2 CPUs


def test_a_version_that_differs_between_nodes_is_named_with_where() -> None:
    nodes = [node("10.0.0.1"), node("10.0.0.2", torch="2.12.0")]
    (problem,) = version_problems(nodes)
    assert problem.startswith("versions: torch differs between nodes (2.12.0 on 10.0.0.2; ")
    assert version_problems(nodes[:1]) == []


def test_storage_failures_are_grouped_and_an_unshared_folder_is_refused() -> None:
    cfg = make_config(storage="./runs")
    nodes = [node("10.0.0.1"), node("10.0.0.2", sees=False)]
    lines, problems = storage_verdict(cfg, "/data/runs", nodes)
    assert lines == ["storage /data/runs: failed"]
    assert problems == [
        "storage: ./runs is a folder on the driver's machine that node(s) 10.0.0.2 do not "
        "see: on a cluster set storage to s3://..., gs://... or a folder every node mounts (NFS)"
    ]
    denied = "cannot write a marker in s3://b/runs: AccessDenied"
    cloud = [node("10.0.0.1", problem=denied), node("10.0.0.2", problem=denied)]
    _, problems = storage_verdict(cfg, "s3://b/runs", cloud, driver_problem=denied)
    (one,) = problems
    assert one.startswith(f"storage: the driver, node 10.0.0.1, node 10.0.0.2: {denied}")
    lines, problems = storage_verdict(cfg, "s3://b/runs", nodes)  # a store: always shared
    assert problems == [] and lines == [
        "storage s3://b/runs: written, read and deleted from every node"
    ]


def test_a_node_slower_than_the_probe_is_named_not_a_timeout_error(
    ray_cluster: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node whose probe has not answered when the wait ends is named as not checked
    (``ray.get(ref, timeout=1)`` after the wait raised Ray's GetTimeoutError)."""
    import ray

    from raylift.run import check

    @ray.remote(num_cpus=0)
    def slow() -> None:
        time.sleep(3600)

    monkeypatch.setattr(check, "PROBE_TIMEOUT_S", 0.5)
    node = check.alive_nodes()[0]
    found, silent = check.answers([slow.remote()], [node])
    assert found == [] and silent == [node["NodeManagerAddress"]]


def test_gpu_memory_is_read_from_nvidia_smi_without_a_visible_gpu(tmp_path: Path) -> None:
    """The probe asks Ray for no GPU, so Ray hides the node's GPUs from it: the memory is
    NVIDIA's tool's answer (here a script that answers as nvidia-smi does, two GPUs)."""
    from raylift.run.check import gpu_memory_gib

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '81559\\n40960\\n'\n")
    smi.chmod(0o755)
    assert gpu_memory_gib(str(smi)) == 40.0
    assert gpu_memory_gib(str(tmp_path / "absent")) == 0.0


@pytest.mark.gpu
def test_a_gpu_nodes_facts_are_read_with_its_gpus_hidden() -> None:
    """On a GPU machine, with the GPUs hidden as Ray hides them from a zero-GPU task."""
    import ast
    import os
    import subprocess
    import sys

    code = "from raylift.run.check import gpu_facts; print(gpu_facts())"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=HANG_S
    )
    cuda, nccl, memory = ast.literal_eval(out.stdout)
    assert cuda != "-" and nccl != "-" and memory > 1.0, out


def test_the_storage_checks_cleanup_keeps_what_another_command_wrote(tmp_path: Path) -> None:
    """Two commands on one new storage folder: the check removes only empty folders, and
    one that another command already removed is no error."""
    from raylift.run.check import _remove_empty

    top = tmp_path / "runs"
    (top / "empty" / "deeper").mkdir(parents=True)
    (top / "theirs").mkdir()
    (top / "theirs" / ".raylift-lock").write_text("pid 7")
    _remove_empty(top)
    assert sorted(p.name for p in top.iterdir()) == ["theirs"]
    _remove_empty(tmp_path / "gone")  # removed by the other command's check first
