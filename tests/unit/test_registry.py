"""The strategy registry: one declaration per strategy, read by config, plan, export, submit."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from raylift.cli import main
from raylift.commands.submit import pip_packages
from raylift.core.config import AUTO, ConfigError, StrategyConfig
from raylift.run.plan import planned_strategy
from raylift.strategies import REGISTRY, config_problems, plan_row_for, plan_rows, spec_for
from raylift.strategies.registry import COMMON_OPTIONS
from raylift.validation import load_config

GPT = str(Path(__file__).resolve().parents[2] / "configs" / "gpt-tiny.yaml")


def validate(capsys: pytest.CaptureFixture[str], *overrides: str) -> tuple[int, str]:
    code = main(["validate", GPT, *overrides])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "overrides, key, fix",
    [
        (["strategy.name=fairscale", "precision=16-mixed"], "precision", "bf16-mixed"),
        (["strategy.name=fsdp", "strategy.cpu_offload=true"], "strategy.cpu_offload", "use_gpu"),
        (
            ["strategy.name=deepspeed", "strategy.zero_stage=0", "strategy.offload=true"],
            "strategy.offload",
            "zero_stage to 1, 2 or 3",
        ),
        (
            ["strategy.name=deepspeed", "strategy.zero_stage=2", "strategy.offload_param=true"],
            "strategy.offload_param",
            "zero_stage: 3",
        ),
        (["strategy.name=deepspeed", "strategy.zero_stage=4"], "strategy.zero_stage", "0, 1, 2"),
        (["strategy.name=deepspeed", "train.on_nan=skip"], "train.on_nan", "16-mixed"),
        (["strategy.bucket_cap_mb=0"], "strategy.bucket_cap_mb", "> 0"),
        (["strategy.name=fairscale", "strategy.zero_stage=3"], "strategy.zero_stage", "remove it"),
    ],
)
def test_validate_refuses_what_the_config_alone_shows_wrong(
    capsys: pytest.CaptureFixture[str], overrides: list[str], key: str, fix: str
) -> None:
    code, err = validate(capsys, *overrides)
    assert code == 2
    (line,) = [x for x in err.splitlines() if x.startswith("  - ")]
    assert line.startswith(f"  - {key}:") and fix in line, err


def test_strategy_problems_are_listed_with_the_others(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = validate(capsys, "strategy.name=fairscale", "precision=16-mixed", "optim.lr=-1")
    assert code == 2 and "2 problem(s)" in err
    assert "  - precision:" in err and "  - optim.lr:" in err


def test_train_refuses_them_before_starting_ray(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", GPT, "strategy.name=fsdp", "strategy.cpu_offload=true"]) == 2
    assert "strategy.cpu_offload" in capsys.readouterr().err


def test_config_accepts_exactly_the_registered_names_and_auto() -> None:
    for name in (*REGISTRY, AUTO):
        assert load_config(GPT, [f"strategy.name={name}"]).strategy.name == name
    with pytest.raises(ConfigError, match="choose one of") as info:
        load_config(GPT, ["strategy.name=nope"])
    assert str((*REGISTRY, AUTO)) in str(info.value)


def test_every_registered_strategy_is_complete() -> None:
    labels = [r.label for r in plan_rows()]
    assert len(labels) == len(set(labels))
    for name, spec in REGISTRY.items():
        assert spec is spec_for(name) and spec.name == name
        assert callable(spec.build) and callable(spec.read_export) and callable(spec.problems)
        assert spec.plan_rows and all(r.strategy["name"] == name for r in spec.plan_rows)
        assert set(spec.options) <= {f.name for f in dataclasses.fields(StrategyConfig)}
        assert pip_packages(load_config(GPT, [f"strategy.name={name}"])) == list(spec.extras)
    with pytest.raises(ValueError, match="has no engine"):
        spec_for("nope")


def test_every_strategy_option_is_read_by_some_strategy() -> None:
    read = {key for spec in REGISTRY.values() for key in spec.reads}
    options = {f.name for f in dataclasses.fields(StrategyConfig)} - {"name"}
    assert read == options and set(COMMON_OPTIONS) <= read


def test_plan_rows_keep_their_order_and_are_valid_configs() -> None:
    rows = plan_rows()
    assert [r.label for r in rows] == [
        "ddp",
        "zero1",
        "fairscale",
        "zero2",
        "fsdp",
        "fsdp-full",  # only where the run spans nodes: on one it is fsdp's twin
        "fsdp-tp",  # tp: the workers per node, filled in by the plan
        "zero3",
        "zero3-offload",
    ]
    base = load_config(GPT)
    for row in rows:
        cfg = dataclasses.replace(base, strategy=StrategyConfig(**planned_strategy(row, 2)))
        assert config_problems(cfg) == [], row.label
        assert plan_row_for(cfg.strategy) is row
    assert plan_row_for(StrategyConfig(name=AUTO)) is None


def test_a_resume_crosses_strategies_only_within_one_checkpoint_format() -> None:
    from raylift.run.checkpointing import same_format

    assert same_format("fsdp", "ddp") and same_format("ddp", "fsdp")  # both DCP
    assert same_format("deepspeed", "deepspeed")
    assert not same_format("deepspeed", "fsdp") and not same_format("fairscale", "ddp")
    assert not same_format(None, "ddp") and not same_format("mine", "ddp")
