"""Tensor parallel within a node: each of a group's ranks holds a slice of every large
matrix and computes its part of each layer (DTensor's ``parallelize_module``).

A model says how it is split by a plan: module name patterns (``*`` for a layer's
number) to the names Hugging Face's ``base_model_tp_plan`` uses:

- ``colwise``: the output features split (q/k/v, gate/up); the output stays split,
  so attention runs on the group's share of the heads;
- ``rowwise``: the input features split (o_proj, down_proj); the outputs summed across
  the group (one all-reduce), so what leaves the layer is whole on every rank;
- ``colwise_rep`` / ``rowwise_rep``: the same weights, with the output gathered whole
  (a fused q/k/v whose split would cut heads apart) and the input taken whole;
- ``replicated_with_grad_allreduce``: a small module (Qwen3's per-head norms) that sees
  the group's share of the heads: its weight is whole on every rank and its gradient is
  summed across the group.

A Hugging Face model's plan is its config's ``base_model_tp_plan``; raylift's ``gpt``
has one of its own; a user's task may declare ``tp_plan(model)``. What the plan leaves
out (embeddings, norms, the head) is whole on every rank of the group and sharded by
FSDP over the other dimensions. The group's ranks train on one batch: each reads the
group's rows (:meth:`raylift.data.ingest.ShardSource.regroup`).
"""

from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING, Any

from torch import nn

from raylift.core.config import ConfigError
from raylift.tasks.base import hf_plan

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

STYLES = ("colwise", "rowwise", "colwise_rep", "rowwise_rep", "replicated_with_grad_allreduce")
# The head counts a plan splits: each must be a multiple of the group's size.
HEADS = ("num_attention_heads", "num_key_value_heads", "n_head")


def plan_of(task: Any, model: nn.Module) -> dict[str, str] | None:
    """The task's own plan, else the Hugging Face model's (its base model's plan, under
    the base model's attribute), else None."""
    own = getattr(task, "tp_plan", None)
    plan = own(model) if callable(own) else hf_plan(model)
    return None if plan is None else dict(plan)


def style(name: str, pattern: str) -> ParallelStyle:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    styles: dict[str, Any] = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        # Applied to (batch, sequence, heads, head_dim): the heads are what is split.
        "replicated_with_grad_allreduce": lambda: SequenceParallel(
            sequence_dim=2, use_local_output=True
        ),
    }
    if name not in styles:
        raise ConfigError(
            f"strategy.tp: the model's plan splits {pattern} as {name!r}, which raylift "
            f"does not apply (it applies {', '.join(STYLES)}); set strategy.tp to 1, "
            "or give the task a tp_plan of those"
        )
    return styles[name]()


def expand(plan: dict[str, str], model: nn.Module) -> dict[str, str]:
    """The plan's patterns matched against the model's module names: every module it
    splits, by name. A pattern that matches nothing is a plan for another model."""
    names = [n for n, _ in model.named_modules() if n]
    out: dict[str, str] = {}
    for pattern, how in plan.items():
        hits = [n for n in names if matches(n, pattern)]
        if not hits:
            raise ConfigError(
                f"strategy.tp: the tensor-parallel plan names {pattern}, which the model "
                f"({type(model).__name__}) does not have; fix the task's tp_plan"
            )
        out.update(dict.fromkeys(hits, how))
    return out


def matches(name: str, pattern: str) -> bool:
    """``*`` stands for one part of a dotted name (a layer's number), as in
    ``parallelize_module``'s plans: ``layers.*.q_proj`` is not ``layers.0.attn.q_proj``."""
    parts, wanted = name.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(
        fnmatch.fnmatchcase(p, w) for p, w in zip(parts, wanted, strict=True)
    )


def check_heads(model: nn.Module, tp: int) -> None:
    """Attention heads split evenly over the group, or refused with the numbers."""
    config = getattr(model, "config", None)
    for key in HEADS:
        heads = getattr(config, key, None)
        if isinstance(heads, int) and heads % tp:
            raise ConfigError(
                f"strategy.tp: {tp} does not divide the model's {heads} {key}; "
                f"set strategy.tp to a divisor of {heads}"
            )


def refuse_without_plan(model: nn.Module) -> ConfigError:
    return ConfigError(
        f"strategy.tp: {type(model).__name__} has no tensor-parallel plan (no "
        "base_model_tp_plan in its config, no tp_plan in the task); set strategy.tp to 1 "
        "(FSDP or HSDP shard it instead), or give the task a tp_plan(model)"
    )


def parallelize(model: nn.Module, plan: dict[str, str], mesh: DeviceMesh) -> int:
    """Split ``model`` over the 1-D ``mesh`` by ``plan``, in place (on the meta device,
    before FSDP); returns how many modules were split."""
    from torch.distributed.tensor.parallel import parallelize_module

    check_heads(model, mesh.size())
    split = expand(plan, model)
    parallelize_module(model, mesh, {name: style(how, name) for name, how in split.items()})
    return len(split)


def clip_across_meshes(params: list[nn.Parameter], max_norm: float) -> Any:
    """``clip_grad_norm_`` for a model whose gradients live on different meshes (the
    split layers' on shard x tp, the rest on shard alone), which one stack of their
    norms cannot hold: each mesh's norm whole, then the norm of those."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental import implicit_replication

    by_mesh: dict[Any, list[nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    norms = []
    for group in by_mesh.values():
        norm = nn.utils.get_total_norm([g for p in group if (g := p.grad) is not None], 2.0)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    with implicit_replication():  # the one scale, mesh by mesh
        for group in by_mesh.values():
            nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total
