"""LoRA adapters on a pretrained Llama under every strategy: the base frozen and never
changed, the adapters trained alike on every rank, each strategy's curve DDP's."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")

from raylift.core.config import AdapterConfig
from raylift.core.parsing import merge
from raylift.run.loop import initial_weights
from raylift.tasks import build_task
from raylift.tensors.adapters import attach, base_name, is_adapter, targets, trainable_numel
from raylift.tensors.init import write_in_place
from raylift.validation import config_from_dict
from tests.corpora import documents
from tests.helpers import (
    GPT_SMALL,
    SHIPPED_TRAINING,
    ListTracker,
    LocalReporter,
    make_config,
    run_ranks,
)
from tests.unit.test_hf import LLAMA
from tests.unit.test_init import ZERO3, whole_params

STRATEGIES = {
    "ddp": {"name": "ddp"},
    "fsdp": {"name": "fsdp"},
    "zero1": {"name": "deepspeed", "zero_stage": 1},
    "zero2": {"name": "deepspeed", "zero_stage": 2},
    "zero3": {"name": "deepspeed", "zero_stage": 3, "config": ZERO3},
    "fairscale": {"name": "fairscale"},
}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama as a user has one: ``save_pretrained`` of random weights, with a BPE
    tokenizer trained here on standard-library text (nothing downloaded; not the tests'
    own files, an edit to which would change the runs' tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    text = documents(30)
    bpe = Tokenizer(models.BPE(unk_token="[UNK]"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    bpe.train_from_iterator(
        text, trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]", "<eos>"])
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>", unk_token="[UNK]")
    folder = tmp_path_factory.mktemp("llama")
    config = AutoConfig.for_model(**{**LLAMA, "vocab_size": len(tokenizer)})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def lora_run(folder: Path, strategy: dict, **more: Any) -> dict:
    return make_config(
        **merge(
            {
                "task": "hf-causal-lm",
                "task_args": {
                    "model": str(folder),
                    "block_size": 32,
                    "max_bytes": 300_000,
                    "val_percent": 1,
                },
                "model": {"adapter": {"type": "lora", "r": 8, "alpha": 16}},
                "strategy": strategy,
                "checkpoint": {"every_n_steps": 15},
                **SHIPPED_TRAINING,
            },
            more,
        )
    ).to_dict()


@pytest.mark.slow
def test_lora_goes_on_every_linear_layer_but_the_head_and_starts_as_the_base(
    pretrained: Path,
) -> None:
    task = build_task("hf-causal-lm", {"model": str(pretrained), "block_size": 32})
    base = task.build_model()
    chosen = targets(base, "all-linear")
    assert "lm_head" not in chosen and len(chosen) == 2 * 7  # q k v o gate up down, 2 layers
    model = attach(task.build_model(), AdapterConfig(type="lora", r=8))
    trainable, frozen = trainable_numel(model)
    d, ff = LLAMA["hidden_size"], LLAMA["intermediate_size"]
    per_layer = 8 * (4 * (d + d) + 2 * (d + ff) + (ff + d))  # r x (in + out) per adapter
    assert trainable == 2 * per_layer and frozen == trainable_numel(base)[0]
    for name, p in model.named_parameters():
        assert p.requires_grad == is_adapter(name), name
    assert {base_name(n) for n, _ in model.named_parameters() if not is_adapter(n)} == {
        n for n, _ in base.named_parameters()
    }
    # Drawn and loaded as a run does: the base's weights, B zero, so the same logits.
    for m in (base, model):
        initial_weights(m, task, 0, str(pretrained), False, {}, write_in_place)
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    lora_a = [p for n, p in model.named_parameters() if "lora_A" in n]
    assert all(bool(a.abs().sum() > 0) for a in lora_a)
    with torch.no_grad():
        assert torch.equal(model(input_ids=tokens).logits, base(input_ids=tokens).logits)


def moment_numel(engine: Any) -> int:
    """The optimizer state this rank holds, in elements of one Adam moment."""
    if hasattr(engine, "ds"):
        return sum(t.numel() for t in engine._master_partitions())
    inner = getattr(engine.optimizer, "optim", engine.optimizer)
    moments = [s["exp_avg"] for s in inner.state.values()]
    return sum(getattr(m, "to_local", lambda m=m: m)().numel() for m in moments)


def on_every_rank(engine: Any) -> dict[str, torch.Tensor]:
    """The whole parameters, gathered on every rank (not on rank 0 alone)."""
    if hasattr(engine, "ds"):
        return whole_params(engine)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(engine.model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().float().clone() for k, v in full.items()}


def train_watching_adapters(rank: int, world: int, cfg_dict: dict, out: str) -> None:
    """Train; after every optimizer step every rank gathers the whole adapters and the
    ranks compare digests of them. Rank 0 keeps the curve, the verdicts, the final
    parameters and each rank's optimizer state size."""
    import torch.distributed as dist

    from tests.helpers import make_trainer, settle

    tracker = ListTracker()
    cfg = config_from_dict(cfg_dict)
    trainer = make_trainer(cfg, rank, world, LocalReporter(Path(out).parent), tracker)
    engine, step, agreed = trainer.engine, trainer.engine.step, []

    def watched() -> Any:
        result = step()
        settle(engine)  # ZeRO-3: no gather of the next step's weights left in flight
        adapters = {k: v for k, v in on_every_rank(engine).items() if is_adapter(k)}
        digest = hashlib.sha256(b"".join(v.numpy().tobytes() for v in adapters.values()))
        digests: list[Any] = [None] * world
        dist.all_gather_object(digests, (len(adapters), digest.hexdigest()))
        agreed.append(len(set(digests)) == 1 and digests[0][0] > 0)
        return result

    engine.step = watched  # type: ignore[method-assign]
    trainer.run()
    settle(engine)
    params = whole_params(engine)
    held: list[Any] = [None] * world
    dist.all_gather_object(held, moment_numel(engine))
    if rank == 0:
        torch.save(
            {"loss": tracker.series("train_loss"), "agreed": agreed, "params": params,
             "moments": held, "dir": str(Path(out).parent), "dtypes": dtypes(engine)},
            out,
        )  # fmt: skip


