"""The engine seam: what the training loop asks of every strategy.

An engine owns the wrapped model and its optimizer and knows how to run one
micro-step's backward, one optimizer step, and how to save and load its
sharded state. The loop never branches on the strategy.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from raylift.strategies.mesh import DataView
from raylift.tensors.precision import Precision
from raylift.tensors.ranged import Files, dcp_planner, dcp_reader, together
from raylift.tensors.streaming import DCPModel

# Writes a part taken by ``save`` (from any thread); where each item starts, by file.
Write = Callable[[], dict[str, list[int]]]


def written(starts: dict[str, list[int]]) -> Write:
    """The :data:`Write` of a part already written, with where its items start."""
    return lambda: starts


class Engine(Protocol):
    model: nn.Module  # call this in training forward passes
    optimizer: torch.optim.Optimizer
    precision: Precision
    inference_mode_ok: bool  # False: evaluate under no_grad instead of inference_mode
    skip_nonfinite: bool  # train.on_nan: skip -- step() leaves the weights alone on inf/NaN grads
    layout: str  # how the ranks are arranged, for the run's first lines ("" where nothing to say)
    # Where a tensor-parallel group trains on one batch: which rows this rank reads.
    # None: each rank reads its own (data parallel).
    data_view: DataView | None
    # The ranks of each whole copy of the state, one node's ranks each (HSDP by node):
    # ``save(replica=True)`` writes a copy among them alone. (): no such copies.
    replicas: tuple[tuple[int, ...], ...]

    @property
    def skipped_steps(self) -> int:
        """Updates skipped for non-finite gradients so far."""
        ...

    @property
    def eval_model(self) -> nn.Module: ...

    def sync(self, enabled: bool) -> contextlib.AbstractContextManager[None]:
        """Gradient synchronisation on (last micro-step) or off (accumulating)."""
        ...

    def autocast(self) -> contextlib.AbstractContextManager[None]: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self) -> torch.Tensor | None:
        """Clip, step, zero grads; returns the pre-clip gradient norm when clipping.

        With ``skip_nonfinite`` a step whose gradient norm is inf/NaN zeroes the
        gradients instead of updating, and counts in ``skipped_steps``."""
        ...

    def save(self, directory: Path, copy: bool, replica: bool = False) -> Write:
        """Collective: every rank takes its part of model + optimizer state. With ``copy``
        the part is copied to host memory now and the returned call writes it into
        ``directory``, from any thread, while training changes the state; without, the
        part is written now. The call returns where each item (tensor) starts in the
        files this rank wrote, by name, where the format says. ``replica``: the ranks of
        each of ``replicas`` write a whole copy of the state among themselves."""
        ...

    def load(self, files: Files) -> None:
        """Collective: every rank reads back what it needs of the model + optimizer state."""
        ...

    def extra_state(self) -> dict[str, Any]: ...

    def load_extra_state(self, state: dict[str, Any]) -> None: ...

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds in ``params``, ``grads`` and ``optimizer`` state, counted
        from the tensors themselves (local shards only); ``grads`` as of the last step."""
        ...


class StateIO(Protocol):
    """How an engine's model + optimizer state is written to and read from a folder."""

    def save(self, folder: Path, copy: bool) -> Write: ...

    def load(self, files: Files, folder: str) -> None:
        """Read back from the checkpoint's ``folder`` (``engine``)."""
        ...


class DCPState:
    """torch.distributed.checkpoint: each rank writes its shards; loading reshards, so a
    checkpoint from N ranks loads on M (DDP replicas and FSDP2 shards alike)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        self.model, self.optimizer = model, optimizer
        # A frozen base (adapters) is never saved: it comes from its own weights at start.
        frozen = any(not p.requires_grad for p in model.parameters())
        self.options = StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)
        self._group: Any = None  # a gloo group of its own for writes from a thread

    def _state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The model's and the optimizer's state, the frozen base left out (under every
        name: a tied head is a frozen weight's second name, which the options miss)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self.options)
        frozen = {_local(p).data_ptr() for p in self.model.parameters() if not p.requires_grad}
        frozen.discard(0)  # an empty shard is no storage to match
        if frozen:
            model_sd = {k: v for k, v in model_sd.items() if _local(v).data_ptr() not in frozen}
        return model_sd, optim_sd

    def save(self, folder: Path, copy: bool, group: Any = None) -> Write:
        """``group``: the ranks that write a whole checkpoint among themselves (a gloo
        group; a replica of HSDP); None: every rank of the run, each item written once."""
        import torch.distributed.checkpoint as dcp

        model_sd, optim_sd = self._state()
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        if not copy:
            writer = _recording_writer(folder)
            dcp.save(state, storage_writer=writer, process_group=group)
            return written(_starts(folder, writer.written))
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        # Plain host memory: pinned buffers would copy faster from a GPU, but pinning
        # a rank's whole part for every save costs more than it saves on the copy.
        stager = DefaultStager(StagingOptions(False, False, False, False))
        try:
            staged = stager.stage(state)  # DTensors stay DTensors, their shards copied
        finally:
            stager.close()
        group = group or self._writer_group()

        def write() -> dict[str, list[int]]:
            # DCP's planning is collective: on its own group, beside the loop's traffic.
            writer = _recording_writer(folder)
            dcp.save(staged, storage_writer=writer, process_group=group)
            return _starts(folder, writer.written)

        return write

    def _writer_group(self) -> Any:
        """Collective on first use (every rank saves together): the group that writes
        from a thread, so its collectives never interleave with the loop's."""
        import torch.distributed as dist

        if self._group is None and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")
        return self._group

    def load(self, files: Files, folder: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        model_sd, optim_sd = self._state()
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        # Its .metadata read, and checked, by every rank before DCP's collectives.
        reader = together(files, lambda: dcp_reader(files, folder))
        # DCP's planner picks the ranges this rank's shards need; only those are read.
        try:
            dcp.load(state, storage_reader=reader, planner=dcp_planner())
        except dcp.CheckpointException as exc:
            raise first_failure(exc) from None
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=self.options,
        )


