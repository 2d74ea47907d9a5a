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
    ``model.adapter`` on the task's model, of ``path`` (by default the run's weights) and
    of the adapters to start from. MLflow URIs are checked once fetched."""
    if cfg.model.adapter.type:  # what model.adapter asks, on this model: ConfigError if wrong
        attach(meta_model(task), cfg.model.adapter)
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
    folder of LoRA adapters whose every setting this run honours, made as this run's
    ``model.adapter`` makes them (rank, alpha, layers, rsLoRA, DoRA, modules saved whole),
    trained on this run's ``base`` where its raylift note says which, every adapter at its
    shape (headers only, ranged reads on an object store)."""
    text = storage.read_text(storage.join(folder, PEFT_CONFIG))
    if text is None:
        raise WeightsError(
            f"model.adapter.weights: {folder} has no {PEFT_CONFIG}; point it at a PEFT "
            "adapter folder (raylift export RUN --format peft writes one)"
        )
    saved = _lora_config_of(folder, text)
    _refuse_unhonoured(folder, saved)
    wanted = cfg.model.adapter
    model = meta_model(task)
    _check_same_adapters(folder, saved, wanted, model, meta_model(task))
    _check_same_base(folder, base)
    named_as = adapter_tensors(saved_whole(model, wanted))
    file = storage.join(folder, PEFT_WEIGHTS)
    check(attach(model, wanted), file, named_as, "model.adapter.weights")


def _lora_config_of(folder: str, text: str) -> dict[str, Any]:
    """The folder's adapter_config.json as a dict, its rank and alpha numbers; WeightsError
    naming the file where it is not."""
    try:
        saved = json.loads(text)
        if not isinstance(saved, dict):
            raise ValueError(f"a JSON {type(saved).__name__}, not an object")
        float(saved.get("lora_alpha", 0)), int(saved.get("r", 0))
        for key in ("target_modules", "modules_to_save"):
            names = saved.get(key) or []
            if not isinstance(names, str) and not all(isinstance(n, str) for n in names):
                raise ValueError(f"{key} {names!r} is not a name or a list of names")
    except (ValueError, TypeError) as exc:
        raise WeightsError(
            f"model.adapter.weights: {storage.join(folder, PEFT_CONFIG)} is not a PEFT "
            f"LoraConfig ({exc}); point model.adapter.weights at a folder PEFT saved"
        ) from None
    return saved


# The LoraConfig keys raylift reads from a folder and compares with model.adapter.
HONOURED = ("r", "lora_alpha", "target_modules", "use_rslora", "use_dora", "modules_to_save")
# Keys that do not change what the saved tensors mean once loaded: where the base came
# from, PEFT's bookkeeping, training-time dropout, and the options of switches that are
# off (a switch that is on is judged by its own key).
INERT = (
    "peft_type", "base_model_name_or_path", "revision", "task_type", "inference_mode",
    "peft_version", "auto_mapping", "lora_dropout", "fan_in_fan_out", "layers_pattern",
    "megatron_core", "qalora_group_size", "loftq_config", "eva_config", "corda_config",
    "lora_ga_config", "runtime_config", "init_lora_weights",
)  # fmt: skip
# init_lora_weights values that draw the adapters alone; the others (pissa, olora, corda,
# loftq, lora_ga, mica) change the base they were trained on, or how it is adapted.
PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal")
# What each setting raylift does not train means, for the line that refuses it.
MEANINGS = {
    "bias": "the base's biases trained beside the adapters",
    "lora_bias": "a bias trained on each lora_B",
    "rank_pattern": "a rank per layer",
    "alpha_pattern": "an alpha per layer",
    "layers_to_transform": "adapters on some layers' modules only",
    "exclude_modules": "layers left out of target_modules",
    "trainable_token_indices": "embedding rows trained apart",
    "target_parameters": "adapters on parameters rather than modules",
    "init_lora_weights": "trained on a base PEFT changed to start them",
}
# What the two switches raylift honours mean, either way.
SWITCHES = {
    ("use_rslora", True): "scale alpha / sqrt(r)",
    ("use_rslora", False): "scale alpha / r",
    ("use_dora", True): "a trained magnitude per output",
    ("use_dora", False): "no magnitudes",
}


