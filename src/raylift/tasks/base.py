"""The Task protocol: what a user writes to bring a model and its data to raylift.

A task knows nothing about strategies, precision, Ray or MLflow. Its pieces run in
three places:

- ``sources`` and ``preprocess`` run offline in Ray Data (``map_batches``) on numpy
  columns, and should leave data compact (uint8 images, small-int tokens). A split's
  source is numpy columns (small data) or a ``ray.data.Dataset`` from any of Ray Data's
  readers (data of any size, local or in an object store; the driver never holds it);
- ``finish`` runs on the worker's device on each batch (dtype casts, normalisation);
- ``build_model``, ``loss`` and ``eval_sums`` run in the training loop.

Optional methods: ``blocks(model)`` (repeated layers, for activation checkpointing
and compile), ``criterion(output, batch)`` (the loss from the model's output: where
``loss`` calls it, ``train.compile`` compiles it as one graph, e.g. an LM head's
fp32 cast fused into its cross-entropy), ``flops_per_sample(model)`` (for MFU),
``tokens_per_sample`` (an attribute, for ``tokens_per_s``), ``preprocess_batch_size``
(an attribute: rows per ``preprocess`` call, 64 unless set), ``data_version()`` (a
string that changes when the raw data does: part of the shards' fingerprint) and
``transform(columns, rng)``: host-side work per training batch that cannot be done
once offline (random augmentation). It runs in the loader's prefetch thread on numpy
columns; everything that can be done once belongs in ``preprocess``.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

Columns = dict[str, np.ndarray]
Batch = dict[str, torch.Tensor]


@runtime_checkable
class Task(Protocol):
    """A model plus its data. Constructed as ``TaskClass(**task_args)``."""

    def build_model(self) -> nn.Module:
        """A fresh model in fp32 on the CPU; raylift moves, wraps and casts it."""
        ...

    def sources(self) -> dict[str, Any]:
        """Raw data per split (``train`` and ``val``): numpy columns of equal length, or a
        ``ray.data.Dataset`` (``ray.data.read_parquet(...)``, ``read_images``, ...)."""
        ...

    def preprocess(self, batch: Columns) -> Columns:
        """Offline, in Ray Data: raw columns -> the compact columns training reads."""
        ...

    def finish(self, batch: Batch, dtype: torch.dtype) -> Batch:
        """On the device: turn stored columns into model inputs of floating ``dtype``."""
        ...

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Scalar mean training loss of ``batch``."""
        ...

    def eval_sums(self, model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
        """Per-batch sums (0-d tensors) that add across batches and ranks; must hold ``count``."""
        ...

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        """Totals from ``eval_sums`` -> metrics, e.g. ``val_loss`` and ``val_acc``."""
        ...


def blocks_of(task: object, model: nn.Module) -> list[nn.Module]:
    """The task's repeated blocks (transformer layers), if it names them; [] otherwise."""
    fn = getattr(task, "blocks", None)
    return list(fn(model)) if callable(fn) else []


def tokens_per_sample(task: object) -> int:
    """Tokens in one training sample, for ``tokens_per_s``; 0 for non-token tasks."""
    return int(getattr(task, "tokens_per_sample", 0) or 0)


def shaped_rows(task: object, n: int) -> Columns | None:
    """``n`` rows as ``preprocess`` makes them, of the shapes training sees, made without
    reading any data (``raylift plan`` measures activations on them); None where the task
    has no such optional ``shaped_rows(n)`` method (then a few real rows are read)."""
    fn = getattr(task, "shaped_rows", None)
    return fn(n) if callable(fn) else None


def flops_per_sample(task: object, model: nn.Module) -> float:
    """Training FLOPs (forward + backward) of one sample, for MFU; 0 when the task does not say.

    A task says it with an optional ``flops_per_sample(model)`` method."""
    fn = getattr(task, "flops_per_sample", None)
    return float(fn(model)) if callable(fn) else 0.0


def not_hf(task: object) -> None:
    """A task's ``hf_config`` where its model is not a Hugging Face model: said, so an
    export or ``log_model`` need not build the model on the meta device to find out."""
    return None


class ImageClassifier:
    """Loss, evaluation sums and metrics of a task whose batches hold ``image`` and
    ``label``: cross-entropy, accuracy. The built-in image tasks share them."""

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return self.criterion(model(batch["image"]), batch)

    def criterion(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        return F.cross_entropy(logits.float(), batch["label"])

    def eval_sums(self, model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
        logits = model(batch["image"]).float()
        label = batch["label"]
        return {
            "loss_sum": F.cross_entropy(logits, label, reduction="sum"),
            "correct": (logits.argmax(-1) == label).sum(),
            "count": torch.tensor(label.numel(), device=label.device),
        }

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        n = max(sums["count"], 1.0)
        return {"val_loss": sums["loss_sum"] / n, "val_acc": sums["correct"] / n}


def hf_plan(model: nn.Module) -> dict[str, str] | None:
    """A Hugging Face model's own plan: its config's ``base_model_tp_plan``, whose names
    are under the base model's attribute (``model.``)."""
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    if not base:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    inner = prefix and isinstance(getattr(model, prefix, None), nn.Module)
    return {(f"{prefix}.{k}" if inner else k): v for k, v in base.items()}
