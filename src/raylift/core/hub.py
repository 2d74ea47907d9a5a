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

    @property
    def pinned(self) -> bool:
        return self.revision is not None and bool(COMMIT.match(self.revision))

    def __str__(self) -> str:
        return self.repo if self.revision is None else f"{self.repo}@{self.revision}"

    def uri(self, path: str = "") -> str:
        """``hf://repo@revision/path``: the form raylift's storage reads."""
        base = f"{SCHEME}{self}"
        return f"{base}/{path}" if path else base


def tags(name: object) -> dict[str, str]:
    """The MLflow tags of a model read from the Hub at one commit (``org/name@<commit>``,
    as the driver pins it): its ID and the commit; none for anything else."""
    ref = parse(name) if isinstance(name, str) else None
    if ref is None or not ref.pinned:
        return {}
    return {"raylift.hub.model": ref.repo, "raylift.hub.commit": str(ref.revision)}


def parse(name: str) -> HubRef | None:
    """``name`` as a Hub reference (``org/name``, ``org/name@rev``, ``hf://org/name@rev``),
    or None where it is not one: a local path that exists, or another URI, stays a path."""
    text = str(name)
    if text.startswith(SCHEME):
        text = text[len(SCHEME) :]
    elif "://" in text or os.path.exists(text) or text.startswith((".", "/", "~")):
        return None
    repo, _, revision = text.partition("@")
    if not _ID.match(repo) or (_ and not revision):
        return None
    return HubRef(repo, revision or None)


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
    return HubRef(ref.repo, os.path.basename(os.path.normpath(folder)))  # the commit


def _cached(ref: HubRef, key: str) -> str:
    """``ref``'s small files as the local cache holds them: what ``HF_HUB_OFFLINE`` reads."""
    from huggingface_hub import snapshot_download

    try:
        with _quiet():
            return str(
                snapshot_download(
                    ref.repo,
                    revision=ref.revision,
                    local_files_only=True,
                    allow_patterns=SMALL_FILES,
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
            f"{key}: no model {ref.repo!r} on the Hugging Face Hub{where}{private}; check "
            "the name, or give a local folder"
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
                    ref.repo, revision=ref.revision, allow_patterns=SMALL_FILES, endpoint=endpoint()
                )
            )
    except Exception as exc:
        raise HubError(explain(exc, ref, key)) from None


# Bytes a read of an open Hub file fetches beyond what it asks for (fsspec's read-ahead;
# its default is 5 MiB): a safetensors header, the first read of each file, is well under
# this even for the largest models' shards, so checking one costs one request of this.
READ_AHEAD = 2**20


def filesystem() -> Any:
    """The Hub as an fsspec filesystem (``HfFileSystem``): ranged reads over HTTP."""
    from huggingface_hub import HfFileSystem

    return HfFileSystem(endpoint=endpoint(), block_size=READ_AHEAD)
