"""A Hugging Face model's tensors as its checkpoint files name and shape them.

transformers 5 loads a checkpoint through per-architecture rules: keys renamed
(GPT-NeoX's ``embed_out`` is the model's ``lm_head``, Mixtral's ``block_sparse_moe`` its
``mlp``) and per-expert tensors fused into one (Mixtral's ``experts.N.w1`` and ``w3``
stacked into ``experts.gate_up_proj``); ``save_pretrained`` writes the checkpoint's
layout back. raylift reads and writes weights one tensor at a time, so it applies the
same rules, transformers' own (``get_model_conversion_mapping``, applied forward as
``from_pretrained`` does and reversed as ``save_pretrained`` does), one model tensor at a
time: a fused tensor is made from exactly the file tensors that ``from_pretrained`` makes
it from, and no others are read.

A model that is not a transformers ``PreTrainedModel`` (or has no rules) is laid out as
its ``state_dict`` names it.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from raylift.tensors.init import meta_model

Shape = tuple[int, ...]


class Layout:
    """The rules of one model: file tensors to model tensors and back."""

    def __init__(self, model: nn.Module | None):
        self.owner = None if model is None else pretrained_root(model)
        self._forward: list[Any] = []
        self._renamings: list[Any] = []
        self._converters: list[Any] = []
        if self.owner is not None:
            from transformers.conversion_mapping import get_model_conversion_mapping

            # As from_pretrained loads (older names included: add_legacy).
            with _as_built(self.owner):
                self._forward = get_model_conversion_mapping(self.owner)
            self._renamings, self._converters = _split(self._forward)

    @property
    def converts(self) -> bool:
        return bool(self._forward)

    def model_name(self, file_name: str) -> tuple[str, bool]:
        """The model tensor a file tensor goes into, and whether others join it there."""
        if not self._forward:
            return file_name, False
        from transformers.core_model_loading import rename_source_key

        renamed, pattern = rename_source_key(file_name, self._renamings, self._converters)
        return renamed, pattern is not None

    def group(self, file_names: Iterable[str]) -> dict[str, list[str]]:
        """Model tensor name -> the file tensors it is made of, in from_pretrained's order."""
        from_files: dict[str, list[str]] = {}
        for name in sorted(file_names, key=_natural) if self._forward else file_names:
            from_files.setdefault(self.model_name(name)[0], []).append(name)
        return from_files

    def join(self, name: str, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The model tensor ``name`` from its file tensors ``parts``, as from_pretrained
        makes it (a rename: the one tensor as it is)."""
        if len(parts) == 1:
            ((file_name, tensor),) = parts.items()
            if not self.model_name(file_name)[1]:
                return tensor
        from transformers.core_model_loading import rename_source_key

        converter = None
        for file_name in sorted(parts, key=_natural):
            renamed, pattern = rename_source_key(file_name, self._renamings, self._converters)
            assert pattern is not None, f"{file_name} joins no other tensor"
            if converter is None:  # its own copy: a converter collects what it joins
                converter = copy.deepcopy(_by_pattern(self._converters)[pattern])
            converter.add_tensor(renamed, file_name, pattern, parts[file_name])
        assert converter is not None and self.owner is not None
        made = converter.convert(name, model=self.owner, config=self.owner.config)
        value = made[name]
        return value[0] if isinstance(value, list) else value

    def split(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """The file tensors ``save_pretrained`` writes for the model tensor ``name``."""
        if self.owner is None or not self._forward:
            return {name: tensor}
        from transformers.core_model_loading import revert_weight_conversion

        with _as_built(self.owner):
            return dict(revert_weight_conversion(self.owner, {name: tensor}))

    def file_shapes(self, shapes: Mapping[str, Shape]) -> dict[str, dict[str, Shape]]:
        """Model tensor name -> {file tensor name: shape} that save_pretrained writes."""
        return {
            name: {k: tuple(v.shape) for k, v in self.split(name, _meta(shape)).items()}
            for name, shape in shapes.items()
        }

    def joined_shape(self, name: str, parts: Mapping[str, Shape]) -> Shape:
        """The shape the model tensor ``name`` gets from file tensors of ``parts``'
        shapes (on the meta device: nothing read)."""
        return tuple(self.join(name, {k: _meta(s) for k, s in parts.items()}).shape)


def of_task(task: Any) -> Layout:
    """The layout of the task's model, built without storage."""
    return Layout(meta_model(task))


def pretrained_root(model: nn.Module) -> Any:
    """The transformers model whose names the model's tensors go by (itself, LoRA
    injected or not), or None."""
    if "transformers" not in sys.modules:
        return None
    from transformers import PreTrainedModel

    return model if isinstance(model, PreTrainedModel) else None


@contextlib.contextmanager
def _as_built(model: Any) -> Iterator[None]:
    """The model under its own transformers class while inside: transformers finds an
    architecture's rules by class name, and FSDP2's ``fully_shard`` gives a sharded model
    a class of its own (``FSDPGPTNeoXForCausalLM``)."""
    wrapped = type(model)
    own = next((c for c in wrapped.__mro__ if c.__module__.startswith("transformers.")), wrapped)
    model.__class__ = own
    try:
        yield
    finally:
        model.__class__ = wrapped


def _split(transforms: list[Any]) -> tuple[list[Any], list[Any]]:
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return renamings, converters


def _by_pattern(converters: list[Any]) -> dict[str, Any]:
    return {p: c for c in converters for p in c.source_patterns}


def _natural(name: str) -> Any:
    from transformers.core_model_loading import dot_natural_key

    return dot_natural_key(name)


def _meta(shape: Shape) -> torch.Tensor:
    return torch.empty(shape, device="meta")
