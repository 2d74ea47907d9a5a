"""Models named by their Hugging Face Hub IDs: ``org/name``, optionally ``org/name@rev``
(a branch, a tag or a commit).

The driver pins a name once, before Ray starts: :func:`pin` asks the Hub which commit the
revision is now and every process of the run reads that commit, so a push to the Hub
during a run cannot mix two versions. A name that does not exist, a revision that does
not, and a gated or private model without a token each stop the command with one line
that names the model and what to do. What ``huggingface_hub`` users expect holds: the
token is ``HF_TOKEN`` or the ``hf auth login`` one (never logged), ``HF_ENDPOINT`` names
a mirror, ``HF_HUB_OFFLINE=1`` reads only the local cache, and ``HF_HOME`` /
``HF_HUB_CACHE`` place it.

Files are read through ``huggingface_hub``: a model's small files (its config,
tokenizer, the weights' index) into the cache, once per machine (:func:`small_files`);
its weights as ``hf://org/name@commit/...`` URIs, which :mod:`raylift.core.storage`
reads with ranged reads like any object store's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# A Hub repo ID as huggingface_hub validates one: one slash, no path beyond it.
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
SCHEME = "hf://"
# What a model's folder holds besides its weights: read whole, once per machine.
SMALL_FILES = [
    "config.json",
    "generation_config.json",
    "*.safetensors.index.json",
    "tokenizer*",
    "vocab*",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template*",
    "*.model",  # sentencepiece
    "adapter_config.json",  # a PEFT adapter's (model.adapter.weights)
]


class HubError(ValueError):
    """A Hub name that cannot be used as it stands: one line, and what to do."""


@dataclasses.dataclass(frozen=True)
class HubRef:
    repo: str
    revision: str | None = None  # None: the repo's default branch
    kind: str = "model"  # or "dataset": a data set's repo

    @property
    def files_wanted(self) -> list[str]:
        """What is fetched whole into the cache: a model's small files, a data set's card."""
        return SMALL_FILES if self.kind == "model" else ["README.md"]

    @property
    def pinned(self) -> bool:
        return self.revision is not None and bool(COMMIT.match(self.revision))

    def __str__(self) -> str:
        return self.repo if self.revision is None else f"{self.repo}@{self.revision}"

    def uri(self, path: str = "") -> str:
        """``hf://repo@revision/path`` (``hf://datasets/...`` for a data set's): the form
        raylift's storage reads."""
        base = f"{SCHEME}{'datasets/' if self.kind == 'dataset' else ''}{self}"
        return f"{base}/{path}" if path else base


def at_a_commit(uri: str) -> bool:
    """Whether ``uri`` is a Hub file at a commit (``hf://[datasets/]org/name@<commit>/...``):
    its bytes never change, so what was read of it may be kept."""
    if not uri.startswith(SCHEME):
        return False
    revision = uri.partition("@")[2].split("/", 1)[0]
    return bool(COMMIT.match(revision))


def tags(name: object) -> dict[str, str]:
    """The MLflow tags of a model read from the Hub at one commit (``org/name@<commit>``,
    as the driver pins it): its ID and the commit; none for anything else."""
    ref = parse(name) if isinstance(name, str) else None
    if ref is None or not ref.pinned:
        return {}
    return {"raylift.hub.model": ref.repo, "raylift.hub.commit": str(ref.revision)}


def parse(name: str, kind: str = "model") -> HubRef | None:
    """``name`` as a Hub reference (``org/name``, ``org/name@rev``, ``hf://org/name@rev``,
    ``hf://datasets/org/name@rev``; ``kind``: what a bare name is), or None where it is
    not one: a local path that exists, or another URI, stays a path."""
    text = str(name)
    if text.startswith(SCHEME):
        text = text[len(SCHEME) :]
        if text.startswith("datasets/"):
            text, kind = text[len("datasets/") :], "dataset"
    elif "://" in text or os.path.exists(text) or text.startswith((".", "/", "~")):
        return None
    repo, _, revision = text.partition("@")
    if not _ID.match(repo) or (_ and not revision):
        return None
    return HubRef(repo, revision or None, kind)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """huggingface_hub's progress bars off: they are another program's lines on the
    console (raylift says what it fetched where it matters)."""
    from huggingface_hub.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )

    was = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    finally:
        if not was:
            enable_progress_bars()


