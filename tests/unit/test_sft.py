"""The hf-sft task's data: formats read as conversations, chat templates rendered, the
tokens that carry loss exactly the assistant's (golden tests on a tokenizer trained
here), packing without cross-talk (packed loss against each example alone)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from raylift.tasks import build_task
from raylift.tasks.chat import IGNORE, RowError, best_fit, conversation, detect_format, pack

pytest.importorskip("transformers")

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A second style: a default system prompt when the conversation has none, the answer
# right after the instruction, an end-of-sequence token closing each answer.
WITH_SYSTEM = (
    "{% if messages[0]['role'] != 'system' %}[SYS]You answer briefly.[/SYS]\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'system' %}[SYS]{{ m['content'] }}[/SYS]\n"
    "{% elif m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %} {{ m['content'] }}</s>\n{% endif %}{% endfor %}"
)
SPECIAL = ["[UNK]", "<|im_start|>", "<|im_end|>", "</s>", "[SYS]", "[/SYS]", "[INST]", "[/INST]"]
TEXT = (
    "What is the capital of France? Paris. How many legs has a cat? Four. Say hello. Hello! "
    "Translate cat into French. Chat. You answer briefly. Count to three. One two three. "
) * 20
LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 64, "tie_word_embeddings": False}  # fmt: skip

ROWS = {
    "messages": {"messages": [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "How many legs has a cat?"},
        {"role": "assistant", "content": "Four."}]},
    "sharegpt": {"conversations": [
        {"from": "human", "value": "Say hello."}, {"from": "gpt", "value": "Hello!"}]},
    "alpaca": {"instruction": "Translate into French.", "input": "cat", "output": "Chat."},
    "prompt-completion": {"prompt": "Count to three.", "completion": "One two three."},
}  # fmt: skip
ANSWERS = {
    "messages": ["Paris.", "Four."],
    "sharegpt": ["Hello!"],
    "alpaca": ["Chat."],
    "prompt-completion": ["One two three."],
}
END = {"chatml": "<|im_end|>", "system": "</s>"}


def model_folder(tmp_path: Path, template: str | None) -> Path:
    """A Llama config and a byte-level BPE tokenizer trained here, with ``template``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoConfig, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="[UNK]"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([TEXT], trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    ))  # fmt: skip
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>", unk_token="[UNK]")
    tokenizer.chat_template = template
    folder = tmp_path / "model"
    tokenizer.save_pretrained(folder)
    AutoConfig.for_model(**{**LLAMA, "vocab_size": len(tokenizer)}).save_pretrained(folder)
    return folder


def sft_task(tmp_path: Path, template: str | None = CHATML, **args: Any) -> Any:
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS.values()))
    folder = model_folder(tmp_path, template)
    return build_task("hf-sft", {"model": str(folder), "data": str(data), **args})


def trained_text(task: Any, row: dict[str, Any]) -> list[str]:
    """The trained tokens, decoded, in runs of consecutive ones."""
    enc = task.encode(row)
    runs: list[list[int]] = []
    for i, (tok, on) in enumerate(zip(enc.ids, enc.trained, strict=True)):
        if on:
            if not runs or not enc.trained[i - 1]:
                runs.append([])
            runs[-1].append(tok)
    decode = task.tokenizer.decode
    return [decode(r, skip_special_tokens=False, clean_up_tokenization_spaces=False) for r in runs]


@pytest.mark.parametrize("style", ["chatml", "system"])
@pytest.mark.parametrize("fmt", sorted(ROWS))
def test_the_trained_tokens_spell_the_assistant_turns_and_nothing_else(
    tmp_path: Path, style: str, fmt: str
) -> None:
    template = CHATML if style == "chatml" else WITH_SYSTEM
    task = sft_task(tmp_path, template)
    lead = "" if style == "chatml" else " "  # this template puts a space before the answer
    assert trained_text(task, ROWS[fmt]) == [f"{lead}{a}{END[style]}" for a in ANSWERS[fmt]]


