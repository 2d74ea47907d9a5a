"""tests/hub_server.py is a Hub the real huggingface_hub client works with: downloads,
commits pinned across a push, ranged reads through ``hf://``, and the errors (gated,
private, unknown repo, revision or file) raised as the exception classes the Hub's own
answers give."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("huggingface_hub")

from huggingface_hub import (
    HfApi,
    HfFileSystem,
    RepoFile,
    constants,
    get_hf_file_metadata,
    hf_hub_download,
    hf_hub_url,
    snapshot_download,
)
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from tests.hub_server import HubServer

REPO = Path(__file__).resolve().parents[2]
LLAMA = "org/tiny-llama"


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    """A hub that knows the tokens ``hf_good`` and ``hf_other``, with this process's
    huggingface_hub (its constants and the environment) pointed at it and its cache in
    ``tmp_path``; no request it failed on."""
    server = HubServer(tmp_path / "hub")
    server.tokens = {"hf_good", "hf_other"}
    with server:
        server.use(monkeypatch, tmp_path / "hf-home")
        yield server
    assert not server.errors, server.errors[0]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A from_pretrained folder of a tiny Llama (config.json, generation_config.json,
    model.safetensors: about 120 kB)."""
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("tiny-llama")
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def test_a_model_downloads_loads_and_a_pinned_commit_outlives_a_push(
    hub: HubServer, llama: Path, tmp_path: Path
) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "model"
    folder.mkdir()
    for f in llama.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    first_weights = (folder / "model.safetensors").read_bytes()
    first = hub.add_repo(LLAMA, folder)

    info = HfApi().model_info(LLAMA)
    assert info.sha == first and info.gated is False and info.private is False
    assert sorted(s.rfilename for s in info.siblings or []) == sorted(
        p.name for p in folder.iterdir()
    )
    local = Path(snapshot_download(LLAMA, revision="main"))
    assert local.name == first and local.is_relative_to(constants.HF_HUB_CACHE)
    assert hub.served(LLAMA, "model.safetensors") == len(first_weights)
    model = AutoModelForCausalLM.from_pretrained(local)
    saved = load_file(folder / "model.safetensors")
    assert model.state_dict().keys() == saved.keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, saved[name]), name

    # The folder changes after the commit (the commit holds copies), then is pushed.
    changed = {name: tensor + 1 for name, tensor in saved.items()}
    save_file(changed, folder / "model.safetensors", metadata={"format": "pt"})
    assert hub.files(LLAMA, first)["model.safetensors"] == first_weights
    second = hub.push(LLAMA, folder)
    assert second != first and HfApi().model_info(LLAMA).sha == second
    assert HfApi().model_info(LLAMA, revision=first).sha == first

    # A run pinned to the first commit reads it, from the server (a fresh cache) ...
    hub.reset_stats()
    fresh = tmp_path / "fresh-cache"
    pinned = hf_hub_download(LLAMA, "model.safetensors", revision=first, cache_dir=fresh)
    same = Path(pinned).read_bytes() == first_weights  # not in the assert: pytest diffs bytes
    assert same, "the pinned download is not the first commit's weights"
    assert {r.revision for r in hub.requests if r.file == "model.safetensors"} == {first}
    assert hub.served(LLAMA, "model.safetensors") == len(first_weights)
    old = AutoModelForCausalLM.from_pretrained(snapshot_download(LLAMA, revision=first))
    assert torch.equal(old.state_dict()["model.norm.weight"], saved["model.norm.weight"])
    # ... and main is the push; transformers finds it by name through the patched constants.
    latest = AutoModelForCausalLM.from_pretrained(LLAMA)
    assert torch.equal(latest.state_dict()["model.norm.weight"], changed["model.norm.weight"])
    latest_file = Path(hf_hub_download(LLAMA, "model.safetensors", cache_dir=fresh))
    same = (folder / "model.safetensors").read_bytes() == latest_file.read_bytes()
    assert same, "main's download is not the pushed weights"


