"""Pretrained weights (``model.weights``) loaded into a model of any strategy, one tensor
at a time.

``model.weights`` names a ``.safetensors`` file, or a folder holding one
(``model.safetensors``) or a sharded Hugging Face checkpoint
(``model.safetensors.index.json`` and the files it maps), on this machine or in a store
(an object store's URI, or a Hub model pinned to a commit, ``hf://org/name@<commit>``), or
an MLflow model (``models:/NAME/VERSION``, ``runs:/RUN_ID/model``:
:mod:`raylift.artifacts.mlmodel` fetches it first). The driver reads only the files'
headers, where they are (ranged reads in a store), before any worker starts
(:mod:`raylift.tensors.preflight`), and refuses a missing, extra or differently shaped
tensor, or a file it cannot read, naming the tensor and the file.

In the workers, after the initial-weights pass, rank 0 reads the headers again and
tells every rank the plan and where each tensor's bytes lie. From a store, no rank copies
a file: each reads byte ranges of it, each range fetched alone (no read-ahead), tried
again as the store's other reads are. Where a strategy shards a parameter (an FSDP2,
HSDP or tensor-parallel DTensor, a ZeRO-3 partition) and the parameter is one file tensor
as the file holds it, every rank reads only the bytes of its own share: a ZeRO-3
partition's elements, or the rows that cover its DTensor slice (a tensor is stored
row-major, so a range of rows is one range of bytes; a slice along another dim is cut
from its rows). Each of N ranks that shard a model then reads about 1/N of it, and
none of it crosses between ranks. Everything else, a tensor the layout joins or
converts from the files' (:mod:`raylift.tensors.hf_layout`), a buffer, a parameter every
rank keeps whole (DDP, fairscale, ZeRO-1/2), and every tensor of a file on this machine,
rank 0 reads and broadcasts, bit for bit in the file's own dtype, and every rank keeps
its share of it (``raylift.tensors.init`` writers). No rank ever holds more than one whole
tensor beside its shards, and a node's host memory holds the weights once rather than
once per worker.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch import nn

from raylift.core import hub, storage
from raylift.core.errors import SourceError
from raylift.core.names import is_mlflow_uri
from raylift.tensors.adapters import base_name, is_adapter
from raylift.tensors.hf_layout import Layout
from raylift.tensors.init import Share, Writer, own_share

# A model's tensors as a weights file names them: (model, named tensors) -> (name, tensor).
NamedAs = Callable[[nn.Module, Any], Iterator[tuple[str, Any]]]

# Model tensor name -> (the name it is loaded as: its own or a tied twin's, and the
# ``file::tensor`` entries it is made of, in order).
Plan = dict[str, tuple[str, list[str]]]
# ``file::tensor`` -> where its bytes start in the file, its shape and its dtype.
Places = dict[str, tuple[int, tuple[int, ...], torch.dtype]]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class WeightsError(SourceError):
    """``model.weights`` cannot be loaded into the task's model."""


def weight_files(path: str) -> dict[str, str]:
    """Tensor name -> the file holding it, from the index or the files' headers (a local
    path or a URI alike)."""
    root = path
    if storage.is_dir(path):
        index = storage.read_text(storage.join(path, INDEX))
        if index is not None:
            mapping = json.loads(index)["weight_map"]
            return {name: storage.join(path, file) for name, file in mapping.items()}
        root = storage.join(path, SINGLE)
    if not storage.is_file(root):
        raise WeightsError(
            f"model.weights: {path} is neither a .safetensors file nor a folder with "
            f"{SINGLE} or {INDEX}"
        )
    return {name: root for name in header(root)}


MAX_HEADER = 100 << 20  # bytes; safetensors refuses larger headers too


def raw_header(path: str) -> tuple[bytes, int]:
    """A safetensors file's JSON header, as written, and the file's size: its first 8
    bytes give the header's length, then the header; two ranged reads on an object
    store, never the tensors. ValueError where the length does not fit the file. A Hub
    file at a commit never changes: its header is read once a process."""
    return _kept_header(path, hub.endpoint()) if hub.at_a_commit(path) else _read_header(path)


@functools.lru_cache(maxsize=256)
def _kept_header(path: str, endpoint: str | None) -> tuple[bytes, int]:
    return _read_header(path)  # by the Hub it was read from, too: a mirror is another


def _read_header(path: str) -> tuple[bytes, int]:
    with storage.Ranges(path) as f:
        total = f.size()
        size = int.from_bytes(f.read(0, 8), "little") if total >= 8 else 0
        if not 2 <= size <= min(MAX_HEADER, total - 8):
            raise ValueError(f"its header length, {size} bytes, does not fit the file")
        return f.read(8, size), total


