"""Each sharded strategy against DDP on the same seed and data: the loss curves must agree."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from raylift.artifacts.export import consolidated_state_dict
from raylift.cli import main
from raylift.core.config import ConfigError
from raylift.core.parsing import merge
from raylift.run.plan import count_params, model_states
from raylift.tasks import build_task
from raylift.validation import load_config
from tests.helpers import (
    GPT_SMALL,
    make_config,
    resume_and_record,
    run_ranks,
    train_and_record,
    train_keep_checkpoints,
)

REPO = Path(__file__).resolve().parents[2]


def curve(tmp: Path, strategy: dict, precision: str, **more: dict) -> dict[int, float]:
    cfg = make_config(**merge(GPT_SMALL, {"strategy": strategy, "precision": precision, **more}))
    out = tmp / f"{strategy['name']}-{precision}" / "loss.pt"
    run_ranks(2, tmp, train_and_record, cfg.to_dict(), str(out))
    return torch.load(out, weights_only=True)


@pytest.fixture
def ddp_curves(ddp_reference: dict) -> dict[str, dict[int, float]]:
    return {p: ddp_reference[p]["loss"] for p in ("32", "bf16-mixed")}


@pytest.mark.slow
@pytest.mark.parametrize("precision, rel", [("32", 1e-5), ("bf16-mixed", 2e-2)])
@pytest.mark.parametrize(
    "strategy",
    [
        {"name": "fsdp"},
        {"name": "fsdp", "reshard_after_forward": False},
        {"name": "fsdp", "activation_checkpointing": True},
        {"name": "fairscale"},
    ],
    ids=["fsdp", "fsdp-no-reshard", "fsdp-ac", "fairscale"],
)
def test_loss_curve_matches_ddp(
    tmp_path: Path, ddp_curves: dict, strategy: dict, precision: str, rel: float
) -> None:
    ref = ddp_curves[precision]
    got = curve(tmp_path, strategy, precision)
    assert sorted(got) == sorted(ref) == list(range(1, 31))
    assert ref[30] < 0.8 * ref[1]  # it learned: the comparison is not of two flat lines
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=rel), step


@pytest.mark.slow
def test_compiled_ddp_matches_eager_ddp(tmp_path: Path, ddp_curves: dict) -> None:
    """train.compile under DDP at 2 ranks: the model compiled whole, its graph split at the
    gradient buckets by dynamo, trains as eager DDP does."""
    ref = ddp_curves["32"]
    got = curve(tmp_path, {"name": "ddp"}, "32", train={"compile": True})
    assert sorted(got) == sorted(ref)
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-4), step


def test_options_for_another_strategy_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"strategy\.reshard_after_forward: applies to fsdp"):
        load_config(REPO / "configs" / "quickstart.yaml", ["strategy.reshard_after_forward=false"])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fairscale"])
def test_resume_continues_the_curve_and_reshards_to_one_worker(
    tmp_path: Path, strategy: str
) -> None:
    cfg = make_config(
        **merge(GPT_SMALL, {"strategy": {"name": strategy}, "checkpoint": {"every_n_steps": 5}})
    ).to_dict()
    run_ranks(2, tmp_path, train_keep_checkpoints, cfg, str(tmp_path / "full"))
    full = torch.load(tmp_path / "full" / "loss.pt", weights_only=True)
    ckpt = tmp_path / "full" / "checkpoint-step00000015"
    exported = consolidated_state_dict(ckpt)

    # Same world size: the resumed curve is the uninterrupted one.
    run_ranks(2, tmp_path, resume_and_record, cfg, str(ckpt), str(tmp_path / "two.pt"))
    two = torch.load(tmp_path / "two.pt", weights_only=True)
    assert sorted(two["loss"]) == list(range(16, 31))
    for step, loss in two["loss"].items():
        assert loss == pytest.approx(full[step], rel=1e-6), step

    # 2 -> 1 worker, as an elastic run shrinks: the checkpoint reshards, the weights are
    # exactly those saved, and the one worker accumulates what two did (the same rows in
    # every step), so the curve goes on as the uninterrupted one.
    elastic = merge(cfg, {"scaling": {"num_workers": [1, 2]}})
    run_ranks(1, tmp_path, resume_and_record, elastic, str(ckpt), str(tmp_path / "one.pt"))
    one = torch.load(tmp_path / "one.pt", weights_only=True)
    assert sorted(one["loss"]) == list(range(16, 31))
    for step, loss in one["loss"].items():
        assert loss == pytest.approx(full[step], rel=1e-6), step
    assert one["params"].keys() == exported.keys()
    for key, value in exported.items():
        torch.testing.assert_close(one["params"][key], value, rtol=0, atol=0)


def test_export_loads_into_the_plain_model(tmp_path: Path) -> None:
    cfg = make_config(
        **merge(GPT_SMALL, {"strategy": {"name": "fsdp"}, "train": {"max_steps": 6}})
    ).to_dict()
    run_ranks(2, tmp_path, train_keep_checkpoints, cfg, str(tmp_path / "run"))
    out = tmp_path / "model.pt"
    assert main(["export", str(tmp_path / "run"), "--out", str(out)]) == 0
    task = build_task("gpt", GPT_SMALL["task_args"])
    model = task.build_model()
    state = torch.load(out, weights_only=True)
    model.load_state_dict(state)  # strict: every key matches
    assert main(["export", str(tmp_path / "nothing"), "--out", str(out)]) == 2
    # safetensors: what model.weights reads, for a run that starts from this one
    from raylift.tensors.init import write_in_place
    from raylift.tensors.weights import load

    st = tmp_path / "model.safetensors"
    assert main(["export", str(tmp_path / "run"), "--out", str(st)]) == 0
    fresh = task.build_model()
    load(fresh, str(st), write_in_place)
    for k, v in fresh.state_dict().items():
        torch.testing.assert_close(v, state[k], rtol=0, atol=0, msg=k)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fairscale"])
def test_planned_model_states_match_what_rank0_holds(
    ddp_reference: dict, tmp_path: Path, strategy: str
) -> None:
    """The plan's ZeRO accounting agrees with the bytes counted from the tensors (world 2)."""
    cfg = make_config(**merge(GPT_SMALL, {"strategy": {"name": strategy}}))
    if strategy == "ddp":
        measured = ddp_reference["32"]["memory"]
    else:
        curve(tmp_path, {"name": strategy}, "32")
        out = tmp_path / f"{strategy}-32" / "loss.pt.memory"
        measured = torch.load(out, weights_only=True)
    params, grads, optim = model_states(strategy, count_params(cfg), cfg, world=2)
    assert measured["model_state_params_bytes"] == pytest.approx(params, rel=0.1)
    assert measured["model_state_grads_bytes"] == pytest.approx(grads, rel=0.1)
    assert measured["model_state_optimizer_bytes"] == pytest.approx(optim, rel=0.1)
    total = params + grads + optim
    assert measured["model_state_bytes_per_rank"] == pytest.approx(total, rel=0.1)
