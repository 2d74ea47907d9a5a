"""A byte-level decoder-only transformer trained on a text corpus.

``task_args.corpus`` is ``stdlib`` (the running Python's standard library, its ``.py``
files, which every machine has: the default), or a folder, a glob or a file, local or
in an object store (``s3://``, ``gs://``), of:

- text files (any other extension): each file is a document;
- JSONL (``.jsonl``, ``.json``) or parquet files: each row's ``text_field`` is a
  document, read in parallel by Ray Data's readers.

Documents go to train or val by a hash of their file's path (text files, and JSONL or
parquet files, when there are enough of them for both splits) or of their text (rows of
too few JSONL or parquet files). Text files too few for both splits by path (one file,
say) are split by window instead: each file's windows go to val by a hash of the file's
path and the window's place in it. Either way the split does not change with the file
order or the machine, and prep says which split it used. Documents are packed into uint8
windows of ``block_size + 1`` bytes, with a ``SEP`` byte between documents.

``max_bytes`` caps the train text and ``val_percent`` of it goes to val: whole files
under a split by path; under a split by window, the first ``max_bytes`` plus
``val_percent`` of it of the files in path order, of whose windows ``val_percent`` go to
val.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import sys
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from raylift.core.errors import SourceError
from raylift.core.storage import as_uri, filesystem, is_remote
from raylift.data.sources import (
    RowSplit,
    Source,
    files_version,
    in_val,
    read_bytes,
    shuffled_files,
)
from raylift.tasks.base import Batch, Columns, not_hf

VOCAB = 256
SEP = b"\x00"  # between documents: a byte that text almost never holds
ROW_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(
        self,
        block_size: int,
        n_layer: int,
        n_head: int,
        d_model: int,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Embedding(block_size, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied embeddings
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


INSTALLED = ("site-packages", "dist-packages")


def corpus_files(root: Path) -> list[Path]:
    """Every ``.py`` file under ``root``, sorted; installed packages are not part of the corpus.

    Installed packages' folders are pruned from the walk, not listed and then dropped:
    ``rglob`` over a standard library with its site-packages took 0.8 s of CPU, and every
    rank of every run lists it (``os.walk`` with pruning, 0.06 s).
    """
    if any(part in INSTALLED for part in root.parts):
        return []
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in INSTALLED]
        found += [Path(folder, n) for n in names if n.endswith(".py")]
    return sorted(p for p in found if p.is_file())


def list_corpus(spec: str) -> tuple[str, list[str]]:
    """(root, files) for a folder, a glob or one file, local or remote: the files sorted,
    as paths their filesystem opens, and the folder relative paths are taken against."""
    root, infos = corpus_infos(spec)
    return root, [i.path for i in infos]


def corpus_infos(spec: str, key: str = "task_args.corpus") -> tuple[str, list[Any]]:
    """``list_corpus`` with each file's pyarrow ``FileInfo`` (size, mtime): one listing.
    ``key``: the config key that named ``spec``, for the error."""
    import pyarrow.fs as pafs

    fs, path = filesystem(spec)
    wild = [path.find(c) for c in "*?[" if c in path]
    root = path[: min(wild)].rsplit("/", 1)[0] if wild else path
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.NotFound:
        raise SourceError(f"{key}: {spec} does not exist")
    if info.type == pafs.FileType.File:
        return root.rsplit("/", 1)[0], [info]
    listed = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    infos = sorted(
        (
            i
            for i in listed
            if i.type == pafs.FileType.File and not Path(i.path).name.startswith(".")
        ),
        key=lambda i: i.path,
    )
    if wild:
        infos = [i for i in infos if fnmatch.fnmatch(i.path, path)]
    if not infos:
        raise SourceError(
            f"task_args.corpus: {spec} holds no files; point it at text, JSONL or parquet files"
        )
    return root, infos


def _check_field(path: str, field: str) -> None:
    """SourceError naming the fields ``path``'s rows have, if ``field`` is not among them.

    Reads a parquet footer or a JSONL file's first line: asking Ray Data for the schema
    would read the first file whole.
    """
    fs, where = filesystem(path)
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        names = pq.read_schema(where, filesystem=fs).names
    else:
        names = _first_row_fields(fs, where, path)
    if field not in names:
        raise SourceError(
            f"task_args.text_field: {path} has no field {field!r}; its fields are {names}. "
            "Set task_args.text_field to the one that holds the text"
        )


def _first_row_fields(fs: Any, where: str, path: str) -> list[str]:
    head = b""
    with fs.open_input_stream(where) as f:
        while b"\n" not in head and (chunk := f.read(1 << 16)):
            head += chunk
    line = head.split(b"\n", 1)[0].strip()
    try:
        row = json.loads(line) if line else {}
    except ValueError as exc:
        raise SourceError(f"task_args.corpus: {path}: its first line is not JSON ({exc})") from exc
    if not isinstance(row, dict):
        raise SourceError(f"task_args.corpus: {path}: its rows must be JSON objects, one a line")
    return list(row)


def documents(batch: Columns) -> list[bytes]:
    """A prep batch's documents: the ``doc`` column of rows, or the text files named
    (the first ``limit`` bytes of each, where the batch has that column: -1 for all)."""
    if "doc" in batch:
        return [bytes(d) for d in batch["doc"]]
    limits = batch["limit"] if "limit" in batch else [-1] * len(batch["path"])
    return [read_bytes(str(p), int(n)) for p, n in zip(batch["path"], limits, strict=True)]


def windows(tokens: np.ndarray, block: int) -> np.ndarray:
    """``block + 1``-token windows overlapping by one, so every token is a target once."""
    n = max((len(tokens) - 1) // block, 0)
    if not n:
        return np.zeros((0, block + 1), dtype=tokens.dtype)
    return tokens[np.arange(n)[:, None] * block + np.arange(block + 1)[None, :]]


def _documents(batch: Any, field: str) -> Any:
    """One ``doc`` column of UTF-8 bytes from the text field (other columns dropped)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    text = batch.column(field)
    if not pa.types.is_binary(text.type):
        text = pc.cast(pc.cast(text, pa.string()), pa.binary())
    return pa.table({"doc": text})