def dtypes(engine: Any) -> dict[str, list[str]]:
    """The dtypes this rank holds: the frozen base's, the adapters' in the module, and
    the copy the optimizer updates (DeepSpeed's master partitions; else the adapters)."""
    module = engine.ds.module if hasattr(engine, "ds") else engine.model
    held: dict[str, set[str]] = {"base": set(), "adapters": set()}
    for param in module.parameters():
        held["adapters" if param.requires_grad else "base"].add(str(param.dtype))
    zero = engine.ds.optimizer if hasattr(engine, "ds") else None
    names = ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups")
    masters = [t for name in names for t in getattr(zero, name, None) or []]
    held["updated"] = {str(t.dtype) for t in masters} or held["adapters"]
    return {k: sorted(v) for k, v in held.items()}  # lists: torch.load(weights_only) reads them


@pytest.fixture(scope="module")
def lora_curves(pretrained: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("lora")
    found = {}
    for name, strategy in STRATEGIES.items():
        out = tmp / name / "run.pt"
        run_ranks(2, tmp, train_watching_adapters, lora_run(pretrained, strategy), str(out))
        found[name] = torch.load(out, weights_only=True)
        found[name]["dir"] = Path(found[name]["dir"])
    return found


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(STRATEGIES) - {"ddp"}))
def test_lora_under_each_strategy_follows_ddp_with_the_base_untouched(
    pretrained: Path, lora_curves: dict, name: str
) -> None:
    from safetensors.torch import load_file

    ref, got = lora_curves["ddp"], lora_curves[name]
    assert sorted(got["loss"]) == sorted(ref["loss"]) == list(range(1, 31))
    assert ref["loss"][30] < ref["loss"][1] - 0.05  # the adapters learned, on a random base
    for step, loss in ref["loss"].items():
        assert got["loss"][step] == pytest.approx(loss, rel=1e-5), (name, step)
    assert len(got["agreed"]) == 30 and all(got["agreed"]), got["agreed"]
    base = load_file(pretrained / "model.safetensors")
    trained = {k.removeprefix("module."): v for k, v in got["params"].items()}  # fairscale's
    for key, value in trained.items():
        if not is_adapter(key):
            tied = base["model.embed_tokens.weight"]  # the head, tied: not in the files
            assert torch.equal(value, base.get(base_name(key), tied).float()), key
    trainable = sum(v.numel() for k, v in trained.items() if is_adapter(k))
    held = sum(got["moments"])  # each rank its shard or partition
    # ZeRO pads each rank's partition to an aligned size; nothing else is held.
    assert trainable <= held <= trainable + 64 * len(got["moments"]), (held, trainable)


