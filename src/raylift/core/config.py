"""The run configuration's schema: one small dataclass per section, each checking its own
values in ``problems()``.

:mod:`raylift.core.parsing` builds them from a plain dict, collecting unknown keys,
wrong types and bad values; :mod:`raylift.validation` adds what only the strategy,
precision and task registries know, and raises every problem at once in a single
:class:`ConfigError`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from raylift.core.parsing import (
    as_dict,
    build_dataclass,
    local_path,
    merge,
    parse_overrides,
    read_yaml,
)

# Not a strategy: `raylift plan`'s choice for the run's world size and devices.
AUTO = "auto"
OPTIMIZERS = ("adamw", "adam", "sgd")
SCHEDULES = ("cosine", "constant")


class ConfigError(ValueError):
    """A config with one or more problems; ``problems`` lists each as 'key: what is wrong'."""

    def __init__(self, problems: Sequence[str] | str):
        if isinstance(problems, str):  # rebuilt from its message (Ray re-raising it)
            listed = [ln[4:] for ln in problems.splitlines() if ln.startswith("  - ")]
            problems = listed or [problems]
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s) in the config:\n{lines}")

    def __reduce__(self) -> tuple[type, tuple[list[str]]]:
        return type(self), (self.problems,)


class EnvironmentProblem(ValueError):
    """A setting outside the config (an environment variable) that cannot work; the
    message names it and the fix."""


@dataclasses.dataclass
class DataConfig:
    batch_size: int = 64  # rows per worker per micro-batch
    eval_batch_size: int | None = None  # rows per worker per evaluation batch; null: batch_size
    prefetch_batches: int = 4  # batches each worker reads ahead on a thread; 0: none
    shuffle: bool = True  # a new seeded order of row groups, and of rows in each, every epoch
    shards: str | None = None  # prepared by `raylift prep`; unset: prepared under storage/shards
    cache: bool = False  # hold the prepared data in Ray's object store across epochs

    def problems(self) -> list[str]:
        out = _positive(self, "batch_size", "data")
        if self.eval_batch_size is not None:
            out += _positive(self, "eval_batch_size", "data")
        if self.prefetch_batches < 0:
            out.append("data.prefetch_batches: must be >= 0 (0 turns prefetching off)")
        if self.shards is not None and not self.shards.strip():
            out.append("data.shards: empty; give a folder (or s3:// gs:// URI) or remove the key")
        return out


# torch.compile's modes; the CUDA-graph ones ("reduce-overhead", "max-autotune") are left
# out: a graph replays fixed buffers, which collectives and per-block compile break.
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")


@dataclasses.dataclass
class ScalingConfig:
    num_workers: int | list[int] = 2  # training workers; [min, max]: elastic, grows as room appears
    use_gpu: bool = False  # one GPU per worker, NCCL; false: CPU workers over gloo
    cpus_per_worker: float = 1.0  # CPUs Ray reserves per worker (fractions allowed)
    resize_interval_s: float = 60.0  # elastic runs: how often to look for room to grow
    # Give up when the workers cannot be placed for this long, rather than wait forever.
    placement_timeout_s: float = 300.0

    @property
    def min_workers(self) -> int:
        return self.num_workers[0] if isinstance(self.num_workers, list) else self.num_workers

    @property
    def max_workers(self) -> int:
        return self.num_workers[-1] if isinstance(self.num_workers, list) else self.num_workers

    @property
    def elastic(self) -> bool:
        return isinstance(self.num_workers, list)

    def problems(self) -> list[str]:
        out: list[str] = []
        n = self.num_workers
        if isinstance(n, list):
            if len(n) != 2 or not all(isinstance(v, int) for v in n):
                return ["scaling.num_workers: an elastic range is [min, max], two integers"]
            if n[0] < 1:
                out.append("scaling.num_workers: min must be >= 1")
            if n[0] > n[1]:
                out.append(f"scaling.num_workers: min ({n[0]}) is greater than max ({n[1]})")
        elif n < 1:
            out.append(f"scaling.num_workers: must be >= 1, got {n}")
        if self.cpus_per_worker <= 0:
            out.append("scaling.cpus_per_worker: must be > 0 (fractions such as 0.5 are fine)")
        if self.resize_interval_s < 0:
            out.append("scaling.resize_interval_s: must be >= 0 seconds")
        if self.placement_timeout_s <= 0:
            out.append("scaling.placement_timeout_s: must be > 0 seconds")
        return out


@dataclasses.dataclass
class StrategyConfig:
    name: str = "ddp"  # ddp | fsdp | deepspeed | fairscale | auto (raylift plan's choice)
    activation_checkpointing: bool = False  # recompute each block in backward
    find_unused_parameters: bool = False  # ddp: for models whose forward skips parameters
    bucket_cap_mb: float = 25.0  # ddp: gradient bucket size for the all-reduce
    reshard_after_forward: bool = True  # fsdp: free gathered params after forward (ZeRO-3)
    cpu_offload: bool = False  # fsdp: params, grads, optimizer state in host memory
    dp_replicate: int | str = AUTO  # fsdp: copies of the sharded model (auto: one per node)
    dp_shard: int | str = AUTO  # fsdp: ranks one copy is sharded over (auto: a node's workers)
    tp: int | str = AUTO  # fsdp: tensor-parallel ranks within a node (auto: 1)
    zero_stage: int = 2  # deepspeed: 0 (DDP-like) .. 3 (everything sharded)
    offload: bool = False  # deepspeed: shorthand for offload_optimizer (+ offload_param at 3)
    offload_optimizer: bool = False  # deepspeed: optimizer state and step on the CPU
    offload_param: bool = False  # deepspeed, stage 3: parameters in host memory
    # deepspeed, stage 3: ZeRO++ hpZ, backward gathers within a node (auto: across nodes)
    hpz: bool | str = AUTO
    # deepspeed: raw DeepSpeed keys, merged last (they win)
    config: dict[str, Any] = dataclasses.field(default_factory=dict)

    def problems(self) -> list[str]:
        # The name and each strategy's own checks need the strategy registry, which
        # raylift.validation adds: a strategy's checks may involve other sections.
        return []


@dataclasses.dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | adam | sgd
    lr: float = 3.0e-4  # peak learning rate (after warm-up)
    weight_decay: float = 0.0  # decoupled decay of matrices (not biases or norm gains)
    # adam/adamw moment decay rates
    betas: list[float] = dataclasses.field(default_factory=lambda: [0.9, 0.999])
    momentum: float = 0.9  # sgd momentum
    warmup_steps: int = 0  # linear warm-up from 0 to lr over this many steps
    schedule: str = "cosine"  # cosine (decay to lr x min_lr_ratio) | constant
    min_lr_ratio: float = 0.1  # cosine: the final lr as a share of lr

    def problems(self) -> list[str]:
        out: list[str] = []
        if self.name not in OPTIMIZERS:
            out.append(f"optim.name: unknown optimizer {self.name!r}; choose one of {OPTIMIZERS}")
        if self.lr <= 0:
            out.append(f"optim.lr: must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            out.append(f"optim.weight_decay: must be >= 0, got {self.weight_decay}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            out.append("optim.betas: two numbers in [0, 1), e.g. [0.9, 0.999]")
        if self.warmup_steps < 0:
            out.append("optim.warmup_steps: must be >= 0")
        if self.schedule not in SCHEDULES:
            out.append(f"optim.schedule: unknown schedule {self.schedule!r}; choose {SCHEDULES}")
        if not 0 <= self.min_lr_ratio <= 1:
            out.append("optim.min_lr_ratio: must be in [0, 1]")
        return out


@dataclasses.dataclass
class EarlyStoppingConfig:
    monitor: str = "val_loss"  # the evaluation metric watched (val_loss, val_acc, ...)
    mode: str = "min"  # min | max: which way is better
    patience: int = 3  # evaluations without improvement before stopping
    min_delta: float = 0.0  # the least change that counts as an improvement

    def problems(self) -> list[str]:
        out: list[str] = []
        if self.mode not in ("min", "max"):
            out.append(f"train.early_stopping.mode: must be 'min' or 'max', got {self.mode!r}")
        if self.patience < 1:
            out.append("train.early_stopping.patience: must be >= 1")
        if self.min_delta < 0:
            out.append("train.early_stopping.min_delta: must be >= 0")
        return out


@dataclasses.dataclass
class TrainConfig:
    max_epochs: int = 10  # passes over the training split
    max_steps: int | None = None  # optimizer steps; whichever limit comes first
    grad_accum: int = 1  # micro-batches per optimizer step
    grad_clip: float | None = None  # max global gradient norm; null: no clipping
    early_stopping: EarlyStoppingConfig | None = None  # null: train to the end
    seed: int = 0  # initial weights, data order and dropout, the same on every strategy
    eval_every_n_steps: int | None = None  # evaluate every n steps too; null: each epoch's end
    log_every_n_steps: int = 10  # steps per logging interval (one host sync each)
    compile: bool = False  # torch.compile the model (per block for transformers)
    compile_mode: str = "default"  # torch.compile's mode: one of COMPILE_MODES
    max_failures: int = 0  # restarts from the latest checkpoint after a worker fails
    on_nan: str = "stop"  # a non-finite loss or gradient: stop the run, or skip that step

    def problems(self) -> list[str]:
        out = _positive(self, "max_epochs", "train") + _positive(self, "grad_accum", "train")
        if self.on_nan not in ("stop", "skip"):
            out.append(
                f"train.on_nan: {self.on_nan!r} is not a choice; 'stop' ends the run at the first "
                "non-finite loss, keeping the last good checkpoint; 'skip' skips that step"
            )
        out += _positive(self, "log_every_n_steps", "train")
        for key in ("max_steps", "eval_every_n_steps"):
            if getattr(self, key) is not None:
                out += _positive(self, key, "train")
        if self.grad_clip is not None and self.grad_clip <= 0:
            out.append("train.grad_clip: must be > 0, or null to turn clipping off")
        if self.max_failures < -1:
            out.append("train.max_failures: must be >= 0, or -1 for unlimited retries")
        if self.compile_mode not in COMPILE_MODES:
            out.append(
                f"train.compile_mode: {self.compile_mode!r} is not one of {COMPILE_MODES}; "
                "max-autotune-no-cudagraphs tunes kernels for the GPU at a longer compile"
            )
        return out


@dataclasses.dataclass
class MemorySnapshotConfig:
    """Snapshots of the run's state held in the cluster's memory (raylift.run.snapshots)."""

    every_n_steps: int = 10  # a snapshot of every rank's part this often
    keep: int = 2  # the newest snapshots each node's keeper holds

    def problems(self) -> list[str]:
        out = _positive(self, "every_n_steps", "checkpoint.memory")
        return out + _positive(self, "keep", "checkpoint.memory")


@dataclasses.dataclass
class CheckpointConfig:
    every_n_steps: int | None = 200  # null: a checkpoint at the run's end only
    keep: int | None = 3  # newest checkpoints kept; null: all
    # the loop stops only to write each rank's part to local disk; checksums and the upload
    # to storage go on while it trains (one save in flight at a time); false: it waits
    async_: bool = dataclasses.field(default=True, metadata={"key": "async"})
    # each rank's part kept in the memory of its node and of one other as well, more often
    # than storage takes it: a restart restores from there when it is newer; null: off
    memory: MemorySnapshotConfig | None = None

    def problems(self) -> list[str]:
        out: list[str] = []
        if self.every_n_steps is not None and self.every_n_steps < 1:
            out.append("checkpoint.every_n_steps: must be >= 1, or null for end-of-run only")
        if self.keep is not None and self.keep < 1:
            out.append("checkpoint.keep: must be >= 1, or null to keep every checkpoint")
        return out + (self.memory.problems() if self.memory else [])


LOG_MODEL = ("final", "best", "none")


@dataclasses.dataclass
class TrackingConfig:
    uri: str | None = None  # MLflow tracking URI; null: sqlite:///<cwd>/mlflow.db
    experiment: str = "raylift"  # MLflow experiment name
    # The trained weights as an MLflow logged model of the run: the last checkpoint's, the
    # best evaluated one's (train.early_stopping.monitor, else val_loss), or none.
    log_model: str = "final"
    register_as: str | None = None  # a registered model the logged one becomes a version of

    def problems(self) -> list[str]:
        out = [] if self.experiment else ["tracking.experiment: must be a non-empty name"]
        if self.uri and is_file_store(self.uri) and not file_store_allowed():
            out.append(
                f"tracking.uri: {self.uri} is an MLflow file store, which MLflow 3 refuses "
                "(in maintenance mode); use sqlite:///PATH/mlflow.db (null: "
                "sqlite:///<cwd>/mlflow.db) or a tracking server's http(s):// URI, or set "
                "MLFLOW_ALLOW_FILE_STORE=true to keep it"
            )
        if self.log_model not in LOG_MODEL:
            out.append(
                f"tracking.log_model: {self.log_model!r} is not one of {LOG_MODEL}; 'final' "
                "logs the last checkpoint's weights, 'best' the best evaluated one's"
            )
        if self.register_as is not None and not str(self.register_as).strip():
            out.append("tracking.register_as: empty; give a model name or remove the key")
        if self.register_as and self.log_model == "none":
            out.append(
                "tracking.register_as: nothing to register with tracking.log_model: none; "
                "set log_model to final or best, or remove register_as"
            )
        return out


def is_file_store(uri: str) -> bool:
    """A tracking URI MLflow reads as a folder of files: ``file:`` or a bare path."""
    return uri.startswith(("file:", "/", "./", "../", "~"))


def file_store_allowed() -> bool:
    return os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").strip().lower() in ("true", "1")


ADAPTERS = ("lora",)


@dataclasses.dataclass
class AdapterConfig:
    # lora: the base model frozen, low-rank matrices beside its linear layers trained
    # (PEFT's LoRA); null: every parameter trains
    type: str | None = None
    r: int = 8  # the rank of each adapter's two matrices
    alpha: float = 16.0  # the adapter's output is scaled by alpha / r (rslora: alpha / sqrt(r))
    # rank-stabilised LoRA (PEFT's use_rslora): the output scaled by alpha / sqrt(r), so a
    # higher rank does not train more slowly
    rslora: bool = False
    # DoRA (PEFT's use_dora): each adapted layer's weight split into a magnitude per output
    # (trained, starting at the base's row norms) and a direction the adapters move
    dora: bool = False
    dropout: float = 0.0  # dropout on the adapter's input
    # all-linear: every nn.Linear (and GPT-2's Conv1D) but the output head; or a list of
    # module names (a name matches a module whose full name is it or ends in .name)
    target_modules: str | list[str] = "all-linear"
    # modules trained whole beside the adapters (an untied embedding, say), by name as
    # above; not one whose weight another module shares (a tied head)
    modules_to_save: list[str] = dataclasses.field(default_factory=list)
    # adapters to start from instead of a fresh draw: a PEFT folder (adapter_config.json,
    # adapter_model.safetensors; local, a URI or a Hub ID: org/name, org/name@rev) or the
    # MLflow model of a run that trained adapters (models:/NAME/VERSION,
    # runs:/RUN_ID/model), on the same base
    weights: str | None = None

    def problems(self) -> list[str]:
        out: list[str] = []
        if self.weights and not self.type:
            out.append(
                "model.adapter.weights: adapters to start from, but model.adapter.type is "
                "null (every parameter trains); set model.adapter.type: lora"
            )
        for key in ("rslora", "dora"):
            if getattr(self, key) and not self.type:
                out.append(
                    f"model.adapter.{key}: set, but model.adapter.type is null (every "
                    "parameter trains); set model.adapter.type: lora, or remove the key"
                )
        if self.type is not None and self.type not in ADAPTERS:
            out.append(
                f"model.adapter.type: {self.type!r} is not one of {ADAPTERS}; null trains "
                "every parameter"
            )
        elif self.type and importlib.util.find_spec("peft") is None:
            out.append(
                f"model.adapter.type: {self.type} is built on PEFT, which is not installed "
                "here: pip install 'raylift[hf]'"
            )
        if self.r < 1:
            out.append(f"model.adapter.r: must be a rank >= 1, got {self.r}")
        if self.alpha <= 0:
            out.append(f"model.adapter.alpha: must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            out.append(f"model.adapter.dropout: must be in [0, 1), got {self.dropout}")
        if isinstance(self.target_modules, str) and self.target_modules != "all-linear":
            out.append(
                f"model.adapter.target_modules: {self.target_modules!r}: write all-linear "
                "or a list of module names, e.g. [q_proj, v_proj]"
            )
        if isinstance(self.target_modules, list) and not self.target_modules:
            out.append("model.adapter.target_modules: empty; name modules or write all-linear")
        return out


@dataclasses.dataclass
class ModelConfig:
    # Pretrained weights: a .safetensors file, or a folder with model.safetensors or a
    # sharded Hugging Face checkpoint (model.safetensors.index.json), local or a folder's
    # URI; a Hub ID (org/name, org/name@rev: read at one commit); or an MLflow model:
    # models:/NAME/VERSION, runs:/RUN_ID/model.
    weights: str | None = None
    # adapters trained on the frozen model (LoRA), rather than every parameter
    adapter: AdapterConfig = dataclasses.field(default_factory=AdapterConfig)

    def problems(self) -> list[str]:
        return [] if self.weights != "" else ["model.weights: a path, or null for none"]


@dataclasses.dataclass
class TuneSchedulerConfig:
    name: str = "asha"  # asha | median | none: which trials stop early
    grace_period: int = 1  # epochs a trial trains before it can be stopped
    max_t: int | None = None  # asha: epochs a trial may reach; null: train.max_epochs
    reduction_factor: float = 2.0  # asha: the share of trials kept at each rung is 1 / this


@dataclasses.dataclass
class TuneConfig:
    """The ``tune:`` section, which ``raylift tune`` checks (raylift.commands.tune) and
    every other command carries untouched."""

    # config key -> distribution: loguniform | uniform | randint [low, high], choice | grid
    # [values]; e.g. {optim.lr: {loguniform: [1.0e-4, 1.0e-2]}}
    space: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    num_samples: int = 8  # trials drawn from the space (each grid point this many times)
    max_concurrent: int = 2  # trials running at once, each with its own workers
    metric: str = "val_loss"  # the evaluation metric trials are ranked and stopped by
    mode: str = "min"  # min | max: which way is better
    # asha, median or none; or {name: asha, grace_period: 1, max_t: null, reduction_factor: 2}
    scheduler: TuneSchedulerConfig = dataclasses.field(default_factory=TuneSchedulerConfig)
    search: str = "random"  # random | optuna: how the next trial's values are drawn
    scaling: dict[str, Any] = dataclasses.field(default_factory=dict)  # each trial's scaling.*
    max_failures: int = 1  # restarts of a failed trial, each from its latest checkpoint


@dataclasses.dataclass
class Config:
    name: str = "raylift-run"  # the run's name: a rerun with the same name and storage resumes
    # a built-in (digits, gpt, images, hf-causal-lm, hf-sft) or package.module:Class
    task: str = "digits"
    # keyword arguments of the task's constructor
    task_args: dict[str, Any] = dataclasses.field(default_factory=dict)
    # the model's initial weights
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    # the prepared shards and how workers read them
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    # how many workers, on what
    scaling: ScalingConfig = dataclasses.field(default_factory=ScalingConfig)
    # how the model is distributed (see Strategies)
    strategy: StrategyConfig = dataclasses.field(default_factory=StrategyConfig)
    precision: str = "32"  # auto | 32 | 32-true | 16-mixed | bf16-mixed | bf16-true
    # optimizer and learning-rate schedule
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    # the loop: steps, accumulation, evaluation, failures
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    # when checkpoints are written and how many kept
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    # MLflow: where, and what is logged
    tracking: TrackingConfig = dataclasses.field(default_factory=TrackingConfig)
    storage: str = "./runs"  # runs and shards: a folder, or s3:// gs:// (or NFS) on a cluster
    # the sweep `raylift tune` runs (its keys: TuneConfig); other commands carry it untouched
    tune: dict[str, Any] | None = None

    def problems(self) -> list[str]:
        out: list[str] = []
        sc = self.scaling
        if sc.elastic and not sc.problems():
            total = self.train.grad_accum * sc.max_workers
            bad = [w for w in range(sc.min_workers, sc.max_workers + 1) if total % w]
            if bad:
                out.append(elastic_problem(self, bad))
        if not self.name or "/" in self.name:
            out.append(f"name: must be a non-empty name without '/', got {self.name!r}")
        if not self.storage:
            out.append("storage: must be a local path or a URI such as s3://bucket/runs")
        # The strategy's, the precision's and the task's checks: raylift.validation.
        return out

    def to_dict(self) -> dict[str, Any]:
        return as_dict(self)


def elastic_accum(cfg: Config, world: int) -> int:
    """Micro-batches each of ``world`` workers accumulates per optimizer step.

    ``data.batch_size x train.grad_accum x max workers`` is an elastic run's global
    batch; at fewer workers the run accumulates more micro-batches, so the learning
    dynamics do not change with a resize. Fixed-size runs keep ``train.grad_accum``.
    """
    if not cfg.scaling.elastic:
        return cfg.train.grad_accum
    total = cfg.train.grad_accum * cfg.scaling.max_workers
    if total % world:
        raise ConfigError([elastic_problem(cfg, [world])])
    return total // world


def elastic_problem(cfg: Config, bad: list[int]) -> str:
    total = cfg.train.grad_accum * cfg.scaling.max_workers
    return (
        "scaling.num_workers: an elastic run keeps its global batch (data.batch_size"
        " x train.grad_accum x max workers) by accumulating more on fewer workers; "
        f"{bad} worker(s) cannot divide train.grad_accum x max = {total}: use a "
        "range such as [1, 2], or raise train.grad_accum until every count divides it"
    )


# ---------------------------------------------------------------- building from dicts


def _positive(obj: Any, key: str, section: str) -> list[str]:
    value = getattr(obj, key)
    return [] if value >= 1 else [f"{section}.{key}: must be >= 1, got {value}"]


# ---------------------------------------------------------------- loading


def build_config(raw: Mapping[str, Any]) -> tuple[Config, list[str]]:
    """The config of ``raw`` and the schema's problems with it: unknown keys, wrong types,
    values out of range. A key that fails keeps its default, so the checks that need the
    registries (:mod:`raylift.validation`) still run and the user sees every problem at once."""
    problems: list[str] = []
    cfg = build_dataclass(Config, raw, "", problems)
    return typing.cast(Config, cfg), problems


def read_config(path: str | Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The tree of ``path`` with ``key=value`` overrides applied, task paths made absolute;
    raises :class:`ConfigError` where the file or an override cannot be read."""
    raw, problems = read_yaml(path)
    tree, override_problems = parse_overrides(overrides)
    problems += override_problems
    if problems:
        raise ConfigError(problems)
    merged = merge(raw, tree)
    if isinstance(merged.get("task_args"), dict):
        merged["task_args"] = {k: local_path(v) for k, v in merged["task_args"].items()}
    return merged