def _recording_writer(folder: Path) -> Any:
    """DCP's file writer, keeping the results of this rank's own writes: where each item
    it wrote starts. (The Metadata ``dcp.save`` returns is no source: under torch 2.11,
    on a GPU machine, its ``storage_data`` was None.)"""
    from torch.distributed.checkpoint import FileSystemWriter

    class Recording(FileSystemWriter):
        written: list[Any]

        def write_data(self, plan: Any, planner: Any) -> Any:
            done = super().write_data(plan, planner)
            self.written = done.wait()
            return done

    writer = Recording(folder)
    writer.written = []
    return writer


def _starts(folder: Path, results: list[Any]) -> dict[str, list[int]]:
    """Where each item this rank wrote starts, by file."""
    starts: dict[str, list[int]] = {}
    for result in results:
        info = result.storage_data
        starts.setdefault(f"{folder.name}/{info.relative_path}", []).append(info.offset)
    return starts


def host_copy(obj: Any, memo: dict[int, Any] | None = None) -> Any:
    """``obj`` with every tensor in it copied to host memory (a tensor reached twice is
    copied once); dicts, lists and tuples rebuilt, anything else kept as it is."""
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            # A view is copied alone: the copy never holds the rest of its storage.
            memo[id(obj)] = obj.detach().to("cpu", copy=True)
        return memo[id(obj)]
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps its type: an OrderedDict, a defaultdict's factory
        for k, v in obj.items():
            out[k] = host_copy(v, memo)
        return out
    if isinstance(obj, list):
        return [host_copy(v, memo) for v in obj]
    if isinstance(obj, tuple):
        values = [host_copy(v, memo) for v in obj]
        return type(obj)(*values) if hasattr(obj, "_fields") else type(obj)(values)
    return obj


def _local(t: Any) -> torch.Tensor:
    """A DTensor's shard on this rank; any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def first_failure(exc: Any) -> Exception:
    """The error one rank of a DCP load hit, as it was raised there (a checksum mismatch
    names the file), rather than DCP's every-rank report with its tracebacks. DCP's
    exception is a BaseException: passed on, it would escape every ``except Exception``."""
    for _, (failure, _trace) in sorted(exc.failures.items()):
        if isinstance(failure, Exception):
            return failure
    return RuntimeError(str(exc))


def tied_names(model: nn.Module) -> dict[str, str]:
    """Each tied weight's later names -> the first it is listed under, as its
    ``state_dict`` names them (``model`` unwrapped: no DDP ``module.`` prefix)."""
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied[name] = first[id(param)]
        else:
            first[id(param)] = name
    return tied


def read_dcp_model(files: Any) -> DCPModel:
    """The model of a :class:`DCPState` checkpoint (a ``CheckpointReader``), one tensor at
    a time, reading only the model's ranges."""
    return DCPModel(files)