def test_the_last_turn_or_everything_is_trained_when_asked(tmp_path: Path) -> None:
    last = sft_task(tmp_path / "last", train_on="last")
    assert trained_text(last, ROWS["messages"]) == ["Four.<|im_end|>"]
    everything = sft_task(tmp_path / "all", train_on="all")
    whole = (  # ChatML, written out: the conversation as the template renders it
        "<|im_start|>system\nYou answer briefly.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\nParis.<|im_end|>\n"
        "<|im_start|>user\nHow many legs has a cat?<|im_end|>\n"
        "<|im_start|>assistant\nFour.<|im_end|>\n"
    )
    assert trained_text(everything, ROWS["messages"]) == [whole]


def test_text_rows_are_trained_whole_with_the_end_of_text_token(tmp_path: Path) -> None:
    task = sft_task(tmp_path)
    assert trained_text(task, {"text": "Say hello. Hello!"}) == ["Say hello. Hello!</s>"]


def test_the_format_is_found_from_a_rows_keys_and_bad_rows_say_what_is_wrong() -> None:
    assert [detect_format(r) for r in ROWS.values()] == list(ROWS)
    with pytest.raises(ValueError, match=r"set task_args\.format"):
        detect_format({"question": "?"})
    bad = {
        "turn 1 has role 'robot'": {"messages": [{"role": "user", "content": "hi"},
                                                  {"role": "robot", "content": "beep"}]},
        "turn 0 (user) has no content": {"messages": [{"role": "user", "content": " "},
                                                      {"role": "assistant", "content": "?"}]},
        "no assistant turn": {"conversations": [{"from": "human", "value": "hi"}]},
        "no 'output'": {"instruction": "hi", "output": None},
    }  # fmt: skip
    for said, row in bad.items():
        with pytest.raises(RowError, match=re.escape(said)):
            conversation(row, detect_format(row))


def test_a_tokenizer_without_a_template_is_refused_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"task_args\.chat_template"):
        sft_task(tmp_path / "none", template=None)
    task = sft_task(tmp_path / "given", template=None, chat_template=CHATML)
    assert trained_text(task, ROWS["sharegpt"]) == ["Hello!<|im_end|>"]
    (tmp_path / "chatml.jinja").write_text(CHATML)  # or a file holding one
    task = sft_task(tmp_path / "file", template=None, chat_template=str(tmp_path / "chatml.jinja"))
    assert trained_text(task, ROWS["sharegpt"]) == ["Hello!<|im_end|>"]
    with pytest.raises(ValueError, match=r"task_args\.chat_template: .*nope\.jinja"):
        sft_task(tmp_path / "missing", template=None, chat_template=str(tmp_path / "nope.jinja"))


def test_bad_rows_are_counted_by_file_and_line_beside_the_windows(tmp_path: Path) -> None:
    task = sft_task(tmp_path, block_size=48)
    lines = [json.dumps(r) for r in ROWS.values()] + ["{not json", json.dumps({"messages": []})]
    batch = {"where": np.array([f"chat.jsonl:{i}" for i in range(1, 7)], dtype=object),
             "record": np.array(lines, dtype=object)}  # fmt: skip
    out = task.preprocess(batch)
    errors = [e for e in out["_error"] if e]
    assert [e.split(": ")[0] for e in errors] == ["chat.jsonl:5", "chat.jsonl:6"], errors
    good = out["_error"] == ""
    assert good.sum() >= 1 and (out["example"][good].max(1) >= 1).all()
    # Every example of the four is in some window, once.
    assert sum(len(set(row[row > 0])) for row in out["example"][good]) == 4