def resume_watching(rank: int, world: int, cfg_dict: dict, ckpt: str, out: str) -> None:
    """Restore ``ckpt`` at this world size and train on; rank 0 keeps the restored
    parameters and the curve after it."""
    from tests.helpers import make_trainer, settle

    tracker = ListTracker()
    trainer = make_trainer(
        config_from_dict(cfg_dict), rank, world, LocalReporter(Path(out).parent / "again"), tracker
    )
    trainer.restore(Path(ckpt))
    settle(trainer.engine)
    restored = whole_params(trainer.engine)
    trainer.run()
    if rank == 0:
        torch.save({"params": restored, "loss": tracker.series("train_loss")}, out)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp", "zero3"])
def test_an_adapter_checkpoint_holds_what_trains_and_resumes_at_two_and_one_rank(
    pretrained: Path, lora_curves: dict, tmp_path: Path, name: str
) -> None:
    """The checkpoint at step 15 holds the adapters and their optimizer state, not the
    base; resumed at 2 ranks, and at 1 accumulating what 2 did, the curve is the
    uninterrupted one; at 1 rank the adapters are exactly those saved and the base exactly
    the pretrained one."""
    from safetensors.torch import load_file

    from raylift.strategies import spec_for
    from raylift.tensors.checkpoints import CheckpointReader

    run = lora_curves[name]["dir"]
    ckpt = run / "checkpoint-step00000015"
    adapters = {k: v for k, v in lora_curves[name]["params"].items() if is_adapter(k)}
    trainable = sum(v.numel() for v in adapters.values())
    saved = spec_for(STRATEGIES[name]["name"]).read_export(CheckpointReader(str(ckpt)))
    assert {s.name for s in saved.specs} == set(adapters)  # no tensor of the base
    held = sum(p.stat().st_size for p in (ckpt / "engine").rglob("*") if p.is_file())
    # Weights and two moments in fp32; the format's own bytes are per tensor, not per
    # weight: each rank's piece of each tensor (about 2 KiB) and the metadata.
    pieces = 3 * len(adapters) * 2
    assert held <= 3 * 4 * trainable + pieces * 2560 + 96 * 1024, (held, trainable)
    cfg = lora_run(pretrained, STRATEGIES[name])
    full = lora_curves[name]["loss"]
    run_ranks(2, tmp_path, resume_watching, cfg, str(ckpt), str(tmp_path / "two.pt"))
    two = torch.load(tmp_path / "two.pt", weights_only=True)
    assert sorted(two["loss"]) == list(range(16, 31))
    for step, loss in two["loss"].items():
        assert loss == pytest.approx(full[step], rel=1e-6), (name, step)
    # 2 -> 1 as an elastic run does it: the one rank accumulates both ranks' micro-batches,
    # the same rows in each step, so the curve goes on as the uninterrupted one.
    elastic = lora_run(pretrained, STRATEGIES[name], scaling={"num_workers": [1, 2]})
    run_ranks(1, tmp_path, resume_watching, elastic, str(ckpt), str(tmp_path / "one.pt"))
    one = torch.load(tmp_path / "one.pt", weights_only=True)
    assert sorted(one["loss"]) == list(range(16, 31))
    for step, loss in one["loss"].items():
        assert loss == pytest.approx(full[step], rel=1e-6), (name, step)
    base = load_file(pretrained / "model.safetensors")
    for key, value in one["params"].items():
        tied = base["model.embed_tokens.weight"]  # the head: not in the files, tied
        expected = two["params"][key] if is_adapter(key) else base.get(base_name(key), tied)
        assert torch.equal(value, expected.float()), key


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp", "zero3"])
def test_adapters_trained_on_one_rank_resume_on_two_on_the_one_rank_curve(
    pretrained: Path, lora_curves: dict, tmp_path: Path, name: str
) -> None:
    """1 -> 2: an elastic run on one rank (accumulating what two do), resumed from its
    step-15 checkpoint on two, goes on as the one-rank run does (within 1e-6); and the
    one-rank run follows the two-rank one as far as fp32 sums in another order allow."""
    from tests.helpers import train_keep_checkpoints

    elastic = lora_run(pretrained, STRATEGIES[name], scaling={"num_workers": [1, 2]})
    run_ranks(1, tmp_path, train_keep_checkpoints, elastic, str(tmp_path / "one"))
    one = torch.load(tmp_path / "one" / "loss.pt", weights_only=True)
    ckpt = tmp_path / "one" / "checkpoint-step00000015"
    run_ranks(2, tmp_path, resume_watching, elastic, str(ckpt), str(tmp_path / "two.pt"))
    two = torch.load(tmp_path / "two.pt", weights_only=True)["loss"]
    assert sorted(two) == list(range(16, 31))
    for step, loss in two.items():
        assert loss == pytest.approx(one[step], rel=1e-6), (name, step)
    # The same rows in every step; one rank sums two micro-batches' gradients where two
    # ranks all-reduce theirs: the last bits differ, and Adam carries them on.
    full = lora_curves[name]["loss"]
    assert all(loss == pytest.approx(full[s], rel=1e-4) for s, loss in one.items()), name


