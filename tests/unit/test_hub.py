"""Models named by Hugging Face Hub IDs, against a Hub on 127.0.0.1 (tests/hub_server.py)
with the real huggingface_hub client: the driver pins a branch to one commit, the task
reads its config and tokenizer from the cache and its weights from the Hub at that commit,
and the Hub's refusals (gated, unknown name or revision, offline with nothing cached) are
one line each, exit 2, before Ray."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

pytest.importorskip("transformers")

from raylift.core import hub as hubs
from raylift.core.config import ConfigError
from raylift.core.errors import SourceError
from raylift.tasks import build_task
from raylift.validation import pin_hub_names, recorded_args
from tests.helpers import make_config
from tests.hub_server import HubServer

REPO = Path(__file__).resolve().parents[2]
LLAMA = "org/tied-llama"
WIDE = "org/wide-llama"


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.zoo import save_zoo

    return save_zoo(tmp_path_factory.mktemp("zoo"), ["llama-tied"])["llama-tied"]


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama of 10 MiB of fp32 weights in three files and their index, no tokenizer
    (its 320 tokens are bytes and more): each file a few read-aheads of the Hub's
    filesystem."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=320, max_position_embeddings=64,
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("wide-llama")
    AutoModelForCausalLM.from_config(config).save_pretrained(folder, max_shard_size="4MB")
    return folder


# What a Hub model's folder holds beside its safetensors, which no run reads.
OTHER_FORMATS = {"original/consolidated.00.pth": b"\0" * 300_000, "pytorch_model.bin": b"x" * 1000}


@pytest.fixture
def hub(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, zoo: Path, wide: Path
) -> Iterator[HubServer]:
    """The zoo's tied Llama (with its tokenizer) as ``org/tied-llama``, a gated copy and
    ``org/wide-llama``;
    this process's huggingface_hub pointed at the server, its cache in ``tmp_path``."""
    server = HubServer(tmp_path / "hub")
    server.tokens = {"hf_good"}
    with server:
        server.use(monkeypatch, tmp_path / "hf-home")
        server.add_repo(LLAMA, zoo)
        server.add_repo("org/gated-llama", zoo, gated=True)
        server.add_repo(WIDE, {**{p.name: p for p in wide.iterdir()}, **OTHER_FORMATS})
        yield server
    assert not server.errors, server.errors[0]


def hf_config(model: str) -> object:
    return make_config(task="hf-causal-lm", task_args={"model": model, "block_size": 32})


def test_a_hub_id_is_told_from_a_path() -> None:
    assert hubs.parse("org/name") == hubs.HubRef("org/name")
    assert hubs.parse("org/name@v1.0") == hubs.HubRef("org/name", "v1.0")
    assert hubs.parse("hf://org/name@main") == hubs.HubRef("org/name", "main")
    sha = "a" * 40
    assert hubs.parse(f"org/name@{sha}").pinned  # type: ignore[union-attr]
    assert hubs.HubRef("org/name", sha).uri("config.json") == f"hf://org/name@{sha}/config.json"
    for path in ("./org/name", "/abs/org/name", "~/models/x", "s3://b/org", "name", "a/b/c",
                 "org/name@"):  # fmt: skip
        assert hubs.parse(path) is None, path
    assert hubs.parse(str(REPO / "configs")) is None  # an existing folder is a folder
    # The MLflow run's tags name what was read: a pinned ID only.
    assert hubs.tags(f"org/name@{sha}") == {"raylift.hub.model": "org/name",
                                            "raylift.hub.commit": sha}  # fmt: skip
    assert hubs.tags("org/name@main") == hubs.tags("/models/x") == hubs.tags(None) == {}


