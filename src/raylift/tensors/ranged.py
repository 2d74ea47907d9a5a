"""Reading a checkpoint in ranges, each byte checked as it arrives.

A restore on N ranks from an object store must not move N copies of the checkpoint, nor
read it twice to check it. Its writer records an xxh3-64 checksum per block of every file
(a block starts at every tensor of a DCP file and every ``BLOCK`` bytes within one, so a
rank that reads one tensor of another rank's file reads no other byte).
:class:`VerifiedFile` serves any read or seek with ranged reads (a run of blocks in one
request, whatever the store), checks each block it fetches against its checksum, and keeps
the last few blocks, so that neighbouring small reads (a zip's header, the next tensor)
do not fetch a block again. DCP's planner decides which ranges a rank needs;
:func:`dcp_reader` hands its reads to such files, so a rank of a sharded model reads its
own shards and little else. DCP's own reader unpickles its ``.metadata`` and loads each
non-tensor item with ``torch.load(weights_only=False)``; this one checks both against
:data:`raylift.tensors.pickles.CHECKPOINT` first (:func:`dcp_metadata`).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import io
import itertools
from collections import OrderedDict
from collections.abc import Callable
from typing import IO, Any, Protocol, TypeVar, cast

from raylift.core.errors import RefusedPickle
from raylift.tensors.lazytorch import LazyTensor, load_lazy
from raylift.tensors.pickles import check_torch_file, load_pickle, load_torch

BLOCK = 1 << 20  # the most bytes one recorded checksum covers
CACHE_BYTES = (
    4 << 20
)  # what a file keeps of the blocks it read: a zip's header sits beside its data
SMALL_BLOCK = 64 << 10  # a block this small (a zip record's header, its directory) ...
READ_AHEAD = 256 << 10  # ... is fetched with the read before it, up to this many bytes


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used for resuming; the message says why and what to do."""


def block_starts(size: int, items: list[int] | None = None, block: int = BLOCK) -> list[int]:
    """Where each checked block of a file of ``size`` bytes starts: at every item's start
    (a DCP file's tensors, so that reading one item reads no byte of another) and every
    ``block`` bytes within an item."""
    bounds = sorted({0, *(i for i in items or () if 0 < i < size)})
    starts: list[int] = []
    for a, b in zip(bounds, [*bounds[1:], size], strict=True):
        starts.extend(range(a, max(b, a + 1), block))
    return starts


def block_digests(chunks: Any, starts: list[int]) -> tuple[str, list[str]]:
    """The xxh3-64 of the whole stream of ``chunks`` and of each block (from each of
    ``starts`` to the next), in one pass."""
    import xxhash

    whole, part = xxhash.xxh3_64(), xxhash.xxh3_64()
    blocks: list[str] = []
    pos, ends = 0, [*starts[1:], None]
    for chunk in chunks:
        whole.update(chunk)
        view = memoryview(chunk)
        while view:
            end = ends[len(blocks)]
            take = view if end is None else view[: end - pos]
            part.update(take)
            pos += len(take)
            view = view[len(take) :]
            if pos == end:
                blocks.append(part.hexdigest())
                part = xxhash.xxh3_64()
    if len(blocks) < len(starts):  # the last block (or an empty file's one)
        blocks.append(part.hexdigest())
    return whole.hexdigest(), blocks


@dataclasses.dataclass
class Listed:
    """What a checkpoint's writer recorded of one file."""

    name: str
    size: int
    blocks: list[str]  # xxh3-64 per block; [] in checkpoints written before them
    starts: list[int]  # where each block starts
    writer: int = 0  # the rank that wrote it
    whole: str | None = None  # xxh3-64 of the whole file

    def end(self, i: int) -> int:
        return self.starts[i + 1] if i + 1 < len(self.starts) else self.size

    def index(self, pos: int) -> int:
        """The block holding byte ``pos``."""
        return bisect.bisect_right(self.starts, pos) - 1


class Files(Protocol):
    """A checkpoint's files as an engine reads them back
    (:class:`raylift.tensors.checkpoints.CheckpointReader`)."""

    def open(self, name: str) -> io.RawIOBase:
        """The file ``name`` (relative to the checkpoint), read in checked ranges."""
        ...

    def has(self, name: str) -> bool: ...

    def names(self, under: str) -> list[str]:
        """The files below the folder ``under``, as names relative to the checkpoint."""
        ...

    def agree(self, problem: str | RefusedPickle | None) -> None:
        """Collective: every rank raises the first problem any rank found (None: none):
        a refused pickle as itself, anything else as a :class:`CheckpointError`."""
        ...

    def load_each(self, names: list[str], load: Callable[[IO[bytes]], Any]) -> dict[str, Any]:
        """Collective: ``load`` of each of ``names``, read once and checked as read; all
        ranks raise the first problem any rank found, before a loader's collectives."""
        ...


