"""One checkpoint format for everything that must survive a restart.

A checkpoint folder holds the engine's sharded model and optimizer state
(``engine/``, written by every rank), the loop's state (``loop_state.pt``:
step, epoch, data position, LR schedule, early stopping, scaler; written by
rank 0) and each rank's RNG state.

What is trusted: nothing in the folder. Every pickle in it (each ``torch.save`` file's,
each item of a DCP file, DCP's ``.metadata``) is first run dry on stand-ins, each global
it names looked up in an explicit list of the pairs that these checkpoints hold
(:data:`raylift.tensors.pickles.CHECKPOINT`): a file naming anything else is refused,
naming the file and the global (:class:`~raylift.tensors.pickles.RefusedPickle`), before
anything of it is built; a resume, an export, ``raylift verify`` alike, and none of them
passes over it to an older checkpoint. Files that pass are built by loaders that admit
the same list (``torch.load(weights_only=True)``, the restricted unpickler). So a folder
someone else can write can stop a run, or give it wrong numbers, but not run code.

Each rank ends its part with ``complete-rank<r>.json``: the size of every file it wrote,
its xxh3-64 checksum, and one per 1 MiB block. A checkpoint is complete when every rank's
list is there and every file has its listed size (a listing tells); it is intact when
the bytes match too. A restore reads through :class:`CheckpointReader`: each rank reads
only the ranges it needs (its own shards), straight from the store, and each block is
checked as it arrives, so a write that was cut off (a killed worker, a full disk) or a
file damaged since (a flipped block) stops the load, and the resume falls back to the
previous intact checkpoint, without anything being read twice. xxh3 because it hashes at
memory speed (4x zlib's CRC-32), where what it hashes is in the CPU's cache: a local file
is read 1 MiB at a time. What sealing a save costs against writing it:
``benchmarks/checksum.py``, its figures on the manual's Results page.
"""

from __future__ import annotations

import io
import json
import random
import re
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, cast

import torch

from raylift.core import storage
from raylift.core.config import ConfigError
from raylift.core.errors import RefusedPickle
from raylift.tensors.lazytorch import LOCAL_HEADER, data_start
from raylift.tensors.pickles import check_torch_file, load_torch
from raylift.tensors.ranged import (
    BLOCK,
    METADATA,
    CheckpointError,
    Listed,
    VerifiedFile,
    Window,
    block_digests,
    block_starts,
    dcp_metadata,
)

FORMAT = 1
LOOP_FILE = "loop_state.pt"


__all__ = ["CheckpointError", "CheckpointReader", "RefusedPickle"]


def rng_file(rank: int) -> str:
    return f"rng-rank{rank}.pt"


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _as_tuple(obj: Any) -> Any:
    # random.setstate wants tuples all the way down; some loaders return lists.
    return tuple(_as_tuple(x) for x in obj) if isinstance(obj, (list, tuple)) else obj


def done_file(rank: int) -> str:
    """The name of ``rank``'s completion list in a checkpoint (and a memory snapshot)."""
    return f"complete-rank{rank}.json"


def seal_checkpoint(directory: Path, items: dict[str, list[int]]) -> str:
    """The text of this rank's ``complete-rank<r>.json``: the size and checksums of every
    file it wrote. Written last, after the files: the part counts only once it is there."""
    listed = {
        str(p.relative_to(directory)): _listed(p, items.get(str(p.relative_to(directory))))
        for p in sorted(directory.rglob("*"))
        if p.is_file() and not p.name.startswith("complete-rank")
    }
    return json.dumps(listed, indent=0)