def header_entries(path: str) -> dict[str, dict[str, Any]]:
    """Tensor name -> its header entry (dtype, shape, data_offsets from the data's start,
    which is ``8 + len(raw header)``), checked against the file's size."""
    return _entries(path)[0]


def _entries(path: str) -> tuple[dict[str, dict[str, Any]], int]:
    """The header entries, and where in the file the tensors' data starts."""
    try:
        text, total = raw_header(path)
        meta = json.loads(text)
        tensors = {n: t for n, t in meta.items() if n != "__metadata__"}
        need = max((int(t["data_offsets"][1]) for t in tensors.values()), default=0)
        if 8 + len(text) + need != total:  # cut off, or not safetensors
            raise ValueError(
                f"its tensors take {need} bytes after the header, the file holds "
                f"{total - 8 - len(text)}"
            )
        return tensors, 8 + len(text)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise WeightsError(f"model.weights: cannot read {path}: {exc}") from exc


def header(path: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors file's header alone."""
    return {n: tuple(t["shape"]) for n, t in header_entries(path).items()}


def header_fingerprint(path: str) -> str:
    """xxh3-64 of the safetensors headers of the weights at ``path`` (every tensor's name,
    dtype, shape and place): what says a checkpoint's adapters were trained on these
    weights, in two ranged reads a file."""
    import xxhash

    digest = xxhash.xxh3_64()
    for file in sorted(set(weight_files(path).values())):
        digest.update(raw_header(file)[0])
    return digest.hexdigest()


def file_shapes(files: dict[str, str]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Tensor name -> (shape, file), reading each file's header once."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in sorted(set(files.values())):
        for name, shape in header(file).items():
            out[name] = (shape, file)
    missing = [n for n, f in files.items() if n not in out]
    if missing:
        raise WeightsError(
            f"model.weights: tensor {missing[0]} is listed for {files[missing[0]]} "
            "but that file does not hold it"
        )
    return out


def expected(
    model: nn.Module, named_as: NamedAs | None = None
) -> tuple[dict[str, tuple[int, ...]], dict[str, list[str]]]:
    """The model's tensors to load (parameters once each, persistent buffers), under the
    files' names (``named_as``: the base's, by default), and, per name, the other names a
    tied parameter goes by."""
    named_as = named_as or base_tensors
    shapes: dict[str, tuple[int, ...]] = {}
    aliases: dict[str, list[str]] = {}
    first: dict[int, str] = {}
    for name, p in named_as(model, model.named_parameters(remove_duplicate=False)):
        if id(p) in first:
            aliases[first[id(p)]].append(name)
            continue
        first[id(p)] = name
        aliases[name] = []
        shapes[name] = tuple(getattr(p, "ds_shape", p.shape))
    for name, b in named_as(model, model.state_dict(keep_vars=True).items()):
        if name not in shapes and not any(name in a for a in aliases.values()):
            shapes[name] = tuple(b.shape)
    return shapes, aliases


def base_tensors(model: nn.Module, named: Any) -> Iterator[tuple[str, Any]]:
    """``named`` (name, tensor) pairs of a model as its weights' files name them: with
    adapters attached, the base's tensors under the base's names, the adapters' left out
    (they start as raylift draws them, not from the files)."""
    for name, tensor in named:
        if not is_adapter(name):
            yield base_name(name), tensor


def check(
    model: nn.Module, path: str, named_as: NamedAs | None = None, key: str = "model.weights"
) -> Plan:
    """Every tensor of ``model`` (as ``named_as`` names them) made from the files at its
    shape, and nothing else in them; the plan to load from. A Hugging Face model's files
    are read by transformers' own rules for its architecture (:mod:`raylift.tensors.hf_layout`:
    renamed keys, per-expert tensors fused); adapters' files (``named_as``) as named.
    WeightsError names what is wrong, and the config ``key`` that gave the files."""
    found = file_shapes(weight_files(path))
    layout = Layout(model if named_as is None else None)
    groups = layout.group(found)
    shapes, aliases = expected(model, named_as)
    known = set(shapes) | {a for names in aliases.values() for a in names}
    extra = sorted(f for name, files in groups.items() if name not in known for f in files)
    if extra:
        raise WeightsError(
            f"{key}: tensor {extra[0]} in {found[extra[0]][1]} is not in the "
            f"task's model ({len(extra)} such); check that the weights are for this "
            "model and its task_args"
        )
    plan: Plan = {}
    for name, shape in shapes.items():
        have = next((n for n in [name, *aliases.get(name, [])] if n in groups), None)
        if have is None:
            raise WeightsError(f"{key}: tensor {name} (shape {list(shape)}) is missing from {path}")
        parts = {f: found[f][0] for f in groups[have]}
        got = layout.joined_shape(have, parts) if layout.converts else next(iter(parts.values()))
        if got != shape:
            first = groups[have][0]
            raise WeightsError(
                f"{key}: tensor {first} in {found[first][1]} makes {have} of shape "
                f"{list(got)}, the model's is {list(shape)}; check task_args against the "
                "weights' config"
                if layout.converts
                else f"{key}: tensor {have} in {found[have][1]} has shape {list(got)}, the "
                f"model's is {list(shape)}; check task_args against the weights' config"
            )
        plan[name] = (have, [f"{found[f][1]}::{f}" for f in groups[have]])
    return plan


def absolute(weights: str | None) -> str | None:
    """``model.weights`` as workers in other folders find it: a local path made absolute
    against this process's folder; a URI or an MLflow model as it is."""
    if not weights or is_mlflow_uri(weights):
        return weights
    return storage.resolve(weights)


def weights_path(cfg: Any, task: Any) -> str | None:
    """``model.weights``, else the task's own pretrained weights (a Hugging Face folder's)."""
    return cfg.model.weights or getattr(task, "pretrained_weights", None)


def load(
    model: nn.Module,
    path: str,
    write: Writer,
    named_as: NamedAs | None = None,
    key: str = "model.weights",
) -> None:
    """Collective: every tensor of the model (as ``named_as`` names them: the base's, by
    default) written from the files. Where they are in a store and ``write`` shards a
    parameter made of one file tensor as it is, each rank reads its own share's bytes of
    it; anything else (a tensor joined from several, a buffer, a parameter kept whole,
    any tensor of a local file) rank 0 reads and broadcasts, and every rank writes its
    share of it."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    layout = Layout(model if named_as is None else None)  # as check() reads the files
    remote = storage.is_remote(path)
    # The plan, and each file tensor's place: the other ranks read, or allocate what
    # rank 0 sends, from it.
    shared: list[Any] = [_planned(model, path, named_as, key, layout) if rank == 0 else None]
    named_as = named_as or base_tensors
    if dist.is_initialized():
        dist.broadcast_object_list(shared, src=0)
    if isinstance(shared[0], WeightsError):
        raise shared[0]  # on every rank: none is left waiting for a tensor
    plan, dtypes, places = cast(tuple[Plan, dict[str, torch.dtype], Places], shared[0])
    params = dict(named_as(model, model.named_parameters()))
    buffers = dict(named_as(model, model.named_buffers()))
    with contextlib.ExitStack() as stack:
        read = _Reader(stack, places)
        for name, (have, parts) in plan.items():
            if remote and name in params and _as_is(layout, parts):
                share = own_share(write, params[name])
                if share is not None:  # the same on every rank: none waits for a broadcast
                    read.share(parts[0], share)
                    continue
            value = layout.join(have, read(parts)) if rank == 0 else None
            target = params[name] if name in params else buffers[name]
            shape = tuple(getattr(target, "ds_shape", target.shape))
            value = _broadcast(value, shape, dtypes[name])
            if name in params:
                write(params[name], value)
            else:
                with torch.no_grad():
                    buffers[name].copy_(value)


def _as_is(layout: Layout, parts: list[str]) -> bool:
    """Whether the model tensor is one file tensor as the file holds it (not joined,
    transposed or converted by the layout)."""
    return len(parts) == 1 and not layout.model_name(parts[0].split("::", 1)[1])[1]


class _Reader:
    """File tensors by ``file::name``, each file opened once for the whole load: a local
    file with safetensors, a file in a store with ranged reads of exactly the bytes wanted
    (:class:`raylift.core.storage.Ranges`), never copied whole."""

    def __init__(self, stack: contextlib.ExitStack, places: Places):
        self.stack, self.places = stack, places
        self.opened: dict[str, Any] = {}

    def __call__(self, parts: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for where in parts:
            file, name = where.split("::", 1)
            if storage.is_remote(file):
                _, shape, dtype = self.places[where]
                out[name] = self._read(where, 0, math.prod(shape), dtype).view(shape)
            else:
                out[name] = self._local(file).get_tensor(name)
        return out

    def share(self, where: str, share: Share) -> None:
        """This rank's share of the file tensor ``where``: the bytes of its elements
        alone, read and placed."""
        _, _, dtype = self.places[where]
        share.place(self._read(where, share.start, share.end, dtype))

    def _read(self, where: str, first: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """Elements ``first`` to ``end`` of the file tensor ``where``, row-major."""
        file = where.split("::", 1)[0]
        start, _, _ = self.places[where]
        out = torch.empty(end - first, dtype=dtype)
        if out.numel():
            ranges = self.opened.get(file)
            if ranges is None:
                ranges = self.opened[file] = storage.Ranges(file)
                self.stack.callback(ranges.close)
            wire = out.view(torch.uint8).numpy().data  # a view: read straight into ``out``
            ranges.read_into(start + first * dtype.itemsize, wire)
        return out

    def _local(self, file: str) -> Any:
        from safetensors import safe_open

        if file not in self.opened:
            self.opened[file] = self.stack.enter_context(safe_open(file, framework="pt"))
        return self.opened[file]


def _planned(
    model: nn.Module, path: str, named_as: NamedAs | None, key: str, layout: Layout
) -> tuple[Plan, dict[str, torch.dtype], Places] | WeightsError:
    """The plan (:func:`check`), each planned tensor's dtype as rank 0 will make it (its
    file tensors', joined on the meta device as ``layout`` joins them) and each file
    tensor's place, from the files' headers. The WeightsError itself where the files do
    not fit, for every rank to raise."""
    try:
        return _plan_and_dtypes(model, path, named_as, key, layout)
    except WeightsError as exc:
        return exc


def _plan_and_dtypes(
    model: nn.Module, path: str, named_as: NamedAs | None, key: str, layout: Layout
) -> tuple[Plan, dict[str, torch.dtype], Places]:
    plan = check(model, path, named_as, key)
    wanted = {where for _, parts in plan.values() for where in parts}
    places: Places = {}
    for file in sorted({where.split("::", 1)[0] for where in wanted}):
        entries, data = _entries(file)
        for n, e in entries.items():
            where = f"{file}::{n}"
            if where in wanted:
                dtype = _dtype(e["dtype"], where, key)
                places[where] = (data + int(e["data_offsets"][0]), tuple(e["shape"]), dtype)
    dtypes = {}
    for name, (have, parts) in plan.items():
        meta = {
            where.split("::", 1)[1]: torch.empty(
                places[where][1], dtype=places[where][2], device="meta"
            )
            for where in parts
        }
        dtypes[name] = layout.join(have, meta).dtype
    return plan, dtypes, places


# A safetensors header's dtype names, as torch names them.
SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "C64": "complex64",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip


def _dtype(name: str, where: str, key: str) -> torch.dtype:
    dtype = getattr(torch, SAFETENSORS_DTYPES.get(name, ""), None)
    if not isinstance(dtype, torch.dtype):
        raise WeightsError(
            f"{key}: tensor {where.replace('::', ' in ')} is of dtype {name}, which this "
            "torch cannot hold; convert the weights to bf16, fp16 or fp32"
        )
    return dtype


def _broadcast(
    value: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """Rank 0's tensor on every rank's host, bit for bit in its own ``dtype`` (a bf16 file
    crosses the wire and sits in memory at 2 bytes an element): its bytes are sent, which
    every backend carries whatever the dtype."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        assert value is not None
        return value
    # Rank 0's join makes the planned dtype (``_planned``); the cast keeps both ends agreed.
    out = value.to(dtype).contiguous() if value is not None else torch.empty(shape, dtype=dtype)
    if out.numel() == 0:
        return out
    wire = out.reshape(-1).view(torch.uint8)  # a view: received straight into ``out``
    if dist.get_backend() == "nccl":  # NCCL moves device tensors only
        sent = wire.to(torch.device("cuda", torch.cuda.current_device()))
        dist.broadcast(sent, src=0)
        wire.copy_(sent)
    else:
        dist.broadcast(wire, src=0)
    return out


def base_of(cfg: Any, weights: str | None) -> dict[str, str] | None:
    """What the run's adapters train on, as its checkpoints record it: the base's weights
    (path or URI) and a digest of their safetensors headers; a base drawn from the seed
    (no weights) by the seed. None without adapters."""
    if not cfg.model.adapter.type:
        return None
    if weights is None:
        seeded = f"drawn from train.seed {cfg.train.seed}"
        return {"weights": seeded, "headers": seeded}

    return {
        "weights": weights,
        "headers": weights if is_mlflow_uri(weights) else header_fingerprint(weights),
    }
