"""rsLoRA and DoRA as PEFT means them, and every other PEFT setting either honoured or
refused: the run's layers are PEFT's own, its curves under every strategy DDP's, its
exports what PEFT loads and merges, and a PEFT folder starts a run with the logits PEFT
gives it, or stops the run before any worker starts, naming the setting.

The strategy runs are tests/zoo.py's (a few fp32 steps on the tiny Llama, in-process
gloo ranks), both variants in one job per strategy. (This file's name sorts after the
test files the tiny Llama's tokenizer is trained on: editing it changes no one's data.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")

from raylift.core.config import AdapterConfig, ConfigError
from raylift.core.parsing import merge
from raylift.run.loop import initial_weights
from raylift.tasks import build_task
from raylift.tensors.adapters import attach, describe, targets
from raylift.tensors.init import write_in_place
from raylift.tensors.preflight import check_for_config
from raylift.tensors.weights import WeightsError
from raylift.validation import config_from_dict
from tests.helpers import ListTracker, LocalReporter, make_config, run_ranks
from tests.unit.test_adapters import STRATEGIES, export_cli, pretrained  # noqa: F401
from tests.zoo import LORA, STEPS, probe, zoo_config, zoo_train

# DoRA's run trains the final norm whole beside it (an untied module: PEFT's meaning).
VARIANTS = {"rslora": {"rslora": True}, "dora": {"dora": True, "modules_to_save": ["norm"]}}
R, ALPHA = LORA["adapter"]["r"], LORA["adapter"]["alpha"]  # the zoo's: 4 and 8


def adapter_run(folder: Path, **adapter: Any) -> dict:
    """The tiny Llama with the zoo's adapters and ``adapter`` over them, under DDP."""
    return make_config(
        task="hf-causal-lm",
        task_args={"model": str(folder), "block_size": 16, "max_bytes": 20_000},
        model={"adapter": {**LORA["adapter"], **adapter}},
    ).to_dict()


def load_hf(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()


def logits_of(model: Any, vocab: int) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=probe(vocab)).logits.float()


# ------------------------------------------------------------ the layers, before any step


