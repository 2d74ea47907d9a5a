"""Initial weights that no rank needs the whole model for.

Under a strategy that shards parameters (``fsdp``, DeepSpeed ZeRO-3) the task's model
is created without parameter storage (on the meta device, or partitioned as it is
built under ``deepspeed.zero.Init``), sharded, and only then initialised, one module
at a time: each module's own parameters are drawn whole on the host, from the same
seeded generator on every rank, and each rank keeps its shard. Peak extra memory is
one module's parameters, never the model's.

Every strategy runs the same pass, so the initial weights are identical whether the
model was built eagerly (``ddp``, ``fairscale``, ZeRO-1/2) or sharded first:

1. the generator is seeded with ``train.seed``;
2. every module with a ``reset_parameters()`` method calls it, in ``model.modules()``
   order (the order constructors run theirs);
3. where the task defines ``init_weights(module)``, it is called for every module
   holding parameters, in ``model.apply`` order (children first), as Hugging Face's
   ``_init_weights`` is.

A task's modules must set their own parameters this way: a module that holds a
parameter neither pass sets (say an ``nn.Parameter(torch.zeros(...))`` in a custom
module without ``reset_parameters``) is an error under a sharded strategy, naming it.
Buffers (masks, BatchNorm statistics) keep the values their constructors gave them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

# Writes a parameter's full value (a host tensor) into wherever that parameter lives.
Writer = Callable[[nn.Parameter, torch.Tensor], None]
Initializer = Callable[[Writer], None]


class InitError(ValueError):
    """A module's parameters cannot be initialised without the whole model."""


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Parameters registered inside land on the meta device; buffers stay real.

    Each parameter is still created by its constructor on the host (one at a time, then
    dropped), so what a constructor computes into a buffer from it survives.
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(
                param.detach().to("meta"), requires_grad=param.requires_grad
            )

    nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def materialize(model: nn.Module, device: torch.device) -> None:
    """Give a sharded model's meta parameters storage on ``device`` (each rank its shards),
    keeping the buffers' values (``to_empty`` would leave them undefined too)."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((m, name))
    model.to_empty(device=device)
    # to_empty gives each module a new parameter: tied ones (embeddings and head) would
    # come apart. Every owner gets the first one's again, as FSDP2 registers them.
    for (first, first_name), *others in owners.values():
        for m, name in others:
            m._parameters[name] = first._parameters[first_name]
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])


def full_shape(p: nn.Parameter) -> torch.Size:
    """The whole parameter's shape: DTensors carry it, ZeRO-3 keeps it in ``ds_shape``."""
    return torch.Size(getattr(p, "ds_shape", p.shape))


def write_in_place(p: nn.Parameter, value: torch.Tensor) -> None:
    """A parameter every rank holds whole."""
    with torch.no_grad():
        p.copy_(value)


def write_dtensor(p: nn.Parameter, value: torch.Tensor) -> None:
    """An FSDP2 (DTensor) parameter: keep this rank's slice of the full value."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    assert isinstance(p, DTensor), f"not an FSDP2 parameter: {type(p)}"
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    piece = value[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
    with torch.no_grad():
        p.to_local().copy_(piece)


def write_zero3(p: nn.Parameter, value: torch.Tensor) -> None:
    """A ZeRO-3 partitioned parameter: gathered, set on rank 0, partitioned back."""
    import deepspeed
    import torch.distributed as dist

    with deepspeed.zero.GatheredParameters([p], modifier_rank=0), torch.no_grad():
        if dist.get_rank() == 0:
            p.copy_(value)


@contextlib.contextmanager
def whole(module: nn.Module, write: Writer, touched: set[int]) -> Iterator[None]:
    """``module``'s own parameters as whole host tensors while inside; written back after."""
    swapped: dict[str, nn.Parameter] = {}
    for name, p in module._parameters.items():
        if p is not None:
            # Drawn in fp32 even for bf16 parameters, as an eagerly built model is
            # (it is initialised before the strategy casts it).
            dtype = torch.float32 if p.is_floating_point() else p.dtype
            # NaN marks "not set": what the init leaves alone keeps its earlier value.
            temp = torch.full(full_shape(p), math.nan, dtype=dtype, device="cpu")
            swapped[name] = p
            module._parameters[name] = nn.Parameter(temp, requires_grad=p.requires_grad)
    try:
        yield
    finally:
        for name, original in swapped.items():
            drawn = module._parameters[name]
            module._parameters[name] = original
            assert drawn is not None, f"{name} was removed during its initialisation"
            _write_if_set(module, name, original, drawn.detach(), write, touched)


def _write_if_set(
    module: nn.Module,
    name: str,
    original: nn.Parameter,
    drawn: torch.Tensor,
    write: Writer,
    touched: set[int],
) -> None:
    unset = torch.isnan(drawn)
    if bool(unset.all()):
        return
    if bool(unset.any()):
        raise InitError(
            f"{type(module).__name__}.{name}: its initialisation set only part of it or "
            "read its earlier value; raylift initialises one module at a time from an "
            "unset tensor, so draw every element (nn.init.* functions do)"
        )
    write(original, drawn)
    touched.add(id(original))


def _post_order(model: nn.Module) -> list[nn.Module]:
    """``model.apply``'s order: each module after its children."""
    out: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            visit(child)
        out.append(m)

    visit(model)
    return out


def _own_params(m: nn.Module) -> bool:
    return any(p is not None for p in m._parameters.values())


def initialize(model: nn.Module, task: Any, seed: int, write: Writer, sharded: bool) -> None:
    """raylift's initial weights for ``model`` (see the module docstring).

    ``sharded``: the parameters hold no values yet, so one that no pass sets is an error.
    """
    torch.manual_seed(seed)
    touched: set[int] = set()
    for m in model.modules():
        reset = getattr(m, "reset_parameters", None)
        if callable(reset) and _own_params(m):
            with whole(m, write, touched):
                reset()
    custom = getattr(task, "init_weights", None)
    if callable(custom):
        for m in _post_order(model):
            if _own_params(m):
                with whole(m, write, touched):
                    custom(m)
    if sharded:
        _check_all_set(model, touched)


def _check_all_set(model: nn.Module, touched: set[int]) -> None:
    missed = [name for name, p in model.named_parameters() if id(p) not in touched]
    if missed:
        raise InitError(
            f"parameter(s) {missed[:5]} are set by neither a reset_parameters() of their "
            "module nor the task's init_weights(module); a sharded strategy creates them "
            "without values, so give the task an init_weights(module) that sets them"
        )