@pytest.mark.slow  # lora_curves trains under every strategy
def test_a_resume_on_another_base_is_refused_naming_both(
    pretrained: Path, lora_curves: dict, tmp_path: Path
) -> None:
    import shutil

    from raylift.core.config import ConfigError
    from raylift.run.checkpointing import load_checkpoint
    from raylift.tensors.checkpoints import CheckpointReader

    other = tmp_path / "other"
    shutil.copytree(pretrained, other)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(other, local_files_only=True)
    model.to(torch.bfloat16).save_pretrained(other)  # another base: its headers differ
    ckpt = lora_curves["fsdp"]["dir"] / "checkpoint-step00000015"
    from raylift.tensors.weights import base_of

    cfg = config_from_dict(lora_run(other, STRATEGIES["fsdp"]))
    base = base_of(cfg, str(other))
    with pytest.raises(ConfigError) as caught:
        load_checkpoint(CheckpointReader(str(ckpt)), None, 0, "fsdp", base)  # type: ignore[arg-type]
    said = str(caught.value)
    assert f"trained adapters on the base {pretrained}" in said and f"base is {other}" in said


def start_watching(rank: int, world: int, cfg_dict: dict, out: str) -> None:
    """Build the run's trainer (its initial weights) and keep them, on rank 0."""
    from tests.helpers import make_trainer, settle

    cfg = config_from_dict(cfg_dict)
    trainer = make_trainer(cfg, rank, world, LocalReporter(Path(out).parent), ListTracker())
    settle(trainer.engine)
    params = whole_params(trainer.engine)
    if rank == 0:
        torch.save({"params": params}, out)


