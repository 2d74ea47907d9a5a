"""``raylift check CONFIG``: can this run start on this cluster, and if not, what to change.

One small task on every node alive reports its CPUs, GPUs and GPU memory, its CUDA and
NCCL, its Python, torch, Ray and raylift versions, and whether it can write, read and
delete a marker through the run's own storage URI (and, for a local folder, whether it
sees the driver's marker: the folder is shared only then). The driver checks the
tracking store from its own node, where the tracking actor runs, and whether the
cluster can ever hold the run's workers, with the autoscaler's node types where it
knows them. ``raylift train`` runs the storage and tracking parts before its workers
start whenever the cluster has more than one node.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from raylift.artifacts import tracking
from raylift.core import storage
from raylift.core.config import Config, EnvironmentProblem
from raylift.core.errors import first_line
from raylift.core.names import VERSION

MARKER = ".raylift-check"
PROBE_TIMEOUT_S = 120.0  # a node whose first Python worker is slow to start


@dataclasses.dataclass
class NodeFacts:
    """What one node says about itself."""

    node_id: str
    address: str
    cpus: float
    gpus: float
    versions: dict[str, str]  # python, torch, ray, raylift
    cuda: str  # "-" where the node has no GPU
    nccl: str
    gpu_memory_gib: float  # the smallest of its GPUs'; 0 without one
    storage_problem: str | None  # what failed through the run's storage; None: all of it worked
    sees_driver: bool  # the driver's marker is there: a local folder is shared with the driver


@dataclasses.dataclass
class Report:
    nodes: list[NodeFacts]
    lines: list[str]  # what was checked and found, beside the table
    problems: list[str]  # each with its fix; none: the run can start

    @property
    def ok(self) -> bool:
        return not self.problems


# ---------------------------------------------------------------- on each node


def probe(storage_dir: str, token: str) -> NodeFacts:
    """Runs on one node (a zero-CPU task pinned there)."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    # The whole id: fake_multinode's ids differ only in their last digits, and two nodes
    # sharing a marker's name would delete each other's before it is read back.
    problem, sees = storage_probe(storage_dir, token, node)
    cuda, nccl, memory = gpu_facts()
    return NodeFacts(
        node_id=node,
        address=ray.util.get_node_ip_address(),
        cpus=0.0,
        gpus=0.0,  # both filled in by the driver, from Ray's view of the node
        versions=versions(),
        cuda=cuda,
        nccl=nccl,
        gpu_memory_gib=memory,
        storage_problem=problem,
        sees_driver=sees,
    )


def storage_probe(storage_dir: str, token: str, who: str) -> tuple[str | None, bool]:
    """(what failed writing, reading back or deleting a marker of this node's own; whether
    the driver's marker is visible from here)."""
    theirs = storage.join(storage_dir, f"{MARKER}-{token}")
    mine = f"{theirs}-{who}"
    step = "read"
    try:
        sees = storage.read_text(theirs) == token
        step = "write"
        storage.write_text(mine, who)
        step = "read back"
        if storage.read_text(mine) != who:
            return f"wrote a marker in {storage_dir} but read back something else", sees
        step = "delete"
        storage.delete(mine)
        return None, sees
    except Exception as exc:  # a store's own error types: every one is a finding here
        return f"cannot {step} a marker in {storage_dir}: {first_line(exc)}", False


def versions() -> dict[str, str]:
    import platform

    import ray
    import torch

    return {
        "python": platform.python_version(),
        "torch": str(torch.__version__).split("+")[0],
        "ray": ray.__version__,
        "raylift": VERSION,
    }


def gpu_facts() -> tuple[str, str, float]:
    """(CUDA, NCCL, the smallest GPU's memory in GiB) of this node; dashes without GPUs.

    Read without taking a GPU: Ray hides the GPUs from a task that asks for none (the
    probe asks for none, or it would wait behind a running job), so the memory comes from
    NVIDIA's ``nvidia-smi`` and the versions from torch's build, neither of which
    needs a visible device or a CUDA context."""
    import torch

    memory = gpu_memory_gib()
    if torch.version.cuda is None or not memory:
        return "-", "-", 0.0
    try:
        nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    except (RuntimeError, AttributeError):  # a build without NCCL
        nccl = "-"
    return str(torch.version.cuda), nccl, memory


