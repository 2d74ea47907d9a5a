"""The per-worker training loop: accumulate, step, log, evaluate, stop early, checkpoint.

It runs the same way under Ray Train and in a plain process group: everything
environment-specific (where batches come from, where checkpoints and metrics go)
arrives through :class:`~raylift.run.context.WorkerContext`. The loop never calls
``.item()`` per step: losses accumulate on the device and are synced once per
logging interval (:mod:`raylift.run.progress`); saving and restoring is
:class:`~raylift.run.checkpointing.Checkpointer`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch

from raylift.core import storage
from raylift.core.config import AdapterConfig, Config, EarlyStoppingConfig, elastic_accum
from raylift.data.ingest import to_device
from raylift.run.checkpointing import Checkpointer, Leaving, LoopState
from raylift.run.context import NullTracker, Reporter, StepView, Tracker, WorkerContext
from raylift.run.progress import Interval, IntervalMeter, Rates, console_line
from raylift.run.saving import Saver
from raylift.run.wire import WireMeter, wire_line
from raylift.strategies import Engine, spec_for
from raylift.strategies.mesh import node_of_ranks
from raylift.strategies.registry import Parts
from raylift.strategies.tensor_parallel import plan_of
from raylift.tasks.base import Batch, Task, blocks_of, flops_per_sample, tokens_per_sample
from raylift.tensors.adapters import (
    PEFT_WEIGHTS,
    adapter_tensors,
    attach,
    describe,
    init_adapters,
    init_magnitudes,
    is_adapter,
    meaning,
    saved_whole,
)
from raylift.tensors.init import InitReport, initialize, kept_by_name, whole
from raylift.tensors.metrics import (
    PhaseClock,
    StepTimes,
    all_reduce_max,
    all_reduce_sum,
    peak_flops,
    system_now,
)
from raylift.tensors.optim import build_scheduler
from raylift.tensors.precision import resolve_precision
from raylift.tensors.weights import base_of, load, weights_path

__all__ = [
    "LoopState",
    "NonFiniteLoss",
    "NullTracker",
    "Reporter",
    "Tracker",
    "Trainer",
    "WorkerContext",
    "early_stop_update",
    "seed_everything",
]


class NonFiniteLoss(RuntimeError):
    """The loss or gradients went inf/NaN and ``train.on_nan`` is ``stop``."""

    def __init__(self, step: int):
        super().__init__(step)
        self.step = step


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


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


def initial_weights(
    model: torch.nn.Module,
    task: Task,
    seed: int,
    weights: str | None,
    sharded: bool,
    kept: dict[str, torch.Tensor],
    write: Any,
    adapters: AdapterConfig | None = None,
) -> InitReport:
    """The seeded initial-weights pass, the adapters' own draw over it where the model
    has adapters, then ``model.weights`` over it where given (the base's tensors), and
    the adapters' own weights where ``adapters`` names them."""
    report = initialize(model, task, seed, write, sharded=sharded, kept=kept)
    kept.clear()  # the constructor values are in the parameters now: free the host copies
    if any(is_adapter(n) for n, _ in model.named_parameters()):
        report.adapters = init_adapters(model, seed + 1, write, whole, {})

    if weights:
        load(model, weights, write)
    if adapters is not None and adapters.dora:  # PEFT's start: the loaded base's row norms
        report.adapters += init_magnitudes(model, write, whole)
    if adapters is not None and adapters.weights:  # the adapters to start from, over the draw
        file = storage.join(adapters.weights, PEFT_WEIGHTS)
        named_as = adapter_tensors(saved_whole(model, adapters))
        load(model, file, write, named_as, "model.adapter.weights")
        report.adapters_from = adapters.weights
    return report


def apply_compile(model: torch.nn.Module, task: Task, mode: str = "default") -> None:
    """Compile each repeated block where the task names them, else the model, and the
    task's ``criterion``.

    Per block: one graph serves every layer (compile time does not grow with depth), and
    it composes with each strategy's per-block wrapping (FSDP2's ``fully_shard``,
    activation checkpointing, DeepSpeed's hooks) instead of tracing through them."""
    blocks = blocks_of(task, model)
    for block in blocks or [model]:
        block.compile(mode=mode)
    compile_criterion(task, mode)


def compile_criterion(task: Task, mode: str) -> None:
    """Compile the task's ``criterion`` where it has one: it holds no parameters, so no
    strategy's hooks are in its graph."""
    criterion = getattr(task, "criterion", None)
    if callable(criterion) and not hasattr(criterion, "_torchdynamo_orig_callable"):
        # The instance attribute shadows the method for this task object only.
        task.criterion = torch.compile(criterion, mode=mode)  # type: ignore[attr-defined]


def freeze_heap() -> None:
    """Put every object alive now out of the garbage collector's reach: chiefly the
    imported modules' own (about half a million with transformers and DeepSpeed), which
    never become garbage. DeepSpeed runs a full ``gc.collect()`` at each ZeRO-3 setup and
    partition-cache release; each one walked them all (0.4 s apiece on a 2-core machine,
    twice a build) and now walks only what was made since."""
    gc.collect()
    gc.freeze()


def split_rows(batch: Batch, pieces: int) -> list[Batch]:
    """``batch`` as ``pieces`` batches of consecutive rows (one rank's rows each)."""
    if pieces == 1:
        return [batch]
    parts = {k: v.chunk(pieces) for k, v in batch.items()}
    return [{k: v[i] for k, v in parts.items()} for i in range(pieces)]


class Trainer:
    """One worker's run. ``run()`` returns the last metrics it reported."""

    def __init__(self, cfg: Config, task: Task, ctx: WorkerContext):
        freeze_heap()
        accum = elastic_accum(cfg, ctx.world_size)
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_accum=accum))
        self.cfg, self.task, self.ctx = cfg, task, ctx
        self.precision = resolve_precision(cfg.precision)
        self.precision.configure_matmul(ctx.device)  # before MFU's peak, which depends on it
        self.accum = accum
        self.clock = PhaseClock(ctx.device, ctx.now)
        self.wire = WireMeter(node_of_ranks())
        self.engine, fps = self._build_engine()
        view = self.engine.data_view
        # A tensor-parallel group trains on one batch: its members' rows, one at a time.
        self.pieces = view.group if view is not None else 1
        if view is not None:
            ctx.source.regroup(view.index, view.count, view.group)
        self.base = base_of(cfg, weights_path(cfg, task))
        self.adapter = meaning(cfg.model.adapter)
        self.checkpointer = Checkpointer(
            self.engine, ctx, cfg.strategy.name, self.base, self.adapter
        )
        self.leaving = Leaving()
        self.saver = Saver(self.engine, ctx, cfg.checkpoint.async_)
        # Before the reseed below: measuring a CPU's peak draws random matrices.
        peak, _ = peak_flops(ctx.device, self.precision.compute_dtype)
        # Distinct dropout masks per data rank (a tensor-parallel group's ranks agree).
        seed_everything(cfg.train.seed + 1000 * (view.index if view is not None else ctx.rank))
        self.steps_per_epoch = self._micro_per_epoch() // accum
        self.total_steps = self._total_steps()
        self.scheduler = build_scheduler(self.engine.optimizer, cfg.optim, self.total_steps)
        self.global_batch = cfg.data.batch_size * accum * ctx.world_size
        rates = Rates(self.global_batch, fps, tokens_per_sample(task), peak)
        self.meter = IntervalMeter(ctx, self.clock, rates)
        self.state = LoopState()
        self.last_metrics: dict[str, float] = {}
        self.sticky: dict[str, float] = {}  # carried in every later report (a probe's findings)
        self.view = StepView(
            ctx.rank,
            ctx.world_size,
            ctx.device,
            self.clock,
            self._reduce_window,
            self.sticky.update,
            ctx.tracker,
        )

    def _build_engine(self) -> tuple[Engine, float]:
        """The wrapped model, and its training FLOPs per sample (for MFU)."""
        cfg, device = self.cfg, self.ctx.device
        spec = spec_for(cfg.strategy.name)
        seed_everything(cfg.train.seed)
        with spec.create(cfg, self.precision, device) as kept:  # no storage where it shards
            model = self.task.build_model()
            if cfg.model.adapter.type:  # before any wrapping: the strategy sees it frozen
                model = attach(model, cfg.model.adapter)
                self.ctx.log(describe(model, cfg.model.adapter))
        fps = flops_per_sample(self.task, model)
        whole = cfg.train.compile and spec.compile_whole
        if cfg.train.compile and not whole:
            apply_compile(model, self.task, cfg.train.compile_mode)
        blocks = blocks_of(self.task, model)
        # The same seeded pass on every rank and strategy: identical initial weights.
        sharded = any(p.is_meta or hasattr(p, "ds_id") for p in model.parameters())
        self.sharded_init = sharded  # created without the whole model's storage
        weights = weights_path(cfg, self.task)
        reports: list[InitReport] = []
        by_name = kept_by_name(model, kept)
        del kept

        def init(write: Any) -> InitReport:
            args = (cfg.train.seed, weights, sharded, by_name, write, cfg.model.adapter)
            reports.append(initial_weights(model, self.task, *args))
            return reports[-1]

        parts = Parts(blocks, functools.partial(plan_of, self.task))
        engine = spec.build(model, cfg, self.precision, device, parts, init)
        self.ctx.log(reports[0].describe(spec.build_path if sharded else "built whole"))
        if engine.layout:
            self.ctx.log(f"raylift: {engine.layout}")
        if whole:
            compiled = torch.compile(engine.model, mode=cfg.train.compile_mode)
            engine.model = cast(torch.nn.Module, compiled)  # an OptimizedModule
            compile_criterion(self.task, cfg.train.compile_mode)
        engine.skip_nonfinite = cfg.train.on_nan == "skip"
        return engine, fps

    def _micro_per_epoch(self) -> int:
        micro = self.ctx.source.micro_batches_per_epoch()
        if micro < self.accum:
            raise ValueError(
                f"data.batch_size x train.grad_accum ({self.cfg.data.batch_size} x {self.accum}) "
                f"needs more rows per worker than one epoch has ({micro} batches); "
                "lower data.batch_size or train.grad_accum, or use fewer workers"
            )
        return micro

    def _total_steps(self) -> int:
        by_epochs = self.cfg.train.max_epochs * self.steps_per_epoch
        return min(by_epochs, self.cfg.train.max_steps or by_epochs)

    @property
    def memory(self) -> dict[str, float]:
        """Model-state bytes this rank held after its first step."""
        return self.meter.memory

    # ------------------------------------------------------------ state

    def loop_state(self) -> dict[str, Any]:
        return {
            "loop": dataclasses.asdict(self.state),
            "scheduler": self.scheduler.state_dict(),
            "strategy": self.cfg.strategy.name,
            "base": self.base,  # what the adapters train on; None without adapters
            "adapter": self.adapter,  # what they are: rank, alpha, rsLoRA, DoRA, layers
            "world_size": self.ctx.world_size,
            "global_batch": self.global_batch,
            # Reports after a restart carry the last evaluation, as Tune's schedulers expect.
            "metrics": self.last_metrics,
        }

    def restore(self, directory: str | Path, memory: tuple[int, int] | None = None) -> None:
        """Resume from a checkpoint folder, local or a URI (read where it is, each rank
        reading its own part); ``memory``: the folder is the memory snapshot at that step,
        fetched from its keepers (that many bytes by every rank together)."""
        directory = str(directory)
        watch = self.ctx.restarts
        if watch is not None:
            watch.restoring()
        saved = self.checkpointer.restore(directory)
        self.state = LoopState(**saved["loop"])
        # Counted in this world's micro-batches: at another world size (an elastic resize)
        # the saved count is another size's, and its accumulation phase would be off.
        # A checkpoint is taken between steps, so the rows are whole micro-batches here.
        self.state.batch_in_epoch = self.state.epoch_rows // self.ctx.source.rows_per_micro_batch
        self.scheduler.load_state_dict(saved["scheduler"])
        self.last_metrics = dict(saved.get("metrics", {}))
        if watch is not None:
            nbytes = memory[1] if memory else self.checkpointer.bytes_read
            watch.restored(self.state.step, nbytes, "memory" if memory else "storage")
        # Numbered by the run, not the checkpoint: two resumes from one checkpoint (a node
        # lost before the resized group saved) are two restarts, each with its own tag.
        self.state.restarts = max(self.state.restarts, self.ctx.tracker.restarts()) + 1
        where = "the run's memory snapshot" if memory else directory
        self.checkpointer.record_restart(
            where, self.state, saved.get("world_size", self.ctx.world_size)
        )
        if self._finished():
            self.ctx.log(
                f"raylift: this run already finished (step {self.state.step} of "
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
            f"raylift: loss is not finite at step {step}: stopping (train.on_nan: stop); the "
            f"last good checkpoint is step {kept}" + ("" if kept >= 0 else " (none was written)")
        )
        metrics = {**self.last_metrics, "nonfinite_step": float(step)}
        self.last_metrics = metrics
        self.ctx.tracker.log_metrics({"nonfinite_step": float(step)}, self.state.step)
        self.saver.settle(wait=True)  # the last good checkpoint, complete
        self.ctx.reporter.report(metrics)
        return metrics

    def _check_finite(self, worst: float | None = None) -> None:
        """Raise :class:`NonFiniteLoss` if any rank saw an inf/NaN loss (a host sync).

        ``worst`` is the bad step already reduced over ranks, where the caller packed it
        into a collective of its own."""
        if worst is None:
            if self.cfg.train.on_nan == "skip":
                return  # nothing to stop for: no sync
            worst = all_reduce_max([self.meter.current.first_bad_step()], self.ctx.device)[0]
        if worst >= 0 and self.cfg.train.on_nan == "stop":
            raise NonFiniteLoss(int(worst))
        # skip: the engine left the weights alone on that step and counted it

    def _run(self) -> dict[str, float]:
        self.first_step_started = self.clock.now()
        self.engine.model.train()
        if self.state.step == 0:
            self._evaluate_and_report()  # the untrained baseline, so every curve has a start
        if self.ctx.startup is not None:
            self.ctx.startup.mark("eval0")
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
        self.saver.settle(wait=True)  # the run ends with its last checkpoint in storage
        if self.state.stopped_early:
            es = self.cfg.train.early_stopping
            self.ctx.log(
                f"early stopping at step {self.state.step}: {es.monitor if es else ''}"
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
        source, now = self.ctx.source, self.clock.now
        usable = source.remaining_micro_batches(self.state.epoch_rows) // self.accum * self.accum
        batches = source.train_batches(self.state.epoch, self.state.epoch_rows)
        try:
            for _ in range(usable):
                waited = now()
                batch = next(batches, None)
                self.clock.add("data_wait", now() - waited)
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
        last = (self.state.batch_in_epoch + 1) % self.accum == 0
        pieces = split_rows(raw, self.pieces)
        for i, piece in enumerate(pieces):
            self._forward_backward(piece, last and i == len(pieces) - 1)
        self.state.batch_in_epoch += 1
        self.state.epoch_rows += self.ctx.source.rows_per_micro_batch

    def _forward_backward(self, raw: Batch, sync: bool) -> None:
        phase = self.clock.phase
        with phase("h2d"):
            batch = self.task.finish(to_device(raw, self.ctx.device), self.precision.input_dtype)
        with self.engine.sync(sync):
            with phase("forward"), self.engine.autocast():
                loss = self.task.loss(self.engine.model, batch)
            with phase("backward"):
                self.engine.backward(loss / (self.accum * self.pieces))
        self.meter.current.add(loss, self.state.step + 1)

    def _after_step(self) -> None:
        with self.clock.phase("optimizer"):
            self.engine.step()
            self.scheduler.step()
        self.state.step += 1
        self.state.samples += self.global_batch
        self.clock.count_step(self.global_batch)
        step, train_cfg = self.state.step, self.cfg.train
        if self.ctx.restarts is not None:
            self._after_restart_step(step)
        self._log_wire(self.wire.end())
        if not self.meter.memory:
            self._log_startup()
            self._log_compile()
            self.meter.log_model_state(self.engine, step)
        if step % train_cfg.log_every_n_steps == 0 or step == self.total_steps:
            self._end_interval()
        if self.ctx.probe is not None:
            self.view.step = step
            self.ctx.probe.after_step(self.view)
        if train_cfg.eval_every_n_steps and step % train_cfg.eval_every_n_steps == 0:
            self._evaluate_and_report()
        every, memory = self.cfg.checkpoint.every_n_steps, self.cfg.checkpoint.memory
        to_storage = bool(every and step % every == 0 and step != self.state.last_ckpt_step)
        to_memory = self.ctx.keepers is not None and memory and step % memory.every_n_steps == 0
        if to_storage or to_memory:
            self.checkpoint(self.last_metrics, to_storage)
        self.wire.begin()  # the next step's collectives are measured: this start's second

    def _log_wire(self, wire: dict[str, float]) -> None:
        if wire:
            self.ctx.tracker.log_metrics(wire, self.state.step)
            self.ctx.log(f"raylift: {wire_line(wire)}")

    def _after_restart_step(self, step: int) -> None:
        """Rank 0's progress to the tracking actor; a restart's phases once it is back."""
        assert self.ctx.restarts is not None
        back = self.ctx.restarts.after_step(step)
        if back is not None:
            self.ctx.tracker.log_metrics(back.metrics(), step)
            self.ctx.log(f"raylift: {back.line(self.state.restarts)}")

    def _log_compile(self) -> None:
        """How long the first step took with compilation in it: said once."""
        if not self.cfg.train.compile:
            return
        seconds = self.clock.now() - self.first_step_started
        self.ctx.tracker.log_metrics({"compile_first_step_s": seconds}, self.state.step)
        self.ctx.log(
            f"raylift: train.compile ({self.cfg.train.compile_mode}): {seconds:.1f} s to the end "
            "of the first step, compilation included (the evaluation's graphs and training's)"
        )

    def _log_startup(self) -> None:
        """The run's start-up phases, once, at its first step (one host sync, once)."""
        startup = self.ctx.startup
        if startup is None:
            return
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)  # the step's kernels really finished
        startup.mark("first_step")
        self.ctx.tracker.log_metrics(startup.metrics(), self.state.step)

    def _end_interval(self) -> None:
        ending = self.meter.rotate()
        with self.clock.phase("sync"):
            self._log_interval(ending)
            left = self.ctx.reporter.leaving_in()
        self._node_leaving(left)

    def _node_leaving(self, left: float | None) -> None:
        """A node of the run leaves in ``left`` s (None: none is leaving): the notice's
        checkpoint, and the last one before the deadline with the wait for Ray's restart."""
        first = not self.leaving.noticed
        save, hold = self.leaving.look(left)
        step, started = self.state.step, self.clock.now()
        if save and step != self.state.last_ckpt_step:
            if first:
                self.ctx.log(f"raylift: preemption notice: checkpoint at step {step}")
            self.checkpoint(self.last_metrics)
            self.saver.settle(wait=True)  # in storage before the node goes
            self.leaving.saved(self.clock.now() - started)
        if hold and left is not None:
            self.ctx.log(
                f"raylift: the leaving node goes in {left:.0f} s: checkpoint at step {step} "
                "saved; waiting for Ray to restart the workers without it"
            )
            self.leaving.hold(left, self.ctx.log)
        if save:
            self.clock.pause(self.clock.now() - started)

    # ------------------------------------------------------------ metrics

    def _log_interval(self, interval: Interval) -> None:
        if interval.micro_batches == 0:
            return
        self.ctx.heartbeat()
        # The interval's host syncs: one sum and one max over ranks, the NaN check riding along.
        loss_sum_t, count_t, bad = interval.summary()
        (loss_sum, count), timing, worst = self.meter.reduce(
            interval.times, [loss_sum_t, count_t], [bad]
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
        if self.ctx.rank == 0:  # rank 0's node, as MLflow's system metrics would show it
            metrics.update(system_now(self.ctx.device))
        self.ctx.tracker.log_metrics(metrics, self.state.step)
        estimated = self.ctx.device.type != "cuda"  # a CPU's peak is measured, not published
        self.ctx.log(
            console_line(metrics, self.state.epoch, self.state.step, self.total_steps, estimated)
        )

    def _reduce_window(self, times: StepTimes) -> dict[str, float]:
        """A probe's window of steps, reduced over ranks like a logging interval."""
        return self.meter.reduce(times, [], [])[1]

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
        # A tensor-parallel group's ranks evaluated the same rows: each counted once.
        totals = [t / self.pieces for t in totals]
        return self.task.summarize(dict(zip(keys, totals, strict=True)))

    def _epochs_done(self) -> float:
        """Epochs of data trained on: whole numbers at epoch ends (a sweep's time axis)."""
        usable = self.steps_per_epoch * self.accum * self.ctx.source.rows_per_micro_batch
        return self.state.epoch + min(self.state.epoch_rows / max(usable, 1), 1.0)

    def _evaluate_and_report(self) -> None:
        started = self.clock.now()
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
        self.saver.settle(wait=False)  # a save the ranks have all uploaded goes on record first
        self.ctx.reporter.report(metrics)
        self.clock.pause(self.clock.now() - started)

    def checkpoint(self, metrics: dict[str, float], to_storage: bool = True) -> None:
        """A checkpoint to storage (``to_storage``) and, with the run's memory, a snapshot
        there too: both from one copy of the state."""
        started = self.clock.now()
        self._check_finite()  # never overwrite the last good checkpoint with broken weights
        if to_storage:
            self.state.last_ckpt_step = self.state.step
        self.saver.save(self.state.step, self.loop_state(), metrics, to_storage)
        self.clock.pause(self.clock.now() - started)