def test_rslora_and_dora_layers_start_as_peft_starts_them(pretrained: Path) -> None:  # noqa: F811
    """rsLoRA scales by alpha / sqrt(r); DoRA's magnitudes are PEFT's own (the row norms
    of the loaded base, bit for bit those ``get_peft_model`` draws), and the adapted model
    starts as the base."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    task = build_task("hf-causal-lm", {"model": str(pretrained), "block_size": 16})
    rslora = AdapterConfig(type="lora", r=R, alpha=ALPHA, rslora=True)
    model = attach(task.build_model(), rslora)
    scales = {m.scaling["default"] for m in model.modules() if isinstance(m, LoraLayer)}
    assert scales == {ALPHA / R**0.5}, scales
    assert "rsLoRA r=4 alpha=8 (scale 4)" in describe(model, rslora)

    dora = AdapterConfig(type="lora", r=R, alpha=ALPHA, dora=True)
    model = attach(task.build_model(), dora)
    initial_weights(model, task, 0, str(pretrained), False, {}, write_in_place, dora)
    chosen = targets(load_hf(pretrained), "all-linear")
    theirs = get_peft_model(
        load_hf(pretrained), LoraConfig(r=R, lora_alpha=ALPHA, target_modules=chosen, use_dora=True)
    ).base_model.model
    ours = {n: p for n, p in model.named_parameters() if "lora_magnitude_vector" in n}
    assert len(ours) == len(chosen)
    for name, magnitude in ours.items():
        assert torch.equal(magnitude, theirs.get_parameter(name)), name
    vocab = task.vocab
    torch.testing.assert_close(logits_of(model, vocab), logits_of(load_hf(pretrained), vocab))


def test_rslora_and_dora_are_keys_of_model_adapter() -> None:
    """Set with type: lora; without it, or spelt as PEFT spells them, each is named."""
    both = {"model": {"adapter": {"type": "lora", "rslora": True, "dora": True}}}
    cfg = config_from_dict(merge(make_config().to_dict(), both))
    assert cfg.model.adapter.rslora and cfg.model.adapter.dora
    with pytest.raises(ConfigError) as caught:
        config_from_dict(merge(make_config().to_dict(), {"model": {"adapter": {"dora": True}}}))
    assert "model.adapter.dora: set, but model.adapter.type is null" in str(caught.value)
    wrong = {"use_rslora": True, "use_dora": True, "bias": "all", "rank_pattern": {"q_proj": 2}}
    with pytest.raises(ConfigError) as caught:
        config_from_dict(merge(make_config().to_dict(), {"model": {"adapter": wrong}}))
    said = caught.value.problems
    assert any("model.adapter.use_rslora: unknown key (did you mean 'rslora'?)" in p for p in said)
    assert any("model.adapter.use_dora: unknown key (did you mean 'dora'?)" in p for p in said)
    assert any(p.startswith("model.adapter.bias: unknown key") for p in said)
    assert any(p.startswith("model.adapter.rank_pattern: unknown key") for p in said)


def test_what_peft_would_train_otherwise_is_refused_before_any_worker(
    pretrained: Path,  # noqa: F811
) -> None:
    """The tiny Llama ties its head to its embeddings: PEFT would train a copy of
    embed_tokens apart from the head, raylift the one weight; PEFT puts no adapter on a
    module it saves whole; an embedding's adapters are shaped otherwise. The driver
    refuses each before any worker starts."""
    cfg = config_from_dict(adapter_run(pretrained, modules_to_save=["embed_tokens"]))
    with pytest.raises(ConfigError) as caught:
        check_for_config(cfg, build_task(cfg.task, cfg.task_args))
    said = str(caught.value)
    assert "model.adapter.modules_to_save: model.embed_tokens shares its weight with" in said
    assert "lm_head" in said and "(tied)" in said
    cfg = config_from_dict(adapter_run(pretrained, modules_to_save=["q_proj"]))
    with pytest.raises(ConfigError) as caught:
        check_for_config(cfg, build_task(cfg.task, cfg.task_args))
    assert "model.adapter.modules_to_save: model.layers.0.self_attn.q_proj is adapted too" in str(
        caught.value
    )
    cfg = config_from_dict(adapter_run(pretrained, target_modules=["embed_tokens"], dora=True))
    with pytest.raises(ConfigError) as caught:
        check_for_config(cfg, build_task(cfg.task, cfg.task_args))
    said = str(caught.value)
    assert "model.adapter.target_modules: model.embed_tokens is a Embedding; raylift puts " in said


# ------------------------------------------------------------ folders PEFT writes


def peft_folder(base: Path, out: Path, **settings: Any) -> torch.Tensor:
    """A folder as PEFT writes one, ``get_peft_model(...).save_pretrained``, on the base
    with ``settings``; its trainable tensors moved off their start, so that a load with
    another meaning shows in the logits. Returns PEFT's logits for it on the probe."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        load_hf(base), LoraConfig(r=R, lora_alpha=ALPHA, target_modules="all-linear", **settings)
    )
    draw = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=draw))
    model.save_pretrained(out)
    return logits_of(model, model.config.vocab_size)


