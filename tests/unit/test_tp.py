"""Tensor parallel within a node (``strategy.tp``) against DDP, fp32, 30 steps: FSDP+TP 2
on gpt and the zoo's Llama and Qwen3 (four gloo ranks: shard 2 x tp 2), HSDP+TP on gpt
(eight ranks: replicate 2 x shard 2 x tp 2). A tensor-parallel group trains on one
batch, its members' rows in turn, so each layout's step sees DDP's rows and loss. Then
a checkpoint saved under TP 2 resumed under TP 1 and under DDP, and what is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from raylift.artifacts.export import consolidated_state_dict
from tests.helpers import (
    GPT_SMALL,
    make_config,
    resume_and_record,
    run_ranks,
    train_keep_checkpoints,
    train_runs,
)
from tests.unit.test_hsdp import TOLERANCE, WORLD, gpt, worst, zoo_thirty

pytestmark = pytest.mark.slow

TP = {"name": "fsdp", "tp": 2}  # shard 2 x tp 2 on one host


def test_fsdp_tp_follows_ddp_on_gpt(tmp_path: Path, ddp_on_four: dict[str, Any]) -> None:
    runs = {
        "fsdp-tp": gpt(TP),
        "fsdp-tp-ac": gpt({**TP, "activation_checkpointing": True}),
    }
    run_ranks(WORLD, tmp_path, train_runs, runs, str(tmp_path / "out.pt"))
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    ref = ddp_on_four["gpt"]["loss"]
    assert ref[30] < 0.8 * ref[1]  # it learned
    table = {name: worst(got[name]["loss"], ref) for name in runs}
    print(table)
    assert all(v <= TOLERANCE for v in table.values()), table
    layout = "mesh: replicate 1 x shard 2 (within a node) x tp 2 (within a node)"
    assert got["fsdp-tp"]["layout"] == layout


def test_fsdp_tp_follows_ddp_on_the_zoo(
    tmp_path_factory: pytest.TempPathFactory, ddp_on_four: dict[str, Any]
) -> None:
    """The models' own plans (``base_model_tp_plan``): Llama's, and Qwen3's, whose per-head
    norms are whole on every rank with their gradients summed. Each TP run exported
    (``--format hf``) loads in transformers with the trained model's logits."""
    from tests.unit.test_zoo import export_and_reload
    from tests.zoo import zoo_train

    root = tmp_path_factory.mktemp("tp")
    zoo = {arch: ddp_on_four["zoo"][arch] for arch in ("llama-tied", "qwen3")}
    runs = {arch: zoo_thirty(folder, TP) for arch, folder in zoo.items()}
    run_ranks(WORLD, root, zoo_train, runs, str(root))
    curves = torch.load(root / "train.pt", weights_only=True)
    ref = ddp_on_four["zoo_curves"]
    table = {run: worst(curves[run]["loss"], ref[run]["loss"]) for run in zoo}
    print(table)
    assert all(curves[run]["layout"].endswith("x tp 2 (within a node)") for run in zoo)
    assert all(v <= TOLERANCE for v in table.values()), table
    for run, cfg in runs.items():
        export_and_reload(run, cfg, root, curves[run]["logits"])


def test_hsdp_tp_follows_ddp_on_gpt(tmp_path: Path) -> None:
    """replicate 2 x shard 2 x tp 2 on eight ranks (four a node on a real cluster)."""
    tiny = {
        "task_args": {**GPT_SMALL["task_args"], "n_layer": 1, "d_model": 32},
        "scaling": {"num_workers": 8},
    }
    runs = {
        "ddp": gpt({"name": "ddp"}, **tiny),
        "hsdp-tp": gpt({"name": "fsdp", "dp_replicate": 2, "tp": 2}, **tiny),
    }
    run_ranks(8, tmp_path, train_runs, runs, str(tmp_path / "out.pt"))
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    layout = "mesh: replicate 2 (within a node) x shard 2 (within a node) x tp 2 (within a node)"
    assert got["hsdp-tp"]["layout"] == layout  # one host: every dimension within it
    diff = worst(got["hsdp-tp"]["loss"], got["ddp"]["loss"])
    print({"hsdp-tp": diff})
    assert diff <= TOLERANCE


@pytest.fixture(scope="module")
def saved_under_tp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """30 steps under shard 2 x tp 2, a checkpoint every 5: the run the resumes go on from."""
    root = tmp_path_factory.mktemp("tp-run")
    cfg = gpt(TP, checkpoint={"every_n_steps": 5})
    run_ranks(WORLD, root, train_keep_checkpoints, cfg, str(root / "full"))
    return root / "full"


@pytest.mark.parametrize(
    "resumed, world",
    [({"name": "fsdp"}, 2), ({"name": "ddp"}, 2), ({"name": "fsdp", "tp": 2}, WORLD)],
    ids=["tp2-to-tp1", "tp2-to-ddp", "tp2-to-tp2"],
)
def test_a_tp_checkpoint_resumes_under_another_mesh(
    saved_under_tp: Path, tmp_path: Path, resumed: dict, world: int
) -> None:
    """Saved under shard 2 x tp 2, resumed at step 15 without tensor parallel (on fewer
    ranks, accumulating what the others did) and with it: the uninterrupted curve goes on
    within 1e-6, from exactly the saved weights."""
    full = torch.load(saved_under_tp / "loss.pt", weights_only=True)
    ckpt = saved_under_tp / "checkpoint-step00000015"
    exported = consolidated_state_dict(ckpt)
    accum = {**GPT_SMALL["train"], "grad_accum": WORLD // world}
    again = gpt(resumed, checkpoint={"every_n_steps": 5}, train=accum)
    run_ranks(world, tmp_path, resume_and_record, again, str(ckpt), str(tmp_path / "r.pt"))
    got = torch.load(tmp_path / "r.pt", weights_only=True)
    assert sorted(got["loss"]) == list(range(16, 31))
    for step, loss in got["loss"].items():
        assert loss == pytest.approx(full[step], rel=1e-6), step
    assert got["params"].keys() == exported.keys()
    for key, value in exported.items():
        torch.testing.assert_close(got["params"][key], value, rtol=0, atol=0)


def test_a_model_without_a_plan_is_refused_before_its_first_step(tmp_path: Path) -> None:
    """The digits task's MLP has no plan: refused as a setting (exit 2 under the CLI),
    naming the model and what to do."""
    cfg = make_config(strategy={"name": "fsdp", "tp": 2}, train={"max_steps": 1}).to_dict()
    with pytest.raises(Exception, match=r"strategy.tp: \w+ has no tensor-parallel plan"):
        run_ranks(2, tmp_path, train_keep_checkpoints, cfg, str(tmp_path / "run"))
    assert not list((tmp_path / "run").glob("checkpoint-*"))
