"""Adapters on a pretrained model: the base frozen, small matrices beside it trained.

``model.adapter.type: lora`` puts PEFT's LoRA layers (the library users load adapters
with) on the task's model as it is built, before any strategy wraps or shards it: the
base's parameters are frozen there, so every strategy sees a model whose only trainable
parameters are the adapters (and ``modules_to_save``), and shards, reduces and
optimises those as it would any trainable parameter. The adapters are drawn by raylift's
seeded initial-weights pass, the same on every rank: A as ``nn.Linear`` draws it, B
zero, as PEFT does, so the adapted model starts as the base.

The model keeps its own class and forward (PEFT's ``inject_adapter_in_model``, not a
``PeftModel`` wrapper): the task's loss, blocks and evaluation stay as they are. A base
layer's weight is named ``<module>.base_layer.weight`` there; the base's files name it
``<module>.weight``, and :func:`base_name` maps one to the other.
"""

from __future__ import annotations

import math
import re
from typing import Any, cast

import torch
from torch import nn

from raylift.core.config import AdapterConfig

ADAPTER_NAME = "default"  # PEFT's name for a model's one adapter
PEFT_WEIGHTS = "adapter_model.safetensors"  # a PEFT adapter folder's tensors
PEFT_CONFIG = "adapter_config.json"  # and its LoraConfig
_ADAPTER_PART = re.compile(r"(^|\.)lora_[A-Za-z_]+(\.|$)")


def is_adapter(name: str) -> bool:
    """A parameter of the adapters themselves (``...lora_A.default.weight``)."""
    return bool(_ADAPTER_PART.search(name))


def base_name(name: str) -> str:
    """The name a base model's files give the tensor the adapted model calls ``name``."""
    return name.replace(".base_layer.", ".")


def peft_key(name: str) -> str:
    """PEFT's name in ``adapter_model.safetensors`` for the model's ``name``: under
    ``base_model.model.``, without the adapter's own name."""
    return "base_model.model." + re.sub(rf"\.(lora_[A-Za-z_]+)\.{ADAPTER_NAME}\.", r".\1.", name)


def adapter_tensors(saved: list[str]) -> Any:
    """A weights file's view of a model with adapters (``weights.NamedAs``): the adapters
    and the modules ``saved`` whole, under PEFT's names, as ``adapter_model.safetensors``
    holds them."""
    whole = tuple(f"{n}." for n in saved)

    def named_as(model: nn.Module, named: Any) -> Any:
        for name, tensor in named:
            if is_adapter(name) or name.startswith(whole):
                yield peft_key(name), tensor

    return named_as


def saved_whole(model: nn.Module, cfg: AdapterConfig) -> list[str]:
    """The modules ``cfg.modules_to_save`` names, trained whole beside the adapters."""
    return targets(model, cfg.modules_to_save) if cfg.modules_to_save else []


def output_head(model: nn.Module) -> nn.Module | None:
    """The layer that maps features to the output vocabulary, which LoRA leaves alone: a
    Hugging Face model's output embeddings, else the last ``nn.Linear`` registered."""
    getter = getattr(model, "get_output_embeddings", None)
    if callable(getter):
        head = getter()
        if isinstance(head, nn.Module):
            return head
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return linears[-1] if linears else None


def is_linear(module: nn.Module) -> bool:
    """A layer LoRA adapts as PEFT's ``all-linear`` does: ``nn.Linear``, or transformers'
    ``Conv1D`` (GPT-2's: a linear layer whose weight is stored transposed)."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


def is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def transposed_layers(model: nn.Module) -> set[str]:
    """The names of the adapted layers whose weight is (in, out): PEFT's fan_in_fan_out,
    where a merged adapter's B @ A is added transposed."""
    return {n for n, m in model.named_modules() if is_conv1d(m)}