def _listed(path: Path, items: list[int] | None) -> dict[str, Any]:
    """A file's size and checksums: whole, and per block (a block starts at every item
    the engine wrote into it, at every zip record of a ``torch.save`` one, and every 1 MiB
    within one)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        starts = block_starts(size, record_starts(f, size, items))
    whole, blocks = block_digests(storage.read_chunks(str(path)), starts)
    entry: dict[str, Any] = {"size": size, "xxh3": whole, "blocks": blocks}
    if starts != block_starts(size):  # only where they are not every BLOCK bytes
        entry["starts"] = starts
    return entry


def record_starts(f: IO[bytes], size: int, items: list[int] | None) -> list[int] | None:
    """Where the ``items`` an engine wrote into a file start (DCP's tensors, each one
    ``torch.save``), or for a plain file the file itself, and within each the start of
    each zip record and its data, and its directory: a rank that reads part of one tensor
    reads only the blocks of its header, its directory and that part."""
    bounds = sorted(items) if items is not None else [0]
    starts: list[int] = []
    for a, b in zip(bounds, [*bounds[1:], size], strict=True):
        within = zip_records(cast(IO[bytes], Window(f, a, b - a)))
        if within is None and items is None:
            return None  # not a torch.save file: blocks of BLOCK bytes
        starts += [a, *(a + s for s in within or ())]
    return starts


def zip_records(f: IO[bytes]) -> list[int] | None:
    """Where each member of a zip (a ``torch.save`` file) and its data start, and its
    directory, or None for another file."""
    if not zipfile.is_zipfile(f):
        return None
    with zipfile.ZipFile(f) as archive:
        infos = archive.infolist()
        directory = int(getattr(archive, "start_dir", 0))  # where the zip's directory starts
        starts = [i.header_offset for i in infos]
        for info in infos:
            f.seek(info.header_offset)
            try:
                starts.append(data_start(info, f.read(LOCAL_HEADER.size)))
            except ValueError:  # compressed: not torch.save's
                return None
    return [*starts, directory]


def file_digest(path: str | Path) -> str:
    """xxh3-64 of a file's bytes, local or in an object store, read one chunk at a time:
    the checksum's memory is one chunk (1 MiB of a local file, 64 MiB of an object),
    whatever the file's size."""
    import xxhash

    digest = xxhash.xxh3_64()
    for chunk in storage.read_chunks(str(path)):
        digest.update(chunk)
    return digest.hexdigest()


Verifier = Callable[[str], None]


def listing(directory: str) -> dict[str, Listed]:
    """What the ranks that wrote ``directory`` recorded of its files, by name; raises
    :class:`CheckpointError` unless every rank finished and every file has its size
    (one listing of the folder, no file's bytes read but the records')."""
    state = read_loop_state(directory)
    # The parts' count: the world's, or one replica's where each wrote a whole copy.
    world = int(state.get("writers", state.get("world_size", 1)))
    sizes = dict(storage.files_under(directory))
    files: dict[str, Listed] = {}
    for rank in range(world):
        done = done_file(rank)
        text = storage.read_text(storage.join(directory, done))
        if text is None:
            raise CheckpointError(
                f"checkpoint {directory} is incomplete: rank {rank} of {world} never "
                f"finished writing it ({done} is missing)"
            )
        try:
            recorded = json.loads(text)
        except ValueError as exc:  # cut off mid-write: a disk that filled up, a killed copy
            raise CheckpointError(
                f"checkpoint {directory} is incomplete: rank {rank}'s {done} is unreadable ({exc})"
            ) from exc
        for name, entry in recorded.items():
            files[name] = _entry(name, entry, rank)
            if sizes.get(name) != files[name].size:
                have = sizes.get(name)
                raise CheckpointError(
                    f"checkpoint {directory} is incomplete: {name} has "
                    f"{'no file' if have is None else f'{have} bytes'}, rank {rank} wrote "
                    f"{files[name].size}"
                )
    return files


def _entry(name: str, entry: Any, rank: int) -> Listed:
    """A record of one file; lists from before checksums hold its size alone."""
    if isinstance(entry, int):
        return Listed(name, entry, [], block_starts(entry), writer=rank)
    size, blocks = entry["size"], entry.get("blocks", [])
    starts = entry.get("starts") or block_starts(size, block=entry.get("block", BLOCK))
    return Listed(name, size, blocks, starts, rank, entry.get("xxh3"))