@pytest.fixture(scope="module")
def plain_folder(pretrained: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    out = tmp_path_factory.mktemp("peft") / "plain"
    peft_folder(pretrained, out)
    return out


def edited(folder: Path, out: Path, **changes: Any) -> Path:
    """``folder`` with its adapter_config.json changed as ``changes`` say."""
    shutil.copytree(folder, out)
    config = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return out


REFUSED = [
    ("bias", "all", 'bias: "all" (the base\'s biases trained beside the adapters)'),
    ("bias", "lora_only", 'bias: "lora_only"'),
    ("lora_bias", True, "lora_bias: true (a bias trained on each lora_B)"),
    ("rank_pattern", {"q_proj": 2}, 'rank_pattern: {"q_proj": 2} (a rank per layer)'),
    ("alpha_pattern", {"v_proj": 32}, 'alpha_pattern: {"v_proj": 32} (an alpha per layer)'),
    ("layers_to_transform", [0], "layers_to_transform: [0]"),
    ("exclude_modules", ["q_proj"], 'exclude_modules: ["q_proj"]'),
    ("init_lora_weights", "pissa", 'init_lora_weights: "pissa" (trained on a base PEFT changed'),
    ("use_qalora", True, "use_qalora: true"),
    ("a_setting_of_a_later_peft", {"on": 1}, 'a_setting_of_a_later_peft: {"on": 1}'),
]


@pytest.mark.parametrize(("key", "value", "named"), REFUSED, ids=[r[0] for r in REFUSED])
def test_a_folder_with_a_setting_raylift_does_not_train_is_refused_naming_it(
    pretrained: Path,  # noqa: F811
    plain_folder: Path,
    tmp_path: Path,
    key: str,
    value: Any,
    named: str,
) -> None:
    folder = edited(plain_folder, tmp_path / "folder", **{key: value})
    cfg = config_from_dict(adapter_run(pretrained, weights=str(folder)))
    with pytest.raises(WeightsError) as caught:
        check_for_config(cfg, build_task(cfg.task, cfg.task_args))
    said = str(caught.value)
    assert said.startswith(f"model.adapter.weights: {folder} was saved with {named}"), said
    assert "which raylift does not train: merge it into its base (PEFT's merge_and_unload)" in said
    assert "\n" not in said


@pytest.mark.parametrize(
    "text",
    ["[1, 2]", "{not json", '{"r": 4, "lora_alpha": "eight"}', '{"modules_to_save": 7}',
     '{"r": 4, "lora_alpha": 8, "target_modules": [["q_proj"]]}'],
)  # fmt: skip
def test_a_config_that_is_not_peft_s_is_named_in_one_line(
    pretrained: Path,  # noqa: F811
    plain_folder: Path,
    tmp_path: Path,
    text: str,
) -> None:
    folder = tmp_path / "folder"
    shutil.copytree(plain_folder, folder)
    (folder / "adapter_config.json").write_text(text)
    cfg = config_from_dict(adapter_run(pretrained, weights=str(folder)))
    with pytest.raises(WeightsError) as caught:
        check_for_config(cfg, build_task(cfg.task, cfg.task_args))
    said = str(caught.value)
    assert said.startswith(f"model.adapter.weights: {folder}/adapter_config.json is not a PEFT")
    assert "\n" not in said


def test_settings_that_do_not_change_the_meaning_pass(
    pretrained: Path,  # noqa: F811
    plain_folder: Path,
    tmp_path: Path,
) -> None:
    """How the adapters were first drawn, their dropout, PEFT's bookkeeping: loaded as
    they are, the tensors mean the same."""
    inert = {"init_lora_weights": "gaussian", "lora_dropout": 0.1, "inference_mode": False,
             "task_type": "CAUSAL_LM", "peft_version": "0.99.0"}  # fmt: skip
    folder = edited(plain_folder, tmp_path / "folder", **inert)
    cfg = config_from_dict(adapter_run(pretrained, weights=str(folder)))
    check_for_config(cfg, build_task(cfg.task, cfg.task_args))


@pytest.mark.parametrize(
    ("changes", "ours", "named"),
    [
        ({"use_rslora": True}, {}, "use_rslora: true (scale alpha / sqrt(r)); this run's "
         "model.adapter.rslora is false: set model.adapter.rslora: true as they were trained"),
        ({}, {"rslora": True}, "use_rslora: false (scale alpha / r); this run's "
         "model.adapter.rslora is true: set model.adapter.rslora: false"),
        ({"use_dora": True}, {}, "use_dora: true (a trained magnitude per output); this run's "
         "model.adapter.dora is false: set model.adapter.dora: true"),
        ({"modules_to_save": ["norm"]}, {}, 'modules_to_save: ["norm"] (trained whole beside '
         "the adapters); this run's model.adapter.modules_to_save is []"),
    ],
    ids=["rslora-folder", "rslora-run", "dora-folder", "modules_to_save-folder"],
)  # fmt: skip
def test_a_folder_honoured_only_with_the_same_settings(
    pretrained: Path,  # noqa: F811
    plain_folder: Path,
    tmp_path: Path,
    changes: dict,
    ours: dict,
    named: str,
) -> None:
    folder = edited(plain_folder, tmp_path / "folder", **changes)
    cfg = config_from_dict(adapter_run(pretrained, weights=str(folder), **ours))
    with pytest.raises(WeightsError) as caught:
        check_for_config(cfg, build_task(cfg.task, cfg.task_args))
    assert str(caught.value).startswith(f"model.adapter.weights: {folder} was saved with {named}")


def start_logits(rank: int, world: int, runs: dict[str, dict], out: str) -> None:
    """Each run's model as its trainer starts it (before any step): logits on the probe."""
    from tests.helpers import make_trainer, settle

    found = {}
    for name, raw in runs.items():
        reporter = LocalReporter(Path(out).parent / name)
        trainer = make_trainer(config_from_dict(raw), rank, world, reporter, ListTracker())
        found[name] = logits_of(trainer.engine.eval_model, trainer.task.vocab)
        settle(trainer.engine)
    if rank == 0:
        torch.save(found, out)


@pytest.mark.slow
def test_peft_folders_start_a_run_with_peft_logits_or_stop_it(
    pretrained: Path,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """PEFT's own rsLoRA and DoRA folders, as ``model.adapter.weights`` under DDP, FSDP
    and ZeRO-3, start the run with the logits PEFT gives them; a rank_pattern folder
    stops ``raylift train`` with exit 2 and one line, before any worker starts."""
    import yaml

    from raylift.cli import main

    peft = {name: peft_folder(pretrained, tmp_path / name, **{f"use_{name}": True})
            for name in VARIANTS}  # fmt: skip
    runs = {name: adapter_run(pretrained, weights=str(tmp_path / name), **{name: True})
            for name in VARIANTS}  # fmt: skip
    for strategy in ("ddp", "fsdp", "zero3"):
        these = {n: {**raw, "strategy": STRATEGIES[strategy]} for n, raw in runs.items()}
        out = tmp_path / f"{strategy}.pt"
        run_ranks(2, tmp_path, start_logits, these, str(out))
        started = torch.load(out, weights_only=True)
        for name in VARIANTS:
            torch.testing.assert_close(started[name], peft[name], rtol=1e-5, atol=1e-5,
                                       msg=f"{strategy} {name}")  # fmt: skip
    ranked = tmp_path / "ranked"
    peft_folder(pretrained, ranked, rank_pattern={"q_proj": 2})
    config = tmp_path / "ranked.yaml"
    raw = adapter_run(pretrained, weights=str(ranked))
    where = {"storage": str(tmp_path / "runs"), "tracking": {"uri": f"sqlite:///{tmp_path}/m.db"}}
    config.write_text(yaml.safe_dump(merge(raw, where)))
    capsys.readouterr()
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"raylift: model.adapter.weights: {ranked} was saved with rank_pattern: "
        '{"q_proj": 2} (a rank per layer), which raylift does not train: merge it into its '
        "base (PEFT's merge_and_unload) and give that as model.weights with fresh adapters, "
        "or use adapters saved without it"
    ), err


# ------------------------------------------------------------ every strategy, and the exports


@pytest.fixture(scope="module")
def variant_curves(pretrained: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:  # noqa: F811
    """rsLoRA and DoRA trained a few fp32 steps under every strategy, one job each
    (tests/zoo.py's runs): curves, the trained model's logits, checkpoints."""
    found = {}
    for name, strategy in STRATEGIES.items():
        root = tmp_path_factory.mktemp(f"variants-{name}")
        runs = {v: merge(zoo_config(pretrained, strategy, lora=True), {"model": {"adapter": extra}})
                for v, extra in VARIANTS.items()}  # fmt: skip
        run_ranks(2, root, zoo_train, runs, str(root))
        found[name] = {
            "root": root,
            "runs": runs,
            **torch.load(root / "train.pt", weights_only=True),
        }
    return found


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(STRATEGIES) - {"ddp"}))
def test_rslora_and_dora_under_each_strategy_follow_ddp(variant_curves: dict, name: str) -> None:
    ddp = variant_curves["ddp"]
    assert ddp["rslora"]["loss"] != ddp["dora"]["loss"]
    for run in VARIANTS:
        ref, got = ddp[run]["loss"], variant_curves[name][run]["loss"]
        assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1)), run
        for step, loss in ref.items():
            assert got[step] == pytest.approx(loss, rel=1e-5), (name, run, step)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp", "zero3"])
