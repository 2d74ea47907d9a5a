"""Initial weights that no rank needs the whole model for.

Under a strategy that shards parameters (``fsdp``, DeepSpeed ZeRO-3) the task's model
is created without the whole model's storage (on the meta device, or partitioned as it
is built under ``deepspeed.zero.Init``), sharded, and only then initialised, one module
at a time: each module's own parameters are drawn whole on the host, from the same
seeded generator on every rank, and each rank keeps its shard. Peak extra memory is
one module's parameters, never the model's.

Every strategy runs the same pass, so the initial weights are identical whether the
model was built eagerly (``ddp``, ``fairscale``, ZeRO-1/2) or sharded first:

1. the generator is seeded with ``train.seed``;
2. every module with a ``reset_parameters()`` method calls it, in ``model.modules()``
   order (the order constructors run theirs);
3. an init function, called for every module holding parameters in ``model.apply``
   order (children first): the task's ``init_weights(module)`` where it defines one,
   else, for modules inside a Hugging Face ``PreTrainedModel``, that model's own
   ``_init_weights`` (the nearest enclosing one, as transformers dispatches it);
4. a parameter neither pass sets keeps the value its constructor gave it (an RMSNorm's
   ones, a learned scale): built eagerly it never lost it; under ZeRO-3 its partitions
   hold it; on the meta device its module's constructor value is kept on the host while
   the model is built, for modules without ``reset_parameters`` only (their parameters
   are small in every common model; the cost is said on the console).

A parameter can be left without a value only on the meta device: one whose module has a
``reset_parameters()`` that does not set it. That is an error naming it and the fix.
Buffers (masks, BatchNorm statistics) keep the values their constructors gave them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from raylift.core import storage

# Writes a parameter's full value (a host tensor) into wherever that parameter lives.
Writer = Callable[[nn.Parameter, torch.Tensor], None]
Initializer = Callable[[Writer], "InitReport"]
# id(parameter as created on the meta device) -> its constructor's value on the host
Kept = dict[int, torch.Tensor]


class InitError(ValueError):
    """A module's parameters cannot be initialised without the whole model."""


@dataclasses.dataclass
class InitReport:
    """Which pass set how many parameters (each counted once), for the run's first lines."""

    reset: int = 0  # by their module's reset_parameters()
    custom: int = 0  # by the init function
    custom_name: str = ""  # which: "the task's init_weights", "the model's _init_weights"
    constructor: int = 0  # kept their constructor's value
    held_bytes: int = 0  # host memory holding constructor values while the model was built
    adapters: int = 0  # adapter matrices drawn as PEFT draws them (raylift.tensors.adapters)
    adapters_from: str = ""  # model.adapter.weights, where they were loaded from instead

    def describe(self, how: str) -> str:
        counts = [(self.reset, "set by reset_parameters()")]
        counts.append((self.custom, f"set by {self.custom_name}"))
        counts.append((self.constructor, "keep their constructor's values"))
        drawn = (
            f"loaded from {self.adapters_from}"
            if self.adapters_from
            else "drawn as PEFT does (B zero)"
        )
        counts.append((self.adapters, f"adapter matrices {drawn}"))
        said = ", ".join(f"{n} {what}" for n, what in counts if n)
        line = f"raylift: initial weights: {how}; parameters: {said}"
        if self.held_bytes:
            held = storage.size_text(self.held_bytes)
            line += f" ({held} of them held on the host while building)"
        return line


def resets_itself(module: nn.Module) -> bool:
    return callable(getattr(type(module), "reset_parameters", None))


def _all_module_classes() -> list[type]:
    out: list[type] = []
    todo: list[type] = [nn.Module]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return out


