"""Each sharded strategy against DDP on the same seed and data: the loss curves must agree."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from raylift.config import ConfigError, load_config, merge
from tests.helpers import GPT_SMALL, make_config, run_ranks, train_and_record

REPO = Path(__file__).resolve().parents[2]


def curve(tmp: Path, strategy: dict, precision: str) -> dict[int, float]:
    cfg = make_config(**merge(GPT_SMALL, {"strategy": strategy, "precision": precision}))
    out = tmp / f"{strategy['name']}-{precision}" / "loss.pt"
    run_ranks(2, tmp, train_and_record, cfg.to_dict(), str(out))
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def ddp_curves(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, float]]:
    tmp = tmp_path_factory.mktemp("ddp")
    return {p: curve(tmp, {"name": "ddp"}, p) for p in ("32", "bf16-mixed")}


@pytest.mark.parametrize("precision, rel", [("32", 1e-3), ("bf16-mixed", 2e-2)])
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


def test_options_for_another_strategy_are_refused() -> None:
    with pytest.raises(ConfigError, match="strategy.reshard_after_forward: applies to fsdp"):
        load_config(REPO / "configs" / "quickstart.yaml", ["strategy.reshard_after_forward=false"])
