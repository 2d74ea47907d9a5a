"""What more than one module of the unit tests holds its runs to, trained once a session."""

from __future__ import annotations

from typing import Any

import pytest
import torch


@pytest.fixture(scope="session")
def ddp_on_four(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """DDP on four gloo ranks, fp32, 30 steps: gpt's curve, and the zoo's Llama (with and
    without LoRA), Qwen3 and Mixtral with the folders they start from. HSDP
    (test_hsdp) and FSDP+TP (test_tp) each follow these; training them once a session
    rather than once a module saves three four-rank runs."""
    pytest.importorskip("transformers")
    from tests.helpers import run_ranks, train_runs
    from tests.unit.test_hsdp import WORLD, gpt, zoo_runs
    from tests.zoo import save_zoo, zoo_train

    root = tmp_path_factory.mktemp("ddp-on-four")
    run_ranks(WORLD, root, train_runs, {"gpt": gpt({"name": "ddp"})}, str(root / "gpt.pt"))
    zoo = save_zoo(root / "zoo", ["llama-tied", "qwen3", "mixtral"])
    runs = zoo_runs(zoo, {"name": "ddp"})
    (root / "zoo-runs").mkdir()
    run_ranks(WORLD, root / "zoo-runs", zoo_train, runs, str(root / "zoo-runs"))
    return {
        "gpt": torch.load(root / "gpt.pt", weights_only=True)["gpt"],
        "zoo": zoo,
        "zoo_curves": torch.load(root / "zoo-runs" / "train.pt", weights_only=True),
    }
