"""DeepSpeed ZeRO against DDP, on 2 gloo ranks on the CPU: loss curves, resume, bytes, export.

Each group of runs shares one pair of spawned processes (DeepSpeed is imported once per
process); every run builds its own Trainer, so runs stay independent and seeded exactly
as they would be alone.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from raylift.artifacts.export import consolidated_state_dict
from raylift.core.parsing import merge
from raylift.data.ingest import to_device
from raylift.strategies.deepspeed import DeepSpeedEngine
from raylift.strategies.deepspeed_config import ds_config
from raylift.tasks import build_task
from raylift.tensors.checkpoints import CheckpointError
from raylift.tensors.precision import resolve_precision
from raylift.validation import config_from_dict
from tests.helpers import (
    GPT_SMALL,
    HANG_S,
    ListTracker,
    LocalReporter,
    make_config,
    make_trainer,
    probe_tokens,
    run_ranks,
    settle,
    train_runs,
)

# Stage 3 keeps parameters under 1e5 elements whole by default, which is every one of
# this small model's: a threshold of 0 makes it really partition them.
ZERO3 = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
STAGES = {
    "zero1": {"name": "deepspeed", "zero_stage": 1},
    "zero2": {"name": "deepspeed", "zero_stage": 2},
    "zero3": {"name": "deepspeed", "zero_stage": 3, "config": ZERO3},
    "zero2-offload": {"name": "deepspeed", "zero_stage": 2, "offload_optimizer": True},
}
PRECISIONS = {"32": 1e-5, "bf16-mixed": 2e-2}  # precision -> rel tolerance against DDP
CKPT_STEP = 15
THIN = {"n_layer": 8, "d_model": 32, "n_head": 4, "block_size": 32, "max_bytes": 100_000}


def cfg_dict(strategy: dict, precision: str = "32", **more: Any) -> dict:
    overrides = merge(GPT_SMALL, {"strategy": strategy, "precision": precision, **more})
    return make_config(**overrides).to_dict()


# ---------------------------------------------------------------- in the ranks


def full_params(engine: Any) -> dict[str, torch.Tensor]:
    """The whole parameters of any engine; collective under ZeRO-3 (gathers them)."""
    if not isinstance(engine, DeepSpeedEngine):
        return {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
    import deepspeed

    module = engine.ds.module
    with deepspeed.zero.GatheredParameters(list(module.parameters()), enabled=engine.stage == 3):
        return {k: v.detach().float().clone() for k, v in module.state_dict().items()}


def optimizer_moments(engine: Any) -> torch.Tensor:
    """Sum of squares of this rank's Adam moments and its largest step count."""
    states = list(engine.optimizer.state.values())
    sq = sum(float(st[k].double().pow(2).sum()) for st in states for k in ("exp_avg", "exp_avg_sq"))
    step = max(float(st["step"]) for st in states)
    return torch.tensor([sq, step], dtype=torch.float64)


def resume_runs(
    rank: int, world: int, runs: dict[str, dict], ckpts: dict[str, str], out: str
) -> None:
    """Restore each run from its checkpoint at this world size, record what came back, train on."""
    results: dict[str, dict] = {}
    for name, raw in runs.items():
        tracker = ListTracker()
        reporter = LocalReporter(Path(out).parent / f"resumed-{name}")
        trainer = make_trainer(config_from_dict(raw), rank, world, reporter, tracker)
        try:
            trainer.restore(Path(ckpts[name]))
        except CheckpointError as exc:
            results[name] = {"error": str(exc)}
            continue
        params = full_params(trainer.engine)
        moments = optimizer_moments(trainer.engine)
        dist.all_reduce(moments[:1])  # squares add over the ranks' partitions
        trainer.run()
        results[name] = {"params": params, "moments": moments, "loss": tracker.series("train_loss")}
        settle(trainer.engine)
    if rank == 0:
        torch.save(results, out)


def lr_probe(rank: int, world: int, raw: dict, out: str) -> None:
    """Does the lr the loop's scheduler writes into engine.optimizer drive DeepSpeed's update?"""
    trainer = make_trainer(config_from_dict(raw), rank, world, LocalReporter(Path(out).parent))
    engine, task = trainer.engine, trainer.task
    batch = task.finish(to_device({"tokens": probe_tokens(33)}, torch.device("cpu")), torch.float32)

    def one_step(lr: float) -> float:
        for group in engine.optimizer.param_groups:
            group["lr"] = lr
        before = full_params(engine)
        engine.backward(task.loss(engine.model, batch))
        engine.step()
        after = full_params(engine)
        return max(float((after[k] - before[k]).abs().max()) for k in before)

    moved = {"warm": one_step(1e-3), "zero": one_step(0.0), "again": one_step(1e-3)}
    settle(engine)
    if rank == 0:
        torch.save(moved, out)


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def ds_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict]]:
    """Every stage x precision, 30 steps on 2 ranks, checkpoints at step 15 and 30."""
    tmp = tmp_path_factory.mktemp("deepspeed")
    ckpt = {"checkpoint": {"every_n_steps": CKPT_STEP}}
    runs = {
        f"{stage}-{p}": cfg_dict(strategy, p, **ckpt)
        for stage, strategy in STAGES.items()
        for p in PRECISIONS
    }
    run_ranks(2, tmp, train_runs, runs, str(tmp / "out.pt"))
    return tmp, torch.load(tmp / "out.pt", weights_only=True)


