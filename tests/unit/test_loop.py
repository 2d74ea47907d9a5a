"""The per-worker loop without Ray: accumulation, precision, resume, early stopping."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from raylift.core.config import EarlyStoppingConfig, OptimConfig
from raylift.core.parsing import merge
from raylift.data.ingest import to_device
from raylift.run.loop import LoopState, early_stop_update, seed_everything
from raylift.strategies.ddp import build_ddp
from raylift.strategies.registry import Parts
from raylift.tasks import build_task
from raylift.tensors.checkpoints import LOOP_FILE, CheckpointError, _listed, read_loop_state
from raylift.tensors.optim import lr_factor
from raylift.tensors.precision import resolve_precision
from tests.helpers import (
    BASE,
    ListTracker,
    LocalReporter,
    init_pg,
    make_config,
    make_trainer,
    run_ranks,
    train_and_save_params,
)


@pytest.fixture
def pg(tmp_path: Path) -> Iterator[None]:
    """A one-rank gloo group in this process, as DDP and DCP need one."""
    init_pg(0, 1, str(tmp_path / "pg"))
    yield
    dist.destroy_process_group()


def test_grad_accum_matches_one_big_batch(tmp_path: Path) -> None:
    """DDP, 2 ranks, fp32: 4 x 16 accumulated == 1 x 64, after one optimizer step.

    SGD, because Adam's first step is lr * sign(grad): it turns float summation-order
    noise on near-zero gradients into lr-sized differences and hides what is compared.
    """
    common = {
        "train": {"max_steps": 1, "seed": 3},
        "optim": {"name": "sgd", "momentum": 0.0, "warmup_steps": 0, "lr": 0.5},
    }
    small = make_config(**common, data={"batch_size": 16}).to_dict()
    small["train"]["grad_accum"] = 4
    big = make_config(**common, data={"batch_size": 64}).to_dict()
    run_ranks(2, tmp_path, train_and_save_params, small, str(tmp_path / "a" / "p.pt"))
    run_ranks(2, tmp_path, train_and_save_params, big, str(tmp_path / "b" / "p.pt"))
    a = torch.load(tmp_path / "a" / "p.pt", weights_only=True)
    b = torch.load(tmp_path / "b" / "p.pt", weights_only=True)
    seed_everything(3)  # the loop's initial weights, never stepped
    init = build_task("digits", BASE["task_args"]).build_model().state_dict()
    moved = max(float((a[k] - init[k]).abs().max()) for k in a)
    assert moved > 1e-4  # the step really changed the weights
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=0)


def run_steps(
    tmp: Path, crash_after: int | None = None, restore: Path | None = None, **overrides: object
) -> tuple[dict[int, float], LocalReporter]:
    defaults = {
        "data": {"batch_size": 64},
        "task_args": {"dropout": 0.2, "width": 8},
        "train": {"max_steps": 30, "max_epochs": 5, "log_every_n_steps": 1},
        "checkpoint": {"every_n_steps": 5},
    }
    cfg = make_config(**merge(defaults, overrides))
    tracker, reporter = ListTracker(), LocalReporter(tmp, crash_after_step=crash_after)
    trainer = make_trainer(cfg, 0, 1, reporter, tracker)
    if restore is not None:
        trainer.restore(restore)
    with contextlib.suppress(KeyboardInterrupt):  # the simulated crash
        trainer.run()
    return tracker.series("train_loss"), reporter


def test_resumed_run_continues_the_uninterrupted_loss_curve(tmp_path: Path, pg: None) -> None:
    full, _ = run_steps(tmp_path / "full")
    partial, reporter = run_steps(tmp_path / "cut", crash_after=15)
    # Async saves go on record at the next save: the crash comes then, at step 20.
    assert max(partial) == 20 and reporter.checkpoints[-1].name.endswith("00000015")
    resumed, _ = run_steps(tmp_path / "resumed", restore=reporter.checkpoints[-1])
    assert min(resumed) == 16 and max(resumed) == 30  # crosses the epoch boundary at 22
    for step in range(16, 31):
        assert resumed[step] == pytest.approx(full[step], rel=1e-6, abs=1e-7), step


@pytest.mark.parametrize("precision", ["32", "16-mixed", "bf16-mixed", "bf16-true"])
def test_every_precision_trains(tmp_path: Path, pg: None, precision: str) -> None:
    losses, _ = run_steps(
        tmp_path,
        precision=precision,
        train={"max_steps": 25, "max_epochs": 5, "log_every_n_steps": 1},
        optim={"lr": 3e-3},
    )
    first, last = losses[1], sum(losses[v] for v in range(21, 26)) / 5
    assert all(math.isfinite(v) for v in losses.values())
    assert last < 0.6 * first, (first, last)


def test_bf16_true_keeps_weights_in_bf16(tmp_path: Path, pg: None) -> None:
    trainer = make_trainer(make_config(precision="bf16-true"), 0, 1, LocalReporter(tmp_path))
    assert all(p.dtype == torch.bfloat16 for p in trainer.engine.module.parameters())


def test_16_mixed_skips_inf_step_and_lowers_scale(pg: None) -> None:
    model = torch.nn.Linear(4, 2)
    engine = build_ddp(
        model,
        make_config(precision="16-mixed"),
        resolve_precision("16-mixed"),
        torch.device("cpu"),
        parts=Parts([]),
        init=lambda write: None,  # the Linear keeps its constructor's weights
    )
    assert engine.scaler is not None
    before = {k: v.clone() for k, v in model.state_dict().items()}
    scale = engine.scaler.get_scale()
    with engine.autocast():
        out = engine.model(torch.ones(3, 4))
    engine.backward(out.float().sum() * float("inf"))
    engine.step()
    assert engine.scaler.get_scale() == scale / 2
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    # A finite step afterwards does update the weights, at the lowered scale.
    with engine.autocast():
        out = engine.model(torch.ones(3, 4))
    engine.backward(out.float().mean())
    engine.step()
    assert engine.scaler.get_scale() == scale / 2
    assert not torch.equal(model.weight, before["weight"])


def test_early_stopping_counts_evaluations_without_improvement() -> None:
    cfg = EarlyStoppingConfig(monitor="val_loss", mode="min", patience=2, min_delta=0.01)
    state = LoopState()
    assert not early_stop_update(state, {"val_loss": 1.0}, cfg)
    assert not early_stop_update(state, {"val_loss": 0.995}, cfg)  # within min_delta
    assert early_stop_update(state, {"val_loss": 0.999}, cfg)
    assert state.best == 1.0
    with pytest.raises(ValueError, match="val_acc"):
        early_stop_update(LoopState(), {"val_acc": 1.0}, cfg)


def test_early_stopping_ends_the_run(tmp_path: Path, pg: None) -> None:
    cfg = make_config(
        train={
            "max_epochs": 50,
            "log_every_n_steps": 5,
            "early_stopping": {
                "monitor": "val_acc",
                "mode": "max",
                "patience": 1,
                "min_delta": 0.5,
            },
        }
    )
    trainer = make_trainer(cfg, 0, 1, LocalReporter(tmp_path))
    trainer.run()
    assert trainer.state.stopped_early and trainer.state.epoch == 1


def test_lr_schedule_warms_up_then_decays_to_the_floor() -> None:
    cfg = OptimConfig(warmup_steps=10, min_lr_ratio=0.1)
    assert lr_factor(0, cfg, 100) == pytest.approx(0.1)
    assert lr_factor(9, cfg, 100) == pytest.approx(1.0)
    assert lr_factor(10, cfg, 100) == pytest.approx(1.0)
    assert lr_factor(100, cfg, 100) == pytest.approx(0.1)
    assert 0.1 < lr_factor(55, cfg, 100) < 1.0


def test_corrupt_or_partial_checkpoint_is_refused_with_a_fix(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="incomplete"):
        read_loop_state(tmp_path)
    (tmp_path / LOOP_FILE).write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="corrupt") as info:
        read_loop_state(tmp_path)
    assert "delete that folder" in str(info.value)


def test_checkpoint_of_another_strategy_is_refused(tmp_path: Path, pg: None) -> None:
    _, reporter = run_steps(tmp_path, train={"max_steps": 5, "max_epochs": 1})
    ckpt = reporter.checkpoints[-1]
    state = torch.load(ckpt / LOOP_FILE, weights_only=True)
    state["strategy"] = "deepspeed"  # another format: ddp reads fsdp's DCP
    torch.save(state, ckpt / LOOP_FILE)
    # Recorded as its writer records it: the checksums match, the strategy does not.
    done = ckpt / "complete-rank0.json"
    listed = {**json.loads(done.read_text()), LOOP_FILE: _listed(ckpt / LOOP_FILE, None)}
    done.write_text(json.dumps(listed))
    trainer = make_trainer(make_config(), 0, 1, LocalReporter(tmp_path / "x"))
    with pytest.raises(CheckpointError, match="strategy 'deepspeed'"):
        trainer.restore(ckpt)
    # A byte changed since it was recorded is caught by its checksum as it is read.
    data = bytearray((ckpt / LOOP_FILE).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (ckpt / LOOP_FILE).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"loop_state\.pt bytes \d+-\d+ do not match"):
        trainer.restore(ckpt)


def test_to_device_is_a_no_op_on_cpu() -> None:
    batch = {"x": torch.arange(4, dtype=torch.uint8)}
    assert to_device(batch, torch.device("cpu"))["x"] is batch["x"]


@pytest.mark.gpu
def test_cuda_copy_is_asynchronous_from_pinned_memory() -> None:
    batch = {"x": torch.arange(1 << 20, dtype=torch.uint8).pin_memory()}
    out = to_device(batch, torch.device("cuda", 0))
    torch.cuda.synchronize()
    assert out["x"].is_cuda and out["x"].dtype == torch.uint8
    assert torch.equal(out["x"].cpu(), batch["x"])


@pytest.mark.gpu
def test_trainer_on_cuda_with_nccl(tmp_path: Path) -> None:
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        cfg = make_config(precision="bf16-mixed", train={"max_steps": 10, "log_every_n_steps": 5})
        trainer = make_trainer(cfg, 0, 1, LocalReporter(tmp_path), device=torch.device("cuda", 0))
        metrics = trainer.run()
        assert next(trainer.engine.module.parameters()).is_cuda
        assert math.isfinite(metrics["val_loss"])
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_compile_follows_the_eager_curve(strategy: str, tmp_path: Path, pg: None) -> None:
    """train.compile compiles DDP's model whole (dynamo splits it at the buckets) and
    FSDP's per transformer block, the task's criterion too, says how long the first step
    took, and trains as eager does (fp32: to compile's rounding). DDP's compiled curve is
    run at 2 ranks against eager DDP's in test_strategies; here its build is checked."""
    curves = {}
    for compiled in (False, True):
        cfg = make_config(
            task="gpt",
            task_args={
                "block_size": 16,
                "n_layer": 2,
                "n_head": 2,
                "d_model": 32,
                "max_bytes": 20000,
            },
            data={"batch_size": 8},
            precision="32",
            strategy={"name": strategy},
            train={"compile": compiled, "max_steps": 6, "log_every_n_steps": 1},
        )
        tracker = ListTracker()
        trainer = make_trainer(cfg, 0, 1, LocalReporter(tmp_path / str(compiled)), tracker)
        per_block = compiled and strategy == "fsdp"
        blocks = trainer.engine.module.blocks  # type: ignore[union-attr]
        assert all(
            (getattr(b, "_compiled_call_impl", None) is not None) == per_block for b in blocks
        )
        whole = isinstance(trainer.engine.model, torch._dynamo.eval_frame.OptimizedModule)
        assert whole == (compiled and strategy == "ddp")
        assert hasattr(trainer.task.criterion, "_torchdynamo_orig_callable") == compiled
        if strategy == "fsdp":
            trainer.run()
            curves[compiled] = tracker.series("train_loss")
    if strategy == "ddp":
        return
    assert tracker.series("compile_first_step_s")[1] > 0
    for step, eager in curves[False].items():
        assert curves[True][step] == pytest.approx(eager, rel=1e-4), step


@pytest.mark.parametrize("task_name", ["gpt", "images"])
def test_the_builtin_blocks_compile_without_a_graph_break(task_name: str, tmp_path: Path) -> None:
    from raylift.tasks import build_task

    if task_name == "gpt":
        task = build_task("gpt", {"n_layer": 1, "d_model": 32, "n_head": 2, "block_size": 16})
        block = task.blocks(task.build_model())[0]
        x = torch.randn(2, 16, 32)
    else:
        from tests.corpora import write_image_folder

        root = write_image_folder(tmp_path / "shapes", per_class=2, size=16)
        task = build_task("images", {"root": str(root), "image_size": 16, "width": 8})
        block = task.blocks(task.build_model())[0]
        x = torch.randn(2, 8, 16, 16)
    explained = torch._dynamo.explain(block)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    # The loss from the model's output compiles as one graph too.
    model = task.build_model()
    if task_name == "gpt":
        batch = {"tokens": torch.randint(0, 256, (2, 17))}
        logits = model(batch["tokens"][:, :-1])
    else:
        batch = {"label": torch.tensor([0, 1])}
        logits = model(torch.randn(2, 3, 16, 16))
    explained = torch._dynamo.explain(task.criterion)(logits, batch)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


class TickingClock:
    """Every reading moves time on by ``tick``: each phase of a step takes a fixed time."""

    def __init__(self, tick: float = 1e-3):
        self.t, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.t += self.tick
        return self.t


class SlowSource:
    """Wraps a source so every train batch takes ``delay`` seconds of ``clock`` to arrive."""

    def __init__(self, inner: object, delay: float, clock: TickingClock):
        self.inner, self.delay, self.clock = inner, delay, clock

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def train_batches(self, epoch: int, start_row: int) -> Iterator[dict[str, torch.Tensor]]:
        for batch in self.inner.train_batches(epoch, start_row):  # type: ignore[attr-defined]
            self.clock.t += self.delay
            yield batch


@pytest.mark.parametrize("delay, low, high", [(0.0, 0.0, 0.3), (0.05, 0.6, 1.0)])
def test_data_wait_frac_is_the_share_of_step_time_spent_waiting_for_batches(
    tmp_path: Path, pg: None, delay: float, low: float, high: float
) -> None:
    cfg = make_config(**{"train": {"max_steps": 12, "log_every_n_steps": 4}})
    tracker = ListTracker()
    clock = TickingClock()
    trainer = make_trainer(cfg, 0, 1, LocalReporter(tmp_path), tracker, now=clock)
    trainer.ctx.source = SlowSource(trainer.ctx.source, delay, clock)  # type: ignore[assignment]
    trainer.run()
    waits = list(tracker.series("data_wait_frac").values())
    assert len(waits) == 3
    assert all(low <= w <= high for w in waits), waits
