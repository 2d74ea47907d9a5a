"""Exporting a run that trained adapters: PEFT's folder, or the base with them merged.

A checkpoint of such a run holds the adapters (and ``modules_to_save``) alone. ``--format
peft`` writes them as ``PeftModel.from_pretrained(base, DIR)`` loads them:
``adapter_model.safetensors`` under PEFT's names and ``adapter_config.json`` naming the
base. ``--format hf`` writes the merged model as PEFT's ``merge_and_unload`` makes it,
``W + scale * B @ A`` for every adapted layer (scale alpha / r, or alpha / sqrt(r) with
rsLoRA), each row then rescaled to its trained magnitude with DoRA: the base is read one
tensor at a time from its safetensors files (ranged reads, local or in an object store),
merged and written before the next is read, so the base is never in memory whole; the
adapters, small, are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from raylift.artifacts.export import each_tensor, hf_config_of, shard_bytes
from raylift.core import storage
from raylift.tensors.adapters import (
    ADAPTER_NAME,
    MAGNITUDE,
    PEFT_WEIGHTS,
    is_adapter,
    lora_config,
    peft_key,
    scale,
    targets,
    transposed_layers,
)
from raylift.tensors.checkpoints import CheckpointError
from raylift.tensors.hf_layout import Layout
from raylift.tensors.init import meta_model
from raylift.tensors.streaming import CODES, Spec, write_hf_shards, write_safetensors
from raylift.tensors.weights import header_entries, raw_header, weight_files, weights_path

DTYPES = {code: dtype for dtype, code in CODES.items()}


def adapter_modules(cfg: Any, task: Any) -> tuple[list[str], list[str]]:
    """The names of the modules the run put adapters on and of those it trained whole."""
    model = meta_model(task)
    wanted = cfg.model.adapter
    saved = targets(model, wanted.modules_to_save) if wanted.modules_to_save else []
    return targets(model, wanted.target_modules), saved


def export_peft(path: str, out: Path, cfg: Any, task: Any) -> tuple[str, int]:
    """``adapter_model.safetensors`` and ``adapter_config.json`` of the run's newest intact
    checkpoint (rsLoRA and DoRA said there as PEFT says them); the checkpoint used and the
    tensors written."""
    chosen, saved = adapter_modules(cfg, task)
    whole = tuple(f"{n}." for n in saved)
    out.mkdir(parents=True, exist_ok=True)

    def write(specs: list[Spec], tensors: Iterator[tuple[Spec, torch.Tensor]]) -> int:
        kept = {s.name: dataclasses.replace(s, name=peft_key(s.name)) for s in specs
                if is_adapter(s.name) or s.name.startswith(whole)}  # fmt: skip

        def renamed() -> Iterator[tuple[Spec, torch.Tensor]]:
            for spec, tensor in tensors:
                if spec.name in kept:
                    yield kept[spec.name], tensor

        write_safetensors(out / PEFT_WEIGHTS, list(kept.values()), renamed())
        return len(kept)

    ckpt, n = each_tensor(path, write)
    config = lora_config(cfg.model.adapter, chosen, saved, weights_path(cfg, task))
    config.save_pretrained(str(out))
    return ckpt, n


def merged_model(path: str, cfg: Any, task: Any, fmt: str) -> tuple[str, Merged]:
    """The checkpoint used and the base with its adapters merged in, read when written."""
    base = weights_path(cfg, task)
    if base is None:
        raise CheckpointError(
            f"--format {fmt}: the run's base was drawn from its seed, not read from weights; "
            "export the adapters with --format peft"
        )
    trained: dict[str, torch.Tensor] = {}

    def keep(specs: list[Spec], tensors: Iterator[tuple[Spec, torch.Tensor]]) -> int:
        trained.update((spec.name, tensor) for spec, tensor in tensors)
        return len(trained)

    ckpt, _ = each_tensor(path, keep)
    model = meta_model(task)
    layers = (scale(cfg.model.adapter), Layout(model), transposed_layers(model))
    return ckpt, Merged(base, trained, *layers)


def export_merged_file(path: str, out: Path, cfg: Any, task: Any, fmt: str) -> tuple[str, int]:
    """The merged model as one safetensors file (what ``model.weights`` reads), streamed,
    or as a ``torch.save`` state_dict (``pt``, built whole in memory)."""
    ckpt, merged = merged_model(path, cfg, task, fmt)
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "pt":
        torch.save({spec.name: tensor for spec, tensor in merged.tensors()}, out)
    else:
        write_safetensors(out, merged.specs, merged.tensors())
    return ckpt, len(merged.specs)


def export_merged(
    path: str, out: Path, cfg: Any, task: Any, max_shard_size: str | int
) -> tuple[str, int]:
    """A ``from_pretrained`` folder of the base with the run's adapters merged in, in the
    base's dtypes, with the base's config and the task's tokenizer."""
    hf_config = hf_config_of(task)
    ckpt, merged = merged_model(path, cfg, task, "hf")
    out.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(out)
    tokenizer = getattr(task, "tokenizer", None)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    write_hf_shards(out, merged.specs, merged.tensors(), shard_bytes(max_shard_size))
    return ckpt, len(merged.specs)