def endpoint() -> str | None:
    """``HF_ENDPOINT`` as set now (huggingface_hub reads it once, at its import)."""
    return os.environ.get("HF_ENDPOINT") or None


def offline() -> bool:
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE", "")
    return constants.HF_HUB_OFFLINE or value.upper() in {"1", "ON", "YES", "TRUE"}


def pin(ref: HubRef, key: str) -> HubRef:
    """``ref`` at the commit its revision names now (``key``: the config key, for errors).

    Its small files are fetched by the revision's name, which resolves it and records the
    name's commit in the local cache as ``hf download`` does, so a later run with
    ``HF_HUB_OFFLINE`` finds it; offline, the commit the cache holds for the name."""
    if ref.pinned:
        return ref
    folder = small_files(ref, key)
    commit = os.path.basename(os.path.normpath(folder))
    return dataclasses.replace(ref, revision=commit)


def _cached(ref: HubRef, key: str) -> str:
    """``ref``'s small files as the local cache holds them: what ``HF_HUB_OFFLINE`` reads."""
    from huggingface_hub import snapshot_download

    try:
        with _quiet():
            return str(
                snapshot_download(
                    ref.repo,
                    revision=ref.revision,
                    repo_type=ref.kind,
                    local_files_only=True,
                    allow_patterns=ref.files_wanted,
                )
            )
    except Exception:
        raise HubError(
            f"{key}: {ref} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; "
            "fetch it once online (hf download NAME), or point HF_HUB_CACHE at a filled cache"
        ) from None


def explain(exc: Exception, ref: HubRef, key: str) -> str:
    """One line for the user from huggingface_hub's error."""
    from huggingface_hub import errors

    where = f" at {endpoint()}" if endpoint() else ""
    if isinstance(exc, errors.GatedRepoError):
        token = "was refused" if _has_token() else "is missing"
        return (
            f"{key}: {ref.repo} is gated and the Hugging Face token {token}; accept its "
            "terms on its Hub page, then set HF_TOKEN (or run hf auth login) with a token "
            "that has access"
        )
    if isinstance(exc, errors.RevisionNotFoundError):
        return (
            f"{key}: {ref.repo} has no revision {ref.revision!r}{where}; give a branch, "
            "a tag or a commit of it (org/name@rev), or leave the revision out"
        )
    if isinstance(exc, errors.RepositoryNotFoundError):
        private = " (or it is private and HF_TOKEN has no access)" if not _has_token() else ""
        return (
            f"{key}: no {ref.kind.replace('data', 'data ')} {ref.repo!r} on the Hugging Face "
            f"Hub{where}{private}; check the name, or give a local "
            f"{'folder' if ref.kind == 'model' else 'file or folder'}"
        )
    return f"{key}: cannot reach the Hugging Face Hub{where} for {ref}: {_first_line(exc)}"


def _has_token() -> bool:
    from huggingface_hub import get_token

    return get_token() is not None


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def small_files(ref: HubRef, key: str) -> str:
    """A local folder of ``ref``'s config, tokenizer and index files (the cache's
    snapshot of its commit; fetched once per machine)."""
    from huggingface_hub import snapshot_download

    if offline():
        return _cached(ref, key)
    if ref.pinned:  # a commit's files never change: another process here may have them
        with contextlib.suppress(HubError):
            return _cached(ref, key)
    try:
        with _quiet():
            return str(
                snapshot_download(
                    ref.repo,
                    revision=ref.revision,
                    repo_type=ref.kind,
                    allow_patterns=ref.files_wanted,
                    endpoint=endpoint(),
                )
            )
    except Exception as exc:
        raise HubError(explain(exc, ref, key)) from None


# Bytes a read of an open Hub file fetches beyond what it asks for (fsspec's read-ahead;
# its default is 5 MiB), for reads that go on where the last one ended (a data set's
# files). Reads of ranges known in advance (weights' headers and tensors) open the file
# without it (:func:`open_exact`).
READ_AHEAD = 2**20