def gpu_memory_gib(smi: str | None = None) -> float:
    """The smallest GPU's memory on this node, in GiB, from ``nvidia-smi`` (0: none)."""
    import subprocess

    smi = smi or shutil.which("nvidia-smi")
    if smi is None:
        return 0.0
    query = [smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=60, check=True)
        sizes = [float(v) for v in out.stdout.split()]  # MiB, one line a GPU
    except (OSError, subprocess.SubprocessError, ValueError):
        return 0.0
    return min(sizes) / 1024 if sizes else 0.0


# ---------------------------------------------------------------- on the driver


def check(cfg: Config, cluster_config: str | None = None) -> Report:
    """Probe every node alive; then tracking and fit, from here."""
    nodes, lines, problems = probe_nodes(cfg)
    problems += version_problems(nodes)
    line, problem = tracking_check(cfg)
    lines.append(line)
    problems += [problem] if problem else []
    line, problem = fit_check(cfg, nodes, node_types(cluster_config))
    lines.append(line)
    problems += [problem] if problem else []
    return Report(nodes, lines, problems)


def alive_nodes() -> list[dict[str, Any]]:
    import ray

    return [n for n in ray.nodes() if n.get("Alive", True)]


def probe_nodes(cfg: Config) -> tuple[list[NodeFacts], list[str], list[str]]:
    """Every node's facts, and the storage's verdict: (nodes, lines, problems)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    where = storage.resolve(cfg.storage)
    token = uuid.uuid4().hex[:12]
    driver_marker = storage.join(where, f"{MARKER}-{token}")
    try:
        storage.write_text(driver_marker, token)
        driver_problem = None
    except Exception as exc:  # a store's own error types
        driver_problem = f"cannot write a marker in {where}: {first_line(exc)}"
    remote = ray.remote(num_cpus=0)(probe)
    alive = alive_nodes()
    refs = [
        remote.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
        ).remote(where, token)
        for n in alive
    ]
    try:
        found, silent = answers(refs, alive)
    finally:
        if driver_problem is None:
            storage.delete(driver_marker)
    lines, problems = storage_verdict(cfg, where, found, driver_problem)
    if silent:
        lines.append(
            f"node(s) {', '.join(silent)}: no answer within {PROBE_TIMEOUT_S:.0f} s "
            "(busy, or still starting): not checked; rerun raylift check to include them"
        )
    return found, lines, problems


def answers(refs: list[Any], alive: list[dict[str, Any]]) -> tuple[list[NodeFacts], list[str]]:
    """Each node's facts, with its CPUs and GPUs, and the addresses of the nodes that did
    not answer within ``PROBE_TIMEOUT_S``; a node the autoscaler removed between the
    listing and its probe is left out (nodes come and go; the rest still answer)."""
    import ray
    from ray.exceptions import NodeDiedError, TaskUnschedulableError

    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=PROBE_TIMEOUT_S)
    found: list[NodeFacts] = []
    silent: list[str] = []
    for ref, node in zip(refs, alive, strict=True):
        if ref not in ready:  # still starting or busy: ray.get would wait on, or time out
            silent.append(str(node.get("NodeManagerAddress", node["NodeID"])))
            ray.cancel(ref)
            continue
        try:
            facts: NodeFacts = ray.get(ref)
        except (TaskUnschedulableError, NodeDiedError):
            continue
        facts.cpus = float(node["Resources"].get("CPU", 0))
        facts.gpus = float(node["Resources"].get("GPU", 0))
        found.append(facts)
    return found, silent


def storage_verdict(
    cfg: Config, where: str, nodes: list[NodeFacts], driver_problem: str | None = None
) -> tuple[list[str], list[str]]:
    # The same failure on the driver and several nodes is one problem, naming them all.
    failed: dict[str, list[str]] = {driver_problem: ["the driver"]} if driver_problem else {}
    for n in nodes:
        if n.storage_problem:
            failed.setdefault(n.storage_problem, []).append(f"node {n.address}")
    problems = [storage_fix(cfg, f"{', '.join(who)}: {p}") for p, who in failed.items()]
    if driver_problem is None and not storage.is_remote(where) and len(nodes) > 1:
        blind = [n.address for n in nodes if not n.storage_problem and not n.sees_driver]
        if blind:
            problems.append(
                f"storage: {cfg.storage} is a folder on the driver's machine that node(s) "
                f"{', '.join(blind)} do not see: on a cluster set storage to s3://..., "
                "gs://... or a folder every node mounts (NFS)"
            )
    shared = "shared by every node" if not storage.is_remote(where) else "every node"
    verdict = "failed" if problems else f"written, read and deleted from {shared}"
    return [f"storage {where}: {verdict}"], problems


def storage_fix(cfg: Config, what: str) -> str:
    return (
        f"storage: {what}; check the URI (its bucket), the nodes' credentials and network, "
        f"or set storage to a place every node reaches (storage={cfg.storage})"
    )


def version_problems(nodes: list[NodeFacts]) -> list[str]:
    out = []
    for key in ("python", "torch", "ray", "raylift"):
        seen: dict[str, list[str]] = {}
        for n in nodes:
            seen.setdefault(n.versions.get(key, "?"), []).append(n.address)
        if len(seen) > 1:
            which = "; ".join(f"{v} on {', '.join(a)}" for v, a in sorted(seen.items()))
            out.append(
                f"versions: {key} differs between nodes ({which}); run every node from "
                "one image (cluster/ shows how)"
            )
    return out


def tracking_check(cfg: Config) -> tuple[str, str | None]:
    """Open the tracking store from this node, where the tracking actor runs."""
    uri = tracking.tracking_uri(cfg)
    quick = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
    before = {k: os.environ.get(k) for k in quick}
    os.environ.update(quick)
    try:
        tracking.client(uri).search_experiments(max_results=1)
    except Exception as exc:  # MLflow's and the network's own error types
        return (
            f"tracking {uri}: unreachable",
            f"tracking.uri: {uri} cannot be opened from the driver's node "
            f"({first_line(exc)}); start the MLflow server, correct the URI, or leave "
            "tracking.uri empty for a local store",
        )
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return f"tracking {uri}: reachable from the driver's node (the tracking actor's)", None


@dataclasses.dataclass(frozen=True)
class NodeType:
    name: str
    resources: dict[str, float]
    max_count: int


def node_types(cluster_config: str | None) -> list[NodeType] | None:
    """The autoscaler's worker node types: from ``cluster_config`` (a ``ray up`` YAML),
    else as Ray publishes them (its v2 autoscaler, KubeRay); None where neither says."""
    if cluster_config:
        import yaml

        raw = yaml.safe_load(Path(cluster_config).read_text()) or {}
        head = raw.get("head_node_type")
        return [
            NodeType(name, dict(t.get("resources", {})), int(t.get("max_workers", 0)))
            for name, t in raw.get("available_node_types", {}).items()
            if name != head
        ]
    import ray

    published = ray._private.state.state.get_cluster_config()
    if published is None:
        return None
    return [
        NodeType(g.name, dict(g.resources), int(g.max_count)) for g in published.node_group_configs
    ]


def worker_bundle(cfg: Config) -> dict[str, float]:
    return worker_resources(cfg)


def fits(capacity: dict[str, float], bundle: dict[str, float]) -> int:
    """How many worker bundles one node of ``capacity`` holds."""
    counts = [int(capacity.get(k, 0) // v) for k, v in bundle.items() if v > 0]
    return min(counts) if counts else 0


def fit_check(
    cfg: Config, nodes: list[NodeFacts], types: list[NodeType] | None
) -> tuple[str, str | None]:
    bundle = worker_bundle(cfg)
    need = cfg.scaling.min_workers
    now = sum(fits({"CPU": n.cpus, "GPU": n.gpus}, bundle) for n in nodes)
    more = sum(fits(t.resources, bundle) * max(t.max_count, 0) for t in types or [])
    said = f"{need} worker(s) of {bundle}: the nodes alive hold {now}"
    if types is None:
        said += " (no autoscaler node types known: pass --cluster-config YAML to count them)"
    else:
        said += f", the autoscaler's node types up to {more} more"
    if now + more >= need:
        return f"fit: {said}: it fits", None
    return (
        f"fit: {said}",
        f"scaling: {said}, fewer than {need}; lower scaling.num_workers or "
        "scaling.cpus_per_worker, or add nodes (max_workers of a node type)",
    )


# ---------------------------------------------------------------- what train runs


def writable(where: str, key: str) -> None:
    """Before a command writes to ``where`` (the value of config key ``key``), on any
    cluster: a marker written, read back and deleted from this process. A store that
    cannot be reached (no such bucket, no credentials) raises :class:`EnvironmentProblem`
    naming the URI, the store's own message and the fix, before anything was written."""
    made = _first_missing(where)
    problem, _ = storage_probe(where, uuid.uuid4().hex[:12], "driver")
    if made is not None:
        _remove_empty(made)  # the check leaves no folder behind
    if problem:
        raise EnvironmentProblem(
            f"{key}: {problem}; check the URI (its bucket), this machine's credentials "
            f"and network, or set {key} to a place you can write"
        )