def verify_checkpoint(directory: str) -> None:
    """Raise :class:`CheckpointError` unless every rank finished writing ``directory``
    (a local folder or a URI) and every file's bytes match their checksums: a whole
    read of the checkpoint (``raylift verify``, export; a restore checks as it reads);
    then :class:`RefusedPickle` unless every pickle in it passes :func:`check_pickles`."""
    for name, listed in sorted(listing(directory).items()):
        whole = listed.whole
        if whole is not None and file_digest(storage.join(directory, name)) != whole:
            raise CheckpointError(
                f"checkpoint {directory} is corrupt: {name} does not match the checksum rank "
                f"{listed.writer} recorded when it wrote it (same size, different content)"
            )
    check_pickles(CheckpointReader(directory))


def check_pickles(reader: CheckpointReader) -> int:
    """Every pickle a restore or an export of the checkpoint could unpickle, checked
    against the list without running any of it: every ``torch.save`` file, DCP's
    ``.metadata`` and each item of the DCP files it indexes. :class:`RefusedPickle` for
    the first that names anything else; the number checked otherwise."""
    checked = 0
    for name in sorted(reader.files):
        try:
            if name.endswith(".pt"):
                with reader.open(name) as f:
                    check_torch_file(cast(IO[bytes], f))
                checked += 1
            elif name.rsplit("/", 1)[-1] == METADATA:
                checked += 1 + _check_dcp_items(reader, name.rsplit("/", 1)[0])
        except zipfile.BadZipFile as exc:  # no archive at all: damage, nothing unpickled
            raise CheckpointError(f"checkpoint {reader.directory} is corrupt: {exc}") from exc
    return checked


def _check_dcp_items(reader: CheckpointReader, folder: str) -> int:
    meta = dcp_metadata(reader, folder)
    by_file: dict[str, list[Any]] = {}
    for info in meta.storage_data.values():
        by_file.setdefault(info.relative_path, []).append(info)
    for path, items in sorted(by_file.items()):
        with reader.open(f"{folder}/{path}") as f:
            for info in sorted(items, key=lambda i: i.offset):
                view = Window(cast(IO[bytes], f), info.offset, info.length)
                at = f"{f.path} (bytes {info.offset}-{info.offset + info.length})"
                check_torch_file(cast(IO[bytes], view), at)
    return sum(len(items) for items in by_file.values())


def check_listing(directory: str) -> None:
    """:func:`listing`'s verdict alone: complete as far as a listing tells. A resume
    checks the bytes as it reads them (:class:`CheckpointReader`)."""
    listing(directory)


def checkpoint_step(path: str | Path) -> int:
    match = re.fullmatch(r"checkpoint-step(\d+)", storage.name(str(path)))
    return int(match.group(1)) if match else -1


def resume_point(
    latest: str, log: Callable[[str], None] = print, verify: Verifier = verify_checkpoint
) -> str:
    """``latest`` if it is complete, else the newest complete checkpoint before it.

    A checkpoint whose write was cut off, or that was damaged since, is reported and
    skipped rather than loaded.
    """
    try:
        verify(latest)
        return latest
    except CheckpointError as exc:
        log(f"raylift: {exc}; looking for the previous complete checkpoint")
    return previous_complete(latest, log, verify)


def previous_complete(
    latest: str, log: Callable[[str], None] = print, verify: Verifier = verify_checkpoint
) -> str:
    """The newest complete checkpoint before ``latest``; :class:`CheckpointError` if none."""
    for candidate in reversed(checkpoint_dirs(storage.parent(latest))):
        if checkpoint_step(candidate) >= checkpoint_step(latest):
            continue
        try:
            verify(candidate)
        except CheckpointError as exc:
            log(f"raylift: {exc}; skipping it")
            continue
        log(f"raylift: resuming from {candidate}, the newest complete checkpoint")
        return candidate
    raise CheckpointError(
        f"no complete checkpoint to resume from beside {latest}; delete "
        f"{storage.parent(latest)} to start over, or start a new run under another name"
    )


