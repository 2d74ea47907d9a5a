"""What raylift unpickles from storage, and the one check that admits it.

A pickle is a small program: its ``GLOBAL`` opcodes import any name of any module and
``REDUCE`` calls it, so a checkpoint that someone else can write is code they can run in
every process that opens it. raylift opens checkpoints and memory snapshots from shared
storage, so every pickle it reads there first goes through :func:`check`: a
dry run of the pickle in which every global it names is looked up in an explicit list of
``(module, name)`` pairs and replaced by a stand-in that does nothing. Nothing it names is
imported, nothing is called, and a name off the list stops it with
:class:`RefusedPickle`, naming the file and the global. Only then is the file loaded
for real, by a loader that admits the same list (``torch.load(weights_only=True)`` with
the non-torch entries as ``safe_globals``, or :class:`Restricted`).

:data:`CHECKPOINT` is every global that the checkpoints of the supported libraries hold
(DDP and FSDP2 through DCP, fairscale, DeepSpeed ZeRO 1-3 with and without offload, in
every precision, with and without adapters, the loop state and the RNG files), found by
saving each and listing what its pickles name. Each is one object, none a module or a
package, and each is harmless to call with any arguments: a tensor's record, a dtype, a
dataclass of DCP's, DeepSpeed's loss scaler. (A sweep's state, which Ray Tune pickles
with functions and commands in it, is never unpickled: raylift.commands.tune.)
"""

from __future__ import annotations

import _compat_pickle
import importlib
import io
import pickle
import struct
import zipfile
from collections.abc import Iterable
from typing import IO, Any, cast

from raylift.core.errors import RefusedPickle

__all__ = ["CHECKPOINT", "RefusedPickle", "check", "load_pickle", "load_torch"]

Global = tuple[str, str]

# torch.save's records of a tensor (every .pt file, every item of a DCP file): the
# rebuild call, its storage's class, for the dtypes raylift reads and exports
# (streaming.CODES) a typed storage or, for the newer ones, an untyped one and the dtype.
_TENSORS = {
    ("collections", "OrderedDict"),  # every state_dict
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_tensor_v3"),  # float8, uint16/32/64
    ("torch.storage", "UntypedStorage"),  # float8, uint16/32/64
    ("torch", "FloatStorage"),
    ("torch", "DoubleStorage"),
    ("torch", "HalfStorage"),  # DeepSpeed 16-mixed
    ("torch", "BFloat16Storage"),  # bf16-true
    ("torch", "LongStorage"),
    ("torch", "IntStorage"),
    ("torch", "ShortStorage"),
    ("torch", "CharStorage"),
    ("torch", "ByteStorage"),  # the RNG files' states
    ("torch", "BoolStorage"),
}
# Dtypes by name: DCP's metadata records each tensor's, DeepSpeed's optimizer states
# name its fp16 one, and _rebuild_tensor_v3 the newer ones'.
_DTYPES = {
    ("torch", name)
    for name in ("float32", "float64", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
                 "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool")
}  # fmt: skip
# DCP's .metadata (DDP, FSDP2): its records of each item and where it lies.
_DCP = {
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # TensorProperties' layout, by name
    ("torch", "Size"),  # also DeepSpeed's model states (parameter shapes)
    ("pathlib", "PosixPath"),  # StorageMeta's checkpoint_id
}
# DeepSpeed's optimizer states (ZeRO 1-3, with offload or not): its ZeRO stage, its loss
# scaler (dynamic with 16-mixed), and where each parameter lies in a flat partition
# (ZeRO 1/2).
_DEEPSPEED = {
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
}

CHECKPOINT: frozenset[Global] = frozenset(_TENSORS | _DTYPES | _DCP | _DEEPSPEED)


NOTHING_RAN = (
    "nothing of it was run and nothing was changed. Whoever can write that storage put "
    "it there: find out who, then"
)
CHECKPOINT_FIX = (
    "start a new run under another name, or delete that checkpoint folder to resume from "
    "the one before it (`raylift verify RUN` checks every checkpoint)"
)


def refusal(where: str, found: Global) -> RefusedPickle:
    module, name = _as_python3(found)
    return RefusedPickle(
        f"refusing to open {where}: its pickle calls {module}.{name}, which no checkpoint "
        f"holds; {NOTHING_RAN} {CHECKPOINT_FIX}"
    )


def _as_python3(found: Global) -> Global:
    """A name as it is written in a pickle of protocol 2 or less (``__builtin__.exec``),
    as Python 3 reads it (``builtins.exec``): what to call it in a message."""
    if found in _compat_pickle.NAME_MAPPING:
        return _compat_pickle.NAME_MAPPING[found]
    return _compat_pickle.IMPORT_MAPPING.get(found[0], found[0]), found[1]


# ---------------------------------------------------------------- the dry run


