"""DeepSpeed's config, from raylift's: precision, the ZeRO stage and offload, bucket
sizes fitted to the model's blocks, and the raw keys a user adds (``strategy.config``),
merged last. Also the checks of those options that need the whole config."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from raylift.core.config import AUTO, Config
from raylift.core.parsing import merge
from raylift.strategies.mesh import by_node, counts
from raylift.tensors.precision import PRECISIONS, Precision


def precision_config(precision: Precision) -> dict[str, Any]:
    if precision.use_scaler:
        # DeepSpeed's fp16: half weights with fp32 masters and a dynamic loss scale whose
        # overflow check spans all ranks; auto_cast turns float inputs to half.
        return {"fp16": {"enabled": True, "loss_scale": 0, "auto_cast": True}}
    if precision.autocast_dtype is not None:
        # torch.autocast semantics: fp32 weights, low-precision compute. An empty list of
        # "lower precision safe" modules keeps gradient reduction in fp32, as DDP does.
        return {
            "torch_autocast": {
                "enabled": True,
                "dtype": str(precision.autocast_dtype).removeprefix("torch."),
                "lower_precision_safe_modules": [],
            }
        }
    if precision.param_dtype == torch.bfloat16:
        return {"bf16": {"enabled": True}}  # the whole model in bf16, no autocast
    return {}


def problems(cfg: Config) -> list[str]:
    s = cfg.strategy
    out: list[str] = []
    if s.zero_stage not in (0, 1, 2, 3):
        out.append(f"strategy.zero_stage: must be 0, 1, 2 or 3, got {s.zero_stage}")
    elif s.zero_stage == 0:
        out += [
            f"strategy.{key}: offloading needs a ZeRO optimizer; "
            "set strategy.zero_stage to 1, 2 or 3"
            for key in ("offload", "offload_optimizer")
            if getattr(s, key)
        ]
    if s.offload_param and s.zero_stage != 3:
        out.append("strategy.offload_param: needs strategy.zero_stage: 3")
    if not (s.hpz == AUTO or isinstance(s.hpz, bool)):
        out.append(f"strategy.hpz: true, false or auto, got {s.hpz!r}")
    elif s.hpz is True and s.zero_stage != 3:
        out.append(
            "strategy.hpz: hierarchical partitioning splits ZeRO-3's parameters; "
            "set strategy.zero_stage: 3, or remove strategy.hpz"
        )
    precision = PRECISIONS.get(cfg.precision)
    # auto may pick an unscaled precision; an unknown name is the config's to report.
    scaled = precision.use_scaler if precision else cfg.precision != AUTO
    if cfg.train.on_nan == "skip" and not scaled:
        out.append(
            "train.on_nan: 'skip' with deepspeed relies on DeepSpeed's fp16 loss scaler, which "
            "skips non-finite steps; set precision: 16-mixed, or train.on_nan: stop"
        )
    return out


def zero_config(cfg: Config) -> dict[str, Any]:
    s = cfg.strategy
    zero: dict[str, Any] = {"stage": s.zero_stage}
    if s.offload_optimizer or s.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    if s.offload_param or (s.offload and s.zero_stage == 3):
        zero["offload_param"] = {"device": "cpu"}
    return zero


# DeepSpeed's own defaults, in elements: sized for models of billions of parameters.
BUCKET_DEFAULTS = {
    "reduce_bucket_size": 500_000_000,
    "allgather_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
}


def sized_buckets(model: nn.Module, blocks: list[nn.Module], stage: int) -> dict[str, int]:
    """ZeRO's buffers sized to the model's largest repeated block, DeepSpeed's defaults
    at most.

    With the defaults, ZeRO-3 keeps every parameter it will reuse within 1e9 elements
    gathered: on any model below that size each rank ends up holding the whole model
    between forward and backward (measured on a 101M-parameter gpt: 1,794 MiB per rank
    where the plan counts 612). A block's worth lets one block be in use while the
    next is prefetched, as FSDP does.
    """

    def numel(m: nn.Module) -> int:
        return sum(getattr(p, "ds_numel", p.numel()) for p in m.parameters())

    block = max((numel(b) for b in blocks), default=numel(model))
    sizes = {
        "reduce_bucket_size": block,
        "allgather_bucket_size": block,
        "stage3_prefetch_bucket_size": block,
        "stage3_max_live_parameters": 2 * block,
        "stage3_max_reuse_distance": block,
    }
    if stage != 3:
        sizes = {k: v for k, v in sizes.items() if not k.startswith("stage3")}
    return {k: max(1, min(v, BUCKET_DEFAULTS[k])) for k, v in sizes.items()}


def ds_config(cfg: Config, precision: Precision, hpz: int = 1) -> dict[str, Any]:
    """DeepSpeed's config from raylift's, with ``hpz`` ranks to a secondary partition
    (:func:`hpz_size`); keys under ``strategy.config`` are merged last and win."""
    zero = zero_config(cfg)
    if hpz > 1:
        zero["zero_hpz_partition_size"] = hpz
    base: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": cfg.data.batch_size,
        "gradient_accumulation_steps": cfg.train.grad_accum,
        "gradient_clipping": cfg.train.grad_clip or 0.0,
        "zero_optimization": zero,
        # raylift's torch optimizer, also under offload (no JIT-compiled CPUAdam).
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,  # raylift logs; DeepSpeed's progress lines are noise
        **precision_config(precision),
    }
    return merge(base, cfg.strategy.config)


def hpz_size(cfg: Config, nodes: Sequence[str]) -> tuple[int, str]:
    """ZeRO++'s hierarchical partitioning for a run on ``nodes`` (the node of each rank):
    the ranks of a secondary partition, and the run's line about it ("" where none).

    ZeRO-3 gathers every block twice a step, for forward and again for backward, over
    all ranks. With hpZ each rank also keeps a partition of the weights over its node's
    workers, written from forward's gather: backward then gathers within the node, and
    only forward's gather and the gradients' reduce-scatter cross nodes. DeepSpeed groups
    consecutive ranks, so it needs each node's ranks numbered together, the same number
    on every node; where Ray placed them otherwise, ZeRO-3 runs without it, and says why.
    """
    s = cfg.strategy
    if (
        s.zero_stage != 3
        or s.hpz is False
        or "zero_hpz_partition_size" in s.config.get("zero_optimization", {})
    ):
        return 1, ""
    per_node = counts(nodes)
    if len(per_node) == 1:
        return 1, "hpz: off, the run is on one node" if s.hpz is True else ""
    if len(set(per_node)) > 1 or by_node(nodes) != tuple(range(len(nodes))):
        placed = ", ".join(f"{n} on node {i + 1}" for i, n in enumerate(per_node))
        return 1, (
            f"hpz: off: Ray placed the workers {placed}, with ranks "
            f"{'unevenly' if len(set(per_node)) > 1 else 'interleaved across nodes'}, and "
            "DeepSpeed partitions consecutive ranks; ZeRO-3 gathers over all of them"
        )
    size = per_node[0]
    if size == 1:  # a node's partition of one rank is the whole model: plain ZeRO-3
        return 1, ""
    return size, (
        f"hpz {size}: a second partition of the weights within each node; backward "
        "gathers there, forward and the gradients' reduce-scatter span the nodes"
    )
