"""FSDP's mesh from where Ray put the workers: the layouts ``auto`` picks, the orders that
keep a node's ranks together, and the refusals, each naming the numbers and the fix."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from raylift.core.config import ConfigError
from raylift.strategies.mesh import MeshError, by_node, resolve
from raylift.validation import load_config

REPO = Path(__file__).resolve().parents[2]
MESH_1_2_1 = ["strategy.dp_replicate=1", "strategy.dp_shard=2", "strategy.tp=1"]


def strategy(rep: int | str = "auto", shard: int | str = "auto", tp: int | str = "auto") -> object:
    return SimpleNamespace(dp_replicate=rep, dp_shard=shard, tp=tp)


def test_one_node_shards_over_all() -> None:
    mesh = resolve(strategy(), ["a"] * 4)
    assert (mesh.replicate, mesh.shard, mesh.tp) == (1, 4, 1)
    assert mesh.line() == "mesh: replicate 1 x shard 4 (within a node) x tp 1"


def test_two_nodes_shard_within_and_replicate_across() -> None:
    mesh = resolve(strategy(), ["a", "a", "b", "b"])
    assert (mesh.replicate, mesh.shard, mesh.tp) == (2, 2, 1)
    assert mesh.groups("shard") == [[0, 1], [2, 3]]
    assert mesh.groups("replicate") == [[0, 2], [1, 3]]
    assert mesh.line() == "mesh: replicate 2 (nodes) x shard 2 (workers per node) x tp 1"


def test_ranks_interleaved_by_ray_are_grouped_by_node() -> None:
    """Ray numbers ranks by IP; fake nodes on one host share one, so a node's ranks may
    not be neighbours. The shard groups are still each one node's workers."""
    nodes = ["a", "b", "a", "b"]
    assert by_node(nodes) == (0, 2, 1, 3)
    mesh = resolve(strategy(), nodes)
    assert mesh.groups("shard") == [[0, 2], [1, 3]]
    assert not mesh.crosses_nodes("shard") and mesh.crosses_nodes("replicate")


def test_tensor_parallel_within_each_node() -> None:
    mesh = resolve(strategy(tp=2), ["a"] * 4 + ["b"] * 4)
    assert (mesh.replicate, mesh.shard, mesh.tp) == (2, 2, 2)
    assert mesh.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.line() == (
        "mesh: replicate 2 (nodes) x shard 2 (workers per node) x tp 2 (within a node)"
    )


def test_each_nodes_ranks_hold_a_whole_copy_only_where_hsdp_replicates_by_node() -> None:
    """The copies a memory snapshot keeps one per node: each replica's ranks, where each
    replica is one node's ranks and no node holds two."""
    assert resolve(strategy(), ["a", "a", "b", "b"]).replicas() == ((0, 1), (2, 3))
    assert resolve(strategy(), ["a", "b", "a", "b"]).replicas() == ((0, 2), (1, 3))
    assert resolve(strategy(tp=2), ["a"] * 4 + ["b"] * 4).replicas() == (
        (0, 1, 2, 3), (4, 5, 6, 7),
    )  # fmt: skip
    assert resolve(strategy(), ["a"] * 4).replicas() == ()  # full sharding: no copy
    assert resolve(strategy(rep=2), ["a"] * 4).replicas() == ()  # both copies on one node
    # Four copies (no sharding) on two nodes: two a node, the peer copy's case.
    assert resolve(strategy(rep=4, shard=1), ["a", "a", "b", "b"]).replicas() == ()


def test_uneven_placement_falls_back_to_full_sharding_and_says_why() -> None:
    mesh = resolve(strategy(), ["a", "a", "a", "b"])
    assert (mesh.replicate, mesh.shard) == (1, 4)
    assert "unevenly (3 on node 1, 1 on node 2)" in mesh.line()
    assert "sharded over all of them instead" in mesh.line()


def test_explicit_numbers() -> None:
    mesh = resolve(strategy(rep=2), ["a"] * 4)  # replicas on one node: the user's choice
    assert (mesh.replicate, mesh.shard) == (2, 2)
    assert mesh.line() == "mesh: replicate 2 (within a node) x shard 2 (within a node) x tp 1"
    assert resolve(strategy(shard=4), ["a"] * 2 + ["b"] * 2).crosses_nodes("shard")


