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

rsLoRA and DoRA are PEFT's own (``use_rslora``, ``use_dora``), built from the one
:func:`lora_config` the run's PEFT folder also says. A DoRA magnitude is PEFT's row norms
of the weight beside it, which a sharded build knows only once the base is loaded: it is
set then (:func:`init_magnitudes`), after a placeholder the initial-weights pass draws.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, cast

import torch
from torch import nn

from raylift.core.config import AdapterConfig, ConfigError
from raylift.tensors.init import full_shape

ADAPTER_NAME = "default"  # PEFT's name for a model's one adapter
PEFT_WEIGHTS = "adapter_model.safetensors"  # a PEFT adapter folder's tensors
PEFT_CONFIG = "adapter_config.json"  # and its LoraConfig
MAGNITUDE = "lora_magnitude_vector"  # DoRA's module of magnitudes, beside lora_A and lora_B
_ADAPTER_PART = re.compile(r"(^|\.)lora_[A-Za-z_]+(\.|$)")


def is_adapter(name: str) -> bool:
    """A parameter of the adapters themselves (``...lora_A.default.weight``)."""
    return bool(_ADAPTER_PART.search(name))


def base_name(name: str) -> str:
    """The name a base model's files give the tensor the adapted model calls ``name``."""
    return name.replace(".base_layer.", ".")


def peft_key(name: str) -> str:
    """PEFT's name in ``adapter_model.safetensors`` for the model's ``name``: under
    ``base_model.model.``, without the adapter's own name; a DoRA magnitude without its
    ``.weight`` too, as PEFT has always saved it."""
    key = "base_model.model." + re.sub(rf"\.(lora_[A-Za-z_]+)\.{ADAPTER_NAME}\.", r".\1.", name)
    return key.removesuffix(".weight") if key.endswith(f".{MAGNITUDE}.weight") else key


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
    adapters' and those of ``cfg.modules_to_save``. Raises ConfigError naming the key
    when nothing matches, or when what it asks would not mean in PEFT what it trains."""
    from peft import inject_adapter_in_model

    chosen = targets(model, cfg.target_modules)
    if not chosen:
        raise ConfigError([
            f"model.adapter.target_modules: {cfg.target_modules!r} matches no module of the "
            "model; name modules it has (e.g. q_proj, v_proj) or write all-linear"
        ])  # fmt: skip
    saved = _saved_as_peft_saves(model, cfg, chosen)
    # Full names: PEFT matches a module whose name is one, or ends in "." + one. The
    # modules saved whole are trained in place (no PEFT wrapper renaming them).
    plain = dataclasses.replace(cfg, dora=False)  # DoRA's magnitudes are added below
    model = inject_adapter_in_model(lora_config(plain, chosen), model, adapter_name=ADAPTER_NAME)
    _refuse_unlike_linear(model)
    if cfg.dora:
        add_magnitudes(model)
    trained = tuple(f"{n}." for n in saved)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name) or name.startswith(trained))
    return model


def _saved_as_peft_saves(model: nn.Module, cfg: AdapterConfig, chosen: list[str]) -> list[str]:
    """The modules ``cfg.modules_to_save`` names, each one PEFT would train whole as
    raylift does: its own weight (not tied), and no adapter on it."""
    saved = targets(model, cfg.modules_to_save) if cfg.modules_to_save else []
    if cfg.modules_to_save and not saved:
        raise ConfigError([
            f"model.adapter.modules_to_save: {cfg.modules_to_save!r} matches no module of the model"
        ])  # fmt: skip
    _refuse_tied(model, saved)
    both = [n for n in chosen if any(n == w or n.startswith(f"{w}.") for w in saved)]
    if both:
        raise ConfigError([
            f"model.adapter.modules_to_save: {both[0]} is adapted too (target_modules); PEFT "
            "trains a module saved whole without adapters on it, so these would not load "
            "in PEFT as trained: leave it out of one of the two"
        ])  # fmt: skip
    return saved


def _refuse_unlike_linear(model: nn.Module) -> None:
    """An adapted module that is not a linear layer (an embedding, a convolution): PEFT
    gives those adapters of another shape, which raylift neither draws nor merges."""
    from peft.tuners.lora import Linear, LoraLayer

    for name, layer in model.named_modules():
        if isinstance(layer, LoraLayer) and not isinstance(layer, Linear):
            raise ConfigError([
                f"model.adapter.target_modules: {name} is a "
                f"{type(layer.get_base_layer()).__name__}; raylift puts adapters on linear "
                "layers (nn.Linear, GPT-2's Conv1D): leave it out, or train it whole "
                "(modules_to_save)"
            ])  # fmt: skip


def _refuse_tied(model: nn.Module, saved: list[str]) -> None:
    """A module saved whole whose weight another module shares (tied embeddings and
    head): raylift would train the one shared weight, where PEFT trains a copy apart from
    the others, so its PEFT folder would load with another meaning."""
    owners: dict[int, set[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for _, p in module.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(id(p), set()).add(name)
    for name in saved:
        mine = {id(p) for p in model.get_submodule(name).parameters()}
        others = sorted(
            {o for i in mine for o in owners[i] if o != name and not o.startswith(f"{name}.")}
        )
        if others:
            raise ConfigError([
                f"model.adapter.modules_to_save: {name} shares its weight with {others} (tied); "
                "PEFT trains a module saved whole as a copy apart from those, so its adapters "
                f"would not load with the meaning they trained with: leave {name} out, or train "
                "every parameter (model.adapter.type: null)"
            ])  # fmt: skip


def lora_config(
    cfg: AdapterConfig, chosen: list[str], saved: list[str] | None = None, base: str | None = None
) -> Any:
    """PEFT's ``LoraConfig`` for ``cfg`` on the modules ``chosen`` (full names): what the
    run's layers are built from, and what its PEFT folder says, so the two mean the same."""
    from peft import LoraConfig

    # PEFT annotates lora_alpha as int; it scales by lora_alpha / r, a float either way.
    return LoraConfig(
        r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,  # type: ignore[arg-type]
        use_rslora=cfg.rslora, use_dora=cfg.dora, target_modules=chosen,
        modules_to_save=saved or None, base_model_name_or_path=base,
    )  # fmt: skip


