"""Every shipped config parses against the real loader, so none can rot."""

from __future__ import annotations

from pathlib import Path

import pytest

from raylift.validation import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def test_there_are_configs() -> None:
    assert {p.name for p in CONFIGS} >= {"quickstart.yaml", "gpt-tiny.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.name and cfg.task


INLINE_LLAMA = {
    "task": "hf-causal-lm",
    "task_args": {
        "model": {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
                  "num_key_value_heads": 4, "max_position_embeddings": 64},
    },
}  # fmt: skip


@pytest.mark.parametrize("path", [*CONFIGS, "inline-llama"], ids=lambda p: getattr(p, "name", p))
def test_the_config_a_run_saves_loads_back_to_the_one_it_ran(
    path: Path | str, tmp_path: Path
) -> None:
    """What a run writes to its folder (credentials masked) is the config it ran: a model's
    ``num_key_value_heads`` is a setting, not a secret."""
    import yaml

    from raylift.run.launch import RUN_CONFIG, record_config
    from raylift.validation import config_from_dict

    if path == "inline-llama":
        cfg = config_from_dict(INLINE_LLAMA | {"storage": str(tmp_path)})
    else:
        cfg = load_config(path, [f"storage={tmp_path}"])
    record_config(cfg, str(tmp_path))
    saved = load_config(tmp_path / RUN_CONFIG)
    assert saved.to_dict() == cfg.to_dict()
    assert "***" not in yaml.safe_dump(saved.to_dict())


def test_credentials_are_masked_wherever_they_are_in_a_config() -> None:
    from raylift.artifacts.tracking import REDACTED, redact

    masked = redact({
        "tracking.uri": "https://alice:s3cret@mlflow.example.com",
        "task_args.hf_token": "hf_abc", "task_args.aws_secret_access_key": "xyz",
        "task_args.api_key": "k", "task_args.password": "p", "task_args.client_secret": "c",
        "task_args.sources": ["postgresql://bob:pw@db/x"],
        "task_args.max_tokens": 10, "task_args.num_key_value_heads": 8,
    })  # fmt: skip
    assert masked["tracking.uri"] == f"https://alice:{REDACTED}@mlflow.example.com"
    for key in ("hf_token", "aws_secret_access_key", "api_key", "password", "client_secret"):
        assert masked[f"task_args.{key}"] == REDACTED, key
    assert masked["task_args.sources"] == [f"postgresql://bob:{REDACTED}@db/x"]
    assert masked["task_args.max_tokens"] == 10 and masked["task_args.num_key_value_heads"] == 8
