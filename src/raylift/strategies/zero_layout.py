"""Where each weight's fp32 master copy and Adam moments lie in a ZeRO checkpoint's
per-rank optimizer files, read by element range; and DeepSpeed's universal load fed from
those ranges, so a run resumes at another world size reading only its own share.

DeepSpeed's own way to change the world size converts the whole checkpoint into a
"universal" folder on local disk (``ds_to_universal``) that every rank then reads. The
layouts below are DeepSpeed's (as its ``zero_to_fp32`` reads them): ZeRO-1/2 lay each
parameter group out as one flat vector, cut into one piece per rank; ZeRO-3 cuts each
weight into one padded piece per rank and lays a rank's pieces end to end.

DeepSpeed's public setters (``deepspeed.utils.safe_set_full_*`` / ``safe_set_local_*``)
cannot do this load: on an engine that has not stepped yet (a resume's) the Adam moments
they write do not exist (ZeRO-1/2 link them at the first step, ZeRO-3's torch optimizer
makes them there), with or without offload, in fp32 and bf16 alike; the master weights
they set leave the module's own weights as they were; and ZeRO-1/2 have only the "full"
setter, which needs the whole weight on every rank. So DeepSpeed's own universal load
runs, and only its per-weight read is replaced; what that relies on of DeepSpeed's
internals is pinned by tests/unit/test_library_private.py.
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from raylift.tensors.lazytorch import LazyTensor, concat_range

FP32 = "fp32"
MOMENTS = ("exp_avg", "exp_avg_sq")
KEYS = (FP32, *MOMENTS)
Shares = dict[int, dict[str, torch.Tensor]]  # a parameter's id -> key -> this rank's elements
# What the universal loader reads from ``zero/optimizer_state.pt``: the optimizer's own
# settings, never a partition (those are what this module reads by range).
_PARTITIONED = ("base_optimizer_state", "single_partition_of_fp32_groups", "param_slice_mappings",
                "fp32_flat_groups", "optimizer_state_dict")  # fmt: skip


@dataclass
class Located:
    """One weight in the saved partitions: ``sources(key)``, per rank (ZeRO-3) or laid end
    to end (ZeRO-1/2), the weight starting at ``offset``; ZeRO-3 pieces of ``each``."""

    shape: torch.Size
    sources: Callable[[str], list[Any]]
    offset: int
    each: int = 0

    def read(self, key: str, first: int = 0, count: int | None = None) -> torch.Tensor:
        """Elements ``first .. first + count`` of the flattened weight's ``key``."""
        count = self.shape.numel() - first if count is None else count
        if not self.each:
            return concat_range(self.sources(key), self.offset + first, count)
        pieces = []
        for rank, groups in enumerate(self.sources(key)):
            lo = max(first, rank * self.each)
            hi = min(first + count, (rank + 1) * self.each)
            if lo < hi:
                pieces.append(concat_range(groups, self.offset + lo - rank * self.each, hi - lo))
        return torch.cat(pieces) if pieces else torch.empty(0)


def locate(state: dict[str, Any], parts: list[dict[str, Any]]) -> dict[str, Located]:
    """Each trained weight of a checkpoint: ``state``, a model-states file; ``parts``, the
    ranks' ``optimizer_state_dict`` in rank order."""
    world, stage = len(parts), parts[0]["zero_stage"]
    shapes: list[dict[str, torch.Size]] = state["param_shapes"]
    found: dict[str, Located] = {}
    if stage <= 2:
        paddings = parts[0].get("param_alignment_paddings")
        for g, group in enumerate(shapes):
            sources = functools.partial(_flats, parts, g)
            offset = 0
            for i, (name, shape) in enumerate(group.items()):
                found[name] = Located(shape, sources, offset)
                offset += shape.numel() + (paddings[g][i] if paddings else 0)
        return found
    offset = 0
    for name, shape in ((n, s) for group in shapes for n, s in group.items()):
        each = math.ceil(shape.numel() / world)
        found[name] = Located(shape, functools.partial(_rank_groups, parts), offset, each)
        offset += each
    return found


def _flats(parts: list[dict[str, Any]], group: int, key: str) -> list[LazyTensor]:
    """ZeRO-1/2: each rank's piece of the flat ``group``."""
    if key == FP32:
        return [p["single_partition_of_fp32_groups"][group] for p in parts]
    return [_base_state(p, group)[key] for p in parts]


def _rank_groups(parts: list[dict[str, Any]], key: str) -> list[list[LazyTensor]]:
    """ZeRO-3: each rank's sub-groups, laid end to end."""
    if key == FP32:
        return [p["fp32_flat_groups"] for p in parts]
    states = [p["optimizer_state_dict"]["state"] for p in parts]
    return [[state[i][key] for i in sorted(state)] for state in states]


def _base_state(part: dict[str, Any], group: int) -> dict[str, Any]:
    # DeepSpeed's default: the torch optimizer's state dict, one flat tensor per group.
    return part["base_optimizer_state"]["state"][group]


def saved_step(parts: list[dict[str, Any]]) -> Any:
    """The optimizer's step count the checkpoint was written at."""
    first = parts[0]
    if first["zero_stage"] <= 2:
        step = _base_state(first, 0)["step"]
    else:
        step = first["optimizer_state_dict"]["state"][0]["step"]
    return step.load() if isinstance(step, LazyTensor) else step