def checkpoint_dirs(run_dir: str) -> list[str]:
    """A run folder's ``checkpoint-step*`` folders (local or URIs, as ``run_dir`` is),
    oldest first."""
    names = [n for n in storage.children(run_dir) if checkpoint_step(n) >= 0]
    return [storage.join(run_dir, n) for n in sorted(names, key=checkpoint_step)]


def verify_run(run_dir: str) -> list[tuple[str, CheckpointError | RefusedPickle | None]]:
    """Every checkpoint of a run folder, oldest first, with its problem (None: intact; a
    :class:`RefusedPickle` where a file's pickle names anything off the list)."""
    out: list[tuple[str, CheckpointError | RefusedPickle | None]] = []
    for ckpt in checkpoint_dirs(run_dir):
        try:
            verify_checkpoint(ckpt)
            out.append((ckpt, None))
        except (CheckpointError, RefusedPickle) as exc:
            out.append((ckpt, exc))
    return out


def newest_complete(
    run_dir: str, log: Callable[[str], None] = print, verify: Verifier = verify_checkpoint
) -> str | None:
    """The newest complete checkpoint in a run folder (local or a URI), or None if it has none.

    Ray registers a checkpoint only after its controller polls the report; a worker
    killed in between leaves a complete checkpoint that Ray does not hand back, so the
    folder, not Ray's record, says where a run resumes.
    """
    found = [p for p in checkpoint_dirs(run_dir) if storage.is_file(storage.join(p, LOOP_FILE))]
    if not found:
        return None
    try:
        return resume_point(found[-1], log, verify)
    except CheckpointError:
        return None


def newest_written(run_dir: str) -> str | None:
    """The newest checkpoint every rank finished writing, by a listing alone (no file is
    read but the loop state): where a restart will resume, as far as a glance tells."""
    for candidate in reversed(checkpoint_dirs(run_dir)):
        names = {name for name, _ in storage.files_under(candidate)}
        if LOOP_FILE not in names:
            continue
        try:
            world = int(read_loop_state(candidate).get("world_size", 1))
        except CheckpointError:  # cut off (a full disk): the restart passes over it too
            continue
        except RefusedPickle:  # the restart refuses it too, loudly: it does not pass over it
            return candidate
        if all(done_file(r) in names for r in range(world)):
            return candidate
    return None


def read_loop_state(directory: str | Path) -> dict[str, Any]:
    data = storage.read_bytes(storage.join(str(directory), LOOP_FILE))
    if data is None:
        raise CheckpointError(
            f"checkpoint {directory} is incomplete ({LOOP_FILE} is missing); delete that folder "
            "to resume from the previous checkpoint, or start a new run under another name"
        )
    return _loop_state(str(directory), io.BytesIO(data))


def _loop_state(directory: str, data: Any) -> dict[str, Any]:
    try:
        state = load_torch(data, storage.join(directory, LOOP_FILE))
    except (CheckpointError, RefusedPickle):
        raise
    except Exception as exc:
        if getattr(data, "failed", None) is not None:  # a damaged block, read through C++
            raise data.failed from exc
        raise CheckpointError(
            f"checkpoint {directory} is corrupt ({LOOP_FILE}: {exc}); delete that folder to "
            "resume from the previous checkpoint, or start a new run under another name"
        ) from exc
    if state.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint {directory} has format {state.get('format')}, "
            f"this raylift reads format {FORMAT}"
        )
    return dict(state)


Problem = str | RefusedPickle | None
Agree = Callable[[Problem], None]


def _alone(problem: Problem) -> None:
    if isinstance(problem, RefusedPickle):
        raise problem
    if problem:
        raise CheckpointError(problem)


def agree_across(world: int) -> Agree:
    """A collective verdict: every rank raises the first problem any rank found (a
    refused pickle as itself, anything else as a :class:`CheckpointError`), so no rank
    goes on into a loader's collectives while another has given up."""
    if world == 1:
        return _alone

    def agree(problem: Problem) -> None:
        import torch.distributed as dist

        found: list[Problem] = [None] * world
        dist.all_gather_object(found, problem)
        _alone(next((p for p in found if p), None))

    return agree


