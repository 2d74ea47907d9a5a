"""Tensors out of a ``torch.save`` file, reading only the bytes of the tensors asked for.

``torch.save`` writes a zip: a pickle of the object (small: its structure, each tensor a
reference to a storage record) and one uncompressed record per storage. ``torch.load``
reads every record; an export of a DeepSpeed checkpoint wants the fp32 weights out of
files that hold them beside the two Adam moments, each as large. :func:`load_lazy`
unpickles the structure with each tensor replaced by a :class:`LazyTensor` that knows
where its bytes are in the file and reads only the elements asked for. The pickle is
checked first (:func:`raylift.tensors.pickles.check`) and built only from what
:data:`raylift.tensors.pickles.CHECKPOINT` lists.
"""

from __future__ import annotations

import math
import pickle
import struct
import zipfile
from collections.abc import Callable
from typing import IO, Any

import torch

from raylift.tensors.pickles import CHECKPOINT, check_torch_file, path_of, refusal

LOCAL_HEADER = struct.Struct("<4s22xHH")  # a zip member's local header: lengths at 26


class LazyTensor:
    """A tensor of a ``torch.save`` file, not yet read: its shape and dtype, and where
    its elements are."""

    def __init__(
        self, f: IO[bytes], start: int, dtype: torch.dtype, offset: int,
        size: tuple[int, ...], stride: tuple[int, ...],
    ):  # fmt: skip
        self.f, self.start, self.dtype, self.offset = f, start, dtype, offset
        self.shape = torch.Size(size)
        self.contiguous = all(
            s == math.prod(size[i + 1 :]) for i, s in enumerate(stride) if size[i] > 1
        )

    def numel(self) -> int:
        return self.shape.numel()

    def read(self, first: int = 0, count: int | None = None) -> torch.Tensor:
        """Elements ``first .. first + count`` of the tensor, flattened (a 1-D tensor)."""
        if not self.contiguous:
            raise ValueError("a strided view in a torch.save file: load the file whole")
        count = self.numel() - first if count is None else count
        size = torch.empty(0, dtype=self.dtype).element_size()
        self.f.seek(self.start + (self.offset + first) * size)
        data = bytearray(self.f.read(count * size))
        return (
            torch.frombuffer(data, dtype=self.dtype) if data else torch.empty(0, dtype=self.dtype)
        )

    def load(self) -> torch.Tensor:
        return self.read().view(self.shape)


def load_lazy(f: IO[bytes], where: str | None = None) -> Any:
    """The object ``torch.save`` wrote to ``f`` (a seekable file), every tensor in it a
    :class:`LazyTensor`: only the zip's directory and the pickle are read. A pickle that
    names anything off the list is refused (:class:`~raylift.tensors.pickles.RefusedPickle`,
    naming ``where``: by default the file's path) before anything of it is built."""
    where = where or path_of(f)
    check_torch_file(f, where)
    archive = zipfile.ZipFile(f)
    pickled = next(n for n in archive.namelist() if n.endswith("/data.pkl"))
    root = pickled[: -len("data.pkl")]

    def record(key: str) -> int:
        info = archive.getinfo(f"{root}data/{key}")
        f.seek(info.header_offset)
        return data_start(info, f.read(LOCAL_HEADER.size))

    with archive.open(pickled) as data:
        return _Unpickler(data, f, record, where).load()


def data_start(info: zipfile.ZipInfo, header: bytes) -> int:
    """Where the bytes of the zip member ``info`` start, from its local ``header``."""
    magic, name_len, extra_len = LOCAL_HEADER.unpack(header)
    if magic != b"PK\x03\x04" or info.compress_type != zipfile.ZIP_STORED:
        raise ValueError(f"{info.filename} is not a stored zip member")
    return info.header_offset + LOCAL_HEADER.size + name_len + extra_len


class _Storage:
    def __init__(self, start: int, dtype: torch.dtype):
        self.start, self.dtype = start, dtype


class _Unpickler(pickle.Unpickler):
    """Builds what the list admits (a second gate: the pickle was checked first), each
    tensor a :class:`LazyTensor`."""

    def __init__(self, data: IO[bytes], f: IO[bytes], record: Callable[[str], int], where: str):
        super().__init__(data)
        self.f, self.record, self.where = f, record, where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in CHECKPOINT:
            raise refusal(self.where, (module, name))
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return self.tensor
        if (module, name) == ("torch._utils", "_rebuild_tensor_v3"):
            return self.tensor_v3
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> _Storage:
        _, storage_type, key, _location, _numel = pid
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type._dtype
        return _Storage(self.record(str(key)), dtype)

    def tensor(
        self, storage: _Storage, offset: int, size: tuple[int, ...], stride: tuple[int, ...],
        *_: Any,
    ) -> LazyTensor:  # fmt: skip
        return LazyTensor(self.f, storage.start, storage.dtype, offset, size, stride)

    def tensor_v3(
        self, storage: _Storage, offset: int, size: tuple[int, ...], stride: tuple[int, ...],
        _grad: bool, _hooks: Any, dtype: torch.dtype, *_: Any,
    ) -> LazyTensor:  # fmt: skip
        # The dtypes without a typed storage (float8, uint16/32/64) name theirs here.
        return LazyTensor(self.f, storage.start, dtype, offset, size, stride)


def concat_range(parts: list[LazyTensor], first: int, count: int) -> torch.Tensor:
    """Elements ``first .. first + count`` of the flattened ``parts`` laid end to end,
    reading only those."""
    pieces, start = [], 0
    for part in parts:
        end = start + part.numel()
        lo, hi = max(first, start), min(first + count, end)
        if lo < hi:
            pieces.append(part.read(lo - start, hi - lo))
        start = end
    got = sum(p.numel() for p in pieces)
    if got != count:
        raise ValueError(f"elements {first}..{first + count} run past the {start} there are")
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
