"""Memory planning: what each strategy holds per worker, and the choice ``strategy: auto`` makes.

Model states follow the ZeRO paper's accounting (parameters, gradients and
optimizer state, each either replicated or divided by the world size), with the
byte widths raylift's engines really use. Activations are measured, not guessed:
one forward and backward of the task's model on a small batch counts the bytes
autograd saves, with and without activation checkpointing.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from raylift.core.config import Config, ConfigError, StrategyConfig
from raylift.data.sources import sample
from raylift.strategies import PlanRow, config_problems, plan_row, plan_rows
from raylift.strategies.base import apply_activation_checkpointing
from raylift.strategies.registry import TP_PER_NODE
from raylift.strategies.tensor_parallel import HEADS, expand, plan_of, refuse_without_plan, style
from raylift.tasks import build_task
from raylift.tasks.base import blocks_of, shaped_rows, tokens_per_sample
from raylift.tensors.adapters import attach, trainable_numel
from raylift.tensors.init import meta_model
from raylift.tensors.precision import DeviceFacts, Precision, resolve_precision

# Share of memory a plan may fill: the rest is the allocator's cache, fragmentation,
# communication buffers and the CUDA context.
USABLE = 0.85
GIB = 2**30


@dataclasses.dataclass
class Row:
    label: str
    strategy: dict
    params: int
    grads: int
    optimizer: int
    activations: int  # at the configured micro-batch
    activations_ckpt: int  # the same with activation checkpointing
    refused: list[str]  # what the config alone shows wrong with this strategy; empty: usable
    buffers: int = 0  # gathered blocks and gradient buckets of sharding strategies
    within: float = 0.0  # bytes a rank sends a step to ranks of its own node
    across: float = 0.0  # ... on groups that span nodes

    @property
    def states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def fixed(self) -> int:
        """Bytes held whatever the micro-batch: states and buffers."""
        return self.states + self.buffers


@dataclasses.dataclass
class Plan:
    rows: list[Row]
    budget: int
    choice: Row | None
    checkpointing: bool
    micro_batch: int
    grad_accum: int
    frozen: tuple[int, int] = (0, 0)  # (trainable, frozen) parameters where some are frozen
    nodes: int = 1


def planned_precision(cfg: Config) -> Precision:
    """The precision a run of ``cfg`` would use. ``auto`` is resolved for an Ampere or
    newer GPU where the run uses GPUs (the plan may be made on a laptop without one),
    and for this host's CPU otherwise."""
    gpu = DeviceFacts("cuda", "GPU", (8, 0)) if cfg.scaling.use_gpu else None
    return resolve_precision(cfg.precision, gpu)


def optimizer_slots(cfg: Config) -> int:
    """Tensors of optimizer state per parameter: Adam's two moments, SGD's momentum."""
    if cfg.optim.name == "sgd":
        return 1 if cfg.optim.momentum else 0
    return 2