def _remove_empty(top: Path) -> None:
    """The empty folders at and under ``top``, deepest first; one another command put a
    file in meanwhile (two commands on one new storage folder) stays, and so do its parents."""
    with contextlib.suppress(OSError):  # another command's check removed it first
        folders = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
        for folder in [*folders, top]:
            with contextlib.suppress(OSError):
                folder.rmdir()


def _first_missing(where: str) -> Path | None:
    """The outermost folder of a local ``where`` that does not exist yet (None: none, or a
    URI, where a marker's write makes no folder)."""
    local = storage.local_path(where)
    if local is None or local.exists():
        return None
    while not local.parent.exists():
        local = local.parent
    return local


def before_workers(cfg: Config) -> list[str]:
    """The storage and tracking parts, where the cluster has more than one node:
    problems each with its fix (none: go on)."""
    if len(alive_nodes()) < 2:
        return []
    _, _, problems = probe_nodes(cfg)
    _, problem = tracking_check(cfg)
    return problems + ([problem] if problem else [])


def render(report: Report, address: str) -> str:
    head = ("node", "CPU", "GPU", "GPU GiB", "python", "torch", "ray", "raylift", "CUDA", "NCCL")
    rows = [
        (
            f"{n.address} ({n.node_id[:6]})",
            f"{n.cpus:g}",
            f"{n.gpus:g}",
            f"{n.gpu_memory_gib:.0f}" if n.gpus else "-",
            *(n.versions.get(k, "?") for k in ("python", "torch", "ray", "raylift")),
            n.cuda,
            n.nccl,
        )
        for n in report.nodes
    ]
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    table = [
        "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in [head, *rows]
    ]
    out = [f"raylift check: {address}, {len(report.nodes)} node(s) alive", *table, *report.lines]
    if report.problems:
        out.append(f"raylift: {len(report.problems)} problem(s); the run cannot start:")
        out += [f"  - {p}" for p in report.problems]
    else:
        out.append("raylift: the run can start")
    return "\n".join(out)


def worker_resources(cfg: Config) -> dict[str, float]:
    resources: dict[str, float] = {"CPU": cfg.scaling.cpus_per_worker}
    if cfg.scaling.use_gpu:
        resources["GPU"] = 1
    return resources
