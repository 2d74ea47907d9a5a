"""A Hugging Face Hub on 127.0.0.1, serving repos that tests build as local folders, for the
real ``huggingface_hub`` client (2.4.0) to talk HTTP to: ``hf_hub_download``,
``snapshot_download``, ``HfApi`` (``model_info``, ``dataset_info``, ``list_repo_tree``,
``get_paths_info``, ``list_repo_refs``, ``list_repo_commits``, ``file_exists``) and
``HfFileSystem`` (``hf://``: ``ls``, ``info``, ``find``, ranged reads).

    hub = HubServer(tmp_path / "hub")
    hub.tokens = {"hf_good"}
    with hub:                                   # a thread; a free port on 127.0.0.1
        first = hub.add_repo("org/tiny-llama", folder)     # a commit of the folder as it is
        hub.use(monkeypatch, tmp_path / "hf-home")         # this process's client -> hub
        snapshot_download("org/tiny-llama")
        hub.push("org/tiny-llama", {"config.json": b"{}"})  # a new commit on main
        hub.served("org/tiny-llama", "model.safetensors")  # body bytes sent for that file

Pointing the client at it. ``huggingface_hub`` reads ``HF_ENDPOINT`` once, when it is
imported (``constants.ENDPOINT``, and the download URL template
``constants.HUGGINGFACE_CO_URL_TEMPLATE`` built from it), so setting the variable later
changes nothing in a process that has imported it already:

* in this process, :meth:`HubServer.use` sets both constants (and the cache, token and
  offline ones, for the same reason) with ``monkeypatch``; every call then reaches the hub
  without an ``endpoint=``. Passing ``endpoint=hub.url`` to ``HfApi``, ``HfFileSystem``,
  ``hf_hub_download`` and ``snapshot_download`` works as well, constants or not; it does not
  for callers that take no endpoint (``transformers``' ``from_pretrained``).
* in a process started from here, ``env=hub.env(home)`` (``HF_ENDPOINT`` and the rest set
  before that process imports ``huggingface_hub``).

What it answers as the Hub does, and why (the client function that reads it):

* ``GET /api/{models,datasets}/{id}[/revision/{rev}]``: the repo's info at the commit the
  revision names (``sha``: ``snapshot_download`` and ``HfApi.resolve_revision`` pin to it;
  ``siblings``, with sizes and LFS data under ``?blobs=true``; ``expand=`` honoured).
* ``GET /api/{type}s/{id}/tree/{rev}[/{path}]?recursive=&expand=``: ``list_repo_tree``,
  ``HfFileSystem.ls/find``, ``snapshot_download``'s file list. One page, no ``Link`` header.
  A path that is a file or does not exist is ``EntryNotFound`` (``HfFileSystem.ls`` relies
  on that to tell a file from a folder).
* ``POST /api/{type}s/{id}/paths-info/{rev}`` (form or JSON ``paths``, ``expand``):
  ``get_paths_info``, ``HfFileSystem.info``. Paths that do not exist are left out.
* ``GET /api/{type}s/{id}/refs`` and ``/commits/{rev}``: ``list_repo_refs``,
  ``list_repo_commits``.
* ``GET``/``HEAD /[datasets/]{id}/resolve/{rev}/{path}``: the file, whole (200) or the one
  range of a ``Range: bytes=a-b`` / ``a-`` / ``-n`` header (206 with ``Content-Range``; 416
  where none of it is in the file). ``X-Repo-Commit`` (``get_hf_file_metadata``: without it
  ``hf_hub_download`` refuses the server), a quoted ``ETag`` (the git blob id, or the sha256
  of an LFS file; ``hf_hub_download`` names the cached blob after it), ``X-Linked-Etag`` and
  ``X-Linked-Size`` on LFS files (preferred by ``get_hf_file_metadata``, as the Hub sends
  them there), ``Content-Length``, ``Accept-Ranges``. Files are served here, never through a
  redirect to a CDN, and no ``X-Xet-*`` header is sent: the client downloads over plain HTTP,
  never with hf-xet.

Revisions: a branch, a tag, ``refs/heads/x`` / ``refs/tags/x``, or a full 40-hex commit of
the repo, URL-encoded in one segment (as the client sends ``refs%2Fpr%2F1``) or not.
A push to a branch that does not exist starts it from the default branch (``main``).

Errors, as ``huggingface_hub.utils.hf_raise_for_status`` tells them apart (by the
``X-Error-Code`` header; its status-only fallback for a 401 applies to ``https://`` URLs
only, so every answer here names its code): an unknown repo, or a private one the token
cannot read, is ``RepoNotFound`` (401 without a token, 404 with one:
``RepositoryNotFoundError``); a gated repo's files without a token that may read them are
``GatedRepo`` (401 without a token, 403 with one: ``GatedRepoError``; its info, tree and
paths-info stay public, as on the Hub); an unknown revision is ``RevisionNotFound`` (404:
``RevisionNotFoundError``); a missing file is ``EntryNotFound`` (404, with
``X-Repo-Commit``: ``RemoteEntryNotFoundError``, an ``EntryNotFoundError``). A token that
is not one of ``hub.tokens`` is refused on every request with the Hub's 401 "Invalid
credentials in Authorization header" (a plain ``HfHubHTTPError``).

Files under ``.git`` and ``.cache/huggingface`` (what a ``local_dir`` download writes) are
not part of a commit. A file is stored as LFS (``lfs`` in the tree, sha256 ETag) where the
Hub's default ``.gitattributes`` would track it (``*.safetensors``, ``*.bin``,
``*.parquet``, ...) or where it is 10 MiB or more.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import sys
import threading
import traceback
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import parse_qs, unquote, urlsplit

if TYPE_CHECKING:
    import pytest

RepoType = Literal["model", "dataset"]
Content = Path | str | bytes  # a file to copy (its path), or the bytes themselves

PLURAL: dict[str, RepoType] = {"models": "model", "datasets": "dataset"}
# What the Hub's default .gitattributes sends to LFS, and the size git refuses beyond.
LFS_SUFFIXES = frozenset({
    ".7z", ".arrow", ".bin", ".bz2", ".ckpt", ".ftz", ".gguf", ".gz", ".h5", ".joblib",
    ".mlmodel", ".model", ".msgpack", ".npy", ".npz", ".onnx", ".ot", ".parquet", ".pb",
    ".pickle", ".pkl", ".pt", ".pth", ".rar", ".safetensors", ".tar", ".tflite", ".tgz",
    ".wasm", ".xz", ".zip", ".zst",
})  # fmt: skip
LFS_MIN_SIZE = 10 * 1024 * 1024
SKIPPED = (".git", ".cache/huggingface")  # folders add_repo/push leave out
CHUNK = 64 * 1024
# The Hub's answer to an unknown token; hf_raise_for_status matches these words.
INVALID_TOKEN = "Invalid credentials in Authorization header"


@dataclass(frozen=True)
class Blob:
    """A file's content, stored once under the hub's ``root/blobs`` by its sha256."""

    path: Path
    size: int
    sha256: str
    oid: str  # the git object id a tree lists: of the content, or of its LFS pointer
    lfs: bool
    pointer_size: int  # 0 where not LFS

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.oid


@dataclass(frozen=True)
class Commit:
    sha: str
    parent: str | None
    files: Mapping[str, Blob]  # path in repo -> content; never changed once made
    title: str
    date: datetime


@dataclass
class _Repo:
    type: RepoType
    id: str
    gated: bool
    private: bool
    readers: frozenset[str] | None  # tokens that may read it; None: each of hub.tokens
    default: str  # the branch a revision-less request reads
    created: datetime
    branches: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    commits: dict[str, Commit] = field(default_factory=dict)

    @property
    def key(self) -> str:
        """How the hub's counters name it: ``org/name``, or ``datasets/org/name``."""
        return self.id if self.type == "model" else f"{self.type}s/{self.id}"

    def resolve(self, revision: str) -> str | None:
        for refs, prefix in ((self.branches, "refs/heads/"), (self.tags, "refs/tags/")):
            name = revision.removeprefix(prefix)
            if name in refs:
                return refs[name]
        return revision if revision in self.commits else None