def test_branches_tags_and_commits_name_revisions(hub: HubServer) -> None:
    first = hub.add_repo("org/revs", {"a.txt": b"one", "dir/b.txt": b"two"})
    hub.tag("org/revs", "v1")
    second = hub.push("org/revs", {"a.txt": b"ONE"}, delete=["dir/b.txt"])
    pr = hub.push("org/revs", {"c.txt": b"three"}, branch="refs/pr/1")
    api = HfApi()

    def read(revision: str, name: str = "a.txt") -> bytes:
        return Path(hf_hub_download("org/revs", name, revision=revision)).read_bytes()

    assert read("main") == read(second) == b"ONE"
    assert read("v1") == read(first) == read("refs/tags/v1") == b"one"
    assert read("refs/pr/1", "c.txt") == b"three" and read("refs/pr/1") == b"ONE"
    assert api.model_info("org/revs", revision="refs/pr/1").sha == pr  # sent as refs%2Fpr%2F1
    assert sorted(api.list_repo_files("org/revs", revision=first)) == ["a.txt", "dir/b.txt"]
    assert api.list_repo_files("org/revs") == ["a.txt"]
    refs = api.list_repo_refs("org/revs", include_pull_requests=True)
    assert [(b.name, b.target_commit) for b in refs.branches] == [("main", second)]
    assert [(t.name, t.target_commit) for t in refs.tags] == [("v1", first)]
    assert [p.ref for p in refs.pull_requests or []] == ["refs/pr/1"]
    assert [c.commit_id for c in api.list_repo_commits("org/revs")] == [second, first]
    # expand=True: the last commit that changed each entry
    tree = {e.path: e for e in api.list_repo_tree("org/revs", revision="v1", expand=True)}
    assert tree["a.txt"].last_commit is not None and tree["a.txt"].last_commit.oid == first
    entry = api.get_paths_info("org/revs", ["a.txt"], expand=True)[0]
    assert entry.last_commit is not None and entry.last_commit.oid == second


def test_hf_filesystem_lists_and_reads_only_the_range_it_asked_for(
    hub: HubServer, llama: Path
) -> None:
    sha = hub.add_repo(LLAMA, llama)
    fs = HfFileSystem(endpoint=hub.url)
    names = {p.name for p in llama.iterdir()}
    assert {Path(str(p)).name for p in fs.ls(LLAMA, detail=False)} == names
    weights = (llama / "model.safetensors").read_bytes()
    info = fs.info(f"{LLAMA}/model.safetensors")  # from the listing ls cached
    assert info["name"] == f"{LLAMA}/model.safetensors" and info["type"] == "file"
    assert info["size"] == len(weights)
    assert info["lfs"] is not None and info["lfs"].sha256 == hashlib.sha256(weights).hexdigest()
    assert fs.info(f"{LLAMA}/model.safetensors", refresh=True)["size"] == len(weights)  # paths-info
    assert fs.isdir(LLAMA) and not fs.exists(f"{LLAMA}/nope.bin")

    # 100 bytes from the middle, through fsspec's read-ahead cache of block_size bytes.
    hub.reset_stats()
    middle, block = len(weights) // 2, 64
    with fs.open(f"hf://{LLAMA}@{sha}/model.safetensors", "rb", block_size=block) as f:
        f.seek(middle)
        assert f.read(100) == weights[middle : middle + 100]
    gets = [r for r in hub.requests if r.file == "model.safetensors" and r.method == "GET"]
    assert [(r.range, r.status, r.revision) for r in gets] == [
        (f"bytes={middle}-{middle + 100 + block - 1}", 206, sha)
    ]
    assert hub.served(LLAMA, "model.safetensors") == 100 + block < len(weights) // 100
    assert hub.total_bytes_served == 100 + block

    # Concurrent ranged reads, each of its own bytes.
    hub.reset_stats()
    spans = [(i * 1000, i * 1000 + 333) for i in range(16)]
    with ThreadPoolExecutor(8) as pool:
        parts = list(pool.map(lambda s: fs.cat_file(f"{LLAMA}/model.safetensors", *s), spans))
    assert parts == [weights[a:b] for a, b in spans]
    assert hub.served(LLAMA, "model.safetensors") >= 16 * 333


