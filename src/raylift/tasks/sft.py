"""Supervised fine-tuning on instructions and conversations (``task: hf-sft``).

``task_args.model`` is a local Hugging Face folder or a Hub ID, with its tokenizer, as
for ``hf-causal-lm``. ``task_args.data`` (a JSONL, JSON or parquet file, a folder or glob of
them, local or a URI) holds one example a row in a format ``task_args.format`` names or
``auto`` finds from each row's keys (:mod:`raylift.tasks.chat`). Prep renders each with
the chat template (the tokenizer's, or ``task_args.chat_template``, a Jinja string or
file), marks the tokens that carry loss (``task_args.train_on``), and packs whole examples
into ``block_size`` windows whose position ids restart at every example; the model's
attention then keeps examples apart (Hugging Face models build a block-diagonal mask, or
use varlen attention, from position ids that restart). Rows that are not examples are
counted and named by file and line.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from raylift.core.errors import SourceError
from raylift.core.storage import as_uri, filesystem
from raylift.data.manifest import column_total
from raylift.data.sources import ERROR_COLUMN, RowSplit, Source, files_version
from raylift.tasks.base import Batch, Columns
from raylift.tasks.chat import (
    FORMATS,
    IGNORE,
    Encoded,
    Renderer,
    RowError,
    conversation,
    detect_format,
    pack,
)
from raylift.tasks.gpt import corpus_infos
from raylift.tasks.hf import HFCausalLM, data_specs, tokenizer_digest, with_router_loss

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
COLUMNS = ("input_ids", "labels", "position_ids", "example")


class HFSFT(HFCausalLM):
    """Next-token prediction on the trained tokens of chat and instruction examples."""

    # Examples per ``preprocess`` call: the windows are packed from these.
    preprocess_batch_size = 512
    examples_column = "examples"  # a window holds several: the share is of examples

    def __init__(
        self,
        model: str = "",
        data: str = "",
        format: str = "auto",
        chat_template: str | None = None,
        train_on: str = "assistant",
        packing: bool = True,
        long: str = "truncate",
        block_size: int = 512,
        val_percent: int = 5,
        val_data: str | None = None,
        max_bad_fraction: float = 0.5,
        split: str = "train",
        val_split: str | None = None,
        subset: str | None = None,
    ):
        super().__init__(model=model, block_size=block_size, val_percent=val_percent)
        if self.tokenizer is None:
            raise ValueError(f"task_args.model: {model} has no tokenizer; hf-sft needs one")
        if format != "auto" and format not in FORMATS:
            raise ValueError(
                f"task_args.format: {format!r} is not one of auto, {', '.join(FORMATS)}"
            )
        if long not in ("truncate", "drop"):
            raise ValueError(f"task_args.long: {long!r} is not truncate or drop")
        if not data:
            raise ValueError(
                "task_args.data: the examples' file or folder (JSONL, JSON or parquet)"
            )
        self.data, self.val_data, self.format = data, val_data, format
        self.split, self.val_split, self.subset = split, val_split, subset
        if not 0 <= max_bad_fraction < 1:
            raise ValueError("task_args.max_bad_fraction: must be in [0, 1)")
        if packing:
            check_packed_attention()
        self.packing, self.long, self.max_bad_fraction = packing, long, max_bad_fraction
        self.renderer = Renderer(self.tokenizer, read_template(chat_template), train_on)
        self.tokens_per_sample = block_size

    # ------------------------------------------------------------ data

    def data_version(self) -> str:
        """The data files and the tokenizer as ``hf-causal-lm`` counts them, and what turns
        rows into tokens: the template, the format, the mask and the packing."""
        files = files_version(self._files(self.train_specs))
        val = (
            files_version(self._files(self.val_specs, "task_args.val_data"))
            if self.val_specs
            else "-"
        )
        how = json.dumps([self.renderer.template, self.format, self.renderer.train_on,
                          self.packing, self.long, self.block_size])  # fmt: skip
        return f"{files} {val} tokenizer {tokenizer_digest(Path(str(self.folder)))} {how}"

    # Each a list of files, folders or globs: a Hub data set's are its split's files.
    # Found where the data is read (prep, on the driver), not at every build of the task.
    @functools.cached_property
    def train_specs(self) -> list[str]:
        return data_specs(self.data, self.split, self.subset, "task_args.data")

    @functools.cached_property
    def val_specs(self) -> list[str]:
        val, split = self.val_data, self.val_split or self.split
        if val is None and self.val_split and self.train_specs != [self.data]:
            val = self.data  # the same Hub data set's other split
        return data_specs(val, split, self.subset, "task_args.val_data") if val else []

    def _files(self, specs: list[str], key: str = "task_args.data") -> list[Any]:
        found = []
        for spec in specs:
            _, infos = corpus_infos(spec, key)
            found += [i for i in infos if Path(i.path).suffix.lower() in DATA_SUFFIXES]
        if not found:
            raise SourceError(f"{key}: no .jsonl, .json or .parquet file in {', '.join(specs)}")
        return found

    def sources(self) -> dict[str, Source]:
        files = [i.path for i in self._files(self.train_specs)]
        if self.format == "auto":  # said once, on the driver: prep reads each row's keys
            found = first_format(self.train_specs[0], files[0])
            first = as_uri(files[0], self.train_specs[0])
            print(f"raylift: hf-sft: task_args.format auto: {found} "
                  f"(the first row's keys in {first}; each row is read by its own)")  # fmt: skip
        train = examples(self.train_specs[0], files)
        if self.val_specs:
            held = [i.path for i in self._files(self.val_specs, "task_args.val_data")]
            return {"train": train, "val": examples(self.val_specs[0], held)}
        split = RowSplit(train, "record", self.val_percent, f"task_args.data {self.data}")
        return {"train": split, "val": split}

    def preprocess(self, batch: Columns) -> Columns:
        encoded, errors = [], []
        for where, record in zip(batch["where"], batch["record"], strict=True):
            try:
                encoded.append(self.encode(json.loads(record)))
            except (RowError, json.JSONDecodeError) as exc:
                errors.append(f"{where}: {exc}")
        packed = pack(encoded, self.block_size, self.long, self.packing)
        cols = packed.columns()
        cols[ERROR_COLUMN] = np.full(len(packed.input_ids), "", dtype=object)
        if errors:  # rows of their own, dropped and counted by prep
            bad = {
                k: np.zeros((len(errors), *v.shape[1:]), v.dtype)
                for k, v in cols.items()
                if k != ERROR_COLUMN
            }
            cols = {k: np.concatenate([v, bad[k]]) if k in bad else v for k, v in cols.items()}
            cols[ERROR_COLUMN] = np.concatenate(
                [cols[ERROR_COLUMN], np.array(errors, dtype=object)]
            )
        return cols

    def prep_notes(self, manifest: Any) -> list[str]:
        """After prep: how many examples were cut to ``block_size`` or left out."""
        longer = f"example(s) longer than block_size {self.block_size}"
        notes = []
        if cut := column_total(manifest, "truncated"):
            notes.append(
                f"raylift: hf-sft: {cut:,} {longer} cut to it (long: drop leaves them out)"
            )
        if left := column_total(manifest, "dropped"):
            notes.append(f"raylift: hf-sft: {left:,} {longer} left out (task_args.long: drop)")
        return notes

    def encode(self, row: Any) -> Encoded:
        """One row's tokens and their loss mask."""
        if not isinstance(row, dict):
            raise RowError(f"not a JSON object: {str(row)[:80]}")
        fmt = detect_format(row) if self.format == "auto" else self.format
        turns = conversation(row, fmt)
        if fmt == "text":
            return self.renderer.encode_text(turns[0]["content"])
        return self.renderer.encode(turns)

    def shaped_rows(self, n: int) -> Columns:
        """``n`` full windows of one example each, all trained: the shape every packed
        batch has, without reading the data set (for ``raylift plan``). One example a
        window has the model's own positions: no ``position_ids``, so the model does not
        look for packed examples in them (which the meta device plan runs on cannot)."""
        window = np.ones((n, self.block_size), dtype=np.int64)
        return {"input_ids": window, "labels": window.copy(), "example": window.copy()}

    def transform(self, columns: Columns, rng: np.random.Generator) -> Columns:
        """``packing: false``: the batch cut to its longest example (each sits at the
        start of its window), not padded to ``block_size``."""
        if self.packing:
            return columns  # full windows: one shape, nothing to cut
        longest = int((columns["example"] > 0).sum(axis=1).max(initial=1))
        return {k: v[:, :longest] if k in COLUMNS else v for k, v in columns.items()}

    # ------------------------------------------------------------ steps

    def finish(self, batch: Batch, dtype: torch.dtype) -> Batch:
        return {k: batch[k].long() for k in COLUMNS if k in batch}

    def logits(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return self._forward(model, batch).logits

    def _forward(self, model: nn.Module, batch: Batch) -> Any:
        # No attention mask: the model finds each example from its restarting position
        # ids and keeps it apart (transformers' packed-sequence masks).
        positions = batch.get("position_ids")
        if positions is None:  # raylift plan's shaped rows, on the meta device: as hf-causal-lm
            return model(input_ids=batch["input_ids"])
        return model(input_ids=batch["input_ids"], position_ids=positions, use_cache=False)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        out = self._forward(model, batch)
        return with_router_loss(self.criterion(out.logits, batch), out, self.config)

    def criterion(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Mean over the trained tokens: masked ones neither add to it nor count (a batch
        with none gives 0, not NaN, and no host sync to find out)."""
        total, count = trained_loss(logits, batch["labels"])
        return total / count.clamp(min=1)

    def eval_sums(self, model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
        total, count = trained_loss(self.logits(model, batch), batch["labels"])
        return {"loss_sum": total, "count": count}


def trained_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed cross-entropy of the trained tokens, in fp32, and how many there are."""
    labels = labels.flatten()
    total = F.cross_entropy(
        logits.float().flatten(0, 1), labels, ignore_index=IGNORE, reduction="sum"
    )
    return total, (labels != IGNORE).sum()


def check_packed_attention() -> None:
    """Packing keeps examples apart through the model's attention: transformers builds
    the mask from restarting position ids since 4.54 (``find_packed_sequence_indices``).
    An older one would let packed examples attend to each other: refused."""
    try:
        from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
    except ImportError:
        import transformers

        raise ValueError(
            f"task_args.packing: transformers {transformers.__version__} does not keep packed "
            "examples apart (4.54 or newer does); upgrade it, or set task_args.packing: false"
        ) from None


def read_template(spec: str | None) -> str | None:
    """``task_args.chat_template``: a Jinja string, or a file holding one."""
    if not spec or "{" in spec:
        return spec
    fs, path = filesystem(spec)
    try:
        with fs.open_input_stream(path) as f:
            return bytes(f.read()).decode()
    except OSError as exc:
        raise ValueError(
            f"task_args.chat_template: {spec} is neither a Jinja template nor a file ({exc})"
        ) from None


def first_format(spec: str, path: str) -> str:
    """The format the first row of the file ``path`` is in, from its keys (a parquet
    file's columns; of a JSON or JSONL file, the first MiB is read)."""
    fs, _ = filesystem(spec)
    try:
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq

            return detect_format(pq.ParquetFile(fs.open_input_file(path)).schema_arrow.names)
        with fs.open_input_file(path) as f:
            head = bytes(f.read(1 << 20))
        rows = _records({"path": path, "bytes": head})
        return detect_format(json.loads(rows[0]["record"]))
    except (ValueError, IndexError, TypeError, OSError):  # RowError and bad JSON among them
        return "none found in the first row"


def examples(spec: str, files: list[str]) -> Any:
    """The examples of ``files`` as a Dataset of rows {where (file and line), record (its
    JSON)}: each file read whole by one task, so that a bad row is named by its line."""
    import ray.data

    fs, _ = filesystem(spec)
    return ray.data.read_binary_files(files, filesystem=fs, include_paths=True).flat_map(_records)


def _records(row: dict[str, Any]) -> list[dict[str, Any]]:
    path, data = row["path"], row["bytes"]
    if path.endswith(".parquet"):
        import io

        import pyarrow.parquet as pq

        rows = pq.read_table(io.BytesIO(data)).to_pylist()
        return [_row(f"{path} row {i}", json.dumps(r, default=str)) for i, r in enumerate(rows, 1)]
    text = data.decode("utf-8", errors="replace")
    if path.endswith(".json"):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            return [_row(f"{path}:{exc.lineno}", text[:200])]
        items = items if isinstance(items, list) else [items]
        return [_row(f"{path} item {i}", json.dumps(r)) for i, r in enumerate(items, 1)]
    lines = enumerate(text.splitlines(), 1)
    return [_row(f"{path}:{i}", line) for i, line in lines if line.strip()]


def _row(where: str, record: str) -> dict[str, Any]:
    return {"where": where, "record": record}
