"""The configs for the model families users train (``configs/models/``): each one
validates and plans against a Hub on 127.0.0.1 that holds stand-ins of what it names:
the models' real ``config.json`` shapes with a small tokenizer, and the chat data set's
card and files. So none of them can rot, and no test downloads a model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

pytest.importorskip("transformers")

from raylift.cli import main as cli_main
from tests.chats import CARD, chat_parquet, model_folder, triples
from tests.hub_server import HubServer

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs" / "models").glob("*.yaml"))
LLAMA3 = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
          "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
          "num_key_value_heads": 8, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}}  # fmt: skip
# The shapes of each model's own config.json on the Hub.
SHAPES = {
    "meta-llama/Llama-3.1-8B-Instruct": {**LLAMA3, "hidden_size": 4096, "intermediate_size": 14336,
                                         "num_hidden_layers": 32, "num_attention_heads": 32},
    "meta-llama/Llama-3.3-70B-Instruct": {**LLAMA3, "hidden_size": 8192, "intermediate_size": 28672,
                                          "num_hidden_layers": 80, "num_attention_heads": 64},
    "Qwen/Qwen3-8B": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
                      "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                      "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                      "max_position_embeddings": 40960, "rope_theta": 1000000.0,
                      "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
    "mistralai/Mixtral-8x7B-Instruct-v0.1": {
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-5,
        "router_aux_loss_coef": 0.02, "tie_word_embeddings": False},
}  # fmt: skip


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    """Each model the configs name, as its config.json and a small tokenizer (no weights:
    validate and plan read none), and the chat data set in ultrachat's layout."""
    root = tmp_path_factory.mktemp("model-configs")
    tokenizer = model_folder(root / "tokenizer")
    train, held = triples()
    chats = {"train_sft-00000-of-00001": train[:40], "test_sft-00000-of-00001": held[:10]}
    with HubServer(root / "hub") as server, pytest.MonkeyPatch.context() as patch:
        server.use(patch, root / "hf-home")
        for repo, shape in SHAPES.items():
            files = {p.name: p for p in tokenizer.iterdir() if p.name != "config.json"}
            server.add_repo(repo, {**files, "config.json": json.dumps(shape).encode()})
        rows = chat_parquet(chats)
        server.add_repo("HuggingFaceH4/ultrachat_200k", {"README.md": CARD.encode(), **rows},
                        repo_type="dataset")  # fmt: skip
        yield server


def planned(path: Path) -> list[str]:
    """The ``raylift plan`` arguments the config's own comment gives."""
    line = next(x for x in path.read_text().splitlines() if "raylift plan" in x)
    config, *args = line.split("raylift plan", 1)[1].split()
    assert REPO / config == path, line
    return [str(path), *args]


def test_every_model_family_has_its_config() -> None:
    names = {p.stem for p in CONFIGS}
    assert names == {"llama3-8b-lora", "llama3-8b-lora-2nodes", "llama3-70b-lora",
                     "qwen3-8b-full", "mixtral-8x7b-lora"}  # fmt: skip
    for path in CONFIGS:
        raw = yaml.safe_load(path.read_text())
        assert raw["task_args"]["model"] in SHAPES and "/" in raw["task_args"]["data"], path


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_each_model_config_validates_and_plans(
    hub: HubServer, path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["validate", str(path)]) == 0
    assert cli_main(["plan", *planned(path)]) == 0
    out = capsys.readouterr().out
    print(out)
    # The layout the config asks for (FSDP, HSDP across nodes) fits the GPUs it names.
    fsdp = next(line for line in out.splitlines() if line.startswith("fsdp "))
    assert not fsdp.endswith(" no"), out