class TorchEngine:
    """Engine for torch-native wrappers (DDP, FSDP2, ZeRO optimizers).

    What differs between them is passed in rather than subclassed: how gradient
    sync is paused during accumulation, which module evaluates, whether autocast
    runs (FSDP2 casts parameters itself), the loss scaler and how grads are zeroed.
    """

    def __init__(
        self,
        model: nn.Module,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        precision: Precision,
        device: torch.device,
        grad_clip: float | None,
        *,
        pause_sync: Callable[[], contextlib.AbstractContextManager[None]] | None = None,
        eval_module: nn.Module | None = None,
        use_autocast: bool = True,
        scaler: Any = "default",
        grads_to_none: bool = True,
        inference_mode_ok: bool = True,
        state_io: StateIO | None = None,
        clip: Callable[[float], torch.Tensor] | None = None,
        layout: str = "",
        data_view: DataView | None = None,
        replicas: tuple[tuple[int, ...], ...] = (),
    ):
        self.model, self.module, self.optimizer = model, module, optimizer
        self.precision, self.device, self.grad_clip = precision, device, grad_clip
        self._pause_sync = pause_sync
        self._eval_module = eval_module if eval_module is not None else module
        self._use_autocast = use_autocast
        self.scaler = precision.grad_scaler(device) if scaler == "default" else scaler
        self._grads_to_none = grads_to_none
        self.inference_mode_ok = inference_mode_ok
        self._grad_bytes = 0
        self._state_io = state_io or DCPState(model, optimizer)
        self._clip = clip or (
            lambda max_norm: nn.utils.clip_grad_norm_(module.parameters(), max_norm)
        )
        self.skip_nonfinite = False
        self.skipped_steps = 0
        self.layout = layout  # the run's line on how its ranks are arranged (FSDP's mesh)
        self.data_view = data_view
        self.replicas = replicas
        self._replica_group: Any = None  # this rank's replica's gloo group, made on first use

    @property
    def eval_model(self) -> nn.Module:
        return self._eval_module

    def sync(self, enabled: bool) -> contextlib.AbstractContextManager[None]:
        if enabled or self._pause_sync is None:
            return contextlib.nullcontext()
        return self._pause_sync()

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        if not self._use_autocast:
            return contextlib.nullcontext()
        return self.precision.autocast(self.device)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self) -> torch.Tensor | None:
        norm = None
        if self.grad_clip is not None or self.skip_nonfinite:
            if self.scaler:
                self.scaler.unscale_(self.optimizer)
            # max_norm inf measures the global norm (across shards) without clipping.
            norm = self._clip(self.grad_clip if self.grad_clip is not None else math.inf)
        # GradScaler skips non-finite steps by itself; otherwise checking costs the one
        # host sync per step that train.on_nan: skip asks for.
        if self.skip_nonfinite and not self.scaler and norm is not None and not norm.isfinite():
            self.skipped_steps += 1
            self.optimizer.zero_grad(set_to_none=self._grads_to_none)
            return norm
        if self.scaler:
            # Skips the update (and lowers the scale) when a gradient is inf/NaN.
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self._grad_bytes = max(self._grad_bytes, tensor_bytes(p.grad for p in self._params()))
        self.optimizer.zero_grad(set_to_none=self._grads_to_none)
        return norm

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def model_state_bytes(self) -> dict[str, int]:
        # A sharded optimizer (fairscale OSS) keeps its partition's state in the inner optimizer.
        inner = getattr(self.optimizer, "optim", self.optimizer)
        states = inner.state.values()
        params = list(self.module.parameters())
        held = {
            "params": tensor_bytes(p for p in params if p.requires_grad),
            "grads": self._grad_bytes,
            "optimizer": tensor_bytes(v for st in states for v in st.values()),
        }
        return with_frozen(held, tensor_bytes(p for p in params if not p.requires_grad))

    def save(self, directory: Path, copy: bool, replica: bool = False) -> Write:
        if not replica:
            return self._state_io.save(directory / "engine", copy)
        if not isinstance(self._state_io, DCPState) or not self.replicas:
            raise ValueError("this engine's state has no whole copies on groups of its ranks")
        return self._state_io.save(directory / "engine", copy, self._replica())

    def _replica(self) -> Any:
        """Collective on first use (every rank saves together): this rank's replica's
        gloo group, which writes its copy from a thread beside the loop's traffic."""
        import torch.distributed as dist

        if self._replica_group is None:
            groups = [list(ranks) for ranks in self.replicas]
            self._replica_group, _ = dist.new_subgroups_by_enumeration(groups, backend="gloo")
        return self._replica_group

    def load(self, files: Files) -> None:
        self._state_io.load(files, "engine")

    def extra_state(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"scaler": self.scaler.state_dict()} if self.scaler else {}
        if isinstance(self._state_io, DCPState):
            # DCP saves a tied weight under each name, as entries of their own: the
            # export reads which are one weight from here (``torch.save`` shows it).
            extra["tied"] = tied_names(self.module)
        return extra

    def load_extra_state(self, state: dict[str, Any]) -> None:
        if self.scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


def apply_activation_checkpointing(blocks: list[nn.Module]) -> None:
    """Recompute each block in backward: only one block's activations are alive at a time."""
    for block in blocks:
        block.forward = _checkpointed(block.forward)


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def with_frozen(held: dict[str, int], frozen: int) -> dict[str, int]:
    """``held`` with the frozen weights (a base under adapters) as their own entry, where
    there are any: they hold no gradient and no optimizer state."""
    return {**held, "frozen": frozen} if frozen else held


def tensor_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the local data of ``tensors``: a DTensor counts its shard, a tied tensor once."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        key = local.data_ptr()  # tied weights are one tensor; bucket views are not
        if key in seen and key != 0:
            continue
        seen.add(key)
        total += local.numel() * local.element_size()
    return total