class VerifiedFile(io.RawIOBase):
    """A read-only, seekable file over ``read_at(offset, n)`` whose every byte returned has
    been checked against its block's recorded checksum; ``counted`` gets the bytes fetched."""

    def __init__(
        self,
        read_at: Callable[[int, int], bytes],
        listed: Listed,
        where: str,
        counted: Callable[[int], None] = lambda n: None,
        release: Callable[[], None] = lambda: None,
    ):
        super().__init__()
        self._read_at, self.listed, self.where, self._counted = read_at, listed, where, counted
        self._release = release
        self.path = f"{str(where).rstrip('/')}/{listed.name}"  # for messages
        self._pos = 0
        self._cache: OrderedDict[int, bytes] = OrderedDict()
        self._held = 0  # the cache's bytes, kept as it changes: a read must not sum it
        self.failed: CheckpointError | None = None  # the mismatch a read raised

    def close(self) -> None:
        if not self.closed:
            self._release()
            self._cache.clear()
            self._held = 0
        super().close()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.listed.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        n = max(0, min(len(out), self.listed.size - self._pos))
        if n == 0:
            return 0
        first, last = self.listed.index(self._pos), self.listed.index(self._pos + n - 1)
        blocks = self._blocks(first, last)
        start = self._pos - self.listed.starts[first]
        out[:n] = memoryview(b"".join(blocks))[start : start + n]
        self._pos += n
        return n

    def _blocks(self, first: int, last: int) -> list[bytes]:
        """Blocks ``first..last``: the cached ones as they are, each run of missing ones in
        one ranged read, checked block by block."""
        wanted = range(first, last + 1)
        got: dict[int, bytes] = {i: self._cache[i] for i in wanted if i in self._cache}
        fetch_to = self._small_after(last) if last not in got else last
        i = first
        while i <= fetch_to:
            if i in got:
                i += 1
                continue
            end = i
            while end + 1 <= fetch_to and end + 1 not in got:
                end += 1
            got.update(self._fetch(i, end))
            i = end + 1
        for j in range(first, fetch_to + 1):
            if j not in self._cache:
                self._held += len(got[j])
            self._cache[j] = got[j]
            self._cache.move_to_end(j)
        while self._held > CACHE_BYTES and len(self._cache) > 1:  # the oldest go first
            self._held -= len(self._cache.popitem(last=False)[1])
        return [got[j] for j in wanted]

    def _small_after(self, last: int) -> int:
        """``last``, or the last of the small blocks right after it (a zip's records and
        directory, the next item's header): fetched with it, one request, not one each."""
        listed, extra = self.listed, 0
        while last + 1 < len(listed.starts) and last + 1 not in self._cache:
            size = listed.end(last + 1) - listed.starts[last + 1]
            if size > SMALL_BLOCK or extra + size > READ_AHEAD:
                break
            extra += size
            last += 1
        return last

    def _fetch(self, first: int, last: int) -> dict[int, bytes]:
        import xxhash

        listed = self.listed
        offset = listed.starts[first]
        data = self._read_at(offset, listed.end(last) - offset)
        self._counted(len(data))
        out = {}
        for i in range(first, last + 1):
            a, b = listed.starts[i], listed.end(i)
            block = data[a - offset : b - offset]
            if listed.blocks and xxhash.xxh3_64(block).hexdigest() != listed.blocks[i]:
                # Kept: a reader in C++ (torch.load's) may raise its own error instead.
                self.failed = CheckpointError(
                    f"checkpoint {self.where} is corrupt: {listed.name} bytes {a}-{b} do "
                    f"not match the checksum rank {listed.writer} recorded when it wrote them"
                )
                raise self.failed
            out[i] = block
        return out


METADATA = ".metadata"  # DCP's index of a checkpoint folder
T = TypeVar("T")


def together(files: Files, read: Callable[[], T]) -> T:
    """Collective: ``read()`` on every rank; where one rank's fails (a damaged block, a
    refused pickle) every rank raises it, before any goes on into a loader's collectives."""
    found: Any = None
    problem: str | RefusedPickle | None = None
    try:
        found = read()
    except CheckpointError as exc:
        problem = str(exc)
    except RefusedPickle as exc:
        problem = exc
    files.agree(problem)
    return cast(T, found)


def dcp_metadata(files: Files, folder: str) -> Any:
    """DCP's ``Metadata`` of ``folder`` (a name inside the checkpoint): its pickle checked
    against the list, then built by the restricted unpickler, never by ``pickle.load``."""
    with files.open(f"{folder}/{METADATA}") as f:
        where = str(getattr(f, "path", f"{folder}/{METADATA}"))
        return load_pickle(f.read(), where)


def dcp_reader(files: Files, folder: str, metadata: Any = None) -> Any:
    """A torch.distributed.checkpoint ``StorageReader`` of ``folder`` (a name inside the
    checkpoint) whose files come from ``files``: ranged and checked, nothing copied
    first. Its ``metadata`` (by default read now, :func:`dcp_metadata`) is read before
    DCP's collectives, so that a refused or damaged one is raised as itself (DCP would
    wrap it into an error of its own)."""
    metadata = metadata if metadata is not None else dcp_metadata(files, folder)
    return _reader_class()(files, folder, metadata)


