"""Every shipped config parses against the real loader, so none can rot."""

from __future__ import annotations

from pathlib import Path

import pytest

from raylift.config import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def test_there_are_configs() -> None:
    assert {p.name for p in CONFIGS} >= {"quickstart.yaml", "gpt-tiny.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.name and cfg.task
