from __future__ import annotations

from pathlib import Path

import pytest

from raylift.core.config import ConfigError, elastic_accum
from raylift.core.parsing import flatten, parse_overrides
from raylift.tensors.precision import ACCEPTED
from raylift.validation import load_config
from tests.helpers import make_config

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"


def problems(*overrides: str, path: Path = QUICKSTART) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return info.value.problems


def test_quickstart_loads_with_typed_sections() -> None:
    cfg = load_config(QUICKSTART)
    assert cfg.task == "digits"
    assert cfg.scaling.num_workers == 2 and not cfg.scaling.elastic
    assert cfg.train.early_stopping is not None and cfg.train.early_stopping.patience == 4


def test_overrides_are_dotted_and_typed() -> None:
    cfg = load_config(
        QUICKSTART,
        [
            "optim.lr=1e-3",
            "scaling.num_workers=[1, 3]",
            "train.grad_accum=2",
            "train.early_stopping=null",
            "precision=32",
        ],
    )
    assert cfg.optim.lr == pytest.approx(1e-3)
    assert cfg.scaling.elastic and (cfg.scaling.min_workers, cfg.scaling.max_workers) == (1, 3)
    assert cfg.train.early_stopping is None
    assert cfg.precision == "32"


def test_an_elastic_range_must_keep_the_global_batch() -> None:
    # 1 x 3 accumulation steps fit on one worker and three, but not on two.
    (found,) = problems("scaling.num_workers=[1, 3]", "train.grad_accum=1")
    assert found.startswith("scaling.num_workers:") and "[2]" in found and "[1, 2]" in found


def test_every_problem_is_reported_at_once() -> None:
    found = problems(
        "optim.lr=-1",
        "scaling.num_workers=0",
        "strategy.name=nope",
        "precision=fp8",
        "train.max_epoch=3",
        "data.batch_size=abc",
    )
    joined = "\n".join(found)
    assert len(found) == 6, joined
    for key in (
        "optim.lr",
        "scaling.num_workers",
        "strategy.name",
        "precision",
        "train.max_epoch",
        "data.batch_size",
    ):
        assert any(p.startswith(key) for p in found), key
    assert "did you mean 'max_epochs'" in joined
    assert str(ACCEPTED) in joined  # every precision the config accepts, named


@pytest.mark.parametrize(
    "override, key, fix",
    [
        ("scaling.num_workers=[4, 2]", "scaling.num_workers", "greater than max"),
        ("optim.lr=0", "optim.lr", "must be > 0"),
        ("optim.name=lamb", "optim.name", "choose one of"),
        ("train.grad_accum=0", "train.grad_accum", ">= 1"),
        ("checkpoint.keep=0", "checkpoint.keep", ">= 1"),
        ("task=nosuchpkg.mod:Task", "task", "cannot import"),
        ("task_args.nope=1", "task_args.nope", "takes no argument"),
        ("strategy.cpu_offload=true", "strategy.cpu_offload", "applies to fsdp, not to 'ddp'"),
        ("train.early_stopping.mode=up", "train.early_stopping.mode", "'min' or 'max'"),
        ("tracking.uri=file:///tmp/mlruns", "tracking.uri", "use sqlite:///PATH/mlflow.db"),
        ("tracking.uri=./mlruns", "tracking.uri", "MLFLOW_ALLOW_FILE_STORE=true"),
    ],
)
def test_each_bad_value_names_key_and_fix(override: str, key: str, fix: str) -> None:
    found = problems(override)
    assert len(found) == 1 and found[0].startswith(key) and fix in found[0], found


def test_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    assert "not found" in problems(path=tmp_path / "nope.yaml")[0]
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    assert "not valid YAML" in problems(path=bad)[0]


def test_override_syntax() -> None:
    tree, errs = parse_overrides(["a.b=1", "a.c=x", "novalue"])
    assert tree == {"a": {"b": 1, "c": "x"}}
    assert errs and "key=value" in errs[0]


def test_flatten() -> None:
    assert flatten({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": {}}) == {
        "a.b": 1,
        "a.c.d": [1, 2],
        "e": {},
    }


def test_elastic_runs_keep_the_global_batch_by_accumulating_more() -> None:
    cfg = make_config(scaling={"num_workers": [1, 4]}, train={"grad_accum": 3})
    assert [elastic_accum(cfg, w) for w in (1, 2, 3, 4)] == [12, 6, 4, 3]
    fixed = make_config(scaling={"num_workers": 2}, train={"grad_accum": 3})
    assert elastic_accum(fixed, 1) == 3  # a fixed-size run keeps what the config says
    with pytest.raises(ConfigError, match=r"\[2\] worker\(s\) cannot divide"):
        make_config(scaling={"num_workers": [1, 3]})


def test_a_run_folder_records_the_config_it_ran_with(tmp_path: Path) -> None:
    """Overrides applied, storage absolute, secrets masked; the folder (or one of its
    checkpoints) then loads as a config."""
    from raylift.run.launch import record_config

    cfg = load_config(
        REPO / "configs" / "gpt-zero3.yaml",
        ["name=rec", "optim.lr=1e-3", "strategy.config={wandb: {api_key: s3cret}}"],
    )
    run = tmp_path / "runs" / "rec"
    record_config(cfg, str(run))
    text = (run / "config.yaml").read_text()
    assert "s3cret" not in text and "api_key: '***'" in text
    (run / "checkpoint-step00000010").mkdir()
    for where in (run, run / "checkpoint-step00000010"):
        got = load_config(where)
        assert got.optim.lr == 1e-3 and got.strategy.zero_stage == 3
        assert got.storage == str(Path.cwd() / "runs")  # ./runs, resolved where it ran
    with pytest.raises(ConfigError, match="or a run folder"):
        load_config(tmp_path / "runs")


def test_a_file_store_is_taken_where_mlflow_is_told_to_allow_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    cfg = load_config(QUICKSTART, ["tracking.uri=file:///tmp/mlruns"])
    assert cfg.tracking.uri == "file:///tmp/mlruns"


def test_a_config_error_keeps_its_problems_when_rebuilt_as_ray_rebuilds_it() -> None:
    """A worker's ConfigError reaches the driver pickled, or rebuilt from its message:
    either way it still names its problems, not the characters of its text."""
    import pickle

    error = ConfigError(["model.weights: trained on another base; point the run at it"])
    for again in (pickle.loads(pickle.dumps(error)), type(error)(*error.args)):
        assert again.problems == error.problems and str(again) == str(error)


def test_a_task_argument_naming_a_local_path_is_made_absolute_for_the_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Workers run in another folder: a relative path that exists where the command
    runs (a model folder, a data file) travels absolute; other values as they are."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "texts").mkdir()
    (tmp_path / "run.yaml").write_text("task: gpt\ntask_args: {corpus: texts, block_size: 32}\n")
    assert load_config(tmp_path / "run.yaml").task_args == {
        "corpus": str(tmp_path / "texts"),
        "block_size": 32,
    }
    remote = load_config(tmp_path / "run.yaml", ["task_args.corpus=s3://b/texts"]).task_args
    assert remote["corpus"] == "s3://b/texts"
