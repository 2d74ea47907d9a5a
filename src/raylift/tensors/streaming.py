"""Exporting a model one tensor at a time, reading only the model's bytes.

A DCP checkpoint (``ddp``, ``fsdp``) holds the model and the optimizer's state, each
tensor in chunks (one per rank that held a shard) at known ranges of the ranks' files.
The export reads its ``.metadata``, then, for each of the model's tensors in turn, the
ranges of its chunks (through :class:`raylift.tensors.checkpoints.CheckpointReader`: checked as
they arrive, never the optimizer's), joins them into the full tensor and writes it
out before reading the next. safetensors puts every tensor's place in a header before
the data; the places follow from the shapes and dtypes in the metadata, so the header is
written first and the file streamed after it. Memory: the largest tensor, twice.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol, cast

import torch

from raylift.tensors.lazytorch import load_lazy
from raylift.tensors.pickles import load_torch
from raylift.tensors.ranged import dcp_metadata

if TYPE_CHECKING:
    from raylift.tensors.checkpoints import CheckpointReader

PREFIX = "model."  # raylift's DCP state: {"model": ..., "optim": ...}
# safetensors' names for every dtype it stores.
CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint64: "U64", torch.uint32: "U32", torch.uint16: "U16", torch.uint8: "U8",
    torch.bool: "BOOL",
}  # fmt: skip


@dataclasses.dataclass
class Spec:
    """One tensor of the model as the export writes it (floating point as fp32)."""

    name: str
    shape: list[int]
    dtype: torch.dtype
    fqn: str  # its key in the checkpoint

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty(0, dtype=self.dtype).element_size()


class ModelTensors(Protocol):
    """A checkpoint's model as an export reads it: what each tensor is, then the tensors
    one at a time (floating point as fp32), each read when its turn comes."""

    specs: list[Spec]
    aliases: dict[str, str]  # a tied weight's other name -> the name it is written under

    def tensors(self) -> Iterator[tuple[Spec, torch.Tensor]]: ...


class LazyModel:
    """:class:`ModelTensors` from a reading function per tensor."""

    def __init__(self, entries: list[tuple[Spec, Callable[[], torch.Tensor]]],
                 aliases: dict[str, str] | None = None):  # fmt: skip
        self.specs = [spec for spec, _ in entries]
        self._read = dict((spec.name, read) for spec, read in entries)
        self.aliases = aliases or {}

    def tensors(self) -> Iterator[tuple[Spec, torch.Tensor]]:
        for spec in self.specs:
            yield spec, self._read[spec.name]().to(spec.dtype)


def saved_model(reader: CheckpointReader, name: str, key: str) -> LazyModel:
    """The state_dict under ``key`` of the ``torch.save`` file ``name`` (fairscale's
    consolidated file, DeepSpeed's unpartitioned module), reading its tensors' bytes only:
    never the optimizer state saved beside them."""
    state = load_lazy(cast(IO[bytes], reader.open(name)))[key]
    entries: list[tuple[Spec, Callable[[], torch.Tensor]]] = []
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    for fqn, lazy in state.items():
        where = (lazy.start, lazy.offset, tuple(lazy.shape))
        if where in seen:  # tied: one storage under two names
            aliases[fqn] = seen[where]
            continue
        seen[where] = fqn
        entries.append((Spec(fqn, list(lazy.shape), _exported(lazy.dtype), fqn), lazy.load))
    return LazyModel(entries, aliases)


class DCPModel:
    """The model's tensors in a DCP checkpoint folder (``engine``), read one at a time."""

    def __init__(self, reader: CheckpointReader, folder: str = "engine"):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.reader, self.folder = reader, folder
        # DCP's own format, its pickle checked against the list first.
        self.meta = dcp_metadata(reader, folder)
        specs = [
            Spec(fqn[len(PREFIX) :], list(md.size), _exported(md.properties.dtype), fqn)
            for fqn, md in self.meta.state_dict_metadata.items()
            if fqn.startswith(PREFIX) and isinstance(md, TensorStorageMetadata)
        ]
        # The metadata lists a tied weight under each name: the run recorded which are one.
        self.aliases = recorded_ties(reader.loop_state(), specs)
        self.specs = [spec for spec in specs if spec.name not in self.aliases]

    def tensors(self) -> Iterator[tuple[Spec, torch.Tensor]]:
        for spec in self.specs:
            yield spec, self._read(spec)

    def _read(self, spec: Spec) -> torch.Tensor:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        md = self.meta.state_dict_metadata[spec.fqn]
        full = torch.empty(spec.shape, dtype=spec.dtype)
        for chunk in md.chunks:
            info = self.meta.storage_data[MetadataIndex(spec.fqn, chunk.offsets)]
            with self.reader.open(f"{self.folder}/{info.relative_path}") as f:
                f.seek(info.offset)
                blob = f.read(info.length)
                at = f"{f.path} (item {spec.fqn}, bytes {info.offset}-{info.offset + info.length})"
            part = load_torch(io.BytesIO(blob), at)
            where = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))
            full[where] = part.to(spec.dtype)
        return full