def problem_of(exc: CheckpointError | RefusedPickle) -> Problem:
    """What a rank hands :func:`agree_across`: a refusal as itself, else its message."""
    return exc if isinstance(exc, RefusedPickle) else str(exc)


class CheckpointReader:
    """One checkpoint's files, local or in an object store, read straight from where
    they are in the ranges a loader asks for, each block checked against the checksum
    its writer recorded as it arrives. ``read`` counts the bytes fetched."""

    def __init__(self, directory: str, agree: Agree = _alone):
        self.directory, self.agree = directory, agree
        self.files = listing(directory)
        self.read = 0
        self._fs, self._base = storage.filesystem(directory)

    def has(self, name: str) -> bool:
        return name in self.files

    def names(self, under: str) -> list[str]:
        prefix = under.rstrip("/") + "/"
        return sorted(n for n in self.files if n.startswith(prefix))

    def open(self, name: str) -> VerifiedFile:
        listed = self.files.get(name)
        if listed is None:
            raise CheckpointError(f"checkpoint {self.directory} has no file {name}")
        # Written before block checksums: the whole file is checked before it is read.
        old = not listed.blocks and listed.whole is not None
        if old and file_digest(storage.join(self.directory, name)) != listed.whole:
            raise CheckpointError(
                f"checkpoint {self.directory} is corrupt: {name} does not match the "
                f"checksum rank {listed.writer} recorded when it wrote it"
            )
        source = self._fs.open_input_file(f"{self._base.rstrip('/')}/{name}")

        def read_at(offset: int, n: int) -> bytes:
            return bytes(source.read_at(n, offset))  # an object store's file resumes itself

        return VerifiedFile(read_at, listed, self.directory, self._count, source.close)

    def _count(self, n: int) -> None:
        self.read += n

    def load(self, name: str, load: Callable[[IO[bytes]], Any] | None = None) -> Any:
        """``load`` of one file; by default :func:`~raylift.tensors.pickles.load_torch`
        (its pickle checked against the list, then ``torch.load(weights_only=True)``)."""
        with self.open(name) as f:
            try:
                return (load or load_torch)(cast(IO[bytes], f))
            except Exception as exc:
                if f.failed is not None:  # a damaged block, read through torch's C++ reader
                    raise f.failed from exc
                raise

    def load_each(self, names: list[str], load: Callable[[IO[bytes]], Any]) -> dict[str, Any]:
        """Collective: ``load`` of each of ``names``, read once and checked as read; all
        ranks raise the first problem any rank found, before a loader's collectives."""
        loaded: dict[str, Any] = {}
        problem: Problem = None
        try:
            for name in names:
                loaded[name] = self.load(name, load)
        except (CheckpointError, RefusedPickle) as exc:
            problem = problem_of(exc)
        self.agree(problem)
        return loaded

    def loop_state(self) -> dict[str, Any]:
        with self.open(LOOP_FILE) as f:
            return _loop_state(self.directory, f)


def same_base(directory: str, saved: dict[str, str] | None, base: dict[str, str] | None) -> None:
    """ConfigError unless the checkpoint's adapters were trained on this run's base (by
    its weights' headers; a base that only moved is the same base)."""
    if saved is None and base is None:
        return
    if saved is None or base is None:
        had, has = ("adapters", "no adapters") if saved else ("no adapters", "adapters")
        raise ConfigError([
            f"model.adapter: checkpoint {directory} holds {had}; this run trains {has}. "
            "Set model.adapter back, or start a new run under another name"
        ])  # fmt: skip
    if saved.get("headers") != base.get("headers"):
        raise ConfigError([
            f"model.weights: checkpoint {directory} trained adapters on the base "
            f"{saved.get('weights')} (headers {saved.get('headers')}); this run's base is "
            f"{base.get('weights')} (headers {base.get('headers')}). Point the run at the "
            "base it trained on, or start a new run under another name"
        ])  # fmt: skip


# ---------------------------------------------------------------- the loop's side
