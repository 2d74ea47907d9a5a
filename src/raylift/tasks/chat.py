"""Instruction and chat data as a causal language model trains on it: rows of the common
formats as conversations, rendered with a chat template, each token marked trained (the
assistant's words and its end of turn) or not, and examples packed into windows whose
position ids restart at every example.

Pure functions on Python and numpy values: the ``hf-sft`` task (:mod:`raylift.tasks.sft`)
runs them offline, in prep; ``raylift prep --show`` reads their output back.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

FORMATS = ("messages", "sharegpt", "alpaca", "prompt-completion", "text")
TRAIN_ON = ("assistant", "last", "all")
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system",
                  "user": "user", "assistant": "assistant"}  # fmt: skip
IGNORE = -100  # a label that carries no loss (torch's cross_entropy ignore_index)

Message = dict[str, str]


class RowError(ValueError):
    """A row that is not a usable example; the message says what is wrong with it."""


def detect_format(keys: Iterable[str]) -> str:
    """The format a row's keys name (``task_args.format: auto``)."""
    found = set(keys)
    for fmt, needs in (
        ("messages", {"messages"}),
        ("sharegpt", {"conversations"}),
        ("alpaca", {"instruction", "output"}),
        ("prompt-completion", {"prompt", "completion"}),
        ("text", {"text"}),
    ):
        if needs <= found:
            return fmt
    raise RowError(
        f"task_args.format: auto finds no format in a row with keys {sorted(found)}: a row "
        "needs messages, conversations, instruction + output, prompt + completion or text; "
        f"set task_args.format to one of {', '.join(FORMATS)}"
    )


def conversation(row: dict[str, Any], fmt: str) -> list[Message]:
    """The row as a list of {role, content} turns (``text``: one assistant turn)."""
    reader = _READERS.get(fmt)
    if reader is None:
        raise ValueError(f"task_args.format: {fmt!r} is not one of auto, {', '.join(FORMATS)}")
    turns = reader(row)
    for i, turn in enumerate(turns):
        if turn["role"] not in ROLES:
            raise RowError(f"turn {i} has role {turn['role']!r}, not one of {', '.join(ROLES)}")
        if not isinstance(turn["content"], str) or not turn["content"].strip():
            raise RowError(f"turn {i} ({turn['role']}) has no content")
    if fmt != "text" and not any(t["role"] == "assistant" for t in turns):
        raise RowError("no assistant turn: nothing to train on")
    return turns


def _field(row: dict[str, Any], key: str) -> Any:
    if row.get(key) is None:
        raise RowError(f"no {key!r}")
    return row[key]


def _messages(row: dict[str, Any]) -> list[Message]:
    turns = _field(row, "messages")
    if not isinstance(turns, list) or not turns:
        raise RowError("'messages' is not a list of turns")
    return [_turn(t, "role", "content", lambda r: r) for t in turns]


def _sharegpt(row: dict[str, Any]) -> list[Message]:
    turns = _field(row, "conversations")
    if not isinstance(turns, list) or not turns:
        raise RowError("'conversations' is not a list of turns")
    return [_turn(t, "from", "value", lambda r: SHAREGPT_ROLES.get(r, r)) for t in turns]


def _turn(turn: Any, role: str, content: str, mapped: Callable[[str], str]) -> Message:
    if not isinstance(turn, dict) or role not in turn or content not in turn:
        raise RowError(f"a turn without {role!r} and {content!r}: {str(turn)[:80]}")
    return {"role": mapped(str(turn[role])), "content": turn[content]}


def _alpaca(row: dict[str, Any]) -> list[Message]:
    prompt = str(_field(row, "instruction"))
    if row.get("input"):
        prompt = f"{prompt}\n\n{row['input']}"
    system = [{"role": "system", "content": row["system"]}] if row.get("system") else []
    return [*system, {"role": "user", "content": prompt},
            {"role": "assistant", "content": _field(row, "output")}]  # fmt: skip


def _prompt_completion(row: dict[str, Any]) -> list[Message]:
    return [{"role": "user", "content": _field(row, "prompt")},
            {"role": "assistant", "content": _field(row, "completion")}]  # fmt: skip


