"""ZeRO-3 with ZeRO++'s hierarchical partitioning (hpZ): when raylift turns it on (from
where Ray placed the ranks), what it refuses, and a run of it on four gloo ranks against
DDP and plain ZeRO-3: the same loss curve, and fewer bytes gathered, since backward
gathers within a partition of two.

The ranks here share one host, so the partition is asked for with DeepSpeed's own key
(``strategy.config``), as raylift sets it for two nodes of two workers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from raylift.core.config import Config
from raylift.core.parsing import merge
from raylift.strategies.deepspeed_config import ds_config, hpz_size
from raylift.tensors.precision import resolve_precision
from raylift.validation import ConfigError, config_from_dict
from tests.helpers import GPT_SMALL, make_config, run_ranks, train_runs
from tests.unit.test_hsdp import THIRTY, TOLERANCE, worst

ZERO3 = {"name": "deepspeed", "zero_stage": 3}
TWO_BY_TWO = ["a", "a", "b", "b"]


def zero3(**strategy: object) -> Config:
    return make_config(**merge(GPT_SMALL, {"strategy": {**ZERO3, **strategy}}))


def test_on_where_the_run_spans_nodes_with_each_nodes_ranks_together() -> None:
    size, line = hpz_size(zero3(), TWO_BY_TWO)
    assert size == 2 and line.startswith("hpz 2: a second partition of the weights within each")
    assert hpz_size(zero3(), ["a"] * 4) == (1, "")  # one node: ZeRO-3 is already within it
    assert hpz_size(zero3(hpz=True), ["a"] * 4) == (1, "hpz: off, the run is on one node")
    assert hpz_size(zero3(hpz=False), TWO_BY_TWO) == (1, "")
    assert hpz_size(zero3(zero_stage=2), TWO_BY_TWO) == (1, "")
    assert hpz_size(zero3(), ["a", "b"]) == (1, "")  # one rank a node: nothing to gather
    # The user's own DeepSpeed key wins, and raylift says nothing of its own.
    own = zero3(config={"zero_optimization": {"zero_hpz_partition_size": 4}})
    assert hpz_size(own, TWO_BY_TWO) == (1, "")


def test_off_with_the_reason_where_ray_placed_the_ranks_otherwise() -> None:
    size, uneven = hpz_size(zero3(), ["a", "a", "a", "b"])
    assert size == 1 and "3 on node 1, 1 on node 2, with ranks unevenly" in uneven
    size, mixed = hpz_size(zero3(), ["a", "b", "a", "b"])
    assert size == 1 and "interleaved across nodes" in mixed
    assert "DeepSpeed partitions consecutive ranks" in mixed


def test_deepspeed_gets_the_partition_size() -> None:
    cfg = zero3()
    precision = resolve_precision(cfg.precision, torch.device("cpu"))
    assert ds_config(cfg, precision, 2)["zero_optimization"]["zero_hpz_partition_size"] == 2
    assert "zero_hpz_partition_size" not in ds_config(cfg, precision)["zero_optimization"]


@pytest.mark.parametrize(
    ("strategy", "said"),
    [
        ({**ZERO3, "zero_stage": 2, "hpz": True}, "strategy.hpz: hierarchical partitioning"),
        ({**ZERO3, "hpz": "yes"}, "strategy.hpz: true, false or auto, got 'yes'"),
        ({**ZERO3, "hpz": 2}, "strategy.hpz: true, false or auto, got '2'"),
        ({"name": "fsdp", "hpz": True}, "strategy.hpz: applies to deepspeed, not to 'fsdp'"),
    ],
)
def test_refused_where_it_cannot_apply(strategy: dict, said: str) -> None:
    raw = merge(make_config(**GPT_SMALL).to_dict(), {"strategy": strategy})
    with pytest.raises(ConfigError, match=said.replace("'", ".")):
        config_from_dict(raw)


@pytest.mark.slow
def test_hpz_follows_ddp_and_gathers_less(tmp_path: Path) -> None:
    def gpt(strategy: dict) -> dict:
        cfg = merge(GPT_SMALL, {"strategy": strategy, "precision": "32", "train": THIRTY})
        return make_config(**cfg).to_dict()

    hpz = {**ZERO3, "config": {"zero_optimization": {"zero_hpz_partition_size": 2}}}
    runs = {"ddp": gpt({"name": "ddp"}), "zero3": gpt(ZERO3), "hpz": gpt(hpz)}
    run_ranks(4, tmp_path, train_runs, runs, str(tmp_path / "out.pt"))
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    ref = got["ddp"]["loss"]
    assert ref[30] < 0.8 * ref[1]  # it learned
    table = {name: worst(got[name]["loss"], ref) for name in ("zero3", "hpz")}
    print(table)
    assert all(v <= TOLERANCE for v in table.values()), table

    def gathered(name: str) -> float:
        (step,) = got[name]["wire"].values()
        return step["wire/within_node/all_gather_bytes"]

    # Forward gathers over all four ranks (3/4 of a block sent), backward over two (1/2):
    # about 1.25 / 1.5 of ZeRO-3's; the gradients' reduction is the same.
    ratio = gathered("hpz") / gathered("zero3")
    assert 0.75 < ratio < 0.85, ratio
    assert {k: v for k, v in next(iter(got["hpz"]["wire"].values())).items() if "reduce" in k} == {
        k: v for k, v in next(iter(got["zero3"]["wire"].values())).items() if "reduce" in k
    }