class Merged:
    """The base's tensors, each read when its turn comes, with its adapter merged in."""

    def __init__(
        self, base: str, trained: dict[str, torch.Tensor], scale: float, layout: Layout,
        transposed: set[str] | None = None,
    ):  # fmt: skip
        self.trained, self.scale, self.layout = trained, scale, layout
        self.transposed = transposed or set()  # GPT-2's Conv1D: weights stored (in, out)
        self.where: dict[str, tuple[str, int, int]] = {}  # name -> file, first byte, end
        self.specs: list[Spec] = []
        for file in sorted(set(weight_files(base).values())):
            for name, (dtype, shape, start, end) in _entries(file).items():
                self.specs.append(Spec(name, shape, dtype, name))
                self.where[name] = (file, start, end)
        # The checkpoint names tensors as the model does, the base's files as they were
        # saved (transformers renames and fuses some as it loads: raylift.tensors.hf_layout).
        known = {layout.model_name(s.name)[0] for s in self.specs}
        lost = [n for n in trained if not is_adapter(n) and n not in known]
        if lost:
            raise CheckpointError(f"the checkpoint's {lost[0]} is not a tensor of the base {base}")

    def tensors(self) -> Iterator[tuple[Spec, torch.Tensor]]:
        for spec in self.specs:
            yield spec, self._merged(spec)

    def _merged(self, spec: Spec) -> torch.Tensor:
        name, joined = self.layout.model_name(spec.name)
        if name in self.trained:  # trained whole (modules_to_save)
            whole = self.trained[name]
            return (self.layout.split(name, whole)[spec.name] if joined else whole).to(spec.dtype)
        file, start, end = self.where[spec.name]
        with storage.Ranges(file) as f:  # its bytes alone: no read-ahead on the Hub
            data = bytearray(f.read(start, end - start)) if end > start else bytearray()
        tensor = torch.frombuffer(data, dtype=spec.dtype).view(spec.shape) if data else (
            torch.empty(spec.shape, dtype=spec.dtype))  # fmt: skip
        module = name.removesuffix(".weight")
        a, b, magnitude = (
            self.trained.get(f"{module}.{part}.{ADAPTER_NAME}.weight")
            for part in ("lora_A", "lora_B", MAGNITUDE)
        )
        if a is None or b is None:
            return tensor
        # Worked (out, in), as nn.Linear holds it; GPT-2's Conv1D holds (in, out).
        flip = module in self.transposed
        weight = (tensor.float().T if flip else tensor.float()) + self.scale * (
            b.float() @ a.float()
        )
        if magnitude is not None:  # DoRA: each row rescaled to its trained magnitude
            weight = weight * (magnitude.float() / torch.linalg.norm(weight, dim=1)).unsqueeze(1)
        return (weight.T if flip else weight).to(spec.dtype)


def _entries(file: str) -> dict[str, tuple[torch.dtype, list[int], int, int]]:
    """A safetensors file's tensors from its header: dtype, shape and byte range."""
    start = 8 + len(raw_header(file)[0])  # the data follows the header
    return {
        name: (DTYPES[e["dtype"]], list(e["shape"]), start + e["data_offsets"][0],
               start + e["data_offsets"][1])
        for name, e in header_entries(file).items()
    }  # fmt: skip
