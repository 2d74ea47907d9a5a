"""A chat file that teaches one thing, and a small Llama with a tokenizer trained on it:
what the hf-sft tests and benchmark fine-tune and then ask.

The skill: the user says "Repeat: " and three words, the assistant says the three words
back and stops. Held-out prompts are word triples the file never holds, so an exact
answer means the model learned the skill (and to end its turn), not the lines.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Any

WORDS = ["red", "green", "blue", "black", "white", "gold", "silver", "pink", "cat", "dog",
         "bird", "fish", "horse", "mouse", "lion", "bear", "tree", "rock", "river", "hill",
         "sun", "moon", "star", "rain", "snow", "wind", "fire", "ice", "sand", "salt"]  # fmt: skip
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["[UNK]", "<|im_start|>", "<|im_end|>", "</s>"]
LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
         "max_position_embeddings": 256, "tie_word_embeddings": False}  # fmt: skip
SYSTEMS = ("You repeat what you are told.", "Answer with the words alone.")


def triples(seed: int = 0) -> tuple[list[tuple[str, ...]], list[tuple[str, ...]]]:
    """Every ordered triple of distinct words, shuffled: (train, held out)."""
    every = list(itertools.permutations(WORDS, 3))
    random.Random(seed).shuffle(every)
    return every[:-200], every[-200:]


def conversation(words: tuple[str, ...], system: str | None) -> dict[str, Any]:
    turns = [{"role": "user", "content": "Repeat: " + " ".join(words)},
             {"role": "assistant", "content": " ".join(words)}]  # fmt: skip
    return {"messages": ([{"role": "system", "content": system}] if system else []) + turns}


def write_chats(path: Path, rows: int, seed: int = 0) -> list[tuple[str, ...]]:
    """``rows`` conversations (a system prompt in half of them) to ``path`` as JSONL; the
    held-out triples."""
    train, held_out = triples(seed)
    rng = random.Random(seed + 1)
    with path.open("w") as f:
        for words in train[:rows]:
            f.write(json.dumps(conversation(words, rng.choice((None, *SYSTEMS)))) + "\n")
    return held_out


def model_folder(folder: Path, llama: dict[str, Any] | None = None) -> Path:
    """A Llama config and a byte-level BPE tokenizer trained on the words, with ChatML."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoConfig, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="[UNK]"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    text = " ".join(WORDS) + " Repeat: user assistant system " + " ".join(SYSTEMS)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL, initial_alphabet=alphabet)
    bpe.train_from_iterator([text] * 10, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>", unk_token="[UNK]")
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(folder)
    config = {**LLAMA, **(llama or {}), "vocab_size": len(tokenizer)}
    AutoConfig.for_model(**config).save_pretrained(folder)
    return folder


def answers(model: Any, tokenizer: Any, held_out: list[tuple[str, ...]]) -> int:
    """How many held-out prompts the model answers exactly (greedy, through the chat
    template, stopping at its end of turn)."""
    import torch

    right = 0
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for words in held_out:
        turns = conversation(words, None)["messages"][:1]
        ids = tokenizer.apply_chat_template(turns, add_generation_prompt=True, return_tensors="pt")
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=end,
                                 pad_token_id=end)  # fmt: skip
        said = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=False)
        right += said == " ".join(words) + "<|im_end|>"
    return right


def sft_tensors(task: Any, path: Path) -> dict[str, dict[str, Any]]:
    """``task.preprocess`` of a JSONL file's rows, split by ``task.val_percent`` as prep
    splits them, as tensors (what Ray Data would deliver, without Ray)."""
    import numpy as np
    import torch

    from raylift.data.sources import ERROR_COLUMN, val_rows

    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = np.array(lines, dtype=object)
    where = np.array([f"{path}:{i}" for i in range(1, len(lines) + 1)], dtype=object)
    val = val_rows(records, task.val_percent)
    out = {}
    for split, mask in (("train", ~val), ("val", val)):
        cols = task.preprocess({"where": where[mask], "record": records[mask]})
        cols.pop(ERROR_COLUMN)
        out[split] = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in cols.items()}
    return out


# A chat data set's card as the Hub shows it (``HuggingFaceH4/ultrachat_200k``'s layout):
# its splits' files named by its ``configs``.
CARD = """---
configs:
- config_name: default
  data_files:
  - split: train_sft
    path: data/train_sft-*
  - split: test_sft
    path: data/test_sft-*
---
# Chats to repeat
"""


def chat_parquet(split_words: dict[str, list[tuple[str, ...]]]) -> dict[str, bytes]:
    """A chat data set's files as a Hub repo holds them: ``{"data/NAME.parquet": bytes}``
    for each of ``split_words``' names (``train_sft-00000-of-00001``), a conversation a row."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    files = {}
    for name, words in split_words.items():
        out = io.BytesIO()
        pq.write_table(pa.Table.from_pylist([conversation(w, None) for w in words]), out)
        files[f"data/{name}.parquet"] = out.getvalue()
    return files
