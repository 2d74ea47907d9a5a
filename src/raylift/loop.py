"""The per-worker training loop: accumulate, step, log, evaluate, stop early, checkpoint.

It runs the same way under Ray Train and in a plain process group: everything
environment-specific (where batches come from, where checkpoints and metrics go)
arrives through :class:`WorkerContext`. The loop never calls ``.item()`` per step:
losses accumulate on the device and are synced once per logging interval.
"""

from __future__ import annotations

import dataclasses
import math
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from raylift.checkpoint import load_checkpoint, save_checkpoint
from raylift.config import Config, EarlyStoppingConfig
from raylift.data.ingest import BatchSource, to_device
from raylift.metrics import (
    PHASES,
    PhaseClock,
    StepTimes,
    breakdown,
    memory_now,
    mfu,
    peak_flops,
)
from raylift.optim import build_scheduler
from raylift.precision import resolve_precision
from raylift.strategies import Engine, build_engine
from raylift.tasks.base import Batch, Task, blocks_of, flops_per_sample, tokens_per_sample


class Reporter(Protocol):
    def report(self, metrics: dict[str, float], checkpoint: Path | None, name: str | None) -> None:
        """Called by every rank at the same points (Ray's report is a barrier)."""
        ...

    def preempting(self) -> bool:
        """True once a node of this run has been told it will be taken away.

        Called by every rank at the same points (on Ray it is a barrier)."""
        ...


class Tracker(Protocol):
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def set_tags(self, tags: dict[str, str]) -> None: ...

    def log_artifact(self, path: Path, folder: str) -> None: ...


class NullTracker:
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def set_tags(self, tags: dict[str, str]) -> None:
        pass

    def log_artifact(self, path: Path, folder: str) -> None:
        pass


class Probe(Protocol):
    """Watches the run from outside the loop (``raylift doctor``'s profiled window)."""

    def after_step(self, trainer: Trainer) -> None: ...


class NonFiniteLoss(RuntimeError):
    """The loss or gradients went inf/NaN and ``train.on_nan`` is ``stop``."""

    def __init__(self, step: int):
        super().__init__(step)
        self.step = step


@dataclasses.dataclass
class WorkerContext:
    rank: int
    world_size: int
    device: torch.device
    source: BatchSource
    reporter: Reporter
    tracker: Tracker = dataclasses.field(default_factory=NullTracker)
    log: Callable[[str], None] = print
    probe: Probe | None = None


@dataclasses.dataclass
class LoopState:
    step: int = 0  # optimizer steps taken
    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches this rank ran in `epoch` (accumulation phase)
    epoch_rows: int = 0  # rows of `epoch`'s global order consumed by all ranks: the data position
    samples: int = 0  # global samples trained on
    best: float | None = None  # early stopping
    bad_evals: int = 0
    stopped_early: bool = False
    last_ckpt_step: int = -1
    restarts: int = 0  # resumes from a checkpoint: failures, resizes, reruns
    nonfinite_step: int = -1  # the step whose loss went inf/NaN (train.on_nan: stop)


@dataclasses.dataclass
class Interval:
    """Device-side running sums for one logging interval, and its phase times."""

    loss_sum: torch.Tensor  # finite losses only: a skipped step does not poison the mean
    finite: torch.Tensor  # micro-batches whose loss was finite
    times: StepTimes
    micro_batches: int = 0

    @classmethod
    def fresh(cls, device: torch.device, clock: PhaseClock) -> Interval:
        zero = torch.zeros((), device=device, dtype=torch.float32)
        return cls(zero, zero.clone(), clock.open())


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_max(values: list[float], device: torch.device) -> list[float]:
    """The largest of each value over ranks: the slowest worker sets the pace."""
    if not (dist.is_available() and dist.is_initialized()):
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(v) for v in t.tolist()]