def test_a_dataset_of_parquet_files(hub: HubServer, tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    folder = tmp_path / "ds"
    (folder / "data").mkdir(parents=True)
    for i in range(2):
        table = pa.table({"text": [f"row {i}-{j}" for j in range(100)]})
        pq.write_table(table, folder / "data" / f"train-{i}.parquet")
    (folder / "README.md").write_text("---\nlicense: mit\n---\n")
    sha = hub.add_repo("org/ds", folder, repo_type="dataset")

    assert HfApi().dataset_info("org/ds").sha == sha
    fs = HfFileSystem()
    found = fs.find("datasets/org/ds/data")
    assert found == [f"datasets/org/ds/data/train-{i}.parquet" for i in range(2)]
    assert fs.glob("datasets/org/ds/**/*.parquet") == found
    with fs.open(found[1], "rb", block_size=1024) as f:
        assert pq.ParquetFile(f).metadata.num_rows == 100  # the footer, by ranged reads
    read = hub.served("org/ds", "data/train-1.parquet", repo_type="dataset")
    assert 0 < read <= (folder / "data" / "train-1.parquet").stat().st_size
    assert ("datasets/org/ds", "data/train-1.parquet") in hub.bytes_served
    local = snapshot_download("org/ds", repo_type="dataset", allow_patterns="data/*")
    assert pq.read_table(Path(local) / "data" / "train-0.parquet").num_rows == 100


def test_gated_private_and_missing_are_the_hubs_errors(hub: HubServer) -> None:
    files = {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"\0" * 64}
    hub.add_repo("org/gated", files, gated=True)
    hub.add_repo("org/private", files, private=True)
    hub.add_repo("org/approved-others", files, gated=True, readers={"hf_other"})
    sha = hub.add_repo("org/open", files)
    api = HfApi()

    # Gated: the info and the file list are public, the files need a token with access.
    assert api.model_info("org/gated").gated == "auto"
    assert sorted(api.list_repo_files("org/gated")) == sorted(files)
    with pytest.raises(GatedRepoError) as caught:
        hf_hub_download("org/gated", "config.json")
    assert caught.value.response.status_code == 401
    with pytest.raises(GatedRepoError):
        snapshot_download("org/gated")
    with pytest.raises(GatedRepoError) as caught:
        hf_hub_download("org/approved-others", "config.json", token="hf_good")
    assert caught.value.response.status_code == 403  # a token, but not one with access
    path = hf_hub_download("org/gated", "config.json", token="hf_good")
    assert Path(path).read_bytes() == files["config.json"]
    assert Path(snapshot_download("org/approved-others", token="hf_other")).is_dir()
    assert {r.token for r in hub.requests if r.repo == "org/gated"} >= {None, "hf_good"}

    # Private: not there at all without a token that may read it.
    with pytest.raises(RepositoryNotFoundError) as not_found:
        api.model_info("org/private")
    assert not isinstance(not_found.value, GatedRepoError)
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("org/private", "config.json")
    assert api.model_info("org/private", token="hf_good").private is True

    # A token the Hub does not know: refused everywhere, as the Hub does.
    with pytest.raises(HfHubHTTPError) as refused:
        api.model_info("org/open", token="hf_bad")
    assert refused.value.response.status_code == 401
    assert not isinstance(refused.value, RepositoryNotFoundError)

    # Unknown repo, revision, file.
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("org/nobody")
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("org/nobody", "config.json")
    with pytest.raises(RepositoryNotFoundError):
        snapshot_download("org/nobody")
    assert not api.repo_exists("org/nobody") and api.repo_exists("org/gated")
    for revision in ("nope", "0" * 40):
        with pytest.raises(RevisionNotFoundError):
            api.model_info("org/open", revision=revision)
        with pytest.raises(RevisionNotFoundError):
            hf_hub_download("org/open", "config.json", revision=revision)
    with pytest.raises(RemoteEntryNotFoundError) as missing:
        hf_hub_download("org/open", "nope.json")
    assert isinstance(missing.value, EntryNotFoundError)
    assert missing.value.response.headers["X-Repo-Commit"] == sha
    assert not api.file_exists("org/open", "nope.json")
    assert api.file_exists("org/open", "config.json")
    fs = HfFileSystem()
    with pytest.raises(FileNotFoundError):
        fs.info("org/nobody/config.json")
    with pytest.raises(FileNotFoundError):
        fs.ls("org/open/nope")


def test_file_metadata_is_what_hf_hub_download_needs(hub: HubServer) -> None:
    sha = hub.add_repo("org/meta", {"config.json": b"{}", "model.safetensors": b"x" * 1000})
    small = get_hf_file_metadata(hf_hub_url("org/meta", "config.json"))
    assert (small.commit_hash, small.size, small.xet_file_data) == (sha, 2, None)
    assert small.etag == "9e26dfeeb6e641a33dae4961196235bdb965b21b"  # git hash-object
    # An LFS file: its sha256 is the ETag (X-Linked-Etag), as the tree's lfs.oid; no Xet.
    large = get_hf_file_metadata(hf_hub_url("org/meta", "model.safetensors", revision=sha))
    (entry,) = HfApi().get_paths_info("org/meta", "model.safetensors")
    assert isinstance(entry, RepoFile) and entry.lfs is not None
    assert (large.size, large.etag, large.xet_file_data) == (1000, entry.lfs.sha256, None)
    assert large.etag == hashlib.sha256(b"x" * 1000).hexdigest()


def test_a_process_started_with_hub_env_reaches_it(hub: HubServer, tmp_path: Path) -> None:
    """No endpoint= and no patched constant there: HF_ENDPOINT, set before the import."""
    sha = hub.add_repo("org/sub", {"config.json": b'{"hidden_size": 32}'})
    script = textwrap.dedent(
        """
        import json
        from huggingface_hub import HfApi, constants, hf_hub_download
        path = hf_hub_download("org/sub", "config.json")
        print(json.dumps([constants.ENDPOINT, HfApi().model_info("org/sub").sha, path]))
        """
    )
    env = hub.env(tmp_path / "child-home")
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    endpoint, commit, path = json.loads(out.stdout.strip().splitlines()[-1])
    assert (endpoint, commit) == (hub.url, sha)
    assert Path(path).is_relative_to(tmp_path / "child-home" / "hub")
    assert Path(path).read_text() == '{"hidden_size": 32}'
