"""Tasks as a user writes them, outside raylift: the Task protocol only, no raylift import,
no ``init_weights``. The tests use them where they are and copy this file into a folder
outside the repository for the command-line runs.

- ``LlamaLM``: a Hugging Face ``LlamaForCausalLM`` built from a config (tied embeddings,
  RMSNorm, rotary embeddings), initialised by nothing but its own constructor;
- ``NormLM``: a small decoder of the user's own modules: an RMSNorm and a learned
  residual scale whose parameters their constructors set (no ``reset_parameters``), a
  tied output head.

Both learn next-byte prediction on the Python standard library's own source.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

VOCAB = 256


def stdlib_windows(block: int, max_bytes: int) -> np.ndarray:
    """The standard library's top-level .py files as bytes, cut into ``block + 1`` windows."""
    text = bytearray()
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text += path.read_bytes() + b"\0"
        if len(text) >= max_bytes:
            break
    data = np.frombuffer(bytes(text[:max_bytes]), dtype=np.uint8)
    n = len(data) // (block + 1)
    return data[: n * (block + 1)].reshape(n, block + 1)


class ByteLM:
    """Data, loss and metrics; subclasses build the model."""

    def __init__(
        self, block_size: int = 32, d_model: int = 64, n_layer: int = 2, max_bytes: int = 300_000
    ):
        self.block_size, self.d_model, self.n_layer = block_size, d_model, n_layer
        self.max_bytes = max_bytes

    def sources(self) -> dict[str, dict[str, np.ndarray]]:
        rows = stdlib_windows(self.block_size, self.max_bytes)
        cut = len(rows) * 9 // 10
        return {"train": {"tokens": rows[:cut]}, "val": {"tokens": rows[cut:]}}

    def preprocess(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"tokens": batch["tokens"].astype(np.uint8)}

    def finish(self, batch: dict[str, torch.Tensor], dtype: torch.dtype) -> dict:
        return {"tokens": batch["tokens"].long()}

    def logits(self, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        return model(tokens)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        tokens = batch["tokens"]
        logits = self.logits(model, tokens[:, :-1]).float()
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    def eval_sums(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict:
        tokens = batch["tokens"]
        logits = self.logits(model, tokens[:, :-1]).float()
        target = tokens[:, 1:]
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), reduction="sum")
        return {"loss_sum": loss, "count": torch.tensor(target.numel(), device=target.device)}

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        return {"val_loss": sums["loss_sum"] / max(sums["count"], 1.0)}


class LlamaLM(ByteLM):
    def build_model(self) -> nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=self.d_model,
            intermediate_size=2 * self.d_model,
            num_hidden_layers=self.n_layer,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=self.block_size,
            tie_word_embeddings=True,
        )
        return LlamaForCausalLM(config)

    def logits(self, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        return model(input_ids=tokens).logits


class RMSNorm(nn.Module):
    """No reset_parameters: the constructor's ones are the initial gain."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Layer(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = RMSNorm(dim)
        self.mix = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)
        # A learned residual scale, drawn by the constructor and set nowhere else.
        self.scale = nn.Parameter(1.0 + 0.1 * torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        # causal mixing: each position adds a running mean of what came before it
        h = torch.cumsum(h, dim=1) / torch.arange(1, h.shape[1] + 1, device=h.device)[:, None]
        return x + self.scale * self.out(F.gelu(self.mix(h)))


class Decoder(nn.Module):
    def __init__(self, dim: int, n_layer: int, block: int):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(0.02 * torch.randn(block, dim))
        self.layers = nn.ModuleList(Layer(dim) for _ in range(n_layer))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class NormLM(ByteLM):
    def build_model(self) -> nn.Module:
        return Decoder(self.d_model, self.n_layer, self.block_size)

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(model.layers)