def test_rslora_and_dora_exports_are_what_peft_loads_and_merges(
    pretrained: Path,  # noqa: F811
    variant_curves: dict,
    tmp_path: Path,
    name: str,
) -> None:
    """``--format peft`` says use_rslora / use_dora and loads with
    ``PeftModel.from_pretrained`` to the trained model's logits; ``--format hf`` is, tensor
    for tensor, PEFT's own ``merge_and_unload()`` of that folder."""
    from peft import PeftModel

    runs = variant_curves[name]
    for run in VARIANTS:
        cfg, folder = runs["runs"][run], runs["root"] / run
        export_cli(cfg, folder, "peft", tmp_path / f"{run}-peft")
        export_cli(cfg, folder, "hf", tmp_path / f"{run}-hf")
        said = json.loads((tmp_path / f"{run}-peft" / "adapter_config.json").read_text())
        assert (said["use_rslora"], said["use_dora"]) == (run == "rslora", run == "dora")
        adapted = PeftModel.from_pretrained(load_hf(pretrained), str(tmp_path / f"{run}-peft"))
        trained = runs[run]["logits"]
        got = logits_of(adapted, trained.shape[-1])
        torch.testing.assert_close(got, trained, rtol=1e-5, atol=1e-5, msg=f"{name} {run}")
        merged, ours = adapted.merge_and_unload().state_dict(), load_hf(tmp_path / f"{run}-hf")
        assert ours.state_dict().keys() == merged.keys()
        for key, tensor in ours.state_dict().items():
            torch.testing.assert_close(tensor, merged[key], rtol=0, atol=1e-6, msg=key)
        assert (got - logits_of(load_hf(pretrained), trained.shape[-1])).abs().max() > 1e-3