def filesystem() -> Any:
    """The Hub as an fsspec filesystem (``HfFileSystem``): ranged reads over HTTP."""
    from huggingface_hub import HfFileSystem

    return HfFileSystem(endpoint=endpoint(), block_size=READ_AHEAD)


def open_exact(uri: str) -> Any:
    """The Hub file ``uri`` (``hf://...``) open for reads that each fetch the bytes they
    ask for and no more (fsspec's read-ahead off): for reads of ranges known in advance,
    such as a rank's rows of a tensor, where a read-ahead would fetch a neighbour's."""
    import pyarrow as pa

    handle = filesystem().open(uri.removeprefix(SCHEME), "rb", cache_type="none")
    return pa.PythonFile(handle, mode="r")


# Where a data set's split is when its card names no files for it: the layouts
# ``push_to_hub`` and the Hub's own conventions use.
SPLIT_LAYOUTS = ("data/{split}-*", "{split}-*", "data/{split}/*", "{split}/*", "**/{split}.*")
DATA_FILES = (".parquet", ".jsonl", ".json")


def data_files(ref: HubRef, split: str, subset: str | None, key: str) -> list[str]:
    """The files of a pinned data set's ``split`` (of its ``subset``, the card's config),
    as ``hf://datasets/...`` globs: every pattern the card's ``configs`` names for it,
    else the first of the Hub's usual layouts that holds files. HubError naming the
    splits the card has where none match."""
    named = card_configs(os.path.join(small_files(ref, key), "README.md"))
    fs, base = filesystem(), f"datasets/{ref}"

    def holds(pattern: str) -> bool:
        return any(f.endswith(DATA_FILES) for f in fs.glob(f"{base}/{pattern}"))

    patterns = [p for p in split_patterns(named, subset, split) if holds(p)]
    if not patterns:
        layouts = (p.format(split=split) for p in SPLIT_LAYOUTS)
        patterns = [p for p in layouts if holds(p)][:1]
    if patterns:
        return [ref.uri(p) for p in patterns]
    splits = sorted({s for files in named.values() for s in files})
    have = f"; its card names the splits {', '.join(splits)}" if splits else ""
    of = f" of subset {subset!r}" if subset else ""
    raise HubError(
        f"{key}: {ref.repo} has no .parquet, .jsonl or .json files for split {split!r}{of}"
        f"{have}; set task_args.split (and task_args.subset) to one it has"
    )


def card_configs(card: str) -> dict[str, dict[str, list[str]]]:
    """A data set card's ``configs``: config name -> split -> file patterns."""
    import yaml

    try:
        text = Path(card).read_text(encoding="utf-8")
    except OSError:
        return {}
    head = text.split("---")[1] if text.startswith("---") and text.count("---") >= 2 else ""
    try:
        meta = yaml.safe_load(head) or {}
    except yaml.YAMLError:
        return {}
    configs = meta.get("configs") if isinstance(meta, dict) else None
    out: dict[str, dict[str, list[str]]] = {}
    for config in configs if isinstance(configs, list) else []:
        if isinstance(config, dict):
            name = str(config.get("config_name", "default"))
            out[name] = _by_split(config.get("data_files"))
    return out


def _by_split(files: Any) -> dict[str, list[str]]:
    """``data_files`` in any of the card's forms: a pattern or a list of them (all of
    ``train``), a mapping, or a list of ``{split, path}``."""
    if isinstance(files, dict):
        return {str(k): _listed(v) for k, v in files.items()}
    if isinstance(files, list) and files and all(isinstance(f, dict) for f in files):
        return {str(f["split"]): _listed(f.get("path", [])) for f in files if "split" in f}
    return {"train": _listed(files)} if files else {}


def _listed(patterns: Any) -> list[str]:
    return [str(p) for p in patterns] if isinstance(patterns, list) else [str(patterns)]


def split_patterns(
    named: dict[str, dict[str, list[str]]], subset: str | None, split: str
) -> list[str]:
    """The card's patterns of ``split`` in ``subset`` (by default its only config, or
    ``default``); [] where the card names none."""
    if subset is None:
        subset = next(iter(named)) if len(named) == 1 else "default"
    return named.get(subset, {}).get(split, [])
