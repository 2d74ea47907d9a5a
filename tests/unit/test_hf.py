"""The hf-causal-lm task: a Hugging Face Llama from an inline config, trained under every
sharding strategy, exported as a from_pretrained folder and started from again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from raylift.artifacts.export import consolidated_state_dict
from raylift.cli import main
from raylift.core.parsing import merge
from raylift.data.manifest import task_fingerprint
from raylift.tasks import build_task
from tests.helpers import (
    GPT_SMALL,
    make_config,
    run_ranks,
    train_and_record,
    train_keep_checkpoints,
)
from tests.unit.test_init import STRATEGIES, initial_params

LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 256,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}
TASK_ARGS = {"model": LLAMA, "block_size": 32, "max_bytes": 300_000, "val_percent": 1}


def hf_config(**more: dict) -> dict:
    base = {k: v for k, v in GPT_SMALL.items() if k != "task_args"}
    return make_config(
        **merge(base, {"task": "hf-causal-lm", "task_args": TASK_ARGS, **more})
    ).to_dict()


def test_layers_are_found_and_a_model_neither_folder_nor_hub_id_refused() -> None:
    task = build_task("hf-causal-lm", TASK_ARGS)
    model = task.build_model()
    assert [type(b).__name__ for b in task.blocks(model)] == ["LlamaDecoderLayer"] * 2
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # Hub IDs: tests/unit/test_hub.py, against a Hub on 127.0.0.1.
    for model_arg in ("./no/such/folder", "org/name/extra"):
        with pytest.raises(ValueError, match=r"neither a local folder nor a Hugging Face Hub"):
            build_task("hf-causal-lm", {"model": model_arg})


@pytest.mark.slow
def test_every_strategy_starts_equal_and_follows_ddp(tmp_path: Path) -> None:
    runs = {name: hf_config(strategy=s) for name, s in STRATEGIES.items()}
    run_ranks(2, tmp_path, initial_params, runs, str(tmp_path / "init.pt"))
    found = torch.load(tmp_path / "init.pt", weights_only=True)
    for name in ("fsdp", "zero3"):
        assert found[name]["meta_or_partitioned"]
        for k, v in found["ddp"]["params"].items():
            torch.testing.assert_close(found[name]["params"][k], v, rtol=0, atol=0, msg=k)
    curves = {}
    for name, cfg in runs.items():
        cfg = merge(cfg, {"train": {"max_steps": 12}})
        out = tmp_path / name / "loss.pt"
        run_ranks(2, tmp_path, train_and_record, cfg, str(out))
        curves[name] = torch.load(out, weights_only=True)
    ref = curves["ddp"]
    assert ref[12] < ref[1]
    for name in ("fsdp", "zero3"):
        for step, loss in ref.items():
            assert curves[name][step] == pytest.approx(loss, rel=1e-5), (name, step)


def test_export_hf_round_trip_and_fine_tune_start(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    cfg = hf_config(strategy={"name": "fsdp"}, train={"max_steps": 6})
    run_ranks(2, tmp_path, train_keep_checkpoints, cfg, str(tmp_path / "run"))
    out = tmp_path / "hf"
    yaml_cfg = tmp_path / "run.yaml"
    yaml_cfg.write_text(__import__("yaml").safe_dump(cfg))
    assert (
        main(
            [
                "export",
                str(tmp_path / "run"),
                "--format",
                "hf",
                "--out",
                str(out),
                "--config",
                str(yaml_cfg),
            ]
        )
        == 0
    )
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    task = build_task("hf-causal-lm", TASK_ARGS)
    ours = task.build_model().eval()
    ours.load_state_dict(consolidated_state_dict(tmp_path / "run"), strict=False)
    batch = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(input_ids=batch).logits, ours(input_ids=batch).logits, rtol=1e-5, atol=1e-5
        )
    # The tied head once, as save_pretrained (and a ZeRO-3 run's export) writes it: the
    # FSDP checkpoint lists it under both names, the run recorded that they are one.
    ours.save_pretrained(tmp_path / "saved")
    assert tensor_names(out / "model.safetensors") == tensor_names(
        tmp_path / "saved" / "model.safetensors"
    )
    assert "lm_head.weight" not in tensor_names(out / "model.safetensors")
    assert len(tensor_names(out / "model.safetensors")) == 20
    # Above --max-shard-size the weights are split into files with an index, as
    # save_pretrained splits a model of many GB; both from_pretrained and model.weights read it.
    sharded = tmp_path / "hf-sharded"
    args = ["export", str(tmp_path / "run"), "--format", "hf", "--out", str(sharded)]
    assert main([*args, "--config", str(yaml_cfg), "--max-shard-size", "100KB"]) == 0
    files = sorted(sharded.glob("model-*-of-*.safetensors"))
    assert len(files) > 2 and (sharded / "model.safetensors.index.json").is_file()
    assert not (sharded / "model.safetensors").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(sharded, local_files_only=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=batch).logits, loaded(input_ids=batch).logits)
    # A second run from the sharded export starts exactly where the first ended.
    second = {"ddp": merge(hf_config(), {"task_args": {"model": str(sharded)}})}
    run_ranks(2, tmp_path, initial_params, second, str(tmp_path / "second.pt"))
    start = torch.load(tmp_path / "second.pt", weights_only=True)["ddp"]["params"]
    for k, v in ours.state_dict().items():
        torch.testing.assert_close(start[k], v.float(), rtol=0, atol=0, msg=k)


def tensor_names(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return sorted(f.keys())


def llama_with_a_tokenizer(folder: Path, text: list[str]) -> Any:
    """A model folder (config + a small BPE tokenizer trained on ``text``, no weights)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoConfig, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="[UNK]"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    bpe.train_from_iterator(
        text, trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]", "<eos>"])
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>", unk_token="[UNK]")
    tokenizer.save_pretrained(folder)
    AutoConfig.for_model(**{**LLAMA, "vocab_size": len(tokenizer)}).save_pretrained(folder)
    return tokenizer