def test_best_fit_packs_whole_examples_and_positions_restart_at_each() -> None:
    # Longest first, each into the fullest bin it fits: 5+3 and 4+2+2, both full.
    assert sorted(map(sorted, best_fit([5, 4, 3, 2, 2], 8))) == [[0, 2], [1, 3, 4]]
    from raylift.tasks.chat import Encoded

    examples = [Encoded(list(range(n)), [True] * n) for n in (4, 6, 3, 12)]
    packed = pack(examples, block=8)
    assert packed.truncated == 1  # 11 inputs cut to 8
    assert packed.columns()["truncated"].sum() == 1  # prep sums it over the shards
    columns = (packed.input_ids, packed.position_ids, packed.example, packed.labels)
    # Inputs of 3, 5, 2 and 8 tokens (the last cut): 8, then 5+3, then 2; all four in.
    assert len(packed.input_ids) == 3
    assert sum(len(set(ex[ex > 0].tolist())) for ex in packed.example) == 4
    for ids, pos, ex, lab in zip(*columns, strict=True):
        for k in set(ex[ex > 0].tolist()):
            n = int((ex == k).sum())
            assert pos[ex == k].tolist() == list(range(n))
            assert ids[ex == k].tolist() == list(range(n))  # inputs: the example's tokens
            assert lab[ex == k].tolist() == list(range(1, n + 1))  # labels: the next ones
        assert (lab[ex == 0] == IGNORE).all()
    assert pack(examples, block=8, long="drop").dropped == 1


def per_example_and_packed_loss(task: Any, cross: bool = False) -> tuple[float, float]:
    """Sum of the trained tokens' losses over the four examples, packed into windows
    and one example a window. ``cross``: the packed windows attend across examples (a
    plain causal mask over the window, the position ids still restarting)."""
    from torch.nn import functional as F

    torch.manual_seed(0)
    model = task.build_model().eval()
    encoded = [task.encode(r) for r in ROWS.values()]
    sums = []
    for packing in (True, False):
        packed = pack(encoded, task.block_size, packing=packing)
        batch = {k: torch.from_numpy(v).long() for k, v in packed.columns().items()}
        with torch.no_grad():
            if cross and packing:
                logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                               attention_mask=torch.ones_like(batch["input_ids"]),
                               use_cache=False).logits  # fmt: skip
                labels = batch["labels"].flatten()
                loss = F.cross_entropy(
                    logits.flatten(0, 1), labels, ignore_index=IGNORE, reduction="sum"
                )
            else:
                loss = task.eval_sums(model, batch)["loss_sum"]
        sums.append(float(loss))
    return sums[0], sums[1]


def test_the_packed_loss_is_each_examples_loss_alone(tmp_path: Path) -> None:
    task = sft_task(tmp_path, block_size=64)
    assert len(pack([task.encode(r) for r in ROWS.values()], 64).input_ids) < 4  # packed
    packed, alone = per_example_and_packed_loss(task)
    assert packed == pytest.approx(alone, rel=1e-5)
    # Examples that attend to each other in their window: the same check fails.
    crossed, alone = per_example_and_packed_loss(task, cross=True)
    assert crossed != pytest.approx(alone, rel=1e-5)


SFT_RUNS = {
    "ddp": ({"name": "ddp"}, False),
    "fsdp": ({"name": "fsdp"}, False),
    "zero3": ({"name": "deepspeed", "zero_stage": 3,
               "config": {"zero_optimization": {"stage3_param_persistence_threshold": 0}}}, False),
    "zero2": ({"name": "deepspeed", "zero_stage": 2}, False),
    "fairscale": ({"name": "fairscale"}, False),
    "ddp-lora": ({"name": "ddp"}, True),
    "fsdp-lora": ({"name": "fsdp"}, True),
}  # fmt: skip


def train_sft(rank: int, world: int, cfg_dict: dict, data: str, out: str) -> None:
    """Train on the chat file's windows (prepared as prep would, without Ray); rank 0
    keeps the curve."""
    from raylift.validation import config_from_dict
    from tests.chats import sft_tensors
    from tests.helpers import ListTracker, LocalReporter, make_trainer

    cfg = config_from_dict(cfg_dict)
    task = build_task(cfg.task, cfg.task_args)
    tracker = ListTracker()
    reporter = LocalReporter(Path(out).parent / f"r{rank}")
    make_trainer(cfg, rank, world, reporter, tracker, sft_tensors(task, Path(data))).run()
    if rank == 0:
        torch.save({"loss": tracker.series("train_loss"), "val": tracker.series("val_loss")}, out)


