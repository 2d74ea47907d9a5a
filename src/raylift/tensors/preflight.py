"""The driver's checks of a run's pretrained weights and adapters, before any worker
starts: every tensor the model needs at its shape (headers only, ranged reads on an
object store), and adapters made as this run makes them, on this run's base."""

from __future__ import annotations

import json
from typing import Any

from raylift.core import storage
from raylift.core.names import NOTE, is_mlflow_uri
from raylift.tensors.adapters import (
    PEFT_CONFIG,
    PEFT_WEIGHTS,
    adapter_tensors,
    attach,
    saved_whole,
    targets,
)
from raylift.tensors.init import meta_model
from raylift.tensors.weights import WeightsError, base_of, check, weights_path


def check_for_config(cfg: Any, task: Any, path: str | None = None) -> None:
    """The driver's check, on the model built without storage (no memory, any size), of
    ``path`` (by default the run's weights) and of the adapters to start from. MLflow URIs
    are checked once fetched."""
    path = path or weights_path(cfg, task)
    if path is not None and not is_mlflow_uri(path):
        model = meta_model(task)
        check(model, path)  # headers only, where they are: ranged reads on an object store
    adapters = cfg.model.adapter.weights
    if adapters and not is_mlflow_uri(adapters):
        base = None if path is None or is_mlflow_uri(path) else base_of(cfg, path)
        check_adapter_weights(cfg, task, adapters, base)


def check_adapter_weights(cfg: Any, task: Any, folder: str, base: dict[str, str] | None) -> None:
    """The driver's check of ``model.adapter.weights``, before any worker starts: a PEFT
    folder of LoRA adapters as this run's ``model.adapter`` makes them (rank, alpha,
    layers), trained on this run's ``base`` where its raylift note says which, every
    adapter at its shape (headers only, ranged reads on an object store)."""
    text = storage.read_text(storage.join(folder, PEFT_CONFIG))
    if text is None:
        raise WeightsError(
            f"model.adapter.weights: {folder} has no {PEFT_CONFIG}; point it at a PEFT "
            "adapter folder (raylift export RUN --format peft writes one)"
        )
    wanted = cfg.model.adapter
    model = meta_model(task)
    _check_same_adapters(folder, json.loads(text), wanted, model)
    _check_same_base(folder, base)
    named_as = adapter_tensors(saved_whole(model, wanted))
    file = storage.join(folder, PEFT_WEIGHTS)
    check(attach(model, wanted), file, named_as, "model.adapter.weights")


def _check_same_adapters(folder: str, saved: dict[str, Any], wanted: Any, model: Any) -> None:
    """The folder's LoraConfig against this run's ``model.adapter``: rank, alpha and the
    layers each names (PEFT's short names or full ones, resolved on the model)."""
    layers = targets(model, wanted.target_modules)
    theirs = saved.get("target_modules") or []
    theirs_layers = targets(model, theirs if isinstance(theirs, list) else str(theirs))
    same = (saved.get("r"), float(saved.get("lora_alpha", 0)), sorted(theirs_layers)) == (
        wanted.r, float(wanted.alpha), sorted(layers)
    )  # fmt: skip
    if not same:
        raise WeightsError(
            f"model.adapter.weights: {folder} holds LoRA r={saved.get('r')} alpha="
            f"{saved.get('lora_alpha')} on {len(theirs_layers)} layers; this run's "
            f"model.adapter is r={wanted.r} alpha={wanted.alpha:g} on {len(layers)} layers: "
            "set model.adapter as the adapters were trained, or model.adapter.weights: null "
            "to start them afresh"
        )


def _check_same_base(folder: str, base: dict[str, str] | None) -> None:
    """Adapters that raylift logged name their base's headers: another base is refused."""
    note = json.loads(storage.read_text(storage.join(folder, NOTE)) or "{}")
    trained_on = note.get("base_headers")
    if base is None or trained_on is None or trained_on == base["headers"]:
        return
    raise WeightsError(
        f"model.adapter.weights: {folder} holds adapters trained on the base "
        f"{note.get('base')} (headers {trained_on[:12]}...); this run's base is "
        f"{base['weights']} (headers {base['headers'][:12]}...). Point the run at the base "
        "they trained on, or model.adapter.weights: null to start the adapters afresh"
    )