class GPTTask:
    """Next-byte prediction; ``max_bytes`` caps the train text, val gets ``val_percent`` of it."""

    # Documents per ``preprocess`` call: packing is a join and a gather, cheap per byte,
    # so larger batches spend less of prep on per-batch overhead.
    preprocess_batch_size = 1024

    def __init__(
        self,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        d_model: int = 128,
        dropout: float = 0.0,
        corpus: str = "stdlib",
        max_bytes: int | None = 2_000_000,
        val_percent: int = 5,
        text_field: str = "text",
    ):
        if d_model % n_head:
            raise ValueError("task_args.d_model: must be divisible by task_args.n_head")
        if not 0 < val_percent < 100:
            raise ValueError("task_args.val_percent: must be between 0 and 100")
        self.block_size, self.n_layer = block_size, n_layer
        self.n_head, self.d_model = n_head, d_model
        self.dropout, self.corpus, self.max_bytes = dropout, corpus, max_bytes
        self.val_percent, self.text_field = val_percent, text_field
        self.tokens_per_sample = block_size
        self._listed: tuple[str, list[Any]] | None = None

    def build_model(self) -> nn.Module:
        return GPT(
            self.block_size,
            self.n_layer,
            self.n_head,
            self.d_model,
            self.dropout,
        )

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(model.blocks)  # type: ignore[arg-type]

    def tp_plan(self, model: nn.Module) -> dict[str, str] | None:
        """Tensor parallel (``strategy.tp``): the MLP split as Megatron splits it. The
        fused ``qkv`` is split too, but its output is gathered whole: a contiguous slice
        of [q | k | v] would cut the heads apart, so attention itself runs whole on every
        rank of the group, and ``proj`` takes its input whole."""
        return {
            "blocks.*.qkv": "colwise_rep",
            "blocks.*.proj": "rowwise_rep",
            "blocks.*.mlp.0": "colwise",
            "blocks.*.mlp.2": "rowwise",
        }

    def init_weights(self, module: nn.Module) -> None:
        """GPT-2's initial weights, module by module (see raylift.tensors.init)."""
        GPT._init(module)

    def raw_source(self) -> str:
        """The corpus's folder or URI (the stdlib corpus: this Python's library)."""
        return str(stdlib_root()) if self.corpus == "stdlib" else self.corpus

    def data_version(self) -> str:
        """The corpus files' paths, sizes and mtimes: shards are prepared again after an
        edit. The stdlib corpus is the running Python's."""
        if self.corpus == "stdlib":
            return f"stdlib {sys.version}"
        return files_version(self._corpus()[1])

    def _corpus(self) -> tuple[str, list[Any]]:
        """The corpus's listing, made once for the shards' version and the sources both."""
        if self._listed is None:
            self._listed = corpus_infos(self.corpus)
        return self._listed

    def sources(self) -> dict[str, Source]:
        if self.corpus == "stdlib":
            root = str(stdlib_root())
            files = [str(p) for p in corpus_files(stdlib_root())]
        else:
            root, infos = self._corpus()
            files = [i.path for i in infos]
            self._listed = None  # not shipped to the tasks with ``preprocess``
        rows = [f for f in files if Path(f).suffix.lower() in ROW_FORMATS]
        text = [f for f in files if f not in set(rows)]
        if rows and text:
            raise SourceError(
                f"task_args.corpus: {self.corpus} mixes text files with JSONL/parquet files "
                f"(e.g. {text[0]} and {rows[0]}); point it at one kind"
            )
        if rows:
            return self._row_sources(root, rows)
        return self._file_sources(root, text)

    def _file_sources(self, root: str, files: list[str]) -> dict[str, Source]:
        """Text files, one document each, split by their path; ``max_bytes`` caps train.
        Too few files for both splits: split by window (``_window_sources``)."""
        fs, _ = filesystem(self.corpus if self.corpus != "stdlib" else root)
        sizes = {i.path: i.size for i in fs.get_file_info(files)}
        if all(sizes[f] == 0 for f in files):
            raise SourceError(
                f"task_args.corpus: {self.corpus} holds no text: its {len(files)} file(s) are empty"
            )
        splits: dict[str, list[str]] = {"train": [], "val": []}
        taken = {"train": 0, "val": 0}
        cap = self.max_bytes
        caps = {"train": cap, "val": None if cap is None else cap * self.val_percent // 100}
        for path in files:
            split = "val" if self._is_val(path[len(root) :].lstrip("/").encode()) else "train"
            limit = caps[split]
            if limit is not None and taken[split] >= limit:
                continue
            splits[split].append(path)
            taken[split] += sizes[path] or 0
        if not splits["train"] or not splits["val"]:
            return self._window_sources(root, files, sizes)
        # As URIs where remote: preprocess opens each from whichever node runs it.
        return {
            k: {"path": np.array([as_uri(like=self.corpus, path=f) for f in v])}
            for k, v in splits.items()
        }

    def _window_sources(
        self, root: str, files: list[str], sizes: dict[str, int | None]
    ) -> dict[str, Source]:
        """Text files too few to split by path (one, say): both splits in one RowSplit of
        the files, whose windows go to val by a hash of the file's path under ``root`` and
        their place in it. Each file is preprocessed alone; the files are taken in path
        order up to ``max_bytes`` plus ``val_percent`` of it, the last one cut short."""
        cap = self.max_bytes
        budget = None if cap is None else cap + cap * self.val_percent // 100
        paths, names, limits, taken = [], [], [], 0
        for path in files:
            limit = -1  # the whole file
            if budget is not None:
                if taken >= budget:
                    break
                limit, size = budget - taken, sizes[path]
                taken += limit if size is None else min(limit, size)
            paths.append(as_uri(like=self.corpus, path=path))
            names.append(path[len(root) :].lstrip("/"))
            limits.append(limit)
        n = len(files)
        what = (
            f"task_args.corpus {self.corpus} ({n} text file{'s' if n > 1 else ''}, too few "
            "to split by file)"
        )
        columns = {"path": np.array(paths), "file": np.array(names), "limit": np.array(limits)}
        both = RowSplit(columns, "file", self.val_percent, what, outputs="window")
        return {"train": both, "val": both}

    def _row_sources(self, root: str, files: list[str]) -> dict[str, Source]:
        """JSONL or parquet rows, read in parallel by Ray Data. Split by file where the
        files are enough for both splits, else by the rows' text (one pass writes both)."""
        by_file: dict[str, list[str]] = {"train": [], "val": []}
        for f in files:
            rel = f[len(root) :].lstrip("/")
            by_file["val" if self._is_val(rel.encode()) else "train"].append(f)
        if by_file["train"] and by_file["val"]:
            return {split: self._documents(chosen) for split, chosen in by_file.items()}
        what = f"task_args.corpus {self.corpus}"
        both = RowSplit(self._documents(files), "doc", self.val_percent, what)
        return {"train": both, "val": both}

    def _documents(self, files: list[str]) -> Any:
        """One ``doc`` column of the files' ``text_field``, over JSONL and parquet alike."""
        import ray.data

        field = self.text_field
        paths = [as_uri(like=self.corpus, path=f) for f in files]
        parquet = [f for f in paths if f.endswith(".parquet")]
        jsonl = [f for f in paths if not f.endswith(".parquet")]
        parts = []
        # An object store's filesystem retries what a retry can fix; Ray's own would not.
        fs = filesystem(paths[0])[0] if is_remote(paths[0]) else None
        if parquet:
            _check_field(parquet[0], field)
            parts.append(ray.data.read_parquet(parquet, filesystem=fs, shuffle=shuffled_files()))
        if jsonl:
            _check_field(jsonl[0], field)
            parts.append(ray.data.read_json(jsonl, filesystem=fs, shuffle=shuffled_files()))
        ds: Any = parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0]
        return ds.map_batches(
            _documents, fn_kwargs={"field": field}, batch_format="pyarrow", zero_copy_batch=True
        )

    def _is_val(self, key: bytes) -> bool:
        return in_val(key, self.val_percent)

    def preprocess(self, batch: Columns) -> Columns:
        data = SEP.join(documents(batch))
        return {"tokens": windows(np.frombuffer(data, dtype=np.uint8), self.block_size)}

    def finish(self, batch: Batch, dtype: torch.dtype) -> Batch:
        return {"tokens": batch["tokens"].long()}

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return self.criterion(model(batch["tokens"][:, :-1]), batch)

    def criterion(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Next-token cross-entropy in fp32 of the model's logits (compiled with the blocks)."""
        vocab = logits.shape[-1]
        return F.cross_entropy(
            logits.float().reshape(-1, vocab), batch["tokens"][:, 1:].reshape(-1)
        )

    def eval_sums(self, model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
        tokens = batch["tokens"]
        logits = model(tokens[:, :-1]).float()
        target = tokens[:, 1:]
        loss_sum = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), reduction="sum")
        return {"loss_sum": loss_sum, "count": torch.tensor(target.numel(), device=target.device)}

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        loss = sums["loss_sum"] / max(sums["count"], 1.0)
        return {"val_loss": loss, "val_bpb": loss / math.log(2)}

    hf_config = not_hf  # its model is raylift's own: export writes safetensors

    def flops_per_sample(self, model: nn.Module) -> float:
        """Training FLOPs of one sample: 6 x parameters per token (forward + backward)."""
        # ZeRO-3 builds the parameters partitioned: ds_numel is the whole one's size.
        params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        return 6.0 * params * self.block_size
