"""``auto`` resolved: the strategy the memory plan picks for the model and the workers'
memory, and the precision their devices take, decided once on the driver from what a
worker reports."""

from __future__ import annotations

import dataclasses
from typing import Any

from raylift.core.config import AUTO, Config, ConfigError
from raylift.run.check import alive_nodes
from raylift.run.plan import plan_strategy
from raylift.strategies import config_problems
from raylift.tensors.precision import DeviceFacts, choose


@dataclasses.dataclass(frozen=True)
class WorkerFacts:
    """What one worker-shaped slot of the cluster has: the ``auto`` settings' inputs."""

    memory: int  # bytes one worker may use: its GPU's, or its share of its host's
    device: DeviceFacts


def resolve_auto(cfg: Config, log: Any = print, facts: WorkerFacts | None = None) -> Config:
    """``cfg`` with ``strategy: auto`` and ``precision: auto`` replaced by what they
    resolve to, once for the run, from one worker slot's facts (measured when not given)."""
    if AUTO in (cfg.strategy.name, cfg.precision) and facts is None:
        facts = worker_facts(cfg)
    cfg = resolve_auto_precision(cfg, log, facts)
    return resolve_strategy(cfg, log, facts.memory if facts else None)


def resolve_auto_precision(cfg: Config, log: Any, facts: WorkerFacts | None) -> Config:
    if cfg.precision != AUTO or facts is None:
        log(f"raylift: precision {cfg.precision}")
        return cfg
    name, why = choose(facts.device)
    resolved = dataclasses.replace(cfg, precision=name)
    refused = config_problems(resolved)
    if refused:  # e.g. a strategy that cannot scale fp16 losses: fp32 always trains
        name, why = "32", refused[0]
        resolved = dataclasses.replace(cfg, precision=name)
        if config_problems(resolved):
            raise ConfigError([f"precision: auto resolved to no precision this run accepts: {why}"])
    log(f"raylift: precision auto -> {name} ({why})")
    return resolved


def resolve_strategy(cfg: Config, log: Any = print, memory: int | None = None) -> Config:
    """``cfg`` with ``strategy: auto`` replaced by what it resolves to.

    Planned at the smallest world size the run may have, so the choice fits at every
    size an elastic run passes through. ``memory`` is one worker's (measured on a
    worker-shaped slot of the cluster when not given)."""
    if cfg.strategy.name != AUTO:
        log(f"raylift: strategy {cfg.strategy.name}")
        return cfg
    world = cfg.scaling.min_workers
    memory = worker_facts(cfg).memory if memory is None else memory
    strategy = plan_strategy(cfg, world, memory)
    log(f"raylift: strategy auto -> {strategy} ({memory / 2**30:.1f} GiB per worker)")
    return dataclasses.replace(cfg, strategy=strategy)


def worker_facts(cfg: Config) -> WorkerFacts:
    """Measured where a worker would run: here when the cluster is this one node (a
    local Ray), else by a task placed like a worker, on a GPU node when the run uses
    GPUs. The local answer skips a worker process's start and imports: seconds."""
    import ray

    sc = cfg.scaling
    here = ray.get_runtime_context().get_node_id()
    nodes = alive_nodes()
    alone = len(nodes) == 1 and nodes[0]["NodeID"] == here
    if alone and (not sc.use_gpu or nodes[0]["Resources"].get("GPU", 0) >= 1):
        return _worker_facts(sc.use_gpu, sc.min_workers, sc.cpus_per_worker)
    probe = ray.remote(_worker_facts).options(num_cpus=0.01, num_gpus=1 if sc.use_gpu else 0)
    return ray.get(probe.remote(sc.use_gpu, sc.min_workers, sc.cpus_per_worker))


def _worker_facts(use_gpu: bool, world: int, cpus_per_worker: float) -> WorkerFacts:
    import psutil
    import ray

    device = DeviceFacts.here(use_gpu)
    if use_gpu:
        import torch

        return WorkerFacts(int(torch.cuda.get_device_properties(0).total_memory), device)
    here = ray.get_runtime_context().get_node_id()
    cpus = next(n["Resources"].get("CPU", 1) for n in ray.nodes() if n["NodeID"] == here)
    per_node = max(1, min(world, int(cpus // cpus_per_worker)))  # CPU workers share the host
    return WorkerFacts(int(psutil.virtual_memory().total // per_node), device)