class params_on_meta:  # lower case: it reads as the function it replaced, ``with params_on_meta()``
    """Modules built inside keep their parameters on the meta device; buffers stay real.

    Each module's parameters move to the meta device when its own constructor returns, as
    ``deepspeed.zero.Init`` partitions them: constructors run on real tensors and draw
    from the generator exactly as an eager build does, and what they compute into buffers
    survives. Peak host memory is one module's parameters. ``with`` gives the constructor
    values kept for modules without ``reset_parameters`` (see the module docstring).
    """

    def __init__(self) -> None:
        self.kept: Kept = {}
        self._building: set[int] = set()
        # id(real parameter) -> (a weak reference to it, its meta twin): a parameter two
        # modules share (tied weights) gets one twin.
        self._twins: dict[int, tuple[weakref.ref, nn.Parameter]] = {}
        self._deepcopy = nn.Parameter.__deepcopy__
        self._had_hook = "__init_subclass__" in nn.Module.__dict__
        self._hook = nn.Module.__dict__.get("__init_subclass__")

    def __enter__(self) -> Kept:
        for cls in _all_module_classes():
            self._patch(cls)
        nn.Module.__init_subclass__ = classmethod(self._on_subclass)  # type: ignore[assignment]

        def copy_kept(param: nn.Parameter, memo: dict[int, Any]) -> nn.Parameter:
            return self._copy_kept(param, memo)  # called as the parameter's method

        nn.Parameter.__deepcopy__ = copy_kept  # type: ignore[method-assign,assignment]
        return self.kept

    def __exit__(self, *exc: object) -> None:
        nn.Parameter.__deepcopy__ = self._deepcopy  # type: ignore[method-assign]
        if self._had_hook:
            nn.Module.__init_subclass__ = self._hook  # type: ignore[assignment]
        else:
            del nn.Module.__init_subclass__
        for cls in _all_module_classes():
            init = cls.__dict__.get("__init__")
            if hasattr(init, "_raylift_unwrapped"):
                cls.__init__ = init._raylift_unwrapped  # type: ignore[misc,union-attr]

    def _on_subclass(self, cls: type, **kwargs: Any) -> None:  # classes defined while building
        self._patch(cls)

    def _patch(self, cls: type) -> None:
        init = cls.__dict__.get("__init__")
        if init is not None and not hasattr(init, "_raylift_unwrapped"):
            cls.__init__ = self._wrap(init)  # type: ignore[misc]

    def _wrap(self, init: Callable[..., None]) -> Callable[..., None]:
        building = self._building

        @functools.wraps(init)
        def run(module: nn.Module, *args: Any, **kwargs: Any) -> None:
            outermost = id(module) not in building  # a subclass's __init__ ends last
            building.add(id(module))
            try:
                init(module, *args, **kwargs)
            finally:
                if outermost:
                    building.discard(id(module))
            if outermost:
                self._to_meta(module)

        run._raylift_unwrapped = init  # type: ignore[attr-defined]
        return run

    def _to_meta(self, module: nn.Module) -> None:
        for name, p in own_params(module):
            if p.is_meta:
                continue
            twin = self._twins.get(id(p))
            if twin is None or twin[0]() is not p:
                meta = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
                if not resets_itself(module):
                    self.kept[id(meta)] = p.detach()
                twin = self._twins[id(p)] = (weakref.ref(p), meta)
            module.register_parameter(name, twin[1])

    def _copy_kept(self, param: nn.Parameter, memo: dict[int, Any]) -> nn.Parameter:
        # torch's own clones (nn.TransformerEncoder's layers) deep-copy built modules.
        out = self._deepcopy(param, memo)
        if id(param) in self.kept:
            self.kept[id(out)] = self.kept[id(param)]
        return out


def kept_by_name(model: nn.Module, kept: Kept | None) -> dict[str, torch.Tensor]:
    """``kept`` under the model's parameter names (all of a tied parameter's): sharding
    replaces the parameter objects but keeps their names."""
    if not kept:
        return {}
    return {
        name: kept[id(p)]
        for name, p in model.named_parameters(remove_duplicate=False)
        if id(p) in kept
    }


def meta_model(task: Any) -> nn.Module:
    """The task's model built on the meta device: its structure, names and shapes, with
    no memory and no init (a 70B model builds as fast as a small one)."""
    with torch.device("meta"):
        model: nn.Module = task.build_model()
    return model