@pytest.mark.slow  # variant_curves trains under every strategy
def test_a_resume_with_adapters_of_another_meaning_is_refused(variant_curves: dict) -> None:
    """The checkpoint records what its adapters are: rsLoRA turned off (another scale on
    the same tensors) or DoRA turned on stops the resume, naming both."""
    from raylift.run.checkpointing import load_checkpoint
    from raylift.tensors.adapters import meaning
    from raylift.tensors.checkpoints import CheckpointReader
    from raylift.tensors.weights import base_of, weights_path

    runs = variant_curves["fsdp"]
    ckpt = runs["root"] / "rslora" / "checkpoint-step00000002"
    cfg = config_from_dict(runs["runs"]["rslora"])
    base = base_of(cfg, weights_path(cfg, build_task(cfg.task, cfg.task_args)))
    for change, said in (({"rslora": False}, "rslora: True; this run has rslora: False"),
                         ({"dora": True}, "dora: False; this run has dora: True")):  # fmt: skip
        other = AdapterConfig(**{**vars(cfg.model.adapter), **change})
        with pytest.raises(ConfigError) as caught:
            load_checkpoint(CheckpointReader(str(ckpt)), None, 0, "fsdp", base, meaning(other))  # type: ignore[arg-type]
        assert f"model.adapter: checkpoint {ckpt} trained adapters with {said}" in str(caught.value)