def test_the_driver_pins_a_branch_to_one_commit_that_a_push_does_not_change(
    hub: HubServer, zoo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = hub.resolve(LLAMA)
    cfg, line = pin_hub_names(hf_config(LLAMA))  # type: ignore[arg-type]
    assert "Fetching" not in capsys.readouterr().err  # huggingface_hub's progress bars
    assert cfg.task_args["model"] == f"{LLAMA}@{first}"
    assert line == f"raylift: task_args.model {LLAMA} is the Hub's commit {first}"
    # A push to main after the pin: the pinned run still reads the first commit.
    changed = tmp_path / "changed"
    changed.mkdir()
    config = json.loads((zoo / "config.json").read_text())
    (changed / "config.json").write_text(json.dumps({**config, "pushed": True}))
    second = hub.push(LLAMA, changed)
    task = build_task(cfg.task, cfg.task_args)
    assert task.hub == hubs.HubRef(LLAMA, first) and not hasattr(task.config, "pushed")
    assert {r.revision for r in hub.requests if r.file == "config.json"} == {first}
    latest, _ = pin_hub_names(hf_config(f"{LLAMA}@main"))  # type: ignore[arg-type]
    assert latest.task_args["model"] == f"{LLAMA}@{second}"
    assert build_task(latest.task, latest.task_args).config.pushed is True
    # A pinned name is not asked about again.
    asked = len(hub.requests)
    assert pin_hub_names(cfg)[0] == cfg and len(hub.requests) == asked
    # A resume of the run reads the commit its run folder recorded, not main's new one.
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    resumed, said = pin_hub_names(hf_config(LLAMA), recorded_args(str(run)))  # type: ignore[arg-type]
    assert resumed.task_args["model"] == f"{LLAMA}@{first}"
    assert said == (
        f"raylift: task_args.model {LLAMA}: resuming on the commit this run read, {first} "
        f"(name another commit, {LLAMA}@<commit>, to move it)"
    )
    # A commit named by the config moves it; another model is pinned as new.
    moved, _ = pin_hub_names(hf_config(f"{LLAMA}@{second}"), {"model": f"{LLAMA}@{first}"})  # type: ignore[arg-type]
    assert moved.task_args["model"] == f"{LLAMA}@{second}"
    assert recorded_args(str(tmp_path / "nowhere")) == {}


@pytest.mark.parametrize("name", [LLAMA, WIDE])
def test_the_weights_are_read_from_the_hub_as_save_pretrained_wrote_them(
    hub: HubServer, zoo: Path, wide: Path, name: str
) -> None:
    """The task's weights are the Hub's files at the pinned commit (tied ones too; one
    file, or an index and its files); the driver's check of them reads each file's header
    and nothing more, once however often it is asked for (a file at a commit never
    changes), and the load reads each tensor's bytes once, in ranges: no file whole,
    nothing of the other formats."""
    import torch
    from transformers import AutoModelForCausalLM

    from raylift.tensors.init import write_in_place
    from raylift.tensors.weights import check, load

    cfg, _ = pin_hub_names(hf_config(name))  # type: ignore[arg-type]
    task = build_task(cfg.task, cfg.task_args)
    path = task.pretrained_weights
    assert path == f"hf://{cfg.task_args['model']}"
    folder = {LLAMA: zoo, WIDE: wide}[name]
    files = {p.name: p.stat().st_size for p in folder.glob("*.safetensors")}
    assert len(files) == (1 if name == LLAMA else 3), files

    def served() -> int:
        return sum(hub.served(name, f) for f in files)

    hub.reset_stats()
    model = task.build_model()
    check(model, path)
    headers = sum(8 + int.from_bytes((folder / f).read_bytes()[:8], "little") for f in files)
    assert served() == headers, (served(), files)
    if name == WIDE:
        assert served() < sum(files.values()) / 2, (served(), files)
    first = served()
    check(model, path)  # asked again, as the driver's other checks ask: nothing read
    assert served() == first
    hub.reset_stats()
    load(model, path, write_in_place)
    assert served() == sum(files.values()) - headers, (served(), files)
    assert hub.total_bytes_served == served() + hub.served(name, "model.safetensors.index.json")
    want = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    got = model.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_weights_and_adapters_named_by_hub_ids_are_pinned_and_checked_where_they_are(
    hub: HubServer, zoo: Path, tmp_path: Path
) -> None:
    """``model.weights`` and ``model.adapter.weights`` as Hub IDs: each pinned to one
    commit as an ``hf://`` URI, and the driver's check reads the weights' header and the
    adapters' config and header from the Hub, as it does from an object store."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from raylift.tensors.preflight import check_for_config

    adapters = tmp_path / "lora"
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    get_peft_model(AutoModelForCausalLM.from_pretrained(zoo), lora).save_pretrained(adapters)
    hub.add_repo("org/tied-llama-lora", adapters)
    adapter = {"type": "lora", "r": 4, "alpha": 8, "weights": "org/tied-llama-lora"}
    cfg = make_config(task="hf-causal-lm", task_args={"model": str(zoo), "block_size": 32},
                      model={"weights": LLAMA, "adapter": adapter})  # fmt: skip
    pinned, said = pin_hub_names(cfg)
    commits = hub.resolve(LLAMA), hub.resolve("org/tied-llama-lora")
    assert pinned.model.weights == f"hf://{LLAMA}@{commits[0]}"
    assert pinned.model.adapter.weights == f"hf://org/tied-llama-lora@{commits[1]}"
    assert said.splitlines() == [
        f"raylift: model.weights {LLAMA} is the Hub's commit {commits[0]}",
        f"raylift: model.adapter.weights org/tied-llama-lora is the Hub's commit {commits[1]}",
    ]
    hub.reset_stats()
    check_for_config(pinned, build_task(pinned.task, pinned.task_args))
    assert hub.served("org/tied-llama-lora", "adapter_config.json") > 0
    assert 0 < hub.served(LLAMA, "model.safetensors") <= 2 * (hubs.READ_AHEAD + 8 + 64 * 1024)
    wrong = make_config(model={"weights": "org/no-such-weights"})
    with pytest.raises(ConfigError, match=r"model\.weights: no model 'org/no-such-weights'"):
        pin_hub_names(wrong)


def test_a_corpus_named_by_its_hub_id_is_its_splits_files_at_one_commit(
    hub: HubServer, zoo: Path
) -> None:
    """``hf-causal-lm``'s ``task_args.corpus: org/texts``: a data set without a card, its
    split's files found where ``push_to_hub`` puts them, at the commit the driver pinned."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    out = io.BytesIO()
    pq.write_table(pa.table({"text": ["the sun and the moon"] * 50}), out)
    files = {"data/train-00000-of-00001.parquet": out.getvalue(), "data/test-00000.parquet": b"x"}
    commit = hub.add_repo("org/texts", files, repo_type="dataset")
    args = {"model": str(zoo), "block_size": 32, "corpus": "org/texts"}
    cfg, said = pin_hub_names(make_config(task="hf-causal-lm", task_args=args))
    assert cfg.task_args["corpus"] == f"org/texts@{commit}"
    assert said == f"raylift: task_args.corpus org/texts is the Hub's commit {commit}"
    task = build_task(cfg.task, cfg.task_args)
    assert task.corpus == f"hf://datasets/org/texts@{commit}/data/train-*"
    _, listed = task._corpus()
    assert [Path(i.path).name for i in listed] == ["train-00000-of-00001.parquet"]
    with pytest.raises(SourceError, match=r"org/texts has no \.parquet, \.jsonl or \.json files"):
        build_task("hf-causal-lm", {**cfg.task_args, "split": "validation"})


@pytest.mark.parametrize(
    ("model", "said"),
    [
        ("org/gated-llama", "task_args.model: org/gated-llama is gated and the Hugging Face "
         "token is missing; accept its terms on its Hub page, then set HF_TOKEN"),
        ("org/no-such-model", "task_args.model: no model 'org/no-such-model' on the Hugging "
         "Face Hub at http://127.0.0.1:"),
        (f"{LLAMA}@no-such-branch", f"task_args.model: {LLAMA} has no revision "
         "'no-such-branch' at http://127.0.0.1:"),
    ],
)  # fmt: skip
def test_the_hubs_refusals_are_one_line_and_exit_2_before_ray(
    hub: HubServer, tmp_path: Path, model: str, said: str
) -> None:
    with pytest.raises(ConfigError, match=r"task_args\.model: "):
        pin_hub_names(hf_config(model))  # type: ignore[arg-type]
    # Through the CLI, as a user meets it: train stops at its config, Ray never started.
    env = hub.env(tmp_path / "hf-home")
    config = tmp_path / "hub.yaml"
    config.write_text(f"task: hf-causal-lm\ntask_args: {{model: {model}, block_size: 32}}\n")
    run = subprocess.run(
        [sys.executable, "-m", "raylift.cli", "train", str(config), f"storage={tmp_path / 'runs'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    errors = [line for line in run.stderr.splitlines() if line.strip()]
    assert len([e for e in errors if said in e]) == 1, run.stderr
    assert "Ray" not in run.stdout + run.stderr and not (tmp_path / "runs").exists()


def test_a_token_opens_a_gated_model(hub: HubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_good")
    cfg, _ = pin_hub_names(hf_config("org/gated-llama"))  # type: ignore[arg-type]
    assert build_task(cfg.task, cfg.task_args).tokenizer is not None
    # The token went to the Hub, never into the config or the line.
    assert "hf_good" not in str(cfg.to_dict())
    assert any(r.token == "hf_good" for r in hub.requests)


def test_offline_reads_the_cache_and_without_it_refuses(
    hub: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    online, _ = pin_hub_names(hf_config(LLAMA))  # type: ignore[arg-type]
    build_task(online.task, online.task_args)  # fills the cache with its small files
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    asked = len(hub.requests)
    cached, _ = pin_hub_names(hf_config(LLAMA))  # type: ignore[arg-type]
    assert cached.task_args == online.task_args and len(hub.requests) == asked
    with pytest.raises(ConfigError, match="org/other is not in the local Hugging Face cache"):
        pin_hub_names(hf_config("org/other"))  # type: ignore[arg-type]