def scale(cfg: AdapterConfig) -> float:
    """What PEFT multiplies each adapter's ``B @ A`` by: alpha / r, or alpha / sqrt(r)
    with rsLoRA."""
    return cfg.alpha / (math.sqrt(cfg.r) if cfg.rslora else cfg.r)


def meaning(cfg: AdapterConfig) -> dict[str, Any] | None:
    """What the run's adapters are, as its checkpoints record it: a resume whose
    ``model.adapter`` would give the saved tensors another meaning is refused. None
    without adapters."""
    if not cfg.type:
        return None
    keys = ("r", "alpha", "rslora", "dora", "target_modules", "modules_to_save")
    return {key: getattr(cfg, key) for key in keys}


def kind(cfg: AdapterConfig) -> str:
    """The adapters' name on the run's lines: LoRA, rsLoRA, DoRA."""
    if cfg.dora:
        return "DoRA with rsLoRA's scale" if cfg.rslora else "DoRA"
    return "rsLoRA" if cfg.rslora else "LoRA"


def describe(model: nn.Module, cfg: AdapterConfig) -> str:
    """The run's line about its adapters: where they are and what share trains."""
    from peft.tuners.lora import LoraLayer

    layers = sum(isinstance(m, LoraLayer) for m in model.modules())
    trainable, frozen = trainable_numel(model)
    share = trainable / max(trainable + frozen, 1)
    saved = f", {cfg.modules_to_save} trained whole" if cfg.modules_to_save else ""
    return (
        f"raylift: adapters: {kind(cfg)} r={cfg.r} alpha={cfg.alpha:g} (scale "
        f"{scale(cfg):.4g}) on {layers} layers{saved}; trainable {trainable:,} of "
        f"{trainable + frozen:,} parameters ({share:.2%}), the rest frozen"
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


def add_magnitudes(model: nn.Module) -> None:
    """DoRA on every LoRA layer of ``model``, as PEFT's ``use_dora`` makes it (its variant,
    its magnitude module), each magnitude drawn as ones: PEFT starts one at the row norms
    of the weight beside it, which a sharded build does not hold yet (meta, or ZeRO-3's
    partitions), so :func:`init_magnitudes` sets them once the base is loaded. Built here,
    inside the strategy's build, the magnitudes are sharded as any parameter is. Every
    adapted layer is a linear one (:func:`attach` refuses others)."""
    from peft.tuners.lora import Linear
    from peft.tuners.lora.variants import DoraLinearVariant

    magnitude = _magnitude_class()
    for layer in model.modules():
        if not isinstance(layer, Linear):
            continue
        outputs = full_shape(cast(nn.Parameter, layer.lora_B[ADAPTER_NAME].weight))[0]
        layer.lora_variant[ADAPTER_NAME] = DoraLinearVariant()
        layer.use_dora[ADAPTER_NAME] = True
        if MAGNITUDE not in layer.adapter_layer_names:
            layer.adapter_layer_names = (*layer.adapter_layer_names, MAGNITUDE)
        layer.lora_magnitude_vector[ADAPTER_NAME] = magnitude(layer.fan_in_fan_out, outputs)


@functools.cache
def _magnitude_class() -> type:
    """PEFT's DoRA magnitude module, made with its parameter (ones) and a
    ``reset_parameters`` that draws ones again: raylift's initial-weights pass then sets
    it as it sets every parameter, before :func:`init_magnitudes`."""
    from peft.tuners.lora.dora import DoraLinearLayer

    class Magnitude(DoraLinearLayer):
        def __init__(self, fan_in_fan_out: bool, outputs: int):
            super().__init__(fan_in_fan_out)
            self.weight = nn.Parameter(torch.ones(outputs))

        def reset_parameters(self) -> None:
            nn.init.ones_(self.weight)

    return Magnitude


def init_magnitudes(model: nn.Module, write: Any, whole: Any) -> int:
    """Each DoRA magnitude as PEFT starts it, the row norms of ``W + scale * B @ A`` for
    the layer's weight ``W`` as loaded (B is zero, as drawn); the same on every rank.
    Every rank calls it: a sharded weight is gathered whole for it. Returns how many."""
    from peft.utils.other import transpose

    count = 0
    layer: Any
    for layer in model.modules():
        magnitudes = getattr(layer, MAGNITUDE, None) or {}
        if ADAPTER_NAME not in magnitudes:
            continue
        weight = whole_value(layer.get_base_layer().weight).float()
        a, b = (
            whole_value(part[ADAPTER_NAME].weight).float() for part in (layer.lora_A, layer.lora_B)
        )
        weight = transpose(weight, layer.fan_in_fan_out) + layer.scaling[ADAPTER_NAME] * (b @ a)
        module = magnitudes[ADAPTER_NAME]
        with whole(module, write, {}, "adapter"), torch.no_grad():
            module.weight.copy_(torch.linalg.norm(weight, dim=1))
        count += 1
    return count


def whole_value(p: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value on this rank, however the strategy holds it: an FSDP2
    shard gathered, a ZeRO-3 partition gathered, else the parameter itself. Every rank
    must ask for the same parameters in the same order."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        return p.full_tensor().detach()
    if hasattr(p, "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([p]):
            return p.detach().clone()
    return p.detach()


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
