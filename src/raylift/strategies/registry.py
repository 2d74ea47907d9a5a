"""What raylift knows about a strategy, declared once, as the ``SPEC`` of its own module.

``raylift.strategies`` collects the specs into its ``REGISTRY``; config, plan, export,
submit and doctor read facts from there and never branch on a strategy's name.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from raylift.core.config import Config
from raylift.strategies.base import Engine
from raylift.tensors.init import Initializer, Kept
from raylift.tensors.precision import Precision
from raylift.tensors.streaming import ModelTensors


@dataclasses.dataclass(frozen=True)
class Parts:
    """What the task says of its model's parts: its repeated blocks (transformer layers),
    and its tensor-parallel plan, asked for only where ``strategy.tp`` splits the model
    (raylift.strategies.tensor_parallel)."""

    blocks: list[nn.Module]
    tp_plan: Callable[[nn.Module], dict[str, str] | None] = lambda model: None


# (model, config, precision, device, the model's parts, the initial-weights pass, which
# the builder runs once the parameters have their storage) -> engine
Builder = Callable[[nn.Module, Config, Precision, torch.device, Parts, Initializer], Engine]
# (config, precision, device) -> the context the task's model is created in; it yields
# the constructor values it kept (raylift.tensors.init.params_on_meta), or None
Creator = Callable[
    [Config, Precision, torch.device], contextlib.AbstractContextManager[Kept | None]
]
# a checkpoint (raylift.tensors.checkpoints.CheckpointReader) -> the plain model's tensors, read
# one at a time
ExportReader = Callable[[Any], "ModelTensors"]

# StrategyConfig keys every strategy reads.
COMMON_OPTIONS = ("activation_checkpointing",)


class Shards(NamedTuple):
    """Which model states a strategy divides by the world size (the rest are replicated)."""

    params: bool
    grads: bool
    optimizer: bool


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """One candidate of ``raylift plan`` and ``strategy: auto``."""

    label: str
    strategy: Mapping[str, Any]  # the strategy section it runs as, name included
    shards: Shards
    # Rank by communication per step, least first: the plan takes the first row that fits.
    comm_rank: int
    fp32_master: bool = False  # DeepSpeed's ZeRO keeps an fp32 master copy of its partition
    offload: bool = False  # parameters and optimizer state live in host memory
    # Block-sized buffers beside the states: gathered blocks (the one running and the
    # one prefetched) and a bucket of one block's gradients for the reduce-scatter.
    block_buffers: int = 0
    # Traffic (raylift plan's bytes per step): parameters gathered for each forward and
    # backward and gradients reduce-scattered (FSDP, ZeRO-3), else the gradients' all-reduce.
    gathers: bool = False
    # Sharded over each node's workers and replicated across nodes where the run spans
    # several (HSDP); over every worker on one.
    per_node: bool = False
    # Shown only where the run spans nodes (on one node it is another row's twin).
    spanning: bool = False
    # Tensor parallel over each node's workers (its ``tp`` is TP_PER_NODE, filled in by
    # the plan), sharded over the nodes.
    tp_per_node: bool = False
    # ZeRO-3's hpZ where the run spans nodes: a second partition of the weights within each
    # node, from forward's gather to the step; backward gathers from it, within the node.
    hpz: bool = False


# A plan row's ``tp``: the workers per node of the run planned. No config has it (tp >= 1),
# so no config's strategy is taken for that row.
TP_PER_NODE = 0


@dataclasses.dataclass(frozen=True)
class StrategySpec:
    name: str
    options: tuple[str, ...]  # the StrategyConfig keys it reads besides COMMON_OPTIONS
    # Everything the config alone shows wrong with this strategy: 'key: what, and the fix'.
    problems: Callable[[Config], list[str]]
    build: Builder
    read_export: ExportReader
    plan_rows: tuple[PlanRow, ...]
    extras: tuple[str, ...] = ()  # pip requirements a cluster image may lack (raylift submit)
    # Sharding strategies create the model without parameter storage (raylift.tensors.init).
    create: Creator = lambda cfg, precision, device: contextlib.nullcontext()
    # How ``create`` builds a model without its whole storage, for the run's first lines.
    build_path: str = ""
    # train.compile compiles the built engine's model whole rather than each block: DDP,
    # whose graph dynamo splits at the gradient buckets so all-reduces still overlap
    # backward (and at world size 1 it is the plain model, compiled as by hand).
    compile_whole: bool = False
    # How its checkpoints hold the model + optimizer state: a run resumes from any
    # strategy's checkpoint of the same format. DCP (DDP, FSDP, HSDP) reshards to any mesh.
    state_format: str = "dcp"

    @property
    def reads(self) -> tuple[str, ...]:
        return COMMON_OPTIONS + self.options
