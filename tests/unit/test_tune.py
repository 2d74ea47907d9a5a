"""The tune: section: parsing, validation, trial configs, the trial table (no Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest

from raylift.commands.tune import (
    SweepResult,
    TrialRow,
    _stopped,
    param_space,
    parse_sweep,
    render,
    search_alg,
    trial_config,
)
from raylift.core.config import ConfigError
from raylift.validation import load_config

REPO = Path(__file__).resolve().parents[2]
SWEEP = REPO / "configs" / "sweep-digits.yaml"


def test_the_shipped_sweep_parses() -> None:
    spec = parse_sweep(load_config(SWEEP))
    assert spec.num_samples == 8 and spec.max_concurrent == 2
    assert spec.scheduler.name == "asha" and spec.scaling == {"num_workers": 1}
    space = param_space(spec)
    assert set(space) == {"optim.lr", "optim.weight_decay", "task_args.width"}


def test_every_problem_in_the_tune_section_is_reported_at_once() -> None:
    cfg = load_config(
        SWEEP,
        [
            "tune.space={optim.lrr: {uniform: [0.1, 0.2]}, optim.lr: {normal: [1, 2]},"
            " train.grad_accum: {randint: [4, 1]}}",
            "tune.scheduler=pbt",
            "tune.mode=up",
            "tune.bogus=1",
        ],
    )
    with pytest.raises(ConfigError) as err:
        parse_sweep(cfg)
    text = str(err.value)
    assert "tune.bogus: unknown key" in text
    assert "tune.space.optim.lrr: optim.lrr: unknown key (did you mean 'lr'?)" in text
    assert "tune.space.optim.lr: one of ('loguniform'" in text
    assert "tune.space.train.grad_accum: randint takes [low, high] with low < high" in text
    assert "pbt is not offered" in text and "tune.mode" in text


def test_grid_needs_random_search_and_a_missing_section_is_named() -> None:
    cfg = load_config(SWEEP, ["tune.search=optuna", "tune.space={optim.lr: {grid: [0.1, 0.2]}}"])
    with pytest.raises(ConfigError, match=r"grid needs tune\.search: random"):
        parse_sweep(cfg)
    with pytest.raises(ConfigError, match=r"tune\.space: empty"):
        parse_sweep(load_config(REPO / "configs" / "quickstart.yaml"))


def test_a_trial_config_applies_its_values_to_dotted_keys() -> None:
    cfg = load_config(SWEEP)
    trial = trial_config(cfg.to_dict(), {"optim.lr": 0.01, "task_args.width": 16}, "t-1")
    assert trial.optim.lr == 0.01 and trial.task_args["width"] == 16
    assert trial.name == "t-1" and trial.tune is None
    assert trial.optim.weight_decay == cfg.optim.weight_decay  # the rest untouched


def test_a_sweep_searches_the_adapters_rank_and_alpha_like_any_key() -> None:
    pytest.importorskip("peft")
    cfg = load_config(SWEEP, ["model.adapter.type=lora",
                              "tune.space={model.adapter.r: {choice: [4, 8, 16]},"
                              " model.adapter.alpha: {uniform: [8, 32]}}"])  # fmt: skip
    spec = parse_sweep(cfg)
    assert {"model.adapter.r", "model.adapter.alpha"} <= set(param_space(spec))
    trial = trial_config(cfg.to_dict(), {"model.adapter.r": 16, "model.adapter.alpha": 20.0}, "t")
    assert (trial.model.adapter.type, trial.model.adapter.r, trial.model.adapter.alpha) == (
        "lora",
        16,
        20.0,
    )


def test_why_a_trial_ended_early() -> None:
    cfg = load_config(SWEEP)  # max_epochs 8
    assert _stopped(None, {"stopped_early": 1.0}, 5.0, cfg) == "early stopping"
    assert _stopped(None, {"stopped_early": 0.0}, 2.0, cfg) == "scheduler"
    assert _stopped(None, {"stopped_early": 0.0}, 8.0, cfg) == ""
    assert _stopped(RuntimeError("x"), {}, 1.0, cfg) == ""


def test_the_trial_table_lists_params_metric_epochs_and_why() -> None:
    rows = [
        TrialRow("b", "TERMINATED", {"optim.lr": 0.0123456}, 0.05, 8.0, ""),
        TrialRow("a", "TERMINATED", {"optim.lr": 0.3}, 1.5, 1.0, "scheduler"),
    ]
    text = render(SweepResult("s", rows, rows[0], None, "p", 1.0), "val_loss")
    lines = text.splitlines()
    assert lines[0].split() == ["trial", "status", "optim.lr", "val_loss", "epochs", "stopped"]
    assert lines[1].split() == ["a", "TERMINATED", "0.3", "1.5000", "1", "scheduler"]
    assert lines[2].split() == ["b", "TERMINATED", "0.01235", "0.0500", "8", "-"]


def test_searches_are_seeded_and_limit_concurrency() -> None:
    from ray.tune.search import BasicVariantGenerator, ConcurrencyLimiter

    random = search_alg(parse_sweep(load_config(SWEEP)), seed=0)
    assert isinstance(random, BasicVariantGenerator)
    pytest.importorskip("optuna")
    optuna = search_alg(parse_sweep(load_config(SWEEP, ["tune.search=optuna"])), seed=0)
    assert isinstance(optuna, ConcurrencyLimiter) and optuna.max_concurrent == 2


@pytest.mark.parametrize("where", ["local", "s3"])
def test_the_best_config_is_written_beside_the_sweep_on_any_storage(
    where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """best.yaml goes into the sweep's folder, a local one or a bucket on the S3 server
    (it was written only for local storage), and `raylift train` loads it from there."""
    from raylift.commands.tune import TrialRow, _write_best

    storage = str(tmp_path / "runs")
    if where == "s3":
        request.getfixturevalue("s3_server")
        storage = f"s3://runs/best-{tmp_path.name}"
    cfg = load_config(SWEEP, [f"storage={storage}"])
    best = TrialRow("t_00001", "TERMINATED", {"optim.lr": 0.0042}, 0.1, 3.0, "")
    out = _write_best(cfg, best, storage)
    assert out == f"{storage}/{cfg.name}/best.yaml"
    loaded = load_config(out)
    assert loaded.optim.lr == 0.0042 and loaded.tune is None
    assert loaded.scaling.num_workers == cfg.scaling.num_workers


def test_a_resumed_sweep_makes_the_same_trials_under_the_same_keys() -> None:
    """The variant generator, seeded as a sweep seeds it, makes the same values in the same
    order in a fresh Tuner: each trial's key (its place and a digest of its values) is the
    one the record holds, so a resume finds every trial's run without Tune's pickles."""
    from ray.tune.experiment import Experiment

    from raylift.commands.sweep_record import TrialKeys

    spec = parse_sweep(load_config(SWEEP, ["tune.num_samples=4"]))

    def keys() -> list[str]:
        alg = search_alg(spec, seed=0)
        alg.add_configurations(
            [Experiment("x", lambda c: None, config=param_space(spec), num_samples=4,
                        trial_name_creator=TrialKeys())]
        )  # fmt: skip
        made = []
        for _ in range(4):
            trial = alg.next_trial()
            made.append(trial.custom_trial_name)
            alg.on_trial_complete(trial.trial_id)  # room for the next (max_concurrent)
        return made

    first = keys()
    assert first == keys() and len(set(first)) == 4
    assert [k.rsplit("_", 1)[1] for k in first] == ["00000", "00001", "00002", "00003"]


def test_the_sweep_record_keeps_results_and_refuses_a_torn_file(tmp_path: Path) -> None:
    from raylift.commands.sweep_record import RECORD, finished, kept, read_record
    from raylift.core.config import EnvironmentProblem

    assert read_record(str(tmp_path)) == {}
    result = {"val_loss": 0.5, "epochs_done": 2.0, "trial_id": "x", "config": {"a": 1},
              "time_total_s": 3.0, "stopped_early": False, "bad": float("nan")}  # fmt: skip
    assert kept(result) == {"val_loss": 0.5, "epochs_done": 2.0, "stopped_early": False}
    trials = {"a_00000": {"params": {}, "status": "TERMINATED", "metrics": {"val_loss": 0.5}},
              "b_00001": {"params": {}, "status": "RUNNING"}}  # fmt: skip
    assert finished(trials) == {"a_00000": {"val_loss": 0.5}}
    (tmp_path / RECORD).write_text('{"version": 1, "trials": {"a_00')
    with pytest.raises(EnvironmentProblem, match=r"raylift-sweep\.json: not the record"):
        read_record(str(tmp_path))