def _refuse_unhonoured(folder: str, saved: dict[str, Any]) -> None:
    """WeightsError naming every setting of the folder that raylift would not train as
    PEFT means it, and what to do instead: nothing loads with another meaning."""
    from peft import LoraConfig

    if saved.get("peft_type", "LORA") != "LORA":
        raise WeightsError(
            f"model.adapter.weights: {folder} holds PEFT {saved.get('peft_type')} adapters; "
            "raylift trains LoRA adapters: point it at a LoRA folder, or null to draw them"
        )
    defaults = LoraConfig().to_dict()
    found = [
        _meaning(key, value)
        for key, value in saved.items()
        if key not in HONOURED + INERT
        and (defaults[key] != value if key in defaults else value not in (None, False, [], {}, ""))
    ]
    if saved.get("init_lora_weights", True) not in PLAIN_INITS:
        found.append(_meaning("init_lora_weights", saved["init_lora_weights"]))
    if found:
        raise WeightsError(
            f"model.adapter.weights: {folder} was saved with {'; '.join(found)}, which "
            "raylift does not train: merge it into its base (PEFT's merge_and_unload) and "
            "give that as model.weights with fresh adapters, or use adapters saved without it"
        )


def _meaning(key: str, value: Any) -> str:
    said = f"{key}: {json.dumps(value)}"
    return f"{said} ({MEANINGS[key]})" if key in MEANINGS else said


def _check_same_adapters(
    folder: str, saved: dict[str, Any], wanted: Any, model: Any, spare: Any
) -> None:
    """The folder's LoraConfig against this run's ``model.adapter``: rank, alpha and the
    layers each adapts (the folder's as PEFT resolves them on ``spare``, a model of the
    task), then the kind of adapters."""
    layers = targets(model, wanted.target_modules)
    theirs_layers = _peft_layers(saved, spare)
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
    _check_same_kind(folder, saved, wanted, model)


def _check_same_kind(folder: str, saved: dict[str, Any], wanted: Any, model: Any) -> None:
    """rsLoRA, DoRA and the modules saved whole: the folder's against ``model.adapter``."""
    for key, ours in (("use_rslora", "rslora"), ("use_dora", "dora")):
        theirs = bool(saved.get(key))
        if theirs != getattr(wanted, ours):
            raise WeightsError(
                f"model.adapter.weights: {folder} was saved with {key}: {json.dumps(theirs)} "
                f"({SWITCHES[key, theirs]}); this run's model.adapter.{ours} is "
                f"{json.dumps(getattr(wanted, ours))}: set model.adapter.{ours}: "
                f"{json.dumps(theirs)} as they were trained"
            )
    named = saved.get("modules_to_save") or []
    whole = sorted(targets(model, [named] if isinstance(named, str) else named))
    if whole != sorted(saved_whole(model, wanted)):
        raise WeightsError(
            f"model.adapter.weights: {folder} was saved with modules_to_save: "
            f"{json.dumps(saved.get('modules_to_save'))} (trained whole beside the adapters); "
            f"this run's model.adapter.modules_to_save is {wanted.modules_to_save}: set it as "
            "the adapters were trained"
        )


def _peft_layers(saved: dict[str, Any], model: Any) -> list[str]:
    """The layers PEFT puts the folder's adapters on, on ``model`` (a meta model of the
    task): its own matching of target_modules (names, a regex, all-linear)."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    # What places the adapters; a module saved whole is never adapted too, in PEFT.
    keep = ("r", "lora_alpha", "target_modules", "modules_to_save")
    try:
        config = LoraConfig(**{k: saved[k] for k in keep if k in saved}, init_lora_weights=False)
    except (ValueError, TypeError):
        return []
    try:
        inject_adapter_in_model(config, model)
    except (ValueError, TypeError):  # "Target modules ... not found", or not names at all
        return []
    return [n for n, m in model.named_modules() if isinstance(m, LoraLayer)]


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