@pytest.mark.slow
def test_registered_adapters_train_again_from_the_registry_on_the_same_base(
    pretrained: Path, lora_curves: dict, tmp_path: Path
) -> None:
    """The fsdp run's adapters, logged to MLflow (a sqlite store) and registered as a run
    logs them, are where a new run starts with ``model.adapter.weights: models:/NAME/1``:
    fetched into its folder, checked, and loaded bit for bit (here under ZeRO-3). Adapters
    of another rank, or trained on another base, are refused naming both."""
    import shutil

    from transformers import AutoModelForCausalLM

    from raylift.artifacts.mlmodel import fetch_weights, model_folder
    from raylift.artifacts.tracking import start_run
    from raylift.artifacts.tracking_service import Store
    from raylift.tensors.preflight import check_for_config
    from raylift.tensors.weights import WeightsError

    run = lora_curves["fsdp"]["dir"]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = config_from_dict(lora_run(pretrained, STRATEGIES["fsdp"], tracking={"uri": uri}))
    logged = tmp_path / "logged"
    logged.mkdir()
    assert model_folder(str(run / "checkpoint-step00000030"), cfg, str(run), logged) == "peft"
    run_id = start_run(cfg, str(tmp_path / "runs"), resume=False, world_size=2)
    _, registered = Store(uri).log_model(run_id, str(logged), {}, "llama-lora")
    assert registered == "models:/llama-lora/1"
    again = config_from_dict(lora_run(pretrained, STRATEGIES["zero3"],
                                      model={"adapter": {"weights": registered}}))  # fmt: skip
    said: list[str] = []
    fetched = fetch_weights(again, str(tmp_path / "again"), uri, said.append)
    staged = fetched.model.adapter.weights
    assert staged == str(tmp_path / "again" / "adapter-weights")
    assert said and said[0].startswith(f"raylift: model.adapter.weights {registered} -> {staged}")
    run_ranks(2, tmp_path, start_watching, fetched.to_dict(), str(tmp_path / "start.pt"))
    started = torch.load(tmp_path / "start.pt", weights_only=True)["params"]
    trained = lora_curves["fsdp"]["params"]  # after its last step, whose checkpoint was logged
    adapters = [k for k in trained if is_adapter(k)]
    assert adapters and all(torch.equal(started[k], trained[k]) for k in adapters)
    task = build_task(again.task, again.task_args)
    wider = config_from_dict(lora_run(pretrained, STRATEGIES["fsdp"],
                                      model={"adapter": {"r": 4, "weights": staged}}))  # fmt: skip
    with pytest.raises(WeightsError) as caught:
        check_for_config(wider, task)
    assert "holds LoRA r=8 alpha=16" in str(caught.value) and "is r=4" in str(caught.value)
    other = tmp_path / "other"
    shutil.copytree(pretrained, other)
    model = AutoModelForCausalLM.from_pretrained(other, local_files_only=True)
    model.to(torch.bfloat16).save_pretrained(other)  # another base: its headers differ
    moved = config_from_dict(lora_run(other, STRATEGIES["fsdp"],
                                      model={"adapter": {"weights": staged}}))  # fmt: skip
    with pytest.raises(WeightsError) as caught:
        check_for_config(moved, build_task(moved.task, moved.task_args))
    assert f"trained on the base {pretrained}" in str(caught.value), caught.value
    assert f"this run's base is {other}" in str(caught.value)


def export_cli(cfg: dict, run: Path, fmt: str, out: Path) -> None:
    import yaml

    from raylift.cli import main

    config = run / "export.yaml"
    config.write_text(yaml.safe_dump(cfg))
    args = ["export", str(run), "--format", fmt, "--out", str(out), "--config", str(config)]
    assert main(args) == 0