class _StandIn:
    """What every global becomes in a dry run, and everything built from one: callable,
    buildable, a container, never anything real."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _StandIn:
        return object.__new__(_StandIn)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _StandIn:
        return _StandIn()

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass

    def add(self, value: Any) -> None:
        pass


class _DryRun(pickle.Unpickler):
    """Runs a pickle on stand-ins: each global it names is passed to ``seen``, which may
    refuse it; nothing is imported, nothing is called."""

    def __init__(self, data: IO[bytes], seen: Any):
        super().__init__(data, fix_imports=False)
        self.seen = seen

    def find_class(self, module: str, name: str) -> Any:
        self.seen((module, name))
        return _StandIn

    def persistent_load(self, pid: Any) -> Any:
        return _StandIn()


def globals_in(data: bytes) -> set[Global]:
    """Every global the pickle ``data`` names, found by running it on stand-ins: safe
    on any input. ``pickle.UnpicklingError`` (or another error) where it is malformed."""
    found: set[Global] = set()
    _DryRun(io.BytesIO(data), found.add).load()
    return found


def check(data: bytes, where: str) -> set[Global]:
    """The globals of the pickle ``data``, every one of them on :data:`CHECKPOINT`, else
    :class:`RefusedPickle` naming ``where`` and the first other one. Nothing it names is
    imported or called. A pickle too malformed to run is refused too."""
    found: set[Global] = set()

    def seen(name: Global) -> None:
        if name not in CHECKPOINT:
            raise refusal(where, name)
        found.add(name)

    try:
        _DryRun(io.BytesIO(data), seen).load()
    except RefusedPickle:
        raise
    except Exception as exc:
        raise RefusedPickle(
            f"refusing to open {where}: it is not a pickle raylift can check "
            f"({type(exc).__name__}: {exc}); {NOTHING_RAN} {CHECKPOINT_FIX}"
        ) from exc
    return found


# ---------------------------------------------------------------- torch.save files


def path_of(f: Any) -> str:
    """What to call the file ``f`` in a message: its path in the checkpoint, where known."""
    return str(getattr(f, "path", None) or getattr(f, "name", None) or "a checkpoint file")


def pickles_of(f: IO[bytes], where: str) -> list[bytes]:
    """Every pickle in the ``torch.save`` file ``f`` (a zip), as torch's own reader finds
    them. ``zipfile.BadZipFile`` for a file that is no zip (cut off, damaged). An archive
    that two readers could read differently is refused, as torch.save never writes one:
    a zip behind other bytes (torch reads no zip there, but an older format), a directory
    elsewhere than its end record says (Python shifts every offset, torch does not), a
    member listed twice."""
    f.seek(0)
    if f.read(4) != b"PK\x03\x04":
        if zipfile.is_zipfile(f):
            raise _crafted(where, "a zip archive behind other bytes")
        raise zipfile.BadZipFile(f"{where} is not a torch.save archive")
    with zipfile.ZipFile(f) as archive:
        if archive.start_dir != _directory_offset(f):
            raise _crafted(where, "a zip archive whose directory is not where its end says")
        names = archive.namelist()
        if len(names) != len(set(names)):
            raise _crafted(where, "a zip archive that lists a member twice")
        return [archive.read(n) for n in names if n.endswith(".pkl")]


END_RECORD = struct.Struct("<4s4H2LH")  # a zip's end of central directory, 22 bytes


def _directory_offset(f: IO[bytes]) -> int | None:
    """Where the last end record of the zip ``f`` says its directory starts (ZipFile reads
    the same record, but moves the directory by any bytes before the archive)."""
    size = f.seek(0, io.SEEK_END)
    f.seek(max(0, size - END_RECORD.size))  # as torch.save writes it: no comment after it
    tail = f.read()
    if not tail.startswith(b"PK\x05\x06"):  # else it is somewhere in the comment's room
        f.seek(max(0, size - END_RECORD.size - 0xFFFF))
        tail = f.read()
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or len(tail) - at < END_RECORD.size:
        return None
    return int(END_RECORD.unpack_from(tail, at)[6])


def _crafted(where: str, what: str) -> RefusedPickle:
    return RefusedPickle(
        f"refusing to open {where}: it is {what}, which torch.save never writes and two "
        f"readers could read differently; {NOTHING_RAN} {CHECKPOINT_FIX}"
    )


def check_torch_file(f: IO[bytes], where: str | None = None) -> set[Global]:
    """The globals of every pickle in the ``torch.save`` file ``f``, each passed by
    :func:`check`; ``f`` is left at its start."""
    where = where or path_of(f)
    found: set[Global] = set()
    for data in pickles_of(f, where):
        found |= check(data, where)
    f.seek(0)
    return found


def load_torch(f: IO[bytes], where: str | None = None, map_location: Any = "cpu") -> Any:
    """``torch.load`` of the file ``f`` once :func:`check_torch_file` passed it, with
    ``weights_only=True``: torch's own restricted loader, given as ``safe_globals`` the
    names of :data:`CHECKPOINT` that the file uses and torch does not admit by itself
    (DeepSpeed's)."""
    import torch

    used = check_torch_file(f, where)
    with torch.serialization.safe_globals(_beyond_torch(used)):
        return torch.load(cast(IO[bytes], f), weights_only=True, map_location=map_location)


def load_torch_bytes(data: bytes, where: str) -> Any:
    return load_torch(io.BytesIO(data), where)


def _beyond_torch(used: Iterable[Global]) -> list[Any]:
    """(object, "module.name") for each of ``used`` (names :func:`check` passed), for
    torch's weights-only loader: those it admits by itself (tensors, dtypes) it admits
    again; the rest (DeepSpeed's loss scaler, say) it admits for this file alone."""
    return [(_resolve(module, name), f"{module}.{name}") for module, name in sorted(used)]


def _resolve(module: str, name: str) -> Any:
    return getattr(importlib.import_module(module), name)


# ---------------------------------------------------------------- plain pickles


class Restricted(pickle.Unpickler):
    """An unpickler that builds only what :data:`CHECKPOINT` names (a file already passed
    by :func:`check`: this is the second gate, not the first)."""

    def __init__(self, data: IO[bytes], where: str):
        super().__init__(data)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in CHECKPOINT:
            raise refusal(self.where, (module, name))
        return super().find_class(module, name)


def load_pickle(data: bytes, where: str) -> Any:
    """The object of the plain pickle ``data`` (DCP's ``.metadata``): checked by a dry
    run, then built by :class:`Restricted`."""
    check(data, where)
    return Restricted(io.BytesIO(data), where).load()
