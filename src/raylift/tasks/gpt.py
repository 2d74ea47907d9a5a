"""A byte-level decoder-only transformer trained on a local text corpus.

The default corpus is the running Python's standard library (its ``.py`` files),
which every machine has. Files are split into train and val by a hash of their
relative path, so the split does not change with the file order or the machine.
Tokens are bytes, stored as uint8 windows of ``block_size + 1``.
"""

from __future__ import annotations

import math
import sysconfig
import zlib
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from raylift.tasks.base import Batch, Columns

VOCAB = 256


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


def corpus_files(root: Path) -> list[Path]:
    """Every ``.py`` file under ``root``, sorted; installed packages are not part of the corpus."""
    return sorted(
        p
        for p in root.rglob("*.py")
        if "site-packages" not in p.parts and "dist-packages" not in p.parts and p.is_file()
    )


class GPTTask:
    """Next-byte prediction; ``max_bytes`` caps the train text, val gets ``val_percent`` of it."""

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
    ):
        if d_model % n_head:
            raise ValueError("task_args.d_model: must be divisible by task_args.n_head")
        if not 0 < val_percent < 100:
            raise ValueError("task_args.val_percent: must be between 0 and 100")
        self.block_size, self.n_layer = block_size, n_layer
        self.n_head, self.d_model = n_head, d_model
        self.dropout, self.corpus, self.max_bytes = dropout, corpus, max_bytes
        self.val_percent = val_percent
        self.tokens_per_sample = block_size

    def root(self) -> Path:
        root = stdlib_root() if self.corpus == "stdlib" else Path(self.corpus).expanduser()
        if not root.is_dir():
            raise FileNotFoundError(f"task_args.corpus: {root} is not a folder of .py files")
        return root

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

    def sources(self) -> dict[str, Columns]:
        root = self.root()
        splits: dict[str, list[str]] = {"train": [], "val": []}
        sizes = {"train": 0, "val": 0}
        caps = {
            "train": self.max_bytes,
            "val": None if self.max_bytes is None else self.max_bytes * self.val_percent // 100,
        }
        for path in corpus_files(root):
            rel = path.relative_to(root).as_posix()
            split = "val" if zlib.crc32(rel.encode()) % 100 < self.val_percent else "train"
            cap = caps[split]
            if cap is not None and sizes[split] >= cap:
                continue
            splits[split].append(str(path))
            sizes[split] += path.stat().st_size
        if not splits["train"] or not splits["val"]:
            raise ValueError(
                f"task_args.corpus: {root} has too few .py files for a train/val split"
            )
        return {k: {"path": np.array(v)} for k, v in splits.items()}

    def preprocess(self, batch: Columns) -> Columns:
        data = b"".join(Path(p).read_bytes() for p in batch["path"])
        arr = np.frombuffer(data, dtype=np.uint8)
        width = self.block_size + 1
        n = max((len(arr) - 1) // self.block_size, 0)
        # Windows overlap by one byte, so every byte is a target exactly once.
        idx = np.arange(n)[:, None] * self.block_size + np.arange(width)[None, :]
        return {"tokens": arr[idx] if n else np.zeros((0, width), dtype=np.uint8)}

    def finish(self, batch: Batch, dtype: torch.dtype) -> Batch:
        return {"tokens": batch["tokens"].long()}

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        tokens = batch["tokens"]
        logits = model(tokens[:, :-1]).float()
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    def eval_sums(self, model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
        tokens = batch["tokens"]
        logits = model(tokens[:, :-1]).float()
        target = tokens[:, 1:]
        loss_sum = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), reduction="sum")
        return {"loss_sum": loss_sum, "count": torch.tensor(target.numel(), device=target.device)}

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        loss = sums["loss_sum"] / max(sums["count"], 1.0)
        return {"val_loss": loss, "val_bpb": loss / math.log(2)}

    def flops_per_sample(self, model: nn.Module) -> float:
        """Training FLOPs of one sample: 6 x parameters per token (forward + backward)."""
        params = sum(p.numel() for p in model.parameters())
        return 6.0 * params * self.block_size