@functools.cache
def _reader_class() -> type:
    # torch.distributed.checkpoint takes most of a second to import: here, not with raylift.
    from torch.distributed.checkpoint import StorageReader
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.futures import Future

    class DCPReader(StorageReader):
        def __init__(self, files: Files, folder: str, metadata: Any):
            super().__init__()
            self.files, self.folder, self.metadata = files, folder, metadata
            self.storage_data: dict[Any, Any] = {}

        def reset(self, checkpoint_id: Any = None) -> None:
            self.storage_data = {}

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return self.metadata

        def set_up_storage_reader(
            self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any
        ) -> None:
            self.storage_data = metadata.storage_data

        def prepare_local_plan(self, plan: Any) -> Any:
            return plan

        def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
            return plans

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return True

        def read_data(self, plan: Any, planner: Any) -> Any:
            # In file order: each block is fetched once, the next item's start from the cache.
            def where(item: Any) -> tuple[str, int]:
                info = self.storage_data[item.storage_index]
                return info.relative_path, info.offset

            for path, items in itertools.groupby(
                sorted(plan.items, key=where), key=lambda i: where(i)[0]
            ):
                with self.files.open(f"{self.folder}/{path}") as stream:
                    for item in items:
                        self._read_item(stream, item, planner)
            done: Future[None] = Future()
            done.set_result(None)
            return done

        def _read_item(self, stream: Any, item: Any, planner: Any) -> None:
            info = self.storage_data[item.storage_index]
            end = info.offset + info.length
            at = f"{stream.path} (item {item.storage_index.fqn}, bytes {info.offset}-{end})"
            if info.transform_descriptors:
                raise CheckpointError(
                    f"{at} was written compressed, which raylift never writes: this folder "
                    "is not one of raylift's checkpoints"
                )
            saved = Window(stream, info.offset, info.length)
            if item.type == LoadItemType.BYTE_IO:
                data = _Named(saved.read(), at)
                # DCP's own planner would torch.load it with weights_only=False: checked
                # here whatever the planner, and dcp_planner()'s loads it restricted.
                check_torch_file(data, at)
                planner.load_bytes(item, data)
                return
            target = planner.resolve_tensor(item).detach()
            target.copy_(part_of_saved_tensor(saved, item.storage_offsets, item.lengths, at))
            planner.commit_tensor(item, target)

    return DCPReader


class _Named(io.BytesIO):
    """A non-tensor item's bytes, with where they came from (for a refusal's message)."""

    def __init__(self, data: bytes, path: str):
        super().__init__(data)
        self.path = path


def dcp_planner() -> Any:
    """DCP's default load planner, but for its non-tensor items (the optimizer's settings,
    the loop's numbers), which it loads with ``torch.load(weights_only=False)``: loaded
    here by :func:`~raylift.tensors.pickles.load_torch`, restricted to the list."""
    return _planner_class()()


@functools.cache
def _planner_class() -> type:
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            loaded = load_torch(value)
            fqn = read_item.dest_index.fqn
            if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes places it
                set_element(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

    return Planner


def part_of_saved_tensor(view: Any, offsets: Any, lengths: Any, where: str) -> Any:
    """The block ``offsets`` + ``lengths`` of the tensor DCP saved in ``view`` (one
    ``torch.save`` file), reading only its rows along the first dimension, where a sharded
    model cuts: a rank restoring half of a weight saved whole reads that half."""
    saved = load_lazy(view, where)
    if not isinstance(saved, LazyTensor) or not saved.contiguous or not saved.shape:
        return narrow(load_torch(view, where), offsets, lengths)
    row = saved.shape[1:].numel()
    rows = saved.read(offsets[0] * row, lengths[0] * row).view(lengths[0], *saved.shape[1:])
    return narrow(rows, [0, *offsets[1:]], lengths)


def narrow(tensor: Any, offsets: Any, lengths: Any) -> Any:
    for dim, (first, count) in enumerate(zip(offsets, lengths, strict=True)):
        if first or count != tensor.shape[dim]:
            tensor = tensor.narrow(dim, first, count)
    return tensor


class Window(io.RawIOBase):
    """Bytes ``start .. start + length`` of ``f`` as a file of their own. (DCP's own view
    of an item seeks from the end the wrong way, which a zip reader does.)"""

    def __init__(self, f: IO[bytes], start: int, length: int):
        super().__init__()
        self.f, self.start, self.length, self.at = f, start, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.at, io.SEEK_END: self.length}[whence]
        self.at = min(max(base + offset, 0), self.length)
        return self.at

    def tell(self) -> int:
        return self.at

    def readinto(self, b: Any) -> int:
        n = min(len(b), self.length - self.at)
        if n <= 0:
            return 0
        self.f.seek(self.start + self.at)
        data = b""
        while len(data) < n and (more := self.f.read(n - len(data))):
            data += more  # a raw file may return less than asked (up to a block's end)
        b[: len(data)] = data
        self.at += len(data)
        return len(data)