def materialize(model: nn.Module, device: torch.device) -> None:
    """Give a sharded model's meta parameters storage on ``device`` (each rank its shards),
    keeping the buffers' values (``to_empty`` would leave them undefined too)."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in model.modules():
        for name, p in own_params(m):
            owners.setdefault(id(p), []).append((m, name))
    model.to_empty(device=device)
    # to_empty gives each module a new parameter: tied ones (embeddings and head) would
    # come apart. Every owner gets the first one's again, as FSDP2 registers them.
    for (first, first_name), *others in owners.values():
        for m, name in others:
            m.register_parameter(name, getattr(first, first_name))
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


@dataclasses.dataclass(frozen=True)
class Share:
    """What a sharding writer keeps of a parameter on this rank, as a range of its full
    value's elements in row-major order (``start`` to ``end``): exactly its ZeRO-3
    partition, or the dim-0 rows that cover its DTensor slice; ``place`` writes it from
    those elements, as the writer would from the whole value."""

    start: int
    end: int
    place: Callable[[torch.Tensor], None]


def own_share(write: Writer, p: nn.Parameter) -> Share | None:
    """This rank's :class:`Share` of ``p`` where ``write`` shards it (``write_dtensor``,
    ``write_zero3``); None where the writer keeps the whole value, or needs it: a ZeRO-3
    parameter that is gathered, kept a second time (hpZ), swapped to NVMe or quantized."""
    from torch.distributed.tensor import DTensor

    if write is write_dtensor and isinstance(p, DTensor):
        return _dtensor_share(p)
    if write is write_zero3:
        return _zero3_share(p)
    return None


def _dtensor_share(p: Any) -> Share:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    full = tuple(p.shape)
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    row = math.prod(full[1:])  # elements a step along dim 0
    first, rows = (offset[0], shape[0]) if full else (0, 1)
    # Along the other dims the slice is cut from the rows, as write_dtensor cuts it.
    cut = tuple(slice(o, o + n) for o, n in zip(offset[1:], shape[1:], strict=True))

    def place(elements: torch.Tensor) -> None:
        piece = elements.view(rows, *full[1:])[(slice(None), *cut)] if full else elements.view(())
        with torch.no_grad():
            p.to_local().copy_(piece)

    return Share(first * row, (first + rows) * row, place)


def _zero3_share(p: Any) -> Share | None:
    import torch.distributed as dist
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    part = getattr(p, "ds_tensor", None)
    if (
        part is None
        or p.ds_status != ZeroParamStatus.NOT_AVAILABLE
        or getattr(p, "ds_secondary_tensor", None) is not None
        or getattr(part, "final_location", None) is not None
        or hasattr(part, "ds_quant_scale")
    ):
        return None
    # As DeepSpeed partitions: each rank the same padded count of elements, in rank order,
    # the last ones padding past the parameter's end (left as they are, as a gather and
    # repartition leaves them).
    size = int(part.ds_numel)
    start = min(size * dist.get_rank(group=p.ds_process_group), int(p.ds_numel))
    end = min(start + size, int(p.ds_numel))

    def place(elements: torch.Tensor) -> None:
        with torch.no_grad():
            part.narrow(0, 0, end - start).copy_(elements)

    return Share(start, end, place)


@contextlib.contextmanager
def whole(module: nn.Module, write: Writer, touched: dict[int, str], by: str) -> Iterator[None]:
    """``module``'s own parameters as whole host tensors while inside; written back after,
    each one it set recorded in ``touched`` as set ``by`` this pass."""
    swapped: dict[str, nn.Parameter] = {}
    for name, p in own_params(module):
        # Drawn in fp32 even for bf16 parameters, as an eagerly built model is
        # (it is initialised before the strategy casts it).
        dtype = torch.float32 if p.is_floating_point() else p.dtype
        # NaN marks "not set": what the init leaves alone keeps its earlier value.
        temp = torch.full(full_shape(p), math.nan, dtype=dtype, device="cpu")
        swapped[name] = p
        module.register_parameter(name, nn.Parameter(temp, requires_grad=p.requires_grad))
    try:
        yield
    finally:
        for name, original in swapped.items():
            drawn = getattr(module, name, None)
            module.register_parameter(name, original)
            assert drawn is not None, f"{name} was removed during its initialisation"
            if _is_set(module, name, drawn.detach()):
                write(original, drawn.detach())
                touched[id(original)] = by


def _is_set(module: nn.Module, name: str, drawn: torch.Tensor) -> bool:
    unset = torch.isnan(drawn)
    if bool(unset.all()):
        return False
    if bool(unset.any()):
        raise InitError(
            f"{type(module).__name__}.{name}: its initialisation set only part of it or "
            "read its earlier value; raylift initialises one module at a time from an "
            "unset tensor, so draw every element (nn.init.* functions do)"
        )
    return True


def _post_order(model: nn.Module) -> list[nn.Module]:
    """``model.apply``'s order: each module after its children."""
    out: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            visit(child)
        out.append(m)

    visit(model)
    return out