@pytest.fixture(scope="module")
def thin_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict]]:
    """Stages 0-3 on a model of many small tensors, 2 steps of 2 micro-batches on 2 ranks.

    Two micro-batches: ZeRO-1 accumulates whole gradients between them (with one,
    DeepSpeed reduces them to the partition within backward). Small tensors: ZeRO-2 keeps
    the whole gradient of a parameter straddling its partition's edge, so it halves
    gradients only up to one tensor per param group; thin layers keep that under 10%.
    """
    tmp = tmp_path_factory.mktemp("thin")
    more = {"task_args": THIN, "train": {"max_steps": 2, "grad_accum": 2}}
    runs = {
        f"zero{s}": cfg_dict({"name": "deepspeed", "zero_stage": s, "config": ZERO3}, **more)
        for s in range(4)
    }
    run_ranks(2, tmp, train_runs, runs, str(tmp / "out.pt"))
    return tmp, torch.load(tmp / "out.pt", weights_only=True)


def checkpoint_of(tmp: Path, run: str, step: int) -> Path:
    return tmp / run / f"checkpoint-step{step:08d}"


# ---------------------------------------------------------------- tests


def test_deepspeed_config_comes_from_raylift_config_and_user_keys_win() -> None:
    raw = cfg_dict(
        {
            "name": "deepspeed",
            "zero_stage": 3,
            "offload": True,
            "config": {"zero_optimization": {"overlap_comm": False}, "gradient_clipping": 2.0},
        },
        "bf16-mixed",
        train={"grad_accum": 4, "grad_clip": 1.0},
    )
    out = ds_config(config_from_dict(raw), resolve_precision("bf16-mixed"))
    assert out["train_micro_batch_size_per_gpu"] == 8
    assert out["gradient_accumulation_steps"] == 4
    assert out["gradient_clipping"] == 2.0  # the user's key, merged last
    assert out["zero_optimization"] == {
        "stage": 3,
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "cpu"},
        "overlap_comm": False,
    }
    assert out["torch_autocast"]["enabled"] and out["torch_autocast"]["dtype"] == "bfloat16"
    assert out["zero_force_ds_cpu_optimizer"] is False  # raylift's torch optimizer stays

    def sections(precision: str) -> set[str]:
        cfg = config_from_dict(cfg_dict({"name": "deepspeed"}, precision))
        return {"fp16", "bf16", "torch_autocast"} & ds_config(
            cfg, resolve_precision(precision)
        ).keys()

    assert sections("32") == set()
    assert sections("16-mixed") == {"fp16"}
    assert sections("bf16-true") == {"bf16"}
    no_clip = config_from_dict(cfg_dict({"name": "deepspeed"}, train={"grad_clip": None}))
    assert ds_config(no_clip, resolve_precision("32"))["gradient_clipping"] == 0.0
    # Refused when the config loads, before any worker builds DeepSpeed's config.
    with pytest.raises(ValueError, match="zero_stage to 1, 2 or 3"):
        config_from_dict(cfg_dict({"name": "deepspeed", "zero_stage": 0, "offload": True}))


def test_raylift_imports_without_deepspeed() -> None:
    code = "import sys, raylift.cli, raylift.artifacts.export, raylift.run.loop\n"
    code += "sys.exit('deepspeed' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False, timeout=HANG_S).returncode == 0


@pytest.mark.slow
@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("stage", list(STAGES))
def test_loss_curve_matches_ddp(
    ddp_reference: dict, ds_runs: tuple, stage: str, precision: str
) -> None:
    ref = ddp_reference[precision]["loss"]
    got = ds_runs[1][f"{stage}-{precision}"]["loss"]
    assert sorted(got) == sorted(ref) == list(range(1, 31))
    assert ref[30] < 0.8 * ref[1]  # it learned: the comparison is not of two flat lines
    worst = max(abs(got[s] - ref[s]) / ref[s] for s in ref)
    print(f"{stage} {precision}: max relative loss difference vs DDP {worst:.2e}")
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=PRECISIONS[precision]), step


