"""``raylift export``: a consolidated fp32 ``state_dict`` from a checkpoint of any strategy.

``--format pt`` (``torch.save``) loads into the task's plain model with
``model.load_state_dict(...)``; ``--format safetensors`` is what ``model.weights``
reads, to start another run (a fine-tune, say) from this one's weights; ``--format
hf`` (a run whose model is a Hugging Face model: ``hf-causal-lm``, or a task of the
user's that returns one) writes a folder ``AutoModelForCausalLM.from_pretrained`` loads:
the model's ``config.json``, safetensors sharded above ``HF_SHARD``, the tokenizer where
the task has one. The task comes from the config the run recorded in its folder.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from raylift.core import storage
from raylift.strategies import REGISTRY
from raylift.tensors.checkpoints import (
    LOOP_FILE,
    CheckpointError,
    CheckpointReader,
    check_listing,
    check_pickles,
    checkpoint_dirs,
    newest_complete,
    previous_complete,
)
from raylift.tensors.hf_layout import Layout, of_task
from raylift.tensors.init import meta_model
from raylift.tensors.streaming import Spec, write_hf_shards, write_safetensors

Writer = Callable[[list[Spec], Iterator[tuple[Spec, torch.Tensor]]], Any]


def require_checkpoint(path: str) -> None:
    """CheckpointError unless ``path`` is a checkpoint or a run folder holding one (a
    listing: nothing is read)."""
    if not (storage.is_file(storage.join(path, LOOP_FILE)) or checkpoint_dirs(path)):
        raise CheckpointError(
            f"{path}: no complete checkpoint here; pass a run folder (storage/name) "
            "or one of its checkpoint-step* folders"
        )


def consolidated(path: str | Path, log: Callable[[str], None] = print) -> tuple[str, dict]:
    """The checkpoint used (the newest intact one) and its full fp32 ``state_dict``, tied
    weights under each of their names."""
    state: dict[str, torch.Tensor] = {}

    def keep(specs: list[Spec], tensors: Iterator[tuple[Spec, torch.Tensor]]) -> dict:
        state.update((spec.name, tensor) for spec, tensor in tensors)
        return state

    ckpt, _ = each_tensor(str(path), keep, log, aliased=True)
    return ckpt, state


def consolidated_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    return consolidated(path)[1]


FORMATS = ("pt", "safetensors")  # hf: export_hf, which needs the run's task
HF_SHARD = "5GB"  # Hugging Face's own default shard size


def export(path: str, out: Path, fmt: str | None = None) -> tuple[str, int]:
    """Write the consolidated fp32 state_dict to ``out`` as ``fmt`` (by default from the
    file's suffix); returns (checkpoint used, tensors written). safetensors streams
    (:func:`each_tensor`); ``pt`` is one pickle, built whole in memory."""
    fmt = fmt or ("safetensors" if out.suffix == ".safetensors" else "pt")
    if fmt not in FORMATS:
        raise CheckpointError(f"--format: {fmt!r} is not one of {FORMATS}")
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "pt":
        ckpt, state = consolidated(path)
        torch.save(state, out)
        return ckpt, len(state)

    def write(specs: list[Spec], tensors: Iterator[tuple[Spec, torch.Tensor]]) -> int:
        write_safetensors(out, specs, tensors)
        return len(specs)

    return each_tensor(path, write)


def each_tensor(
    path: str, write: Writer, log: Callable[[str], None] = print, aliased: bool = False
) -> tuple[str, Any]:
    """``write(specs, tensors)`` of the newest complete checkpoint at ``path``: the
    checkpoint used and what ``write`` returns. Every engine's checkpoint streams: one
    tensor at a time, only the model's bytes read (never the optimizer's), each block
    checked as it arrives; a damaged one is reported and the one before it written
    instead. Every pickle in the checkpoint is checked first (``check_pickles``): one that
    names anything off the list stops the export (``RefusedPickle``), with nothing
    written and no fallback. A tied weight comes once, under its first name (``aliased``:
    under each)."""
    require_checkpoint(path)
    explicit = storage.is_file(storage.join(path, LOOP_FILE))
    ckpt = path if explicit else newest_complete(path, log, check_listing)
    while ckpt is not None:
        try:
            reader = CheckpointReader(ckpt)
            check_pickles(reader)
            spec = REGISTRY.get(reader.loop_state().get("strategy", ""))
            if spec is None:
                raise CheckpointError(f"{ckpt}: written by an unknown strategy")
            model = spec.read_export(reader)
            return ckpt, write(*_named(model, aliased))
        except CheckpointError as exc:
            if explicit:
                raise
            log(f"raylift: {exc}; looking for the previous complete checkpoint")
            ckpt = previous_complete(ckpt, log, check_listing)
    raise CheckpointError(f"{path}: no intact checkpoint here (see `raylift verify {path}`)")


def _named(model: Any, aliased: bool) -> tuple[list[Spec], Iterator[tuple[Spec, torch.Tensor]]]:
    """The model's specs and tensors, with each tied name beside the one it shares when
    ``aliased``."""
    if not aliased or not model.aliases:
        return model.specs, model.tensors()
    by_source: dict[str, list[str]] = {}
    for alias, name in model.aliases.items():
        by_source.setdefault(name, []).append(alias)

    def each() -> Iterator[tuple[Spec, torch.Tensor]]:
        for spec, tensor in model.tensors():
            yield spec, tensor
            for alias in by_source.get(spec.name, []):
                yield dataclasses.replace(spec, name=alias), tensor

    specs = [s2 for s in model.specs for s2 in
             [s, *(dataclasses.replace(s, name=a) for a in by_source.get(s.name, []))]]  # fmt: skip
    return specs, each()


def hf_config_of(task: object) -> Any:
    """The Hugging Face config of the task's model: ``hf-causal-lm`` knows it; any other
    task's model is built without storage to read it."""
    config = hf_config_or_none(task)
    if config is None:
        raise CheckpointError(
            "--format hf: the run's model is not a Hugging Face model; use --format "
            "safetensors or pt"
        )
    return config