def test_a_folder_with_a_tokenizer_trains_on_its_tokens(tmp_path: Path) -> None:
    """A local folder (config + tokenizer, no weights): text is tokenised, not bytes."""
    text = [Path(__file__).read_text(), Path(__file__).with_name("test_init.py").read_text()]
    folder = tmp_path / "llama"
    tokenizer = llama_with_a_tokenizer(folder, text)

    task = build_task("hf-causal-lm", {"model": str(folder), "block_size": 16})
    assert task.tokenizer is not None and task.pretrained_weights is None
    rows = task.preprocess({"doc": [t.encode() for t in text]})["tokens"]
    assert rows.shape[1] == 17 and len(rows) > 10
    assert rows.max() < len(tokenizer) and (rows == tokenizer.eos_token_id).any()
    ids = tokenizer(text[0], add_special_tokens=False)["input_ids"]
    assert rows[0].tolist() == ids[:17]  # the text's own tokens, in order
    model = task.build_model()
    loss = task.loss(model, task.finish({"tokens": torch.from_numpy(rows[:4])}, torch.float32))
    assert torch.isfinite(loss) and float(loss.detach()) > 0
    assert set(task.summarize({"loss_sum": 8.0, "count": 4.0})) == {"val_loss", "val_ppl"}

    # The shards' fingerprint follows the tokenizer: new tokens mean new rows.
    cfg = make_config(task="hf-causal-lm", task_args={"model": str(folder), "block_size": 16})
    before = task_fingerprint(cfg, task)
    assert task_fingerprint(cfg, build_task(cfg.task, cfg.task_args)) == before
    tokenizer.add_tokens(["raylift"])
    tokenizer.save_pretrained(folder)
    assert task_fingerprint(cfg, build_task(cfg.task, cfg.task_args)) != before


def test_one_text_file_is_split_by_its_tokens_windows(tmp_path: Path) -> None:
    """The gpt task's corpus reader: one text file is split by window, here windows of the
    tokenizer's tokens, each in one split; max_bytes caps the text tokenised."""
    from raylift.data.shards import _preprocess_by_split
    from raylift.data.sources import SPLIT_COLUMN, RowSplit, val_outputs

    text = Path(__file__).read_text() + Path(__file__).with_name("test_init.py").read_text()
    tokenizer = llama_with_a_tokenizer(tmp_path / "llama", [text])
    (tmp_path / "corpus.txt").write_text(text)
    args = {"model": str(tmp_path / "llama"), "block_size": 16, "val_percent": 20}
    task = build_task("hf-causal-lm", {**args, "corpus": str(tmp_path / "corpus.txt"),
                                       "max_bytes": 10_000})  # fmt: skip
    both = task.sources()["train"]
    assert isinstance(both, RowSplit) and both.outputs == "window"
    rows = _preprocess_by_split(both.dataset, task.preprocess, key="file", percent=20,
                                outputs=True)  # fmt: skip
    read = text.encode()[:12_000].decode(errors="replace")  # max_bytes + 20% of it
    ids = tokenizer(read, add_special_tokens=False)["input_ids"]
    ids.append(tokenizer.eos_token_id)
    n = (len(ids) - 1) // 16
    val = val_outputs("corpus.txt", n, 20)
    for split, mask in (("train", ~val), ("val", val)):
        got = rows["tokens"][rows[SPLIT_COLUMN] == split].tolist()
        assert got == [ids[i * 16 : i * 16 + 17] for i in np.flatnonzero(mask)], split
        assert got, split