def early_stop_update(
    state: LoopState, metrics: dict[str, float], cfg: EarlyStoppingConfig
) -> bool:
    """Record one evaluation; True when ``patience`` evaluations passed without improvement."""
    if cfg.monitor not in metrics:
        raise ValueError(
            f"train.early_stopping.monitor: {cfg.monitor!r} is not a metric of this "
            f"run; choose one of {sorted(metrics)}"
        )
    value = metrics[cfg.monitor]
    better = state.best is None or (
        value < state.best - cfg.min_delta
        if cfg.mode == "min"
        else value > state.best + cfg.min_delta
    )
    if better:
        state.best, state.bad_evals = value, 0
    else:
        state.bad_evals += 1
    return state.bad_evals >= cfg.patience


def elastic_accum(cfg: Config, world: int) -> int:
    """Accumulation that keeps an elastic run's global batch at its size at max workers.

    ``data.batch_size x train.grad_accum x max workers`` is the global batch; at ``world``
    workers the run accumulates more micro-batches, so the learning dynamics do not
    change with a resize. Fixed-size runs keep ``train.grad_accum`` as it is.
    """
    if not cfg.scaling.elastic:
        return cfg.train.grad_accum
    total = cfg.train.grad_accum * cfg.scaling.max_workers
    if total % world:
        raise ValueError(elastic_problem(cfg, world))
    return total // world


def elastic_problem(cfg: Config, world: int) -> str:
    return (
        f"scaling.num_workers: at {world} workers the global batch (data.batch_size x "
        f"train.grad_accum x {cfg.scaling.max_workers} max workers) cannot stay the same: "
        f"{world} does not divide train.grad_accum x max workers "
        f"({cfg.train.grad_accum * cfg.scaling.max_workers}); pick a range whose worker "
        "counts all divide it, e.g. [1, 2], or raise train.grad_accum"
    )


def apply_compile(model: torch.nn.Module, task: Task) -> None:
    """Compile each repeated block where the task names them (fast to build), else the model."""
    blocks = blocks_of(task, model)
    for block in blocks or [model]:
        block.compile()