@pytest.mark.slow
def test_sft_follows_ddps_curve_under_each_strategy_whole_and_with_lora(tmp_path: Path) -> None:
    """30 steps, fp32, 2 ranks: fsdp, ZeRO-2, ZeRO-3 and fairscale on DDP's curve (1e-5),
    and LoRA adapters under ddp and fsdp on the same curve as each other; both learn (the
    trained tokens' loss falls)."""
    from raylift.core.parsing import merge
    from tests.chats import model_folder, write_chats
    from tests.helpers import SHIPPED_TRAINING, make_config, run_ranks

    folder = model_folder(tmp_path / "model", {"hidden_size": 32, "intermediate_size": 64})
    data = tmp_path / "chats.jsonl"
    write_chats(data, 600)
    curves, vals = {}, {}
    for name, (strategy, lora) in SFT_RUNS.items():
        adapter = {"model": {"adapter": {"type": "lora", "r": 4, "alpha": 8}}} if lora else {}
        run = {"task": "hf-sft", "task_args": {"model": str(folder), "data": str(data),
                                                "block_size": 192},
               "strategy": strategy, "checkpoint": {"every_n_steps": None}, **adapter}  # fmt: skip
        more = {"train": {"max_epochs": 100}}  # the windows of 600 examples, again and again
        cfg = make_config(**merge(merge(run, SHIPPED_TRAINING), more)).to_dict()
        out = tmp_path / name / "run.pt"
        out.parent.mkdir()
        run_ranks(2, tmp_path, train_sft, cfg, str(data), str(out))
        curves[name], vals[name] = torch.load(out, weights_only=True).values()
    for name, ref in (("fsdp", "ddp"), ("zero3", "ddp"), ("zero2", "ddp"), ("fairscale", "ddp"),
                      ("fsdp-lora", "ddp-lora")):  # fmt: skip
        assert sorted(curves[name]) == list(range(1, 31)), name
        for step, loss in curves[ref].items():
            assert curves[name][step] == pytest.approx(loss, rel=1e-5), (name, step)
        # The held-out loss too (the trained tokens' mean over every rank's windows).
        assert vals[name].keys() == vals[ref].keys() and {0, 30} <= vals[ref].keys(), name
        for step, loss in vals[ref].items():
            assert vals[name][step] == pytest.approx(loss, rel=1e-5), (name, step)
    full, lora = curves["ddp"], curves["ddp-lora"]
    assert full[30] < 0.7 * full[1], full
    assert lora[30] < lora[1] - 0.05, lora  # adapters on a random base: slower, but learning
    assert vals["ddp"][30] < vals["ddp"][0], vals["ddp"]


def test_json_and_parquet_files_give_the_rows_jsonl_gives_each_named_by_its_place(
    tmp_path: Path,
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raylift.tasks.sft import _records, first_format

    rows = [ROWS["alpaca"], {**ROWS["alpaca"], "output": "Chien."}]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "a.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    found = {}
    for name in ("a.jsonl", "a.json", "a.parquet"):
        path = str(tmp_path / name)
        got = _records({"path": path, "bytes": (tmp_path / name).read_bytes()})
        found[name] = [json.loads(r["record"]) for r in got]
        assert [r["where"] for r in got][1].startswith(path), got
        assert first_format(str(tmp_path), path) == "alpaca"
    assert found["a.jsonl"] == found["a.json"] == found["a.parquet"] == rows
    assert (
        _records({"path": "x.jsonl", "bytes": b'{"a": 1}\n\n{"b": 2}\n'})[1]["where"] == "x.jsonl:3"
    )


def test_unpacked_a_batch_is_cut_to_its_longest_example_not_to_the_block(tmp_path: Path) -> None:
    task = sft_task(tmp_path, packing=False, block_size=128)
    windows = pack([task.encode(r) for r in ROWS.values()], 128, packing=False).columns()
    assert windows["input_ids"].shape == (4, 128)
    cut = task.transform(windows, np.random.default_rng(0))
    longest = int((windows["example"] > 0).sum(1).max())
    assert longest < 128 and cut["input_ids"].shape == cut["labels"].shape == (4, longest)
    assert (cut["labels"] != IGNORE).sum() == (windows["labels"] != IGNORE).sum()  # no loss cut
