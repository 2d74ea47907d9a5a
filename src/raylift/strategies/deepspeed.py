"""DeepSpeed ZeRO (stages 0-3, optional CPU offload) behind raylift's engine seam.

DeepSpeed owns what it is built around: gradient accumulation, reduction,
clipping, mixed precision and the sharded optimizer step. raylift keeps its own
torch optimizer (DeepSpeed steps it on its partitions), so the loop's LR
schedule drives the very ``param_groups`` DeepSpeed reads.

The loop calls ``backward`` on every micro-batch and ``step`` once per
accumulation group; DeepSpeed counts micro-batches itself and applies the update
on the last one, so ``backward`` hands each micro-batch to DeepSpeed's
``backward`` + ``step`` and ``step`` has nothing left to do. ``deepspeed`` is
imported only when this strategy is built, never with raylift itself.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from raylift.core import storage
from raylift.core.config import Config
from raylift.core.errors import RefusedPickle
from raylift.core.parsing import merge
from raylift.strategies.base import (
    Write,
    apply_activation_checkpointing,
    host_copy,
    with_frozen,
    written,
)
from raylift.strategies.deepspeed_config import ds_config, hpz_size, problems, sized_buckets
from raylift.strategies.mesh import DataView, node_of_ranks
from raylift.strategies.registry import Parts, PlanRow, Shards, StrategySpec
from raylift.strategies.zero_files import (
    ENGINE_DIR,
    TAG,
    partition_of,
    partitions,
    rank_order,
    read_export,
)
from raylift.strategies.zero_layout import (
    fed,
    locate,
    saved_groups,
    saved_step,
    share,
    write_settings,
)
from raylift.tensors.checkpoints import CheckpointError
from raylift.tensors.init import Initializer, write_in_place, write_zero3
from raylift.tensors.lazytorch import load_lazy
from raylift.tensors.optim import build_optimizer
from raylift.tensors.pickles import load_torch
from raylift.tensors.precision import Precision
from raylift.tensors.ranged import Files

# Gradient storage DeepSpeed's ZeRO optimizers keep (names as in deepspeed/runtime/zero/).
_GRAD_ATTRS = ("averaged_gradients", "all_grad_tensors", "grads_in_partition")
_GRAD_ATTRS_STAGE3 = ("grad_partitions_flat_buffer",)
# fp32 master partitions, where DeepSpeed keeps them apart from the module's parameters.
_MASTER_ATTRS = (
    "single_partition_of_fp32_groups",  # ZeRO 1/2
    "fp32_partitioned_groups_flat",  # ZeRO 3
    "fp32_groups_flat_partition",  # BF16_Optimizer (bf16 without ZeRO)
    "fp32_groups_flat",  # FP16_Optimizer (fp16 without ZeRO)
    "fp32_groups",  # FP16_UnfusedOptimizer (bf16 without ZeRO)
)


def import_deepspeed(device_type: str) -> Any:
    """``deepspeed``, on the accelerator matching ``device_type`` ('cpu' or 'cuda').

    DeepSpeed picks its accelerator once per process, at import, from DS_ACCELERATOR.
    """
    wanted = "cpu" if device_type == "cpu" else "cuda"
    os.environ["DS_ACCELERATOR"] = wanted
    try:
        import deepspeed
    except ImportError as exc:
        raise ImportError(
            f"strategy deepspeed needs the deepspeed package ({exc}); install it with "
            "pip install 'raylift[deepspeed]', or choose another strategy.name"
        ) from exc
    from deepspeed.accelerator import get_accelerator

    have = get_accelerator().device_name()
    if have != wanted:
        raise RuntimeError(
            f"strategy deepspeed: this process already runs DeepSpeed on {have!r} but the "
            f"worker device is {wanted!r}; DeepSpeed picks one accelerator per process, so "
            "start a fresh worker process (or set DS_ACCELERATOR before anything imports it)"
        )
    return deepspeed


# ---------------------------------------------------------------- build


def build_deepspeed(
    model: nn.Module,
    cfg: Config,
    precision: Precision,
    device: torch.device,
    parts: Parts,
    init: Initializer,
) -> DeepSpeedEngine:
    hpz, layout = hierarchy(cfg)
    config = ds_config(cfg, precision, hpz)  # its problems before the slow import
    deepspeed = ready_deepspeed(device)
    init(write_zero3 if cfg.strategy.zero_stage == 3 else write_in_place)
    buckets = {"zero_optimization": sized_buckets(model, parts.blocks, cfg.strategy.zero_stage)}
    config = merge(merge(config, buckets), cfg.strategy.config)  # the user's keys still win
    if cfg.strategy.activation_checkpointing:
        apply_activation_checkpointing(parts.blocks)
    # DeepSpeed casts to its own precision (fp16/bf16 sections); raylift only places it.
    model = model.to(device)
    # ZeRO's offload keeps the fp32 master and moments on the CPU: no fused CUDA kernel.
    offloaded = cfg.strategy.offload or cfg.strategy.offload_optimizer
    optimizer = build_optimizer(model, cfg.optim, fused=not offloaded)
    # Which device DeepSpeed binds is raylift's choice (Ray may share CUDA_VISIBLE_DEVICES).
    args = argparse.Namespace(device_rank=(device.index or 0) if device.type == "cuda" else 0)
    ds_engine, _, _, _ = deepspeed.initialize(
        args=args,
        model=model,
        optimizer=optimizer,
        config=config,
        dist_init_required=False,  # the run's gloo/nccl group is already up
    )
    if not (cfg.strategy.offload or cfg.strategy.offload_optimizer):
        share_fp32_master(ds_engine.optimizer)
    engine = DeepSpeedEngine(ds_engine, optimizer, precision, cfg.train.grad_clip)
    engine.layout = layout
    return engine


def hierarchy(cfg: Config) -> tuple[int, str]:
    """ZeRO-3's hpZ partition size over the nodes Ray placed the ranks on, and the line
    that says so (collective at stage 3: every rank asks)."""
    if cfg.strategy.zero_stage != 3 or cfg.strategy.hpz is False:
        return 1, ""
    return hpz_size(cfg, node_of_ranks())


def share_fp32_master(optimizer: Any) -> None:
    """One copy of the weights where the model trains in fp32.

    ZeRO keeps an fp32 master of each rank's partition for the optimizer to update.
    When the weights already are fp32 that is a second copy of the partition: ZeRO-1/2
    always clone it, and ZeRO-3 means not to but compares a ``torch.device`` with a
    string, which is never equal. Pointing the master at the partition's own storage
    keeps every value and saves 4 bytes per parameter held (ZeRO-3, fp32 Adam, 2
    ranks: 10 -> 8 bytes per parameter, the ZeRO paper's 0.5 of DDP). DeepSpeed's
    copy from master to weights after each step then copies a buffer onto itself.
    """
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    if hasattr(optimizer, "single_partition_of_fp32_groups"):  # ZeRO-1/2
        for i, master in enumerate(optimizer.single_partition_of_fp32_groups):
            rank = dist.get_rank(group=optimizer.real_dp_process_group[i])
            pairs.append((master, optimizer.parallel_partitioned_bit16_groups[i][rank]))
    elif hasattr(optimizer, "fp32_partitioned_groups_flat"):  # ZeRO-3
        pairs = list(
            zip(
                optimizer.fp32_partitioned_groups_flat,
                optimizer.fp16_partitioned_groups_flat,
                strict=True,
            )
        )
    shared = False
    for master, own in pairs:
        if (
            master.dtype == own.dtype
            and master.device == own.device
            and master.shape == own.shape
            and master.untyped_storage().data_ptr() != own.untyped_storage().data_ptr()
        ):
            master.data = own.data  # the optimizer's state stays keyed by the same tensor
            shared = True
    if shared and hasattr(optimizer, "_link_all_hp_params"):
        # ZeRO-1/2 keep views of the master per parameter (universal checkpoints read
        # and write through them): make them again, over the shared storage.
        optimizer._link_all_hp_params()


def create(cfg: Config, precision: Precision, device: torch.device) -> Any:
    """ZeRO-3 partitions each parameter as its module is built: no rank ever holds the
    whole model (``deepspeed.zero.Init``); other stages build it whole."""
    if cfg.strategy.zero_stage != 3:
        return contextlib.nullcontext()
    config = ds_config(cfg, precision, hierarchy(cfg)[0])
    deepspeed = ready_deepspeed(device)
    forget_hpz_group()
    # zero.Init replaces torch.Tensor.__new__ while inside; torch._dynamo, imported for the
    # first time there (transformers imports it with its models, often inside a task's
    # build_model), checks that signature and refuses to load. Imported first, it loads.
    import torch._dynamo  # noqa: F401

    offload = config["zero_optimization"].get("offload_param", {}).get("device") == "cpu"
    return deepspeed.zero.Init(config_dict_or_path=config, remote_device="cpu" if offload else None)


def forget_hpz_group() -> None:
    """DeepSpeed keeps hpZ's node group in a module global, refuses to make a second
    one and hands the first to every later ZeRO-3 engine: a process that builds another
    (a restart in the same worker, a second run) starts from none. Reset only on the
    world's teardown otherwise; pinned to deepspeed<0.20 (test_library_private)."""
    from deepspeed.utils import groups

    groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None


def ready_deepspeed(device: torch.device) -> Any:
    """``deepspeed`` on the run's accelerator, wrapping the run's process group."""
    deepspeed = import_deepspeed(device.type)
    use_the_run_process_group()
    # DeepSpeed insists on LOCAL_RANK (Ray Train and torchrun set it). In a bare process
    # group the global rank is the one value that cannot collide with another rank's.
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    return deepspeed


def use_the_run_process_group() -> None:
    """Have DeepSpeed wrap the process group the run already opened, and add nothing.

    It wraps the run's group when its accelerator names gloo or nccl; with
    oneccl_bindings_for_pytorch installed the CPU accelerator names 'ccl' instead, and
    DeepSpeed would open a oneCCL world of its own beside the run's group.
    """
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        return
    if accelerator.communication_backend_name() == "ccl":
        accelerator._communication_backend_name = dist.get_backend()
    # On the CPU, wrapping the group JIT-compiles a shared-memory all-reduce that only
    # DeepSpeed inference calls; marking it unavailable (DeepSpeed keeps this dict for
    # such edits) spares every fresh machine that compile.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


# ---------------------------------------------------------------- engine


def leave_out_tied_frozen(ds_engine: Any) -> None:
    """Make ``save_checkpoint(exclude_frozen_parameters=True)`` leave a frozen weight out
    under every name: DeepSpeed drops the names ``named_parameters`` gives, which lists a
    tied weight once, so a tied head of a frozen base (adapters) would be saved whole."""
    saved = ds_engine.module_state_dict

    def module_state_dict(*args: Any, exclude_frozen_parameters: bool = False, **kw: Any) -> Any:
        sd = saved(*args, exclude_frozen_parameters=exclude_frozen_parameters, **kw)
        if exclude_frozen_parameters:
            for name, p in ds_engine.module.named_parameters(remove_duplicate=False):
                if not p.requires_grad:
                    sd.pop(name, None)
        return sd

    ds_engine.module_state_dict = module_state_dict


def part_files(config: Any) -> Any:
    """DeepSpeed's checkpoint engine for raylift: a save can hold its files in host memory
    to write them later (``holding``, then ``write_held`` from any thread), and a load
    takes files already read (``loaded``, by path, kept until the load is over) before it
    opens any itself."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    class PartFiles(TorchCheckpointEngine):
        def __init__(self) -> None:
            super().__init__(config)
            self.holding = False
            self.held: dict[str, Any] = {}
            self.loaded: dict[str, Any] = {}

        def preserves_storage_sharing(self) -> bool:
            # Held files are copied tensor by tensor (a view alone); written ones as
            # DeepSpeed's own engine writes them.
            return not self.holding

        def save(self, state_dict: Any, path: str) -> None:
            if self.holding:
                self.held[path] = host_copy(state_dict)
            else:
                super().save(state_dict, path)

        def write_held(self) -> dict[str, list[int]]:
            while self.held:
                path, state = self.held.popitem()  # each copy freed once it is written
                super().save(state, path)
            return {}

        def load(self, path: str, map_location: Any = None) -> Any:
            if path in self.loaded:
                # ZeRO-3 loads its model states twice; each caller may edit its dict.
                found = self.loaded[path]
                return dict(found) if isinstance(found, dict) else found
            # DeepSpeed's own engine loads with weights_only=False: never here.
            with open(path, "rb") as f:
                return load_torch(f, path, map_location or "cpu")

    return PartFiles()


class DeepSpeedEngine:
    """The loop's :class:`~raylift.strategies.base.Engine` over a DeepSpeed engine."""

    def __init__(
        self,
        ds_engine: Any,
        optimizer: torch.optim.Optimizer,
        precision: Precision,
        grad_clip: float | None,
    ):
        self.ds = ds_engine
        leave_out_tied_frozen(ds_engine)
        self.files = part_files(ds_engine._config)
        ds_engine.checkpoint_engine = self.files
        self.model: nn.Module = ds_engine  # its forward gathers ZeRO-3 params and autocasts
        # raylift's torch optimizer, the one DeepSpeed steps: the loop's LambdaLR writes the
        # lr into the param_groups DeepSpeed reads (DeepSpeed's ZeRO wrapper is no
        # torch Optimizer, which LambdaLR insists on).
        self.optimizer = optimizer
        self.precision = precision
        self.stage = int(ds_engine.zero_optimization_stage())
        # ZeRO-3 all-gathers parameters into place during forward: no inference tensors.
        self.inference_mode_ok = self.stage < 3
        self._clipping = bool(grad_clip)
        self._grad_bytes = 0
        # DeepSpeed's fp16 loss scaler skips non-finite steps itself (the config allows
        # train.on_nan: skip with deepspeed only there); skipped_steps reads its count.
        self.skip_nonfinite = False
        self.layout = ""
        self.replicas: tuple[tuple[int, ...], ...] = ()
        self.data_view: DataView | None = None  # data parallel: each rank reads its own rows

    @property
    def skipped_steps(self) -> int:
        return int(self.ds.skipped_steps)

    @property
    def eval_model(self) -> nn.Module:
        return self.ds

    def sync(self, enabled: bool) -> contextlib.AbstractContextManager[None]:
        # DeepSpeed counts micro-batches and reduces at its own accumulation boundary.
        return contextlib.nullcontext()

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        # DeepSpeed's forward applies its precision (torch_autocast / fp16 / bf16) itself.
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        # The loop already divided by grad_accum: DeepSpeed must not divide again.
        self.ds.backward(loss, scale_wrt_gas=False)
        self._grad_bytes = max(self._grad_bytes, self._held_grad_bytes())
        # A no-op until DeepSpeed's own micro-batch count reaches the accumulation
        # boundary, which is where the loop calls step(): both count the same batches.
        self.ds.step()

    def step(self) -> torch.Tensor | None:
        """The update already happened in the last ``backward``; returns its pre-clip norm."""
        if not self._clipping:
            return None
        norm = self.ds.get_global_grad_norm()
        return None if norm is None else torch.as_tensor(norm, dtype=torch.float32)

    # ------------------------------------------------------------ memory

    def _module_params(self) -> list[nn.Parameter]:
        return list(self.ds.module.parameters())

    def _held_grad_bytes(self) -> int:
        opt = self.ds.optimizer
        found: list[Any] = [p.grad for p in self._module_params()]
        attrs = _GRAD_ATTRS + (_GRAD_ATTRS_STAGE3 if self.stage == 3 else ())
        found += [getattr(opt, name, None) for name in attrs]
        found += [getattr(t, "grad", None) for t in self._master_partitions()]
        return storage_bytes(_tensors_in(found))

    def _master_partitions(self) -> list[torch.Tensor]:
        opt = self.ds.optimizer
        return list(_tensors_in([getattr(opt, name, None) for name in _MASTER_ATTRS]))

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of the storage this rank holds, each buffer counted once, in ZeRO's terms.

        ``params``: the module's weights (its partition ``ds_tensor`` at stage 3, hpZ's
        partition within the node where it has one, plus any parameters ZeRO-3 keeps
        whole). ``grads``: the most gradient storage held after
        any backward so far. ``optimizer``: the optimizer's state plus DeepSpeed's fp32
        master partition, which ZeRO counts as optimizer state and shards with it (from
        stage 1 DeepSpeed keeps one even when training in fp32).
        """
        weights: dict[bool, list[Any]] = {True: [], False: []}
        for p in self._module_params():
            weights[p.requires_grad].append(getattr(p, "ds_tensor", None))
            # hpZ's partition within the node, beside the one over all ranks.
            weights[p.requires_grad].append(getattr(p, "ds_secondary_tensor", None))
            # Empty at stage 3 unless DeepSpeed keeps it gathered.
            weights[p.requires_grad].append(p.data)
        seen: set[int] = set()
        params = storage_bytes(_tensors_in(weights[True]), seen)
        frozen = storage_bytes(_tensors_in(weights[False]), seen)
        states = [v for st in self.optimizer.state.values() for v in st.values()]
        # `seen`: a master partition that is the module's own storage is not a second copy.
        optimizer = storage_bytes(_tensors_in([states, self._master_partitions()]), seen)
        held = {"params": params, "grads": self._grad_bytes, "optimizer": optimizer}
        return with_frozen(held, frozen)

    # ------------------------------------------------------------ checkpoints

    def save(self, directory: Path, copy: bool, replica: bool = False) -> Write:
        if replica:
            raise ValueError("ZeRO partitions the state over every rank: it has no whole copies")
        folder = directory / ENGINE_DIR
        # DeepSpeed lets rank 0 create the folder; with per-rank local folders each makes its own.
        folder.mkdir(parents=True, exist_ok=True)
        self.files.holding = copy
        try:
            # A frozen base (adapters) is never saved: it comes from its own weights at start.
            self.ds.save_checkpoint(str(folder), tag=TAG, exclude_frozen_parameters=True)
        finally:
            self.files.holding = False
        # A rank reads whole files (its own partitions and the shared ones): no item starts.
        return self.files.write_held if copy else written({})

    def load(self, files: Files) -> None:
        names = files.names(ENGINE_DIR)
        saved = partitions(names)
        world = dist.get_world_size()
        if saved is None or saved == world:
            # DeepSpeed opens paths: this rank's own partition files and the shared ones
            # come to this machine (checked as they are read), not the other ranks'.
            rank = dist.get_rank()
            # Its own partitions and the shared files DeepSpeed loads (not `latest` and
            # the zero_to_fp32.py script DeepSpeed writes beside them).
            mine = [n for n in names if n.endswith(".pt") and partition_of(n) in (None, rank)]
            self._load_read(files, mine)
            return
        self._load_resharded(files, names)

    def _load_resharded(self, files: Files, names: list[str]) -> None:
        """ZeRO partitions laid out for another world size: DeepSpeed's universal load,
        fed this rank's share of each weight's master copy and moments, read by range from
        the saved partitions and checked before DeepSpeed starts (zero_layout)."""
        # The model states DeepSpeed's universal load opens: the shared file, or rank 0's.
        shared = [n for n in names if n.endswith("model_states.pt") and not partition_of(n)]
        loaded = files.load_each(shared, load_torch)
        stage = self.ds.zero_optimization_stage()
        optim = sorted((n for n in names if n.endswith("optim_states.pt")), key=rank_order)
        got: Any = {}
        problem: str | RefusedPickle | None = None
        try:
            parts = [
                load_lazy(cast(IO[bytes], files.open(n)))["optimizer_state_dict"] for n in optim
            ]
            saved = locate(loaded[min(shared, key=rank_order)], parts)
            got = share(self.ds.optimizer, stage, saved)
            step, groups = saved_step(parts), saved_groups(parts)
        except CheckpointError as exc:
            problem = str(exc)
        except RefusedPickle as exc:  # as itself on every rank: never passed over
            problem = exc
        files.agree(problem)
        with storage.scratch("ds-names") as tmp:
            root = Path(tmp)
            for name in shared:
                (root / name).parent.mkdir(parents=True, exist_ok=True)
                (root / name).touch()
            write_settings(root / ENGINE_DIR / TAG, parts)
            self.files.loaded = {str(root / n): obj for n, obj in loaded.items()}
            try:
                with fed(self.ds.optimizer, stage, got, step, groups):
                    self._load(root / ENGINE_DIR, universal_format=True)
            finally:
                self.files.loaded = {}

    def _load_read(self, files: Files, names: list[str]) -> None:
        """DeepSpeed's load, its files read once, straight from the checkpoint: each is
        loaded and checked before DeepSpeed starts (whose collectives no rank may leave
        midway), then handed to it by path. Empty files stand in for them on local disk,
        as DeepSpeed finds its model states by listing the folder."""
        loaded = files.load_each(names, load_torch)
        with storage.scratch("ds-names") as tmp:
            root = Path(tmp)
            for name in names:
                (root / name).parent.mkdir(parents=True, exist_ok=True)
                (root / name).touch()
            self.files.loaded = {str(root / n): obj for n, obj in loaded.items()}
            del loaded
            try:
                self._load(root / ENGINE_DIR)
            finally:
                self.files.loaded = {}

    def _load(self, folder: Path, universal_format: bool = False) -> None:
        config = self.ds._config
        before = config.load_universal_checkpoint
        # Read by load_checkpoint only, so it can be switched for this one load.
        config.load_universal_checkpoint = universal_format
        try:
            path, _ = self.ds.load_checkpoint(
                str(folder),
                tag=TAG,
                load_optimizer_states=True,
                load_lr_scheduler_states=False,  # the loop restores its own schedule
                load_module_strict=not self._frozen(),  # a frozen base is not in it
            )
        finally:
            config.load_universal_checkpoint = before
        if path is None:  # DeepSpeed only warns when it finds nothing
            raise CheckpointError(
                f"{folder}: no DeepSpeed checkpoint with tag {TAG!r} there; the folder is "
                "incomplete (a rank's files missing?): resume from an earlier checkpoint"
            )

    def _frozen(self) -> bool:
        return any(not p.requires_grad for p in self.ds.module.parameters())

    def extra_state(self) -> dict[str, Any]:
        return {}  # the fp16 loss scale lives in DeepSpeed's own checkpoint

    def load_extra_state(self, state: dict[str, Any]) -> None:
        pass


# ---------------------------------------------------------------- byte counting


def _tensors_in(objs: Iterable[Any]) -> Iterator[torch.Tensor]:
    """Tensors in ``objs``, looking inside the lists and dicts DeepSpeed keeps them in."""
    for obj in objs:
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, (list, tuple)):
            yield from _tensors_in(obj)
        elif isinstance(obj, dict):
            yield from _tensors_in(obj.values())


def storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors``, skipping (and adding to) ``seen``:
    DeepSpeed hands out views of flat buffers, and the memory held is the buffer, once."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in seen:
            continue
        seen.add(ptr)
        total += storage.nbytes()
    return total


# ---------------------------------------------------------------- registration

NAME = "deepspeed"


def _zero_row(
    label: str, stage: int, shards: Shards, comm_rank: int, offload: bool = False
) -> PlanRow:
    strategy: dict[str, Any] = {"name": NAME, "zero_stage": stage}
    if offload:
        strategy.update(offload_optimizer=True, offload_param=True)
    # ZeRO-3 with sized_buckets: two blocks live (stage3_max_live_parameters), one
    # prefetched and a reduce bucket of one block.
    buffers = 4 if stage == 3 else 0
    # ZeRO keeps an fp32 master copy of each rank's partition, counted as optimizer state.
    return PlanRow(
        label,
        strategy,
        shards,
        comm_rank,
        fp32_master=True,
        offload=offload,
        block_buffers=buffers,
        gathers=stage == 3,
        hpz=stage == 3,  # strategy.hpz: auto
    )


SPEC = StrategySpec(
    name=NAME,
    state_format=NAME,
    options=("zero_stage", "offload", "offload_optimizer", "offload_param", "hpz", "config"),
    problems=problems,
    build=build_deepspeed,
    read_export=read_export,
    create=create,
    build_path="partitioned as built (deepspeed.zero.Init), then initialised module by module",
    plan_rows=(
        _zero_row("zero1", 1, Shards(False, False, True), comm_rank=1),
        _zero_row("zero2", 2, Shards(False, True, True), comm_rank=3),
        _zero_row("zero3", 3, Shards(True, True, True), comm_rank=5),
        _zero_row("zero3-offload", 3, Shards(True, True, True), comm_rank=6, offload=True),
    ),
    extras=("deepspeed>=0.19,<0.20",),  # as pyproject.toml bounds it
)