class Trainer:
    """One worker's run. ``run()`` returns the last metrics it reported."""

    def __init__(self, cfg: Config, task: Task, ctx: WorkerContext):
        accum = elastic_accum(cfg, ctx.world_size)
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_accum=accum))
        self.cfg, self.task, self.ctx = cfg, task, ctx
        self.precision = resolve_precision(cfg.precision)
        seed_everything(cfg.train.seed)  # identical initial weights on every rank
        model = task.build_model()
        # Counted before wrapping: ZeRO-3 leaves its parameters empty on every rank.
        self.flops_per_sample = flops_per_sample(task, model)
        if cfg.train.compile:
            apply_compile(model, task)
        blocks = blocks_of(task, model)
        self.engine: Engine = build_engine(model, cfg, self.precision, ctx.device, blocks)
        self.engine.skip_nonfinite = cfg.train.on_nan == "skip"
        self.clock = PhaseClock(ctx.device)
        compute = self.precision.autocast_dtype or self.precision.param_dtype
        self.peak_flops, _ = peak_flops(ctx.device, compute)
        # The first step whose loss was not finite, kept on the device: checking it costs a
        # host sync, so it is read only where the loop syncs anyway (log, eval, checkpoint).
        self.bad_step = torch.full((), -1.0, device=ctx.device)
        self.preempt_saved = False
        seed_everything(cfg.train.seed + 1000 * ctx.rank)  # distinct dropout masks per rank
        self.accum = cfg.train.grad_accum
        self.micro_per_epoch = ctx.source.micro_batches_per_epoch()
        if self.micro_per_epoch < self.accum:
            raise ValueError(
                f"data.batch_size x train.grad_accum ({cfg.data.batch_size} x {self.accum}) needs "
                f"more rows per worker than one epoch has ({self.micro_per_epoch} batches); "
                "lower data.batch_size or train.grad_accum, or use fewer workers"
            )
        self.steps_per_epoch = self.micro_per_epoch // self.accum
        self.total_steps = self._total_steps()
        self.scheduler = build_scheduler(self.engine.optimizer, cfg.optim, self.total_steps)
        self.global_batch = cfg.data.batch_size * self.accum * ctx.world_size
        self.tokens_per_sample = tokens_per_sample(task)
        self.state = LoopState()
        self.last_metrics: dict[str, float] = {}
        self.interval = Interval.fresh(ctx.device, self.clock)
        self.memory_logged = False
        self.memory: dict[str, float] = {}
        self.sticky: dict[str, float] = {}  # carried in every later report (doctor's findings)

    def _total_steps(self) -> int:
        by_epochs = self.cfg.train.max_epochs * self.steps_per_epoch
        return min(by_epochs, self.cfg.train.max_steps or by_epochs)

    # ------------------------------------------------------------ state

    def loop_state(self) -> dict[str, Any]:
        return {
            "loop": dataclasses.asdict(self.state),
            "scheduler": self.scheduler.state_dict(),
            "strategy": self.cfg.strategy.name,
            "world_size": self.ctx.world_size,
            "global_batch": self.global_batch,
            # Reports after a restart carry the last evaluation, as Tune's schedulers expect.
            "metrics": self.last_metrics,
        }

    def restore(self, directory: Path) -> None:
        saved = load_checkpoint(directory, self.engine, self.ctx.rank, self.cfg.strategy.name)
        self.state = LoopState(**saved["loop"])
        self.scheduler.load_state_dict(saved["scheduler"])
        self.last_metrics = dict(saved.get("metrics", {}))
        self.state.restarts += 1
        before, now = saved.get("world_size", self.ctx.world_size), self.ctx.world_size
        self.ctx.tracker.log_metrics({"restarts": float(self.state.restarts)}, self.state.step)
        self.ctx.tracker.set_tags(
            {
                f"raylift.restart.{self.state.restarts}": (
                    f"step {self.state.step} from {directory.name}: {before} -> {now} workers"
                )
            }
        )
        self.ctx.log(
            f"resumed from {directory} at step {self.state.step} "
            f"(epoch {self.state.epoch}, row {self.state.epoch_rows} of its order; "
            f"{before} -> {now} workers, restart {self.state.restarts})"
        )
        if self._finished():
            self.ctx.log(
                f"this run already finished (step {self.state.step} of "
                f"{self.total_steps}{', stopped early' if self.state.stopped_early else ''}"
                "); raise train.max_steps / train.max_epochs to train on, or use "
                "another name for a fresh run"
            )

    # ------------------------------------------------------------ run

    def run(self) -> dict[str, float]:
        try:
            return self._run()
        except NonFiniteLoss as bad:
            return self._stop_on_nonfinite(bad.step)

    def _stop_on_nonfinite(self, step: int) -> dict[str, float]:
        """End the run without saving the broken weights: the last checkpoint stays the good one."""
        self.state.nonfinite_step = step
        kept = self.state.last_ckpt_step
        self.ctx.log(
            f"loss is not finite at step {step}: stopping (train.on_nan: stop); the last good "
            f"checkpoint is step {kept}" + ("" if kept >= 0 else " (none was written)")
        )
        metrics = {**self.last_metrics, "nonfinite_step": float(step)}
        self.last_metrics = metrics
        self.ctx.tracker.log_metrics({"nonfinite_step": float(step)}, self.state.step)
        self.ctx.reporter.report(metrics, None, None)
        return metrics

    def _check_finite(self, worst: float | None = None) -> None:
        """Raise :class:`NonFiniteLoss` if any rank saw an inf/NaN loss (a host sync).

        ``worst`` is the bad step already reduced over ranks, where the caller packed it
        into a collective of its own."""
        if worst is None:
            worst = all_reduce_max([float(self.bad_step)], self.ctx.device)[0]
        if worst < 0:
            return
        if self.cfg.train.on_nan == "stop":
            raise NonFiniteLoss(int(worst))
        self.bad_step.fill_(-1.0)  # skip: the engine left the weights alone and counted it

    def _run(self) -> dict[str, float]:
        train_cfg = self.cfg.train
        self.engine.model.train()
        if self.state.step == 0:
            self._evaluate_and_report()  # the untrained baseline, so every curve has a start
        while not self._finished():
            self._train_epoch()
            if self.state.step >= self.total_steps or self.state.stopped_early:
                break
            self.state.epoch += 1
            self.state.batch_in_epoch = self.state.epoch_rows = 0
        if self.last_metrics.get("step") != float(self.state.step):
            self._evaluate_and_report()
        if self.state.step > self.state.last_ckpt_step:
            self.checkpoint(self.last_metrics)
        if self.state.stopped_early:
            self.ctx.log(
                f"early stopping at step {self.state.step}: "
                f"{train_cfg.early_stopping.monitor if train_cfg.early_stopping else ''}"
                f" did not improve for {self.state.bad_evals} evaluations"
            )
        return self.last_metrics

    def _finished(self) -> bool:
        return (
            self.state.epoch >= self.cfg.train.max_epochs
            or self.state.step >= self.total_steps
            or self.state.stopped_early
        )

    def _batches(self) -> Iterator[Batch]:
        """This epoch's micro-batches from the saved data position, in whole accumulation groups.

        Time blocked on the source is added to the interval's ``data_wait``: a host-side
        clock, no device sync.
        """
        source = self.ctx.source
        usable = source.remaining_micro_batches(self.state.epoch_rows) // self.accum * self.accum
        batches = source.train_batches(self.state.epoch, self.state.epoch_rows)
        try:
            for _ in range(usable):
                waited = time.perf_counter()
                batch = next(batches, None)
                self.clock.add("data_wait", time.perf_counter() - waited)
                if batch is None:
                    return
                yield batch
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()  # stops the prefetching thread when the epoch ends early

    def _train_epoch(self) -> None:
        for batch in self._batches():
            self._micro_step(batch)
            if self.state.batch_in_epoch % self.accum:
                continue
            self._after_step()
            if self.state.step >= self.total_steps or self.state.stopped_early:
                return
        self._evaluate_and_report()

    def _micro_step(self, raw: Batch) -> None:
        phase = self.clock.phase
        with phase("h2d"):
            batch = self.task.finish(to_device(raw, self.ctx.device), self.precision.input_dtype)
        last = (self.state.batch_in_epoch + 1) % self.accum == 0
        with self.engine.sync(last):
            with phase("forward"), self.engine.autocast():
                loss = self.task.loss(self.engine.model, batch)
            with phase("backward"):
                self.engine.backward(loss / self.accum)
        value = loss.detach().float()
        finite = torch.isfinite(value)
        self.interval.loss_sum += torch.where(finite, value, 0.0)
        self.interval.finite += finite
        # A Python scalar, not a new tensor: no host-to-device copy per micro-step.
        first = float(self.state.step + 1)
        self.bad_step = torch.where(finite | (self.bad_step >= 0), self.bad_step, first)
        self.interval.micro_batches += 1
        self.state.batch_in_epoch += 1
        self.state.epoch_rows += self.ctx.source.rows_per_micro_batch

    def _after_step(self) -> None:
        with self.clock.phase("optimizer"):
            self.engine.step()
            self.scheduler.step()
        self.state.step += 1
        self.state.samples += self.global_batch
        self.clock.count_step(self.global_batch)
        step, train_cfg = self.state.step, self.cfg.train
        if not self.memory_logged:
            self._log_memory()
        if step % train_cfg.log_every_n_steps == 0 or step == self.total_steps:
            # The next interval opens before this log, so it carries this log's sync time:
            # each interval then holds exactly one logging sync, as in steady state.
            ending = self.interval
            self.clock.close(ending.times)
            self.clock.drain()
            self.interval = Interval.fresh(self.ctx.device, self.clock)
            with self.clock.phase("sync"):
                self._log_interval(ending)
                notice = self._preemption_notice()
            if notice:
                self.ctx.log(f"preemption notice: checkpoint at step {self.state.step}")
                self.checkpoint(self.last_metrics)
        if self.ctx.probe is not None:
            self.ctx.probe.after_step(self)
        if train_cfg.eval_every_n_steps and step % train_cfg.eval_every_n_steps == 0:
            self._evaluate_and_report()
        every = self.cfg.checkpoint.every_n_steps
        if every and step % every == 0 and step != self.state.last_ckpt_step:
            self.checkpoint(self.last_metrics)

    def _preemption_notice(self) -> bool:
        """True once, when a node is about to go (a spot reclaim) and the step is unsaved:
        saving now beats losing the interval."""
        if self.preempt_saved or not self.ctx.reporter.preempting():
            return False
        self.preempt_saved = True
        return self.state.step != self.state.last_ckpt_step

    # ------------------------------------------------------------ metrics

    def _log_memory(self) -> None:
        """Model-state bytes this rank holds, counted from the tensors after the first step."""
        held = self.engine.model_state_bytes()
        metrics = {f"model_state_{k}_bytes": float(v) for k, v in held.items()}
        metrics["model_state_bytes_per_rank"] = float(sum(held.values()))
        if self.ctx.device.type == "cuda":
            metrics["cuda_peak_allocated_bytes"] = float(torch.cuda.max_memory_allocated())
        self.ctx.tracker.log_metrics(metrics, self.state.step)
        self.memory = metrics
        self.memory_logged = True
        mib = metrics["model_state_bytes_per_rank"] / 2**20
        self.ctx.log(
            f"model state held by rank 0: {mib:.2f} MiB "
            + " ".join(f"{k} {v / 2**20:.2f}" for k, v in held.items())
        )

    def _log_interval(self, interval: Interval) -> None:
        if interval.micro_batches == 0:
            return
        # The host syncs of the interval: one sum and one max over ranks.
        (loss_sum, count), timing, worst = self.reduce_times(
            interval.times, [interval.loss_sum, interval.finite], [float(self.bad_step)]
        )
        self._check_finite(worst[0])
        metrics: dict[str, float] = {
            "train_loss": loss_sum / count if count else math.nan,
            "lr": float(self.scheduler.get_last_lr()[0]),
            "epoch": float(self.state.epoch),
            "world_size": float(self.ctx.world_size),
            "global_batch": float(self.global_batch),
            **timing,
        }
        if self.cfg.train.on_nan == "skip":
            metrics["skipped_steps"] = float(self.engine.skipped_steps)
        self.ctx.tracker.log_metrics(metrics, self.state.step)
        self._print_line(metrics)

    def reduce_times(
        self, times: StepTimes, sums: list[torch.Tensor], maxes: list[float]
    ) -> tuple[list[float], dict[str, float], list[float]]:
        """Step-time breakdown, throughput, MFU and memory of ``times`` over all ranks.

        ``sums`` and ``maxes`` ride along in the same two collectives; their reduced
        values come back first and last. Phase times are averaged over ranks; the data
        wait and memory are the worst rank's."""
        seconds, elapsed = times.resolve(), times.elapsed()
        local = [seconds[p] for p in PHASES] + [elapsed]
        device = self.ctx.device
        head = torch.stack(sums).double() if sums else torch.zeros(0, dtype=torch.float64)
        packed = torch.cat(
            [head.to(device), torch.tensor(local, dtype=torch.float64, device=device)]
        )
        total = all_reduce_sum(packed).tolist()
        memory = memory_now(device)
        worst = all_reduce_max([*maxes, seconds["data_wait"] / elapsed, *memory.values()], device)
        n = len(sums)
        world = self.ctx.world_size
        mean_elapsed = total[-1] / world
        metrics = breakdown(dict(zip(PHASES, total[n : n + len(PHASES)], strict=True)), total[-1])
        metrics["data_wait_frac"] = min(worst[len(maxes)], 1.0)
        metrics["step_time_s"] = mean_elapsed / max(times.steps, 1)
        metrics["samples_per_s"] = times.samples / mean_elapsed
        if self.tokens_per_sample:
            metrics["tokens_per_s"] = metrics["samples_per_s"] * self.tokens_per_sample
        value = mfu(metrics["samples_per_s"], world, self.flops_per_sample, self.peak_flops)
        if math.isfinite(value):
            metrics["mfu"] = value
        metrics.update(zip(memory, worst[len(maxes) + 1 :], strict=True))
        return total[:n], metrics, worst[: len(maxes)]

    def _print_line(self, m: dict[str, float]) -> None:
        eta = (self.total_steps - self.state.step) * m["step_time_s"]
        tok = f"  {m['tokens_per_s']:,.0f} tok/s" if "tokens_per_s" in m else ""
        util = f"  mfu {m['mfu']:.1%}" if "mfu" in m else ""
        self.ctx.log(
            f"epoch {self.state.epoch:>3}  step {self.state.step:>6}/{self.total_steps}  "
            f"loss {m['train_loss']:.4f}  lr {m['lr']:.2e}  {m['samples_per_s']:,.0f} samples/s"
            f"{tok}{util}  data wait {m['data_wait_frac']:.0%}  eta {_fmt_time(eta)}"
        )

    def evaluate(self) -> dict[str, float]:
        # inference_mode where the engine allows it (FSDP2's all-gathers write to buffers
        # that inference tensors would poison, so it gets no_grad).
        grad_off = torch.inference_mode if self.engine.inference_mode_ok else torch.no_grad
        with grad_off():
            return self._evaluate()

    def _evaluate(self) -> dict[str, float]:
        model = self.engine.eval_model
        model.eval()
        sums: dict[str, torch.Tensor] = {}
        for raw in self.ctx.source.eval_batches():
            batch = self.task.finish(to_device(raw, self.ctx.device), self.precision.input_dtype)
            with self.engine.autocast():
                for key, value in self.task.eval_sums(model, batch).items():
                    sums[key] = sums.get(key, 0) + value.double()
        model.train()
        keys = sorted(sums)
        totals = all_reduce_sum(torch.stack([sums[k] for k in keys])).tolist() if keys else []
        return self.task.summarize(dict(zip(keys, totals, strict=True)))

    def _epochs_done(self) -> float:
        """Epochs of data trained on: whole numbers at epoch ends (a sweep's time axis)."""
        usable = self.steps_per_epoch * self.accum * self.ctx.source.rows_per_micro_batch
        return self.state.epoch + min(self.state.epoch_rows / max(usable, 1), 1.0)

    def _evaluate_and_report(self) -> None:
        started = time.perf_counter()
        self._check_finite()
        metrics = self.evaluate()
        es = self.cfg.train.early_stopping
        if es is not None and early_stop_update(self.state, metrics, es):
            self.state.stopped_early = True
        metrics = {
            **metrics,
            **self.sticky,
            "epoch": float(self.state.epoch),
            "epochs_done": self._epochs_done(),
            "step": float(self.state.step),
            "stopped_early": float(self.state.stopped_early),
        }
        self.last_metrics = metrics
        self.ctx.tracker.log_metrics(metrics, self.state.step)
        shown = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k.startswith("val_"))
        self.ctx.log(f"epoch {self.state.epoch:>3}  step {self.state.step:>6}  eval  {shown}")
        self.ctx.reporter.report(metrics, None, None)
        self.clock.pause(time.perf_counter() - started)

    def checkpoint(self, metrics: dict[str, float]) -> None:
        started = time.perf_counter()
        self._check_finite()  # never overwrite the last good checkpoint with broken weights
        self.state.last_ckpt_step = self.state.step
        with tempfile.TemporaryDirectory(prefix="raylift-ckpt-") as tmp:
            save_checkpoint(Path(tmp), self.engine, self.loop_state(), self.ctx.rank)
            name = f"checkpoint-step{self.state.step:08d}"
            self.ctx.reporter.report({**metrics, "step": float(self.state.step)}, Path(tmp), name)
        self.clock.pause(time.perf_counter() - started)


def _fmt_time(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