def _text(row: dict[str, Any]) -> list[Message]:
    return [{"role": "assistant", "content": _field(row, "text")}]


_READERS: dict[str, Callable[[dict[str, Any]], list[Message]]] = {
    "messages": _messages,
    "sharegpt": _sharegpt,
    "alpaca": _alpaca,
    "prompt-completion": _prompt_completion,
    "text": _text,
}


# ---------------------------------------------------------------- templates and masks


@dataclasses.dataclass
class Encoded:
    """One example's tokens and which of them carry loss."""

    ids: list[int]
    trained: list[bool]


class Renderer:
    """Conversations rendered with a chat template (the tokenizer's, or ``template``) and
    tokenised, each token marked trained or not by ``train_on``."""

    def __init__(self, tokenizer: Any, template: str | None = None, train_on: str = "assistant"):
        if train_on not in TRAIN_ON:
            raise ValueError(
                f"task_args.train_on: {train_on!r} is not one of {', '.join(TRAIN_ON)}"
            )
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(
                "task_args.model: the tokenizer is not a fast (tokenizers) one; the loss mask "
                "needs each token's place in the text: save the folder with a tokenizer.json"
            )
        self.tokenizer, self.train_on = tokenizer, train_on
        self.template = template or getattr(tokenizer, "chat_template", None)
        if not self.template:
            raise ValueError(
                "task_args.chat_template: the tokenizer has no chat template; set "
                "task_args.chat_template to a Jinja template (a string or a file)"
            )

    def render(self, turns: list[Message], prompt: bool = False) -> str:
        return str(self.tokenizer.apply_chat_template(
            turns, chat_template=self.template, tokenize=False, add_generation_prompt=prompt
        ))  # fmt: skip

    def encode_text(self, text: str) -> Encoded:
        """Plain text, trained on whole, with the end-of-text token after it."""
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        eos = self.tokenizer.eos_token_id
        ids += [eos] if eos is not None else []
        return Encoded(ids, [True] * len(ids))

    def encode(self, turns: list[Message]) -> Encoded:
        whole = self.render(turns)
        spans = [self._span(turns, i, whole) for i in self._trained_turns(turns)]
        enc = self.tokenizer(whole, add_special_tokens=False, return_offsets_mapping=True)
        starts = [a for a, _ in enc["offset_mapping"]]
        if self.train_on == "all":
            return Encoded(list(enc["input_ids"]), [True] * len(starts))
        return Encoded(list(enc["input_ids"]), [any(a <= s < b for a, b in spans) for s in starts])

    def _trained_turns(self, turns: list[Message]) -> list[int]:
        answers = [i for i, t in enumerate(turns) if t["role"] == "assistant"]
        return answers[-1:] if self.train_on == "last" else answers

    def _span(self, turns: list[Message], i: int, whole: str) -> tuple[int, int]:
        """Where assistant turn ``i`` is in the rendered conversation: from the end of the
        prompt that asks for it to the end of its end-of-turn (not the space after)."""
        before = self.render(turns[:i], prompt=True)
        upto = self.render(turns[: i + 1])
        if not (upto.startswith(before) and whole.startswith(upto)):
            raise RowError(
                f"the chat template renders turn {i} differently once later turns follow "
                "(a template that rewrites earlier turns): the trained tokens cannot be found; "
                "set task_args.chat_template to one that renders each turn once"
            )
        return len(before), len(upto.rstrip())


# ---------------------------------------------------------------- packing