@dataclass(frozen=True)
class HubRequest:
    """One request the hub answered: what was asked (with its ``Range`` header and bearer
    token), of which repo, revision and file, the status and the body bytes sent."""

    method: str
    target: str
    range: str | None
    token: str | None
    status: int
    repo: str | None = None  # as in bytes_served: org/name, datasets/org/name
    revision: str | None = None
    file: str | None = None
    sent: int = 0


class _Refusal(Exception):
    """An error answer: the status, the ``X-Error-Code`` the client maps to a class, and
    any other header it reads."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.headers = dict(headers or {})


class HubServer:
    """The hub: repos, their commits, and an HTTP server answering for them. Thread-safe:
    the client's parallel downloads are answered each on a thread of its own."""

    def __init__(self, root: Path, host: str = "127.0.0.1") -> None:
        self.root = Path(root)
        self.host = host
        self.tokens: set[str] = set()  # the valid tokens; each may read every gated repo
        self.errors: list[str] = []  # tracebacks of requests the hub failed on (answered 500)
        self._lock = threading.RLock()
        self._repos: dict[tuple[RepoType, str], _Repo] = {}
        self._seq = 0
        self._requests: list[HubRequest] = []
        self._served: Counter[tuple[str, str]] = Counter()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._connections: set[socket.socket] = set()

    # -- the server ------------------------------------------------------------------

    def start(self) -> HubServer:
        if self._server is not None:
            raise RuntimeError("the hub is already serving")
        (self.root / "blobs").mkdir(parents=True, exist_ok=True)
        self._server = _Server(self)
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},  # how soon stop() returns
            name=f"hub-server-{self.port}",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, and end the connections the client keeps open between requests."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(timeout=10)
        # HfFileSystem keeps its instances, with their listings, by endpoint and token: a
        # later hub given this port again must not get one that lists this hub's repos.
        if "huggingface_hub" in sys.modules:
            from huggingface_hub import HfFileSystem

            HfFileSystem.clear_instance_cache()

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the hub is not serving: start() it first")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """The endpoint: ``http://127.0.0.1:PORT``, what ``HF_ENDPOINT`` is set to."""
        return f"http://{self.host}:{self.port}"

    # -- pointing huggingface_hub at it ----------------------------------------------

    def env(self, home: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment for a process started from here whose ``huggingface_hub`` talks
        to this hub: ``base`` (``os.environ``) with ``HF_ENDPOINT`` the hub, its home and
        cache in ``home``, no token (set ``HF_TOKEN`` in it for one), not offline."""
        env = {k: v for k, v in (os.environ if base is None else base).items() if k not in _UNSET}
        home = Path(home)
        env.update(
            HF_ENDPOINT=self.url,
            HF_HOME=str(home),
            HF_HUB_CACHE=str(home / "hub"),
            HF_HUB_DISABLE_TELEMETRY="1",
            HF_HUB_DISABLE_UPDATE_CHECK="1",
        )
        return env

    def use(self, monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
        """Point this process's ``huggingface_hub`` at the hub until the test ends: the
        environment of :meth:`env` (for the processes it starts) and the constants the
        library read from it at its import (for itself)."""
        from huggingface_hub import constants

        for key in _UNSET:
            monkeypatch.delenv(key, raising=False)
        env = self.env(home, base={})
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        home = Path(home)
        patched: dict[str, object] = {
            "ENDPOINT": self.url,
            # hf_hub_url (so hf_hub_download, HfFileSystem's reads) formats this template
            "HUGGINGFACE_CO_URL_TEMPLATE": self.url + "/{repo_id}/resolve/{revision}/{filename}",
            "HF_HOME": str(home),
            "HF_HUB_CACHE": env["HF_HUB_CACHE"],
            "HUGGINGFACE_HUB_CACHE": env["HF_HUB_CACHE"],
            "HF_ASSETS_CACHE": str(home / "assets"),
            "HF_XET_CACHE": str(home / "xet"),
            "HF_TOKEN_PATH": str(home / "token"),  # get_token() reads it: no login leaks in
            "HF_STORED_TOKENS_PATH": str(home / "stored_tokens"),
            "HF_HUB_OFFLINE": False,
            "HF_HUB_DISABLE_TELEMETRY": True,
        }
        for name, constant in patched.items():
            monkeypatch.setattr(constants, name, constant)

    # -- repos -----------------------------------------------------------------------

    def add_repo(
        self,
        repo_id: str,
        folder: Path | Mapping[str, Content],
        *,
        repo_type: RepoType = "model",
        gated: bool = False,
        private: bool = False,
        readers: Iterable[str] | None = None,
        branch: str = "main",
        message: str = "Initial commit",
    ) -> str:
        """A new repo whose ``branch`` is one commit of ``folder`` as it is now (its files
        are copied: later changes to the folder do not change the commit); the commit's
        sha. ``readers``: the tokens that may read it where gated or private (default: each
        of ``hub.tokens``)."""
        if repo_type not in PLURAL.values():
            raise ValueError(f"repo_type must be 'model' or 'dataset', not {repo_type!r}")
        if repo_id.count("/") != 1 or not all(repo_id.split("/")):
            raise ValueError(f"a repo id is namespace/name, not {repo_id!r}")
        files = self._store_all(folder)
        with self._lock:
            if (repo_type, repo_id) in self._repos:
                raise ValueError(f"{repo_type} {repo_id} is already on the hub")
            repo = _Repo(
                type=repo_type,
                id=repo_id,
                gated=gated,
                private=private,
                readers=None if readers is None else frozenset(readers),
                default=branch,
                created=_now(),
            )
            self._repos[(repo_type, repo_id)] = repo
            return self._commit(repo, branch, files, message)

    def push(
        self,
        repo_id: str,
        files: Path | Mapping[str, Content],
        *,
        repo_type: RepoType = "model",
        branch: str = "main",
        delete: Iterable[str] = (),
        message: str | None = None,
    ) -> str:
        """A new commit on ``branch``, as ``upload_folder`` makes one: its files are those
        of the branch's head, with those of ``files`` (a folder, or ``{path: content}``)
        added or replaced and those of ``delete`` removed; the commit's sha. A branch that
        does not exist starts from the default one (``main``)."""
        added = self._store_all(files)
        with self._lock:
            repo = self._repo(repo_type, repo_id)
            head = repo.branches.get(branch) or repo.branches.get(repo.default)
            tree = dict(repo.commits[head].files) if head else {}
            for path in delete:
                tree.pop(_clean(path), None)
            tree.update(added)
            return self._commit(repo, branch, tree, message or f"Update {len(added)} file(s)")

    def create_branch(
        self, repo_id: str, branch: str, *, revision: str = "main", repo_type: RepoType = "model"
    ) -> str:
        """``branch`` at the commit ``revision`` names; that commit."""
        with self._lock:
            repo = self._repo(repo_type, repo_id)
            repo.branches[branch] = sha = self._resolved(repo, revision)
            return sha

    def tag(
        self, repo_id: str, tag: str, *, revision: str = "main", repo_type: RepoType = "model"
    ) -> str:
        """A tag ``tag`` of the commit ``revision`` names; that commit."""
        with self._lock:
            repo = self._repo(repo_type, repo_id)
            repo.tags[tag] = sha = self._resolved(repo, revision)
            return sha

    def resolve(self, repo_id: str, revision: str = "main", repo_type: RepoType = "model") -> str:
        """The commit ``revision`` (a branch, a tag or a commit) names now."""
        with self._lock:
            return self._resolved(self._repo(repo_type, repo_id), revision)

    def files(
        self, repo_id: str, revision: str = "main", repo_type: RepoType = "model"
    ) -> dict[str, bytes]:
        """The files of a commit, as the hub serves them."""
        with self._lock:
            repo = self._repo(repo_type, repo_id)
            commit = repo.commits[self._resolved(repo, revision)]
        return {path: blob.path.read_bytes() for path, blob in commit.files.items()}

    # -- what was served -------------------------------------------------------------

    @property
    def requests(self) -> list[HubRequest]:
        """Every request answered so far, in the order they ended."""
        with self._lock:
            return list(self._requests)

    @property
    def bytes_served(self) -> Counter[tuple[str, str]]:
        """File body bytes sent, by (repo, path in repo); the repo as ``org/name`` for a
        model, ``datasets/org/name`` for a dataset. HEAD requests and API answers are not
        counted."""
        with self._lock:
            return Counter(self._served)

    @property
    def total_bytes_served(self) -> int:
        with self._lock:
            return sum(self._served.values())

    def served(
        self, repo_id: str, filename: str | None = None, repo_type: RepoType = "model"
    ) -> int:
        """File body bytes sent of ``filename`` of the repo (of all its files: None)."""
        key = repo_id if repo_type == "model" else f"{repo_type}s/{repo_id}"
        with self._lock:
            return sum(
                n for (repo, path), n in self._served.items()
                if repo == key and filename in (None, path)
            )  # fmt: skip

    def reset_stats(self) -> None:
        with self._lock:
            self._requests.clear()
            self._served.clear()

    # -- storage ---------------------------------------------------------------------

    def _store_all(self, source: Path | Mapping[str, Content]) -> dict[str, Blob]:
        if isinstance(source, Mapping):
            paths = {_clean(path): content for path, content in source.items()}
            return {path: self._store(content, path) for path, content in paths.items()}
        folder = Path(source)
        if not folder.is_dir():
            raise NotADirectoryError(f"{folder} is not a folder")
        out = {}
        for path in sorted(folder.rglob("*")):
            rel = path.relative_to(folder).as_posix()
            if path.is_file() and not any(rel == s or rel.startswith(s + "/") for s in SKIPPED):
                out[rel] = self._store(path, rel)
        return out

    def _store(self, content: Content, name: str) -> Blob:
        """Copy ``content`` into the blob store (a snapshot: the source may change later);
        ``name``, its path in the repo, says whether git would keep it in LFS."""
        blobs = self.root / "blobs"
        blobs.mkdir(parents=True, exist_ok=True)
        tmp = blobs / f".incoming-{uuid.uuid4().hex}"
        sha256, size = hashlib.sha256(), 0
        with tmp.open("wb") as out:
            if isinstance(content, bytes):
                chunks: Iterable[bytes] = [content]
            else:
                chunks = _chunks(Path(content))
            for chunk in chunks:
                sha256.update(chunk)
                out.write(chunk)
                size += len(chunk)
        digest = sha256.hexdigest()
        final = blobs / digest
        os.replace(tmp, final)  # same bytes under the same name: a race is harmless
        lfs = Path(name).suffix.lower() in LFS_SUFFIXES or size >= LFS_MIN_SIZE
        if lfs:  # the tree lists the pointer file git keeps in the content's place
            pointer = (
                f"version https://git-lfs.github.com/spec/v1\noid sha256:{digest}\nsize {size}\n"
            ).encode()
            return Blob(final, size, digest, _git_oid(pointer), True, len(pointer))
        return Blob(final, size, digest, _git_oid(final), False, 0)

    def _commit(self, repo: _Repo, branch: str, files: dict[str, Blob], title: str) -> str:
        """A commit of ``files`` on ``branch`` (called under the lock); its sha."""
        self._seq += 1
        parent = repo.branches.get(branch) or repo.branches.get(repo.default)
        text = f"commit {self._seq}\ntree {_tree_oid(files, '')}\nparent {parent}\n\n{title}"
        sha = hashlib.sha1(text.encode()).hexdigest()
        repo.commits[sha] = Commit(sha, parent, MappingProxyType(dict(files)), title, _now())
        repo.branches[branch] = sha
        return sha

    def _repo(self, repo_type: RepoType, repo_id: str) -> _Repo:
        try:
            return self._repos[(repo_type, repo_id)]
        except KeyError:
            raise KeyError(f"no {repo_type} {repo_id} on the hub") from None

    @staticmethod
    def _resolved(repo: _Repo, revision: str) -> str:
        sha = repo.resolve(revision)
        if sha is None:
            raise KeyError(f"{repo.id} has no revision {revision!r}")
        return sha

    # -- answering -------------------------------------------------------------------

    def _track(self, conn: socket.socket, open_: bool) -> None:
        with self._lock:
            if open_:
                self._connections.add(conn)
            else:
                self._connections.discard(conn)

    def _answer(self, h: _Handler) -> None:
        """Answer one request: route it, send the reply (or the refusal), record it."""
        split = urlsplit(h.path)
        query = parse_qs(split.query)
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""  # read it all: the connection is reused
        auth = h.headers.get("Authorization") or ""
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else None
        record: dict[str, Any] = {
            "method": h.command, "target": unquote(h.path), "range": h.headers.get("Range"),
            "token": token, "status": 500,
        }  # fmt: skip
        try:
            if token is not None and token not in self.tokens:
                raise _Refusal(401, INVALID_TOKEN)
            segs = split.path.split("/")[1:]  # still URL-encoded: a revision may hold %2F
            if segs[:1] == ["api"] and len(segs) >= 4 and segs[1] in PLURAL:
                self._api(h, PLURAL[segs[1]], f"{unquote(segs[2])}/{unquote(segs[3])}",
                          segs[4:], query, body, token, record)  # fmt: skip
            else:
                repo_type: RepoType = "model"
                if segs[:1] and segs[0] in PLURAL:
                    repo_type, segs = PLURAL[segs[0]], segs[1:]
                if len(segs) < 5 or segs[2] != "resolve" or h.command == "POST":
                    raise _Refusal(404, "Sorry, we can't find the page you are looking for.")
                repo_id = f"{unquote(segs[0])}/{unquote(segs[1])}"
                self._resolve(h, repo_type, repo_id, segs[3:], token, record)
        except _Refusal as refusal:
            record["status"] = refusal.status
            _send_error(h, refusal)
        except (BrokenPipeError, ConnectionResetError):
            h.close_connection = True
        except Exception:
            with self._lock:
                self.errors.append(traceback.format_exc())
            with contextlib.suppress(OSError):
                _send_error(h, _Refusal(500, "hub server error (see HubServer.errors)"))
        finally:
            with self._lock:
                self._requests.append(HubRequest(**record))
                if record.get("sent") and record.get("file") is not None:
                    self._served[(record["repo"], record["file"])] += record["sent"]

    def _open(self, repo_type: RepoType, repo_id: str, token: str | None, files: bool) -> _Repo:
        """The repo, where ``token`` may see it (and read its files, where ``files``)."""
        with self._lock:
            repo = self._repos.get((repo_type, repo_id))
        allowed = (
            repo is not None
            and token is not None
            and (repo.readers is None or token in repo.readers)
        )
        if repo is None or (repo.private and not allowed):
            # 401 to whoever gave no token, as the Hub: it does not say which repos exist
            raise _Refusal(401 if token is None else 404, "Repository not found", "RepoNotFound")
        if repo.gated and files and not allowed:
            if token is None:
                message = (
                    f"Access to {repo_type} {repo_id} is restricted. You must have access to it "
                    "and be authenticated to access it. Please log in."
                )
                raise _Refusal(401, message, "GatedRepo")
            message = (
                f"Access to {repo_type} {repo_id} is restricted and you are not in the "
                f"authorized list. Visit {self.url}/{repo_id} to ask for access."
            )
            raise _Refusal(403, message, "GatedRepo")
        return repo

    def _at(self, repo: _Repo, revision: str) -> Commit:
        with self._lock:
            sha = repo.resolve(revision)
            if sha is None:
                raise _Refusal(404, f"Invalid rev id: {revision}", "RevisionNotFound")
            return repo.commits[sha]

    def _resolve(
        self,
        h: _Handler,
        repo_type: RepoType,
        repo_id: str,
        segs: list[str],
        token: str | None,
        record: dict[str, Any],
    ) -> None:
        """``GET``/``HEAD`` of a file at a revision."""
        revision, segs = _revision(segs)
        path = "/".join(unquote(s) for s in segs)
        repo = self._open(repo_type, repo_id, token, files=True)
        record.update(repo=repo.key, revision=revision, file=path)
        commit = self._at(repo, revision)
        blob = commit.files.get(path)
        if blob is None:  # the client caches "no such file at this commit" from X-Repo-Commit
            raise _Refusal(404, "Entry not found", "EntryNotFound", {"X-Repo-Commit": commit.sha})
        span = _byte_range(h.headers.get("Range"), blob.size)
        headers = {
            "Content-Type": "application/octet-stream",
            "Accept-Ranges": "bytes",
            "X-Repo-Commit": commit.sha,
            "ETag": f'"{blob.etag}"',
        }
        if blob.lfs:
            headers.update({"X-Linked-Etag": f'"{blob.sha256}"', "X-Linked-Size": str(blob.size)})
        if span is None:
            status, start, end = 200, 0, blob.size
        else:
            status, (start, end) = 206, span
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{blob.size}"
        headers["Content-Length"] = str(end - start)
        record["status"] = status
        h.send_response(status)
        for key, value in headers.items():
            h.send_header(key, value)
        h.end_headers()
        if h.command == "HEAD":
            return
        record["sent"] = 0
        with blob.path.open("rb") as f:
            f.seek(start)
            left = end - start
            while left > 0:
                chunk = f.read(min(CHUNK, left))
                h.wfile.write(chunk)
                record["sent"] += len(chunk)
                left -= len(chunk)

    def _api(
        self,
        h: _Handler,
        repo_type: RepoType,
        repo_id: str,
        segs: list[str],
        query: dict[str, list[str]],
        body: bytes,
        token: str | None,
        record: dict[str, Any],
    ) -> None:
        """``/api/{type}s/{id}/...``: info, tree, paths-info, refs, commits."""
        action = segs[0] if segs else ""
        if (action == "paths-info") != (h.command == "POST") or h.command == "HEAD":
            raise _Refusal(405, f"{h.command} is not allowed here")
        repo = self._open(repo_type, repo_id, token, files=False)
        record["repo"] = repo.key
        if action in ("", "revision"):
            revision = repo.default if not segs else unquote("/".join(segs[1:]))
            commit = self._at(repo, revision)
            data: Any = _info(repo, commit, _flag(query, "blobs"), _list(query, "expand"))
        elif action == "refs":
            data = _refs(repo, _flag(query, "include_prs"))
        elif action in ("tree", "paths-info", "commits") and len(segs) >= 2:
            revision, rest = _revision(segs[1:])
            commit = self._at(repo, revision)
            record["revision"] = revision
            if action == "tree":
                path = unquote("/".join(rest)).strip("/")
                data = self._tree(
                    repo, commit, path, _flag(query, "recursive"), _flag(query, "expand")
                )
            elif action == "commits":
                data = [_commit_json(c) for c in self._history(repo, commit)]
            else:
                form = _form(h.headers.get("Content-Type") or "", body)
                paths = [p.strip("/") for p in form.get("paths", [])]
                expand = _flag(form, "expand")
                data = [self._entry(repo, commit, p, expand) for p in paths]
                data = [entry for entry in data if entry is not None]
        else:
            raise _Refusal(404, "Sorry, we can't find the page you are looking for.")
        record["status"] = 200
        _send_json(h, data)

    def _tree(
        self, repo: _Repo, commit: Commit, path: str, recursive: bool, expand: bool
    ) -> list[dict[str, Any]]:
        """The entries under folder ``path`` (all below it, where ``recursive``): folders
        first, then files, each by path."""
        prefix = f"{path}/" if path else ""
        under = [p for p in commit.files if p.startswith(prefix)]
        if path and (path in commit.files or not under):
            raise _Refusal(404, "Entry not found", "EntryNotFound", {"X-Repo-Commit": commit.sha})
        paths: set[str] = set()
        for p in under:
            parts = p[len(prefix) :].split("/")
            depth = len(parts) if recursive else 1
            paths.update(prefix + "/".join(parts[:i]) for i in range(1, depth + 1))
        entries = [self._entry(repo, commit, p, expand) for p in paths]
        return sorted(
            (e for e in entries if e), key=lambda e: (e["type"] != "directory", e["path"])
        )

    def _entry(self, repo: _Repo, commit: Commit, path: str, expand: bool) -> dict[str, Any] | None:
        """A tree entry (``RepoFile``/``RepoFolder`` parse it), or None where nothing is."""
        blob = commit.files.get(path)
        if blob is not None:
            entry: dict[str, Any] = {
                "type": "file",
                "oid": blob.oid,
                "size": blob.size,
                "path": path,
            }
            if blob.lfs:
                entry["lfs"] = {
                    "oid": blob.sha256,
                    "size": blob.size,
                    "pointerSize": blob.pointer_size,
                }
        elif path and any(p.startswith(path + "/") for p in commit.files):
            entry = {
                "type": "directory",
                "oid": _tree_oid(commit.files, path),
                "size": 0,
                "path": path,
            }
        else:
            return None
        if expand:  # the last commit that changed it, as the Hub's expand=true adds
            last = commit
            for older in self._history(repo, commit)[1:]:
                if _version(older, path) != _version(commit, path):
                    break
                last = older
            entry["lastCommit"] = {"id": last.sha, "title": last.title, "date": _iso(last.date)}
        return entry

    def _history(self, repo: _Repo, commit: Commit) -> list[Commit]:
        """``commit`` and its ancestors, newest first."""
        out = [commit]
        with self._lock:
            while out[-1].parent is not None:
                out.append(repo.commits[out[-1].parent])
        return out


# What would point the client elsewhere, send a token, or keep it offline.
_UNSET = (
    "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH", "HF_HUB_DISABLE_IMPLICIT_TOKEN",
    "HF_OIDC_RESOURCE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HUGGINGFACE_CO_STAGING",
    "HUGGINGFACE_HUB_CACHE", "HF_XET_CACHE", "HF_ASSETS_CACHE",
)  # fmt: skip


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # stop() must not wait on connections the client keeps open

    def __init__(self, hub: HubServer) -> None:
        self.hub = hub
        super().__init__((hub.host, 0), _Handler)  # port 0: the kernel picks a free one

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client hanging up (stop() ends kept-alive connections) is no error of the hub's.
        exc = sys.exc_info()[1]
        if not isinstance(exc, OSError):
            with self.hub._lock:
                self.hub.errors.append(traceback.format_exc())


class _Handler(BaseHTTPRequestHandler):
    # Keep-alive: huggingface_hub's one httpx2 client reuses its connections. Every answer
    # then carries a Content-Length, and every request body is read to its end.
    protocol_version = "HTTP/1.1"
    timeout = 60  # an idle kept-alive connection's thread ends after this
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.server.hub._track(self.connection, True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.hub._track(self.connection, False)

    def do_GET(self) -> None:
        self.server.hub._answer(self)

    do_HEAD = do_POST = do_GET

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the hub's own record (HubServer.requests) says what was asked


# -- answers ------------------------------------------------------------------------------


def _send_json(
    h: _Handler, data: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> None:
    body = json.dumps(data).encode()
    h.send_response(status)
    h.send_header("Content-Type", "application/json; charset=utf-8")
    for key, value in (headers or {}).items():
        h.send_header(key, value)
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    if h.command != "HEAD":
        h.wfile.write(body)


def _send_error(h: _Handler, refusal: _Refusal) -> None:
    # hf_raise_for_status picks the exception class from X-Error-Code, and puts
    # X-Error-Message (and the body's "error") in its message.
    headers = {"X-Error-Message": refusal.message, **refusal.headers}
    if refusal.code:
        headers["X-Error-Code"] = refusal.code
    _send_json(h, {"error": refusal.message}, refusal.status, headers)


def _info(repo: _Repo, commit: Commit, blobs: bool, expand: list[str]) -> dict[str, Any]:
    """What ``ModelInfo``/``DatasetInfo`` are built from."""
    siblings = []
    for path, blob in sorted(commit.files.items()):
        sibling: dict[str, Any] = {"rfilename": path}
        if blobs:  # model_info(files_metadata=True)
            sibling.update(size=blob.size, blobId=blob.oid)
            if blob.lfs:
                sibling["lfs"] = {
                    "size": blob.size,
                    "sha256": blob.sha256,
                    "pointerSize": blob.pointer_size,
                }
        siblings.append(sibling)
    data: dict[str, Any] = {
        "_id": hashlib.sha1(repo.key.encode()).hexdigest()[:24],
        "id": repo.id,
        "author": repo.id.split("/")[0],
        "sha": commit.sha,
        "lastModified": _iso(commit.date),
        "createdAt": _iso(repo.created),
        "private": repo.private,
        "gated": "auto" if repo.gated else False,
        "disabled": False,
        "downloads": 0,
        "likes": 0,
        "tags": [],
        "siblings": siblings,
        "usedStorage": sum(b.size for b in commit.files.values()),
    }
    if repo.type == "model":
        data.update(modelId=repo.id, spaces=[])
    if expand:  # only what was asked for, as the Hub answers expand=
        data = {k: v for k, v in data.items() if k in {"_id", "id", *expand}}
    return data


def _refs(repo: _Repo, include_prs: bool) -> dict[str, Any]:
    def ref(name: str, full: str, sha: str) -> dict[str, str]:
        return {"name": name, "ref": full, "targetCommit": sha}

    branches = {n: s for n, s in repo.branches.items() if not n.startswith("refs/")}
    prs = {n: s for n, s in repo.branches.items() if n.startswith("refs/pr/")}
    out: dict[str, Any] = {
        "branches": [ref(n, f"refs/heads/{n}", s) for n, s in sorted(branches.items())],
        "converts": [],
        "tags": [ref(n, f"refs/tags/{n}", s) for n, s in sorted(repo.tags.items())],
    }
    if include_prs:
        out["pullRequests"] = [ref(n.split("/")[-1], n, s) for n, s in sorted(prs.items())]
    return out


def _commit_json(commit: Commit) -> dict[str, Any]:
    return {
        "id": commit.sha,
        "title": commit.title,
        "message": "",
        "authors": [{"user": "hub-server"}],
        "date": _iso(commit.date),
    }


def _byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The one range ``header`` asks for, as [start, end); None for the whole file: no
    header, or one HTTP lets a server ignore (several ranges, another unit, bad syntax)."""
    if not header or not header.strip().lower().startswith("bytes=") or "," in header:
        return None
    first, _, last = header.strip()[6:].partition("-")
    try:
        if not first:  # bytes=-n: the last n bytes
            if int(last) == 0:
                raise _Unsatisfiable(size)
            return (max(size - int(last), 0), size) if size else None
        start = int(first)
        if last and int(last) < start:
            return None
        end = min(int(last) + 1, size) if last else size
    except ValueError:
        return None
    if start >= size:
        raise _Unsatisfiable(size)
    return start, end


class _Unsatisfiable(_Refusal):
    def __init__(self, size: int) -> None:
        super().__init__(
            416, "Requested Range Not Satisfiable", None, {"Content-Range": f"bytes */{size}"}
        )


def _revision(segs: list[str]) -> tuple[str, list[str]]:
    """The revision at the head of ``segs`` and what follows it: one URL-encoded segment
    (``refs%2Fpr%2F1``), or a special ref the client left unencoded (``refs/pr/1``)."""
    if len(segs) >= 3 and segs[0] == "refs" and segs[1] in ("pr", "convert", "heads", "tags"):
        return "/".join(segs[:3]), segs[3:]
    return unquote(segs[0]) if segs else "main", segs[1:]


def _form(content_type: str, body: bytes) -> dict[str, list[str]]:
    if "json" in content_type:
        data = json.loads(body or b"{}")
        paths = data.get("paths", [])
        return {"paths": [paths] if isinstance(paths, str) else list(paths),
                "expand": [str(data.get("expand", False)).lower()]}  # fmt: skip
    return parse_qs(body.decode(), keep_blank_values=True)


def _flag(query: Mapping[str, list[str]], name: str) -> bool:
    return any(v.lower() in ("1", "true", "yes") for v in query.get(name, []))


def _list(query: Mapping[str, list[str]], name: str) -> list[str]:
    return [*query.get(name, []), *query.get(f"{name}[]", [])]


# -- content ------------------------------------------------------------------------------


def _chunks(path: Path) -> Iterator[bytes]:
    with path.open("rb") as f:
        while chunk := f.read(1024 * 1024):
            yield chunk


def _git_oid(content: Path | bytes) -> str:
    """The git blob id of the content: sha1 of ``blob SIZE\\0`` and the bytes."""
    if isinstance(content, bytes):
        size, chunks = len(content), iter([content])
    else:
        size, chunks = content.stat().st_size, _chunks(content)
    digest = hashlib.sha1(f"blob {size}\0".encode())
    for chunk in chunks:
        digest.update(chunk)
    return digest.hexdigest()


def _tree_oid(files: Mapping[str, Blob], folder: str) -> str:
    """A stable id of a folder's content (not git's tree id, which no client checks)."""
    prefix = f"{folder}/" if folder else ""
    lines = [f"{p} {b.oid}" for p, b in sorted(files.items()) if p.startswith(prefix)]
    return hashlib.sha1("\n".join(lines).encode()).hexdigest()


def _version(commit: Commit, path: str) -> str | None:
    """What ``path`` is at ``commit``: its content's id, None where absent."""
    blob = commit.files.get(path)
    if blob is not None:
        return blob.oid
    prefix = path + "/"
    return (
        _tree_oid(commit.files, path) if any(p.startswith(prefix) for p in commit.files) else None
    )


def _clean(path: str) -> str:
    parts = [p for p in str(path).replace("\\", "/").split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise ValueError(f"not a path in a repo: {path!r}")
    return "/".join(parts)


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _iso(when: datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{when.microsecond // 1000:03d}Z"
