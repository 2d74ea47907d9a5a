"""Models users bring, under every strategy: a Hugging Face Llama built from a config and a
model of the user's own modules (an RMSNorm and a learned scale without
``reset_parameters``), each with tied embeddings. Every strategy starts from DDP's exact
initial weights and follows DDP's fp32 loss curve within 1e-5 for 30 steps."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from raylift.core.parsing import merge
from raylift.tensors.init import kept_by_name, params_on_meta
from tests.helpers import SHIPPED_TRAINING, make_config, run_ranks, train_runs
from tests.unit.test_init import initial_params
from tests.user_models import LlamaLM, NormLM

# ZeRO-3 really partitions every parameter (by default it keeps those under 1e5 elements
# whole, which is all of these small models').
ZERO3 = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
STRATEGIES = {
    "ddp": {"name": "ddp"},
    "fsdp": {"name": "fsdp"},
    "fairscale": {"name": "fairscale"},
    "zero1": {"name": "deepspeed", "zero_stage": 1},
    "zero2": {"name": "deepspeed", "zero_stage": 2},
    "zero3": {"name": "deepspeed", "zero_stage": 3, "config": ZERO3},
}
TASKS = {"llama": "tests.user_models:LlamaLM", "norm": "tests.user_models:NormLM"}


def user_config(task: str, strategy: dict) -> dict:
    raw = merge(SHIPPED_TRAINING, {"task": TASKS[task], "strategy": strategy, "precision": "32"})
    return make_config(**raw).to_dict()


@pytest.fixture(scope="module", params=list(TASKS))
def user_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """Each strategy's initial weights and 30-step curve for one user model, on 2 ranks."""
    task = request.param
    tmp = tmp_path_factory.mktemp(task)
    runs = {name: user_config(task, s) for name, s in STRATEGIES.items()}
    starts = {name: runs[name] for name in ("ddp", "fsdp", "zero3")}
    run_ranks(2, tmp, initial_params, starts, str(tmp / "init.pt"))
    run_ranks(2, tmp, train_runs, runs, str(tmp / "curves.pt"))
    return (
        task,
        torch.load(tmp / "init.pt", weights_only=True),
        torch.load(tmp / "curves.pt", weights_only=True),
    )


@pytest.mark.slow
def test_sharded_builds_start_from_ddps_exact_weights(user_runs: tuple) -> None:
    _, found, _ = user_runs
    ref = found["ddp"]["params"]
    for name in ("fsdp", "zero3"):
        assert found[name]["meta_or_partitioned"], name
        assert found[name]["params"].keys() == ref.keys()
        for k, v in ref.items():
            torch.testing.assert_close(found[name]["params"][k], v, rtol=0, atol=0, msg=k)


def test_every_strategy_follows_ddps_fp32_curve(user_runs: tuple) -> None:
    task, _, results = user_runs
    ref = results["ddp"]["loss"]
    assert sorted(ref) == list(range(1, 31))
    assert ref[30] < 0.8 * ref[1]  # it learned: the comparison is not of two flat lines
    for name in STRATEGIES:
        got = results[name]["loss"]
        worst = max(abs(got[s] - ref[s]) / ref[s] for s in ref)
        print(f"{task} {name}: max relative loss difference vs DDP over 30 steps {worst:.2e}")
        assert worst < 1e-5, (name, worst)


def test_the_models_own_initialisation_is_used() -> None:
    """Llama: its _init_weights (N(0, 0.02) linears, ones for RMSNorm); NormLM: the
    constructor's values where no reset_parameters() exists (gain 1, the drawn scale)."""
    from raylift.tensors.init import initialize, write_in_place

    llama = LlamaLM()
    with params_on_meta() as kept:
        model = llama.build_model()
    names = kept_by_name(model, kept)
    # Only the gains of modules without reset_parameters are held: 5 RMSNorms of 64.
    assert sorted(names) == sorted(n for n, _ in model.named_parameters() if "norm" in n)
    assert sum(t.numel() for t in names.values()) == 5 * 64
    torch.manual_seed(0)
    eager = llama.build_model()
    report = initialize(eager, llama, 0, write_in_place, sharded=False)
    assert report.custom_name == "the model's _init_weights"
    proj = eager.model.layers[0].self_attn.q_proj.weight.detach()
    assert abs(float(proj.std()) - 0.02) < 3e-3
    assert torch.equal(eager.model.norm.weight, torch.ones(64))

    norm = NormLM()
    torch.manual_seed(0)
    built = norm.build_model()
    drawn = built.layers[0].scale.detach().clone()
    report = initialize(built, norm, 0, write_in_place, sharded=False)
    assert report.custom_name == ""
    assert torch.equal(built.layers[0].scale.detach(), drawn)  # not redrawn
    assert report.constructor == 2 * 2 + 1 + 1  # per layer: gain, scale; final gain; pos
    # The run's first line says so (it was checked under Ray until NormLM's run there went).
    assert "6 keep their constructor's values" in report.describe("on each rank"), report
