"""The memory planner: accounting, the order of choices, the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from raylift.cli import main
from raylift.run.plan import (
    GIB,
    USABLE,
    activations_per_sample,
    count_params,
    make_plan,
    model_states,
    plan_strategy,
)
from raylift.validation import load_config

GPT = Path(__file__).resolve().parents[2] / "configs" / "gpt-tiny.yaml"


def test_zero_accounting_at_world_size_4() -> None:
    cfg = load_config(GPT, ["precision=32"])
    n = 1000
    assert model_states("ddp", n, cfg, 4) == (4000, 4000, 8000)
    # fp32 weights are ZeRO's master partition themselves (no second copy).
    assert model_states("zero1", n, cfg, 4) == (4000, 4000, 2000)
    assert model_states("zero2", n, cfg, 4) == (4000, 1000, 2000)
    assert model_states("zero3", n, cfg, 4) == (1000, 1000, 2000)
    assert model_states("fsdp", n, cfg, 4) == (1000, 1000, 2000)
    assert model_states("fairscale", n, cfg, 4) == (4000, 4000, 2000)
    assert model_states("zero3-offload", n, cfg, 4) == (0, 1000, 0)
    bf16 = load_config(GPT, ["precision=bf16-true", "optim.name=sgd", "optim.momentum=0"])
    assert model_states("ddp", n, bf16, 4) == (2000, 2000, 0)
    # bf16 weights: ZeRO keeps an fp32 master of the partition (4 bytes a param).
    assert model_states("zero1", n, bf16, 4) == (2000, 2000, 1000)


def test_adapters_hold_gradients_and_optimizer_state_for_what_trains_only() -> None:
    """1000 parameters of which 100 train (adapters): the frozen 900 are weights alone;
    under bf16-true the base is bf16 and the adapters fp32 (DeepSpeed: bf16 with its fp32
    master)."""
    cfg = load_config(GPT, ["precision=32", "model.adapter.type=lora"])
    assert model_states("ddp", 1000, cfg, 4, trainable=100) == (4000, 400, 800)
    assert model_states("fsdp", 1000, cfg, 4, trainable=100) == (1000, 100, 200)
    bf16 = load_config(GPT, ["precision=bf16-true", "model.adapter.type=lora"])
    assert model_states("fsdp", 1000, bf16, 4, trainable=100) == (2200 // 4, 100, 200)
    assert model_states("zero3", 1000, bf16, 4, trainable=100) == (500, 50, 200)
    plan = make_plan(load_config(GPT, ["model.adapter.type=lora"]), 2, 80)
    trainable, frozen = plan.frozen
    assert 0 < trainable < frozen == count_params(load_config(GPT))  # the base, whole
    ddp = next(r for r in plan.rows if r.label == "ddp")
    assert ddp.optimizer == 2 * 4 * trainable  # Adam's two moments, fp32, adapters only


def test_activation_checkpointing_saves_less() -> None:
    cfg = load_config(GPT)
    plain, ckpt = activations_per_sample(cfg, False), activations_per_sample(cfg, True)
    assert 0 < ckpt < plain / 2


def test_choice_moves_down_the_list_as_memory_shrinks() -> None:
    cfg = load_config(GPT, ["precision=32"])
    states = 16 * count_params(cfg)
    roomy = plan_strategy(cfg, 2, 64 * GIB)
    assert roomy.name == "ddp" and not roomy.activation_checkpointing
    tight = make_plan(cfg, 2, (states * 0.6) / USABLE / GIB)  # DDP's states alone do not fit
    assert tight.choice is not None and tight.choice.label != "ddp"
    assert tight.choice.states <= tight.budget
    with pytest.raises(ValueError, match="no strategy fits"):
        plan_strategy(cfg, 2, 1024)


def test_plan_command_prints_a_table_and_the_choice(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(GPT), "--gpus", "2", "--gpu-mem", "16", "data.batch_size=8"]) == 0
    out = capsys.readouterr().out
    for label in ("ddp", "zero1", "zero2", "fsdp", "zero3", "zero3-offload"):
        assert f"\n{label} " in out
    assert "choice (strategy: auto): {'name': 'ddp'}" in out
    assert main(["plan", str(GPT), "--gpus", "0", "--gpu-mem", "16"]) == 2
    capsys.readouterr()
    assert main(["plan", str(GPT), "--gpus", "4", "--nodes", "3", "--gpu-mem", "16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["raylift: --nodes 3 must divide --gpus 4; give a divisor of 4"], err


def test_the_plan_is_for_gpus_whatever_host_makes_it(capsys: pytest.CaptureFixture[str]) -> None:
    """``precision: auto`` is planned as an Ampere GPU resolves it (bf16-mixed), on a host
    whose CPU has bf16 and on one without: the same table as bf16-mixed named outright."""
    tables = []
    for precision in ("auto", "bf16-mixed"):
        args = ["plan", str(GPT), "--gpus", "2", "--gpu-mem", "16", f"precision={precision}"]
        assert main(args) == 0
        tables.append(capsys.readouterr().out)
    assert tables[0] == tables[1]


def test_tensor_parallel_over_each_node_divides_what_its_plan_splits() -> None:
    """fsdp-tp (tp = the workers per node, sharded over the nodes): of 1000 parameters,
    the 800 the plan splits are divided over all 8 ranks, the other 200 over the 2 nodes."""
    cfg = load_config(GPT, ["precision=32"])
    assert model_states("fsdp-tp", 1000, cfg, 8, nodes=2, tp_split=800) == (800, 800, 1600)
    plan = make_plan(cfg, 4, 16, nodes=2)
    row = next(r for r in plan.rows if r.label == "fsdp-tp")
    assert row.strategy == {"name": "fsdp", "dp_replicate": 1, "tp": 2} and not row.refused
    full = next(r for r in plan.rows if r.label == "fsdp-full")
    assert row.states < 2 * full.states and row.across < full.across
    # The digits MLP has no plan: the row is there, refused, saying why.
    digits = make_plan(load_config(GPT.parent / "quickstart.yaml"), 4, 16, nodes=2)
    (refused,) = [r.refused for r in digits.rows if r.label == "fsdp-tp"]
    assert refused and "has no tensor-parallel plan" in refused[0]
    assert all(r.label != "fsdp-tp" for r in make_plan(cfg, 4, 16, nodes=4).rows)  # 1 a node


def test_a_70b_llama_on_4_nodes_of_8_is_split_within_each_node(tmp_path: Path) -> None:
    """Llama 3 70B's shape at 4096 tokens, bf16-mixed, on 4 nodes of 8 x 80 GB: HSDP's
    states do not fit; tensor parallel over each node, sharded over the nodes, does (with
    activation checkpointing) and sends less across nodes than sharding over all 32."""
    shape = {
        "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
        "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
        "vocab_size": 128256, "max_position_embeddings": 4096, "tie_word_embeddings": False,
    }  # fmt: skip
    pytest.importorskip("transformers")
    config = tmp_path / "l70.yaml"
    config.write_text(
        yaml.safe_dump({
            "task": "hf-causal-lm", "task_args": {"model": shape, "block_size": 4096},
            "data": {"batch_size": 1}, "scaling": {"num_workers": 32, "use_gpu": True},
            "strategy": {"name": "auto"}, "precision": "bf16-mixed",
        })
    )  # fmt: skip
    plan = make_plan(load_config(config), 32, 80, nodes=4)
    rows = {r.label: r for r in plan.rows}
    assert rows["fsdp"].states > plan.budget  # HSDP: a node's 8 cannot hold the states
    assert plan.choice is rows["fsdp-tp"] and plan.checkpointing
    assert plan.choice.strategy == {"name": "fsdp", "dp_replicate": 1, "tp": 8}
    # Its gathers across nodes are of its slice, once for each of its group's 8 pieces.
    assert rows["fsdp-tp"].across < rows["fsdp-full"].across