def recorded_ties(loop_state: dict[str, Any], specs: list[Spec]) -> dict[str, str]:
    """The tied names a DCP checkpoint's run recorded (``engine_extra["tied"]``; an older
    checkpoint has none), as :attr:`ModelTensors.aliases`. Data from the checkpoint: an
    entry is kept only where both names are saved tensors of one shape and dtype and the
    one written is no alias itself; any other name is written on its own, as before."""
    extra = loop_state.get("engine_extra")
    record = extra.get("tied") if isinstance(extra, dict) else None
    if not isinstance(record, dict):
        return {}
    by_name = {spec.name: spec for spec in specs}
    ties: dict[str, str] = {}
    for alias, name in record.items():
        if not (isinstance(alias, str) and isinstance(name, str)) or alias == name:
            continue
        a, b = by_name.get(alias), by_name.get(name)
        if a and b and record.get(name, name) == name and (a.shape, a.dtype) == (b.shape, b.dtype):
            ties[alias] = name
    return ties


def _exported(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype.is_floating_point else dtype


def write_safetensors(
    path: Path, specs: list[Spec], tensors: Iterator[tuple[Spec, torch.Tensor]],
    metadata: dict[str, str] | None = None,
) -> None:  # fmt: skip
    """One safetensors file of ``specs``, the tensors written as ``tensors`` yields them
    (in the order of ``specs``): the header from the shapes first, then the data."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for spec in specs:
        header[spec.name] = {
            "dtype": CODES[spec.dtype], "shape": spec.shape,
            "data_offsets": [offset, offset + spec.nbytes],
        }  # fmt: skip
        offset += spec.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the format asks
    with path.open("wb") as out:
        out.write(struct.pack("<Q", len(text)))
        out.write(text)
        for spec in specs:
            got, tensor = next(tensors)
            if got.name != spec.name:
                raise RuntimeError(f"expected tensor {spec.name}, got {got.name}")
            out.write(raw_bytes(tensor))


def raw_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's bytes as safetensors lays them out: C order, little-endian. Flattened
    first: a 0-dim tensor (BatchNorm's ``num_batches_tracked``) has no view of another
    element size."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def shard_plan(specs: list[Spec], max_bytes: int) -> list[list[Spec]]:
    """Specs in files of at most ``max_bytes`` each (a larger tensor alone in its own), in
    order, as Hugging Face's ``save_pretrained`` splits them."""
    shards: list[list[Spec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def write_hf_shards(
    out: Path, specs: list[Spec], tensors: Iterator[tuple[Spec, torch.Tensor]], max_bytes: int
) -> int:
    """``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` and their index
    where the model is larger than ``max_bytes``; the number of files."""
    shards = shard_plan(specs, max_bytes)
    if len(shards) == 1:
        write_safetensors(out / "model.safetensors", specs, tensors)
        return 1
    weight_map = {}
    for k, shard in enumerate(shards, 1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(out / name, shard, tensors)
        weight_map.update({spec.name: name for spec in shard})
    index = {"metadata": {"total_size": sum(s.nbytes for s in specs)}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return len(shards)