@pytest.mark.slow  # lora_curves trains under every strategy
@pytest.mark.parametrize("name", ["fsdp", "zero3"])
def test_the_peft_folder_and_the_merged_model_give_the_same_logits(
    pretrained: Path, lora_curves: dict, tmp_path: Path, name: str
) -> None:
    """``--format peft`` loads with ``PeftModel.from_pretrained`` on the base; ``--format
    hf`` is the base with the adapters merged; their logits agree and differ from the
    base's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = lora_run(pretrained, STRATEGIES[name])
    run = lora_curves[name]["dir"]
    export_cli(cfg, run, "peft", tmp_path / "peft")
    export_cli(cfg, run, "hf", tmp_path / "merged")
    export_cli(cfg, run, "safetensors", tmp_path / "merged.safetensors")
    from safetensors.torch import load_file

    one_file = load_file(tmp_path / "merged.safetensors")
    folder = load_file(tmp_path / "merged" / "model.safetensors")
    assert one_file.keys() == folder.keys()
    assert all(torch.equal(one_file[k], folder[k]) for k in folder)
    assert (tmp_path / "peft" / "adapter_config.json").is_file()
    assert (tmp_path / "merged" / "tokenizer.json").is_file()

    def load(folder: Path) -> Any:
        return AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()

    adapted = PeftModel.from_pretrained(load(pretrained), str(tmp_path / "peft")).eval()
    tokens = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = {
            "peft": adapted(input_ids=tokens).logits,
            "merged": load(tmp_path / "merged")(input_ids=tokens).logits,
            "base": load(pretrained)(input_ids=tokens).logits,
        }
    torch.testing.assert_close(logits["peft"], logits["merged"], rtol=1e-5, atol=1e-5)
    assert (logits["peft"] - logits["base"]).abs().max() > 1e-3


def test_a_sweep_searches_the_adapters_rank_and_alpha(pretrained: Path) -> None:
    from raylift.commands.tune import param_space, parse_sweep

    space = {
        "model.adapter.r": {"choice": [4, 16]},
        "model.adapter.alpha": {"uniform": [8.0, 32.0]},
    }
    cfg = config_from_dict(merge(lora_run(pretrained, {"name": "ddp"}), {"tune": {"space": space}}))
    assert set(param_space(parse_sweep(cfg))) == set(space)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp", "zero3"])
def test_bf16_true_lora_keeps_the_base_bf16_and_follows_the_fp32_curve(
    pretrained: Path, lora_curves: dict, tmp_path: Path, name: str
) -> None:
    """bf16-true: the frozen base in bf16, the adapters (DeepSpeed: their master copy)
    in fp32; no dtype errors, the curve within 2e-2 of fp32's."""
    cfg = lora_run(pretrained, STRATEGIES[name], precision="bf16-true")
    out = tmp_path / "run.pt"
    run_ranks(2, tmp_path, train_watching_adapters, cfg, str(out))
    result = torch.load(out, weights_only=True)
    got, ref = result["loss"], lora_curves[name]["loss"]
    assert result["dtypes"]["base"] == ["torch.bfloat16"], result["dtypes"]
    assert result["dtypes"]["updated"] == ["torch.float32"], result["dtypes"]
    assert sorted(got) == sorted(ref)
    for step, loss in ref.items():
        assert got[step] == pytest.approx(loss, rel=2e-2), (name, step)


@pytest.mark.slow
def test_a_users_own_model_trains_adapters_under_ddp_and_fsdp_alike(tmp_path: Path) -> None:
    """Not a Hugging Face model: the gpt task's own nn.Module, its base drawn from the
    seed. Both strategies follow one curve, and leave the base as drawn."""
    found = {}
    for name in ("ddp", "fsdp"):
        over = {"model": {"adapter": {"type": "lora", "r": 4}}, "strategy": STRATEGIES[name],
                "train": {"max_steps": 8}}  # fmt: skip
        cfg = make_config(**merge(GPT_SMALL, over)).to_dict()
        out = tmp_path / name / "run.pt"
        run_ranks(2, tmp_path, train_watching_adapters, cfg, str(out))
        found[name] = torch.load(out, weights_only=True)
    ddp, fsdp = found["ddp"], found["fsdp"]
    assert len(fsdp["agreed"]) == 8 and all(fsdp["agreed"]), fsdp["agreed"]  # every step
    assert ddp["loss"][8] < ddp["loss"][1]
    for step, loss in ddp["loss"].items():
        assert fsdp["loss"][step] == pytest.approx(loss, rel=1e-5), step
    for key, value in ddp["params"].items():
        if not is_adapter(key):
            assert torch.equal(fsdp["params"][key], value), key
