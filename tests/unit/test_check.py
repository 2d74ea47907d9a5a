"""raylift check's verdicts from node facts: storage, versions, fit (no Ray needed)."""

from __future__ import annotations

from pathlib import Path

from raylift.check import NodeFacts, fit_check, node_types, storage_verdict, version_problems
from tests.helpers import make_config

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