@pytest.mark.slow
def test_resume_continues_the_uninterrupted_curve_and_reshards_to_one_rank(
    ds_runs: tuple, tmp_path: Path
) -> None:
    tmp, full = ds_runs
    names = [f"{stage}-32" for stage in ("zero1", "zero2", "zero3", "zero2-offload")]
    runs = {n: cfg_dict(STAGES[n.removesuffix("-32")]) for n in names}
    ckpts = {n: str(checkpoint_of(tmp, n, CKPT_STEP)) for n in names}

    # Same world size: the resumed curve is the uninterrupted one, step for step.
    run_ranks(2, tmp_path, resume_runs, runs, ckpts, str(tmp_path / "two.pt"))
    two = torch.load(tmp_path / "two.pt", weights_only=True)
    for n in names:
        assert sorted(two[n]["loss"]) == list(range(CKPT_STEP + 1, 31)), n
        for step, loss in two[n]["loss"].items():
            assert loss == pytest.approx(full[n]["loss"][step], rel=1e-6), (n, step)

    # 2 -> 1 rank, through DeepSpeed's universal checkpoint: the weights are exactly the
    # saved ones, and the optimizer moments of both partitions all arrive in one. Elastic,
    # as a run that lost a worker is: the one rank accumulates what two did.
    elastic = {n: merge(raw, {"scaling": {"num_workers": [1, 2]}}) for n, raw in runs.items()}
    run_ranks(1, tmp_path, resume_runs, elastic, ckpts, str(tmp_path / "one.pt"))
    one = torch.load(tmp_path / "one.pt", weights_only=True)
    for n in names:
        assert "error" not in one[n], one[n].get("error")
        saved = consolidated_state_dict(Path(ckpts[n]))
        assert one[n]["params"].keys() == saved.keys(), n
        for key, value in saved.items():
            torch.testing.assert_close(one[n]["params"][key], value, rtol=0, atol=0)
        torch.testing.assert_close(one[n]["moments"], two[n]["moments"], rtol=1e-9, atol=0)
        assert sorted(one[n]["loss"]) == list(range(CKPT_STEP + 1, 31)), n
        # The uninterrupted curve goes on: each group's own Adam step count and weight
        # decay came back (DeepSpeed's universal load shares one, and ZeRO-3 the other).
        for step, loss in one[n]["loss"].items():
            assert loss == pytest.approx(full[n]["loss"][step], rel=1e-5), (n, step)


@pytest.mark.slow
@pytest.mark.parametrize(
    "runs, name, step",
    [("ds_runs", "zero1-32", 30), ("ds_runs", "zero3-32", 30), ("thin_runs", "zero0", 2)],
)
def test_consolidated_state_dict_reproduces_the_trained_model(
    request: pytest.FixtureRequest, runs: str, name: str, step: int
) -> None:
    tmp, results = request.getfixturevalue(runs)
    state = consolidated_state_dict(checkpoint_of(tmp, name, step))
    task_args = THIN if runs == "thin_runs" else GPT_SMALL["task_args"]
    model = build_task("gpt", task_args).build_model()
    model.load_state_dict(state)  # strict: every key, tied head.weight included
    assert model.head.weight is model.tok.weight  # loading kept the tie
    with torch.no_grad():
        logits = model(probe_tokens())
    torch.testing.assert_close(logits, results[name]["logits"], rtol=1e-5, atol=1e-5)


def test_model_state_bytes_follow_zero(thin_runs: tuple) -> None:
    """World size 2, fp32, against stage 0 (no ZeRO: P params, G grads, O Adam moments).

    Stage 1 shards the optimizer state: O/2. The weights are fp32, so they are ZeRO's
    fp32 master partition themselves (raylift shares it; DeepSpeed alone would keep a
    copy, P/2 more). Stage 2 also shards gradients (G/2), stage 3 also parameters (P/2).
    """
    got = {name: r["bytes"] for name, r in thin_runs[1].items()}
    p, g, o = (got["zero0"][k] for k in ("params", "grads", "optimizer"))
    sharded_optimizer = o / 2
    expected = {
        "zero1": {"params": p, "grads": g, "optimizer": sharded_optimizer},
        "zero2": {"params": p, "grads": g / 2, "optimizer": sharded_optimizer},
        "zero3": {"params": p / 2, "grads": g / 2, "optimizer": sharded_optimizer},
    }
    for name, want in expected.items():
        for key, value in want.items():
            assert got[name][key] == pytest.approx(value, rel=0.1), (name, key)


@pytest.mark.parametrize("stage", [1, 3])
def test_lr_written_to_the_engine_optimizer_drives_the_update(tmp_path: Path, stage: int) -> None:
    raw = cfg_dict({"name": "deepspeed", "zero_stage": stage, "config": ZERO3})
    run_ranks(2, tmp_path, lr_probe, raw, str(tmp_path / "moved.pt"))
    moved = torch.load(tmp_path / "moved.pt")
    assert moved["warm"] > 1e-5 and moved["again"] > 1e-5
    assert moved["zero"] == 0.0  # lr 0 (and no weight decay): not a single weight moves


def test_planned_model_states_match_what_each_stage_holds(thin_runs: tuple) -> None:
    """raylift plan's ZeRO accounting (world size 2) within 10% of the counted bytes."""
    from raylift.run.plan import count_params, model_states

    cfg = config_from_dict(cfg_dict({"name": "deepspeed"}, task_args=THIN))
    n = count_params(cfg)
    for stage in (1, 2, 3):
        held = thin_runs[1][f"zero{stage}"]["bytes"]
        planned = model_states(f"zero{stage}", n, cfg, world=2)
        for key, value in zip(("params", "grads", "optimizer"), planned, strict=True):
            assert held[key] == pytest.approx(value, rel=0.1), (stage, key)