def hf_config_or_none(task: object) -> Any:
    """``hf_config_of``, or None where the task's model is not a Hugging Face model."""
    known = getattr(task, "hf_config", None)
    if callable(known):
        return known()
    model = meta_model(task)
    config: Any = getattr(model, "config", None)
    if not hasattr(config, "save_pretrained"):
        return None
    # What AutoModel* loads the folder as, as save_pretrained records it.
    config.architectures = [type(model).__name__]
    return config


def export_hf(
    path: str, out: Path, task: object, max_shard_size: str | int = HF_SHARD
) -> tuple[str, int]:
    """A ``save_pretrained`` folder of a run's Hugging Face model: its config, safetensors
    of at most ``max_shard_size`` each (with their index where there is more than one)
    and the tokenizer where the task has one."""
    hf_config = hf_config_of(task)
    limit = shard_bytes(max_shard_size)
    out.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(out)
    tokenizer = getattr(task, "tokenizer", None)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)

    layout = of_task(task)

    def write(specs: list[Spec], tensors: Iterator[tuple[Spec, torch.Tensor]]) -> int:
        saved = as_saved(layout, specs)
        write_hf_shards(out, saved, saved_tensors(layout, tensors), limit)
        return len(saved)

    return each_tensor(path, write)


def as_saved(layout: Layout, specs: list[Spec]) -> list[Spec]:
    """The model's specs as ``save_pretrained`` names and shapes them (per-expert
    tensors apart again, old names back), each model tensor's in a row."""
    out = []
    for spec in specs:
        for name, shape in layout.file_shapes({spec.name: tuple(spec.shape)})[spec.name].items():
            out.append(dataclasses.replace(spec, name=name, shape=list(shape)))
    return out


def saved_tensors(
    layout: Layout, tensors: Iterator[tuple[Spec, torch.Tensor]]
) -> Iterator[tuple[Spec, torch.Tensor]]:
    """``tensors`` as :func:`as_saved` lays them out, one model tensor read at a time."""
    for spec, tensor in tensors:
        for name, part in layout.split(spec.name, tensor).items():
            yield dataclasses.replace(spec, name=name, shape=list(part.shape)), part.contiguous()


UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def shard_bytes(size: str | int) -> int:
    """``--max-shard-size`` in bytes: a number, or one with a unit as Hugging Face writes
    them (``5GB`` is 5 * 10**9 bytes, ``2GiB`` 2 * 2**30)."""
    if isinstance(size, int):
        return size
    text = size.strip().upper().replace(" ", "")
    unit = next((u for u in sorted(UNITS, key=len, reverse=True) if text.endswith(u)), "")
    try:
        value = float(text[: len(text) - len(unit)]) * UNITS.get(unit, 1)
    except ValueError:
        value = 0
    if value < 1:
        raise CheckpointError(
            f"--max-shard-size: {size!r} is not a size; write it as 5GB, 500MB or 2GiB"
        )
    return int(value)