def own_params(m: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``m``'s own parameters (not its children's), every name of each."""
    return list(m.named_parameters(recurse=False, remove_duplicate=False))


def _own_params(m: nn.Module) -> bool:
    return bool(own_params(m))


InitFn = Callable[[nn.Module], None]


def init_function(model: nn.Module, task: Any) -> tuple[InitFn | None, str]:
    """The pass-3 function and its name: the task's ``init_weights``, else the
    ``_init_weights`` of each module's nearest enclosing Hugging Face ``PreTrainedModel``."""
    custom = getattr(task, "init_weights", None)
    if callable(custom):
        return custom, "the task's init_weights"
    owners = _pretrained_owners(model)
    if not owners:
        return None, ""

    def hf_init(module: nn.Module) -> None:
        owner = owners.get(id(module))
        if owner is not None:
            owner._init_weights(module)

    return hf_init, "the model's _init_weights"


def _pretrained_owners(model: nn.Module) -> dict[int, Any]:
    """id(module) -> the nearest PreTrainedModel holding it (itself included), for every
    module inside one; {} where transformers is not even imported."""
    if "transformers" not in sys.modules:
        return {}
    from transformers import PreTrainedModel

    owners: dict[int, Any] = {}

    def visit(m: nn.Module, owner: Any) -> None:
        owner = m if isinstance(m, PreTrainedModel) else owner
        if owner is not None:
            owners[id(m)] = owner
        for child in m.children():
            visit(child, owner)

    visit(model, None)
    return owners


def initialize(
    model: nn.Module,
    task: Any,
    seed: int,
    write: Writer,
    sharded: bool,
    kept: Mapping[str, torch.Tensor] | None = None,
) -> InitReport:
    """raylift's initial weights for ``model`` (see the module docstring).

    ``sharded``: the parameters hold no values yet (meta or partitioned). ``kept``: the
    constructor values :func:`params_on_meta` kept, by parameter name.
    """
    torch.manual_seed(seed)
    touched: dict[int, str] = {}
    for m in model.modules():
        reset = getattr(m, "reset_parameters", None)
        if callable(reset) and _own_params(m):
            with whole(m, write, touched, "reset"):
                reset()
    custom, name = init_function(model, task)
    if custom is not None:
        for m in _post_order(model):
            if _own_params(m):
                with whole(m, write, touched, "custom"):
                    custom(m)
    report = InitReport(custom_name=name, held_bytes=_bytes(kept))
    report.constructor = _constructor_values(model, write, touched, sharded, kept or {})
    report.reset = sum(by == "reset" for by in touched.values())
    report.custom = sum(by == "custom" for by in touched.values())
    return report


def _bytes(kept: Mapping[str, torch.Tensor] | None) -> int:
    unique = {id(t): t for t in (kept or {}).values()}
    return sum(t.numel() * t.element_size() for t in unique.values())


def _constructor_values(
    model: nn.Module,
    write: Writer,
    touched: Mapping[int, str],
    sharded: bool,
    kept: Mapping[str, torch.Tensor],
) -> int:
    """Every parameter no pass set gets its constructor's value; returns how many.

    Built eagerly or partitioned by ZeRO-3 as built, a parameter holds that value
    already; on the meta device, only where it was kept."""
    count, missed = 0, []
    for name, p in model.named_parameters():
        if id(p) in touched:
            continue
        if name in kept:
            write(p, kept[name])
        elif sharded and not hasattr(p, "ds_id"):
            missed.append(name)
            continue
        count += 1
    if missed:
        raise InitError(
            f"parameter(s) {missed[:5]} hold no value: a sharded strategy builds the model "
            "without storage, and the reset_parameters() of their module does not set them "
            "(so their constructor's values were not kept); set them in reset_parameters(), "
            "or give the task an init_weights(module) that sets them"
        )
    return count