def targets(model: nn.Module, wanted: str | list[str]) -> list[str]:
    """The full names of the modules that get an adapter: every ``nn.Linear`` but the
    output head (``all-linear``), or those a name in ``wanted`` matches (the full name,
    or its last parts)."""
    if wanted == "all-linear":
        head = output_head(model)
        return [n for n, m in model.named_modules() if is_linear(m) and m is not head]
    names = [n for n, _ in model.named_modules() if n]
    return [n for n in names if any(n == w or n.endswith(f".{w}") for w in wanted)]


def attach(model: nn.Module, cfg: AdapterConfig) -> nn.Module:
    """``model`` with LoRA on its target modules and every parameter frozen but the
    adapters' and those of ``cfg.modules_to_save``. Raises ValueError naming the key
    when nothing matches."""
    from peft import LoraConfig, inject_adapter_in_model

    chosen = targets(model, cfg.target_modules)
    if not chosen:
        raise ValueError(
            f"model.adapter.target_modules: {cfg.target_modules!r} matches no module of the "
            "model; name modules it has (e.g. q_proj, v_proj) or write all-linear"
        )
    saved = targets(model, cfg.modules_to_save) if cfg.modules_to_save else []
    if cfg.modules_to_save and not saved:
        raise ValueError(
            f"model.adapter.modules_to_save: {cfg.modules_to_save!r} matches no module of the model"
        )
    # Full names: PEFT matches a module whose name is one, or ends in "." + one.
    # PEFT annotates lora_alpha as int; it scales by lora_alpha / r, a float either way.
    lora = LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,  # type: ignore[arg-type]
                      target_modules=chosen)  # fmt: skip
    model = inject_adapter_in_model(lora, model, adapter_name=ADAPTER_NAME)
    trained = tuple(f"{n}." for n in saved)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name) or name.startswith(trained))
    return model


def describe(model: nn.Module, cfg: AdapterConfig) -> str:
    """The run's line about its adapters: where they are and what share trains."""
    from peft.tuners.lora import LoraLayer

    layers = sum(isinstance(m, LoraLayer) for m in model.modules())
    trainable, frozen = trainable_numel(model)
    share = trainable / max(trainable + frozen, 1)
    saved = f", {cfg.modules_to_save} trained whole" if cfg.modules_to_save else ""
    return (
        f"raylift: adapters: LoRA r={cfg.r} alpha={cfg.alpha:g} on {layers} layers{saved}; "
        f"trainable {trainable:,} of {trainable + frozen:,} parameters ({share:.2%}), the "
        "rest frozen"
    )


def init_adapters(model: nn.Module, seed: int, write: Any, whole: Any, touched: dict) -> int:
    """Draw every adapter as PEFT does (A as ``nn.Linear``, B zero), the same on every
    rank; returns how many parameters were set."""
    from peft.tuners.lora import LoraLayer

    torch.manual_seed(seed)
    count = 0
    for layer in model.modules():
        if not isinstance(layer, LoraLayer):
            continue
        for part, draw in ((layer.lora_A, _kaiming), (layer.lora_B, nn.init.zeros_)):
            module = part[ADAPTER_NAME]
            with whole(module, write, touched, "adapter"):
                draw(cast(torch.Tensor, module.weight))
            count += 1
    return count


def _kaiming(weight: torch.Tensor) -> None:
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))  # nn.Linear's (and PEFT's) draw


def keep_trainable_fp32(model: nn.Module) -> nn.Module:
    """After a cast of the whole model (``bf16-true``): the trainable parameters (the
    adapters) back to fp32, the frozen base left as cast. PEFT's layers cast their input
    to the adapter's dtype and the output back, so the two dtypes work together. A model
    with nothing frozen (full fine-tuning) stays as cast."""
    if all(p.requires_grad for p in model.parameters()):
        return model
    for p in model.parameters():
        if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32:
            p.data = p.data.float()
    return model


def trainable_numel(model: nn.Module) -> tuple[int, int]:
    """(trainable, frozen) parameter counts, each shared parameter once."""
    seen: set[int] = set()
    counts = [0, 0]
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        counts[0 if p.requires_grad else 1] += int(getattr(p, "ds_numel", p.numel()))
    return counts[0], counts[1]