def model_states(
    label: str,
    n_params: int,
    cfg: Config,
    world: int,
    trainable: int | None = None,
    nodes: int = 1,
    tp_split: int = 0,
) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes one rank holds on the device. ``trainable``: the
    parameters that train (adapters on a frozen base); the rest hold no gradient and no
    optimizer state. ``nodes``: what the ``world`` ranks span (HSDP shards within one).
    ``tp_split``: the parameters tensor parallel splits (a row split over each node's
    workers and sharded over the nodes divides those by the world, the rest by the nodes)."""
    row = plan_row(label)
    # The share of a state a rank holds: a split part over the world, the rest over nodes.
    part = tp_split / max(n_params, 1) if row.tp_per_node else 0.0
    share = part / world + (1 - part) / (nodes if row.tp_per_node else world)
    world = world // nodes if row.per_node else world
    trainable = n_params if trainable is None else trainable
    frozen = n_params - trainable
    width = planned_precision(cfg).param_dtype.itemsize
    # Adapters stay fp32 beside a cast base (adapters.keep_trainable_fp32); DeepSpeed
    # casts them with the base and keeps its fp32 master instead.
    own = 4 if frozen and not row.fp32_master else width
    optimizer = trainable * own * optimizer_slots(cfg)
    if row.fp32_master and width != 4:  # fp32 weights are their own master (deepspeed.py)
        optimizer += trainable * 4
    full = (trainable * own + frozen * width, trainable * own, optimizer)
    divided = [round(b * share) if row.tp_per_node else b // world for b in full]
    held = [d if sharded else b for b, d, sharded in zip(full, divided, row.shards, strict=True)]
    if row.offload:
        held[0], held[2] = 0, 0
    return held[0], held[1], held[2]


def saved_activation_bytes(cfg: Config, batch: dict[str, torch.Tensor], checkpointing: bool) -> int:
    """Bytes autograd saves for backward in one forward of ``batch``.

    The model runs on the meta device (shapes, no data), so models far larger than
    this machine's memory can be planned. Weights are cast to the compute dtype, as
    autocast would; the meta device takes the math attention path, which saves more
    than fused attention kernels, so the estimate errs high.
    """
    task = build_task(cfg.task, cfg.task_args)
    dtype = planned_precision(cfg).compute_dtype
    model = meta_model(task).to(dtype)
    if checkpointing:
        apply_activation_checkpointing(blocks_of(task, model))
    params = {id(p) for p in model.parameters()}
    seen: dict[tuple, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in params:
            key = (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), t.dtype)
            seen[key] = t.numel() * t.element_size()
        return t

    meta = {k: v.to("meta") for k, v in batch.items()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        task.loss(model, task.finish(meta, dtype))
    return sum(seen.values())


def activations_per_sample(cfg: Config, checkpointing: bool) -> int:
    """Saved bytes per sample: the difference between batches of 2 and 1."""
    task = build_task(cfg.task, cfg.task_args)

    rows = shaped_rows(task, 8)
    if rows is None:
        rows = task.preprocess(sample(task.sources()["train"], 8))
    numbers = {k: v for k, v in rows.items() if v.dtype != object}  # not the rows' errors
    one = {k: torch.from_numpy(v[:1].copy()) for k, v in numbers.items()}
    two = {k: torch.from_numpy(v[:2].copy()) for k, v in numbers.items()}
    return max(
        saved_activation_bytes(cfg, two, checkpointing)
        - saved_activation_bytes(cfg, one, checkpointing),
        0,
    )


def largest_block(cfg: Config) -> int:
    """Parameters of the model's largest repeated block (the whole model where the task
    names none): what a sharding strategy gathers at a time."""
    task = build_task(cfg.task, cfg.task_args)
    model = meta_model(task)
    blocks = blocks_of(task, model) or [model]
    return max(sum(p.numel() for p in b.parameters()) for b in blocks)


def count_params(cfg: Config) -> int:
    return sum(count_trainable(cfg))


def count_trainable(cfg: Config) -> tuple[int, int]:
    """(trainable, frozen) parameters of the run's model, adapters attached where the
    config asks for them; tied weights once."""
    with torch.device("meta"):  # no memory: a 70B model counts as fast as a small one
        model = build_task(cfg.task, cfg.task_args).build_model()
        if cfg.model.adapter.type:
            model = attach(model, cfg.model.adapter)
    return trainable_numel(model)


def planned_strategy(row: PlanRow, per_node: int) -> dict:
    """The strategy section ``row`` runs as, its tensor-parallel size (where it is the
    workers per node) filled in."""
    strategy = dict(row.strategy)
    if strategy.get("tp") == TP_PER_NODE:
        strategy["tp"] = per_node
    return strategy


def refusals(cfg: Config, row: PlanRow, gpus: int = 0, per_node: int = 1) -> list[str]:
    """Why ``cfg`` cannot run as ``row`` (fp16 where the strategy has no loss scaler, say)
    on ``gpus`` workers (0: the config's own count)."""
    strategy = StrategyConfig(**planned_strategy(row, per_node))
    scaling = dataclasses.replace(cfg.scaling, num_workers=gpus) if gpus else cfg.scaling
    return config_problems(dataclasses.replace(cfg, strategy=strategy, scaling=scaling))


class PlanError(ValueError):
    """A plan that cannot be made as asked: the message names the fix."""


def make_plan(cfg: Config, gpus: int, gpu_mem_gib: float, nodes: int = 1) -> Plan:
    """Each strategy's memory per worker and bytes on the wire per step, at ``gpus``
    workers over ``nodes`` nodes, and the first that fits: least communication first,
    and where the run spans nodes, least across nodes first."""
    if nodes < 1 or gpus % nodes:
        raise PlanError(f"--nodes {nodes} must divide --gpus {gpus}; give a divisor of {gpus}")
    split = param_split(cfg)  # the model built once on the meta device, for both counts
    trainable, n_params = split.trainable, split.blocks + split.root
    frozen, batch = n_params - trainable, cfg.data.batch_size
    per_sample = activations_per_sample(cfg, checkpointing=False)
    per_sample_ckpt = activations_per_sample(cfg, checkpointing=True)
    block = largest_block(cfg) * planned_precision(cfg).param_dtype.itemsize
    per_node = gpus // nodes
    rows = [
        Row(
            row.label,
            planned_strategy(row, per_node),
            *model_states(row.label, n_params, cfg, gpus, trainable, nodes, split.tp.split),
            per_sample * batch,
            per_sample_ckpt * batch,
            refusals(cfg, row, gpus, per_node) + split.tp.problems(per_node, row),
            row.block_buffers * block // (per_node if row.tp_per_node else 1)
            + secondary_partition(row, cfg, n_params, nodes, per_node),
            *predicted_wire(cfg, row.label, gpus, nodes, split),
        )
        for row in plan_rows()
        if (nodes > 1 or not row.spanning) and (per_node > 1 or not row.tp_per_node)
    ]
    if nodes > 1:
        rows.sort(key=lambda r: (r.across, r.within))  # stable: ties keep the order above
    budget = int(gpu_mem_gib * GIB * USABLE)
    counts = (trainable, frozen) if frozen else (0, 0)
    usable = [r for r in rows if not r.refused]
    done = functools.partial(Plan, rows, budget, frozen=counts, nodes=nodes)
    for row in usable:
        for ckpt, act in ((False, per_sample), (True, per_sample_ckpt)):
            if row.fixed + act * batch <= budget:
                return done(row, ckpt, batch, cfg.train.grad_accum)
    # Nothing fits at the configured micro-batch: the largest that fits, same global batch.
    for row in usable:
        room = budget - row.fixed
        if room >= per_sample_ckpt > 0:
            micro = min(batch, room // per_sample_ckpt)
            accum = cfg.train.grad_accum * -(-batch // micro)
            return done(row, True, int(micro), accum)
    return done(None, True, 0, 0)


def secondary_partition(row: PlanRow, cfg: Config, n_params: int, nodes: int, per_node: int) -> int:
    """hpZ's partition of the weights over a node's workers, on the device from forward to
    the step (in host memory where the parameters are offloaded)."""
    if not hpz_spans(row, nodes, per_node) or row.offload:
        return 0
    return n_params * planned_precision(cfg).param_dtype.itemsize // per_node


def hpz_spans(row: PlanRow, nodes: int, per_node: int) -> bool:
    """Whether ``row`` runs with hpZ: ZeRO-3 over several nodes of several workers."""
    return row.hpz and nodes > 1 and per_node > 1


def plan_strategy(cfg: Config, world: int, device_mem_bytes: int) -> StrategyConfig:
    """The concrete strategy ``strategy: auto`` runs as, for this world size and device."""
    plan = make_plan(cfg, world, device_mem_bytes / GIB)
    if plan.choice is None:
        raise ValueError(
            f"strategy: auto: no strategy fits this model in {device_mem_bytes / GIB:.1f} GiB "
            f"per worker at world size {world}; add workers or use larger devices"
        )
    return StrategyConfig(**plan.choice.strategy, activation_checkpointing=plan.checkpointing)


def render(plan: Plan, gpus: int, gpu_mem_gib: float) -> str:
    def mib(b: int) -> str:
        return f"{b / 2**20:10.1f}"

    head = (
        f"memory per worker at world size {gpus}, {gpu_mem_gib:g} GiB each "
        f"(plan within {USABLE:.0%}: {plan.budget / 2**20:.0f} MiB), in MiB"
    )
    lines = [
        head,
        f"{'strategy':<15}{'params':>10}{'grads':>10}{'optim':>10}{'states':>10}"
        f"{'buffers':>10}{'activ.':>10}{'act+ckpt':>10}{'total':>10}  fits",
    ]
    for r in plan.rows:
        total = r.fixed + r.activations
        fits = (
            "yes"
            if total <= plan.budget
            else ("with ckpt" if r.fixed + r.activations_ckpt <= plan.budget else "no")
        )
        if r.refused:
            fits += " (refused, below)"
        lines.append(
            f"{r.label:<15}{mib(r.params)}{mib(r.grads)}{mib(r.optimizer)}"
            f"{mib(r.states)}{mib(r.buffers)}{mib(r.activations)}{mib(r.activations_ckpt)}"
            f"{mib(total)}  {fits}"
        )
    lines += [f"{r.label} refused: {problem}" for r in plan.rows for problem in r.refused]
    lines += wire_lines(plan, gpus)
    trainable, frozen = plan.frozen
    if frozen:
        lines.append(
            f"adapters: {trainable:,} trainable parameters, {frozen:,} frozen (in params; "
            "no grads or optimizer state for them)"
        )
    if plan.choice is None:
        lines.append("choice: nothing fits; add workers or use larger devices")
    else:
        extra = ", activation_checkpointing: true" if plan.checkpointing else ""
        lines.append(
            f"choice (strategy: auto): {plan.choice.strategy}{extra}, micro-batch "
            f"{plan.micro_batch}, grad_accum {plan.grad_accum}"
        )
    return "\n".join(lines)


def wire_lines(plan: Plan, gpus: int) -> list[str]:
    """Each row's bytes a worker sends a step, within its node and across nodes."""
    where = f"{plan.nodes} nodes of {gpus // plan.nodes}" if plan.nodes > 1 else "one node"
    lines = [
        f"bytes each worker sends a step on {where}, in MiB (predicted; ring collectives)",
        f"{'strategy':<15}{'within':>10}{'across':>10}",
    ]
    for r in plan.rows:
        lines.append(f"{r.label:<15}{r.within / 2**20:10.1f}{r.across / 2**20:10.1f}")
    if plan.nodes > 1:
        lines.append(
            f"fsdp: sharded within each node and replicated across the {plan.nodes} (HSDP); "
            f"fsdp-full: sharded over all {gpus} workers"
        )
        if gpus > plan.nodes:
            lines.append(
                "zero3: with hpZ (strategy.hpz: auto), backward gathers from a second "
                "partition within each node"
            )
    return lines


# ---------------------------------------------------------------- bytes on the wire


@dataclasses.dataclass(frozen=True)
class TPShape:
    """What tensor parallel splits of the model (raylift.strategies.tensor_parallel): its
    parameters, and the widths a token's activations have in each of its collectives."""

    split: int = 0  # parameters the plan splits
    fwd_reduce: int = 0  # rowwise outputs, all-reduced in forward
    fwd_gather: int = 0  # colwise_rep outputs, all-gathered in forward
    bwd_reduce: int = 0  # colwise inputs, whose gradients are all-reduced in backward
    bwd_gather: int = 0  # rowwise_rep inputs, whose gradients are all-gathered in backward
    heads: tuple[int, ...] = ()  # the head counts a group's size must divide
    problem: str = ""  # why the model cannot be split; "" where it can

    def problems(self, tp: int, row: PlanRow) -> list[str]:
        if not row.tp_per_node:
            return []
        if self.problem:
            return [self.problem]
        return [
            f"strategy.tp: {tp} (the workers per node) does not divide the model's {h} heads"
            for h in self.heads
            if h % tp
        ]


WIDTHS = ("split", "fwd_reduce", "fwd_gather", "bwd_reduce", "bwd_gather")


def tp_shape(task: object, model: torch.nn.Module) -> TPShape:
    """The model's tensor-parallel plan, counted."""
    try:
        plan = plan_of(task, model)
        if plan is None:
            raise refuse_without_plan(model)
        split = expand(plan, model)
        for name, how in split.items():
            style(how, name)  # one raylift applies, or refused
    except ConfigError as exc:
        return TPShape(problem=str(exc))
    modules = dict(model.named_modules())
    counts: dict[str, Any] = dict.fromkeys(WIDTHS, 0)
    for name, how in split.items():
        m = modules[name]
        if not isinstance(m, torch.nn.Linear):
            continue  # a norm: whole on every rank
        col = how.startswith("colwise")
        counts["split"] += m.weight.numel() + (m.bias.numel() if col and m.bias is not None else 0)
        width = "bwd_reduce" if col else "fwd_reduce"
        counts[width] += m.in_features if col else m.out_features
        if how == "colwise_rep":
            counts["fwd_gather"] += m.out_features
        if how == "rowwise_rep":
            counts["bwd_gather"] += m.in_features
    config = getattr(model, "config", None)
    heads = tuple(h for k in HEADS if isinstance(h := getattr(config, k, None), int))
    return TPShape(**counts, heads=heads)


@dataclasses.dataclass(frozen=True)
class ParamSplit:
    """Parameters in the model's repeated blocks and at its root, all and trainable."""

    blocks: int
    blocks_trainable: int
    root: int
    root_trainable: int
    tp: TPShape = TPShape()
    tokens: int = 0  # a sample's tokens (the task's tokens_per_sample)

    @property
    def trainable(self) -> int:
        return self.blocks_trainable + self.root_trainable


def param_split(cfg: Config) -> ParamSplit:
    """Where the parameters are: FSDP gathers a block's in the blocks' precision and
    again for backward, the root's (embeddings, head) once in their own."""
    task = build_task(cfg.task, cfg.task_args)
    with torch.device("meta"):
        model = task.build_model()
        if cfg.model.adapter.type:
            model = attach(model, cfg.model.adapter)
    seen: set[int] = set()
    counts = [0, 0, 0, 0]
    groups = [b.parameters() for b in blocks_of(task, model)] + [model.parameters()]
    for i, params in enumerate(groups):
        at = 0 if i < len(groups) - 1 else 2
        for p in params:
            if id(p) not in seen:
                seen.add(id(p))
                counts[at] += p.numel()
                counts[at + 1] += p.numel() if p.requires_grad else 0
    blocks, blocks_trainable, root, root_trainable = counts
    tp, tokens = tp_shape(task, model), tokens_per_sample(task)
    return ParamSplit(blocks, blocks_trainable, root, root_trainable, tp, tokens)


def _ring(group: int, factor: float = 1.0) -> float:
    """A rank's share of a ring collective's bytes: (g-1)/g, twice for an all-reduce."""
    return factor * (group - 1) / group if group > 1 else 0.0


def predicted_wire(
    cfg: Config, label: str, gpus: int, nodes: int = 1, split: ParamSplit | None = None
) -> tuple[float, float]:
    """Bytes one rank sends a step (within its node, across nodes) as ``label``, on
    ``gpus`` ranks over ``nodes`` nodes: what raylift.run.wire measures, from the model.

    A group spanning nodes counts as across. On gloo (CPU workers) a reduce-scatter
    runs as an all-reduce of the whole input; on NCCL as itself."""
    row, split = plan_row(label), split or param_split(cfg)
    precision = planned_precision(cfg)
    width = precision.param_dtype.itemsize
    accum = cfg.train.grad_accum
    scatter = 1.0 if cfg.scaling.use_gpu else 2.0
    if not row.gathers:  # every rank's gradients all-reduced over the world
        grads = split.trainable * width * _ring(gpus, 2.0)
        return (grads, 0.0) if nodes == 1 else (0.0, grads)
    tp = gpus // nodes if row.tp_per_node else 1
    shard = gpus // nodes if row.per_node else gpus // tp
    replicas = gpus // shard // tp
    # A rank gathers and reduces its slice of what tensor parallel splits.
    sliced = split.tp.split * (1 - 1 / tp)
    # Blocks gathered in the compute dtype under mixed precision, for forward and, where
    # resharded after it, again for backward; the root once, in its own dtype.
    mixed = (precision.autocast_dtype or precision.param_dtype).itemsize
    passes = 2 if cfg.strategy.reshard_after_forward else 1
    gathered = (split.blocks - sliced) * mixed * passes + split.root * width
    reduced = (split.trainable - sliced) * (4 if precision.autocast_dtype else width)
    # A tensor-parallel rank runs forward and backward once for each rank of its group.
    in_shard = accum * tp * gathered * _ring(shard) + reduced * _ring(shard, scatter)
    in_replicas = reduced / shard * _ring(replicas, 2.0)
    if hpz_spans(row, nodes, gpus // nodes):  # backward's gather from the node's partition
        backward = accum * (passes - 1) * split.blocks * mixed
        within = backward * _ring(gpus // nodes)
        return within, in_shard + in_replicas - backward * _ring(gpus)
    if tp > 1:  # the group's collectives stay within the node; the shards span nodes
        within = tp_activations(cfg, split, tp)
        return (within + in_shard, 0.0) if nodes == 1 else (within, in_shard)
    if nodes == 1:
        return in_shard + in_replicas, 0.0
    # Over several nodes a shard group is a node's workers (HSDP) or the whole world.
    return (in_shard, in_replicas) if row.per_node else (0.0, in_shard + in_replicas)


def tp_activations(cfg: Config, split: ParamSplit, tp: int) -> float:
    """Bytes a rank sends a step in its tensor-parallel group: each split layer's
    activations (a rank runs every row of its group, one rank's rows at a time), forward
    again under activation checkpointing."""
    tokens = cfg.data.batch_size * split.tokens * tp * cfg.train.grad_accum
    act = planned_precision(cfg).compute_dtype.itemsize
    shape = split.tp
    forward = shape.fwd_reduce * _ring(tp, 2.0) + shape.fwd_gather * _ring(tp)
    backward = shape.bwd_reduce * _ring(tp, 2.0) + shape.bwd_gather * _ring(tp)
    passes = 2 if cfg.strategy.activation_checkpointing else 1
    return tokens * act * (forward * passes + backward)