@dataclasses.dataclass
class Packed:
    """Windows of ``block`` tokens: inputs, labels (``IGNORE`` where no loss), position
    ids restarting at each example, and each token's example (1, 2, ...; 0 padding)."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    example: np.ndarray
    truncated: int = 0
    dropped: int = 0

    def columns(self) -> dict[str, np.ndarray]:
        """As prep stores them; ``examples``: how many a window holds (prep counts the
        share of bad rows against examples, not windows)."""
        count = self.example.max(axis=1, initial=0).astype(np.int32)
        # The examples cut or left out for their length, on the first window: prep says
        # how many (their sums over the shards).
        cut, left = np.zeros(len(count), np.int32), np.zeros(len(count), np.int32)
        if len(count):
            cut[0], left[0] = self.truncated, self.dropped
        return {"input_ids": self.input_ids, "labels": self.labels,
                "position_ids": self.position_ids, "example": self.example,
                "examples": count, "truncated": cut, "dropped": left}  # fmt: skip


def shifted(example: Encoded) -> tuple[list[int], list[int]]:
    """Inputs and next-token labels of one example: a label is the next token where that
    token is trained, else ``IGNORE``."""
    labels = [
        t if on else IGNORE for t, on in zip(example.ids[1:], example.trained[1:], strict=True)
    ]
    return example.ids[:-1], labels


def pack(
    examples: list[Encoded], block: int, long: str = "truncate", packing: bool = True
) -> Packed:
    """Whole examples into windows of ``block`` inputs, best fit, none split across
    windows (``packing: false``: one example a window). An example of more than ``block``
    inputs is cut to ``block`` (``long: truncate``) or left out (``long: drop``)."""
    pieces: list[tuple[list[int], list[int]]] = []
    truncated = dropped = 0
    for ex in examples:
        inputs, labels = shifted(ex)
        if len(inputs) > block:
            if long == "drop":
                dropped += 1
                continue
            inputs, labels, truncated = inputs[:block], labels[:block], truncated + 1
        if inputs:
            pieces.append((inputs, labels))
    bins = (
        best_fit([len(p[0]) for p in pieces], block)
        if packing
        else [[i] for i in range(len(pieces))]
    )
    return Packed(*_windows([[pieces[i] for i in b] for b in bins], block), truncated, dropped)


def best_fit(lengths: list[int], block: int) -> list[list[int]]:
    """Indices of ``lengths`` in bins of at most ``block``: longest first, each into the
    fullest bin it fits (best-fit decreasing)."""
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin), sorted
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        at = bisect.bisect_left(free, (lengths[i], -1))
        if at == len(free):
            bins.append([i])
            room, b = block - lengths[i], len(bins) - 1
        else:
            room, b = free.pop(at)
            bins[b].append(i)
            room -= lengths[i]
        bisect.insort(free, (room, b))
    return bins


def _windows(
    windows: list[list[tuple[list[int], list[int]]]], block: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    shape = (len(windows), block)
    ids, labels = np.zeros(shape, np.int32), np.full(shape, IGNORE, np.int32)
    positions, example = np.zeros(shape, np.int32), np.zeros(shape, np.int16)
    for w, pieces in enumerate(windows):
        at = 0
        for k, (inputs, targets) in enumerate(pieces, start=1):
            n = len(inputs)
            ids[w, at : at + n], labels[w, at : at + n] = inputs, targets
            positions[w, at : at + n], example[w, at : at + n] = np.arange(n), k
            at += n
    return ids, labels, positions, example


# ---------------------------------------------------------------- what the loss sees


def unpacked(columns: dict[str, np.ndarray], n: int) -> list[tuple[list[int], list[bool]]]:
    """The first ``n`` examples of packed windows, each as its tokens and which carry
    loss: the inputs and the last label (the first token is never a target)."""
    found: list[tuple[list[int], list[bool]]] = []
    windows = (columns["input_ids"], columns["labels"], columns["example"])
    for ids, labels, example in zip(*windows, strict=True):
        for k in range(1, int(example.max(initial=0)) + 1):
            at = example == k
            inputs, targets = ids[at].tolist(), labels[at].tolist()
            # The last label is the example's last token only where it is trained; a
            # truncated or untrained end is shown up to the last input.
            tokens = inputs + ([targets[-1]] if targets[-1] != IGNORE else [])
            trained = [False, *(t != IGNORE for t in targets)][: len(tokens)]
            found.append((tokens, trained))
            if len(found) == n:
                return found
    return found


def shown(tokens: list[str], trained: list[bool], colour: bool) -> str:
    """An example as text, the trained tokens set apart: green on a terminal, else
    between [[ and ]]."""
    on, off = ("\033[32m", "\033[0m") if colour else ("[[", "]]")
    out, inside = [], False
    for text, is_trained in zip(tokens, trained, strict=True):
        if is_trained != inside:
            out.append(on if is_trained else off)
            inside = is_trained
        out.append(text)
    return "".join(out + ([off] if inside else []))