@pytest.mark.parametrize(
    "asked, nodes, message",
    [
        (strategy(rep=3), ["a"] * 4, r"dp_replicate: 3 \(x tp 1\) does not divide the 4 workers"),
        (strategy(2, 3), ["a"] * 4, r"2 x 3 x 1 = 6, but the run has 4 workers"),
        (strategy(tp=3), ["a"] * 4, r"strategy.tp: 3 does not divide the 4 workers"),
        (strategy(tp=4), ["a"] * 2 + ["b"] * 2, r"tp: 4 does not divide the 2 workers on each"),
        (strategy(shard=1, tp=2), ["a", "a", "a", "b", "b", "b"], r"would span nodes"),
    ],
)
def test_meshes_that_do_not_fit_are_refused(asked: object, nodes: list, message: str) -> None:
    with pytest.raises(MeshError, match=message):
        resolve(asked, nodes)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["strategy.dp_shard=3"], r"dp_shard 3 = 3 does not divide scaling.num_workers \(2\)"),
        (["strategy.tp=0"], r"strategy.tp: an integer >= 1 or auto, got 0"),
        (
            ["scaling.num_workers=[2,4]", "strategy.dp_shard=2", "train.grad_accum=6"],
            r"dp_shard 2 = 2 does not divide scaling.num_workers \(3\); make every",
        ),
        (["strategy.dp_replicate=1", "strategy.dp_shard=1", "strategy.tp=1"], r"= 1, but"),
        (
            ["scaling.num_workers=[2,4]", *MESH_1_2_1],
            r"elastic run's mesh is rebuilt",
        ),
    ],
)
def test_config_refuses_a_mesh_that_cannot_fit(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(REPO / "configs" / "quickstart.yaml", ["strategy.name=fsdp", *overrides])


def test_mesh_keys_belong_to_fsdp() -> None:
    with pytest.raises(ConfigError, match=r"strategy\.dp_replicate: applies to fsdp"):
        load_config(REPO / "configs" / "quickstart.yaml", ["strategy.dp_replicate=2"])


def test_tensor_parallel_with_an_adapter_is_refused_before_training() -> None:
    with pytest.raises(ConfigError, match=r"strategy.tp: tensor parallelism splits .* LoRA"):
        load_config(
            REPO / "configs" / "gpt-tiny.yaml",
            ["strategy.name=fsdp", "strategy.tp=2", "model.adapter.type=lora"],
        )


def test_plans_name_the_modules_of_their_model() -> None:
    """gpt's own plan, and a Hugging Face model's (its base model's plan, under
    ``model.``), each matched against the model; what raylift cannot apply is refused."""
    transformers = pytest.importorskip("transformers")
    from raylift.strategies.tensor_parallel import check_heads, expand, plan_of, style
    from raylift.tasks import build_task
    from tests.zoo import COMMON, ZOO

    gpt = build_task("gpt", {"n_layer": 2, "n_head": 4, "d_model": 32, "block_size": 16})
    split = expand(plan_of(gpt, model := gpt.build_model()) or {}, model)
    assert split["blocks.1.mlp.0"] == "colwise" and split["blocks.0.qkv"] == "colwise_rep"
    assert len(split) == 8

    def hf(name: str) -> torch.nn.Module:
        config = transformers.AutoConfig.for_model(**ZOO[name])
        return transformers.AutoModelForCausalLM.from_config(config)

    qwen3 = hf("qwen3")
    split = expand(plan_of(object(), qwen3) or {}, qwen3)
    assert split["model.layers.0.self_attn.q_norm"] == "replicated_with_grad_allreduce"
    assert split["model.layers.1.mlp.down_proj"] == "rowwise" and len(split) == 18
    check_heads(qwen3, 2)  # 4 heads over 2 key/value heads: both split in two
    with pytest.raises(ConfigError, match=r"3 does not divide the model's 4 num_attention"):
        check_heads(qwen3, 3)
    mixtral = plan_of(object(), hf("mixtral")) or {}
    with pytest.raises(
        ConfigError,
        match=r"splits model.layers.\*.mlp.experts.gate_up_proj "
        r"as 'packed_colwise', which raylift does not apply",
    ):
        [style(how, name) for name, how in mixtral.items()]
    with pytest.raises(ConfigError, match=r"names model.layers.\*.q_proj, which the model"):
        expand({"model.layers.*.q_proj": "colwise"}, qwen3)
    assert plan_of(object(), torch.nn.Linear(2, 2)) is None
    assert COMMON["num_key_value_heads"] == 2