def settings(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """What DeepSpeed's universal load reads from ``zero/optimizer_state.pt``: the loss
    scaler, clipping, version and the optimizer's param groups, no partition."""
    first = parts[0]
    kept = {k: _loaded(v) for k, v in first.items() if k not in _PARTITIONED}
    groups = saved_groups(parts)
    if first["zero_stage"] <= 2:
        return kept | {"param_groups": groups}
    return kept | {
        "optimizer_state_dict": {"state": {0: {"step": saved_step(parts)}}, "param_groups": groups}
    }


def saved_groups(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The optimizer's param groups as saved: each group's settings (lr, weight decay, ...)."""
    first = parts[0]
    key = "base_optimizer_state" if first["zero_stage"] <= 2 else "optimizer_state_dict"
    inner = first[key]
    return list(_loaded(inner["param_groups"]))


def _loaded(obj: Any) -> Any:
    if isinstance(obj, LazyTensor):
        return obj.load()
    if isinstance(obj, dict):
        return {k: _loaded(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_loaded(v) for v in obj)
    return obj


# ---------------------------------------------------------------- this rank's share


def share(optimizer: Any, stage: int, saved: dict[str, Located]) -> Shares:
    """The ranges of every weight's master copy and moments this rank holds at the world
    size it runs at, read from the saved partitions, by ``id`` of the parameter."""
    wanted = list(_wanted(optimizer, stage))
    got: Shares = {id(param): {} for param, *_ in wanted}
    for key in KEYS:  # one key at a time: each file read front to back, once
        for param, first, count, pad in wanted:
            where = saved[optimizer.param_names[param]]
            got[id(param)][key] = _padded(where.read(key, first, count), pad)
    return got


def _wanted(optimizer: Any, stage: int) -> Iterator[tuple[Any, int, int, int]]:
    """(parameter, first element, count, zeros after) this rank's optimizer holds."""
    if stage <= 2:
        for group in optimizer.bit16_groups:
            for lp in group:
                if lp._hp_mapping is not None:  # a weight with none of it on this rank
                    where = lp._hp_mapping.lp_fragment_address
                    yield lp, where.start, where.numel, 0
        return
    for group in optimizer.fp16_groups:
        for param in group:
            partitions = optimizer._get_param_partition_group(param)
            rank, world = dist.get_rank(group=partitions), dist.get_world_size(group=partitions)
            each = math.ceil(param.ds_numel / world)
            first = min(rank * each, param.ds_numel)
            count = min(param.ds_numel, first + each) - first
            yield param, first, count, each - count


def _padded(t: torch.Tensor, pad: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(pad)]) if pad else t


@contextmanager
def fed(
    optimizer: Any, stage: int, got: Shares, step: Any, groups: list[dict[str, Any]]
) -> Iterator[None]:
    """DeepSpeed's universal load taking each weight's share from ``got`` instead of the
    per-weight files of a universal folder: the loaders it calls per weight, swapped for
    the load's duration; then each group's own step and settings (``groups``, as saved)."""
    if stage <= 2:
        params = [lp for group in optimizer.bit16_groups for lp in group if id(lp) in got]
        before = {id(lp): lp.load_hp_checkpoint_state for lp in params}
        for lp in params:
            lp.load_hp_checkpoint_state = types.MethodType(_fragment_loader(got[id(lp)], step), lp)
        try:
            yield
        finally:
            for lp in params:  # DeepSpeed's, as enable_universal_checkpoint set it
                lp.load_hp_checkpoint_state = before[id(lp)]
        return
    optimizer.load_hp_checkpoint_state = lambda _folder, key, param=None: got[id(param)][key]
    try:
        yield
    finally:
        del optimizer.load_hp_checkpoint_state  # the class's own again
    own_steps(optimizer)
    own_settings(optimizer, groups)


def own_settings(optimizer: Any, groups: list[dict[str, Any]]) -> None:
    """Each parameter group's saved settings. DeepSpeed's ZeRO-3 universal load gives every
    group the first one's, and so weight decay to the group that has none (norms, biases)."""
    mine = optimizer.optimizer.param_groups
    if len(mine) != len(groups):
        raise ValueError(f"the checkpoint has {len(groups)} parameter groups, this run {len(mine)}")
    for group, saved in zip(mine, groups, strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})


def own_steps(optimizer: Any) -> None:
    """Each parameter group's ``step`` its own tensor again. DeepSpeed's ZeRO-3 universal
    load gives every group its settings file's one step tensor, and torch's Adam adds 1 to
    each group's step in place: shared, it counts once per group per update, and the bias
    correction of every later step is off."""
    for state in optimizer.optimizer.state.values():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].clone()


def _fragment_loader(pieces: dict[str, torch.Tensor], step: Any) -> Any:
    # As DeepSpeed's universal_checkpoint.load_hp_checkpoint_state, at tensor-parallel size 1.
    def load(lp: Any, *_: Any, **__: Any) -> Any:
        mapping = lp._hp_mapping
        mapping.optim_fragment = {}
        mapping.get_hp_fragment().data.copy_(pieces[FP32])
        for key in MOMENTS:
            mapping.optim_fragment[key] = pieces[key].clone()
        # A copy each: DeepSpeed makes the first one of each group that group's step,
        # which torch's Adam then adds to in place (see own_steps).
        return step.clone() if isinstance(step, torch.Tensor) else step

    return load


def write_settings(folder: Path, parts: list[dict[str, Any]]) -> None:
    """``zero/optimizer_state.pt`` as DeepSpeed's universal load opens it (by path): the
    optimizer's settings alone, a few kilobytes."""
    (folder / "zero").mkdir(parents=True, exist_ok=True)
    torch.save(settings(parts), folder / "zero" / "optimizer_state.pt")
