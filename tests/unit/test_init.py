"""Initial weights without the whole model on a rank: meta/zero.Init creation, then one
seeded pass that every strategy runs, so sharded and eager builds start identical."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from raylift.core.parsing import merge
from raylift.tasks import build_task
from raylift.tensors.init import (
    InitError,
    initialize,
    kept_by_name,
    materialize,
    params_on_meta,
    write_in_place,
)
from tests.helpers import GPT_SMALL, LocalReporter, config_from_dict, make_config, run_ranks

ZERO3 = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
STRATEGIES = {
    "ddp": {"name": "ddp"},
    "fsdp": {"name": "fsdp"},
    "zero3": {"name": "deepspeed", "zero_stage": 3, "config": ZERO3},
}


def eager(task: Any, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = task.build_model()
    initialize(model, task, seed, write_in_place, sharded=False)
    return model


def test_meta_build_then_pass_equals_the_eager_build() -> None:
    """One rank's view of the sharded path: no storage at creation, the pass gives it values."""
    task = build_task("gpt", GPT_SMALL["task_args"])
    with params_on_meta():
        shell = task.build_model()
    assert all(p.is_meta for p in shell.parameters())
    assert shell.head.weight is shell.tok.weight  # ties survive
    materialize(shell, torch.device("cpu"))
    initialize(shell, task, 0, write_in_place, sharded=True)
    ref = eager(task).state_dict()
    got = shell.state_dict()
    assert ref.keys() == got.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=0, msg=k)
    assert shell.head.weight is shell.tok.weight


def test_the_pass_keeps_the_tasks_own_init() -> None:
    """gpt's init_weights draws N(0, 0.02), as its constructor does; LayerNorm gets 1 and 0."""
    task = build_task("gpt", GPT_SMALL["task_args"])
    model = eager(task)
    assert abs(float(model.blocks[0].qkv.weight.detach().std()) - 0.02) < 2e-3
    assert torch.equal(model.blocks[0].qkv.bias, torch.zeros_like(model.blocks[0].qkv.bias))
    assert torch.equal(model.ln_f.weight, torch.ones_like(model.ln_f.weight))


class _Bare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))  # no reset_parameters sets it
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale @ self.mask


class _HalfReset(nn.Module):
    """A reset_parameters() that leaves one of its module's parameters alone."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4))
        self.gain = nn.Parameter(torch.ones(4))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)


def test_buffers_and_constructor_values_survive_the_meta_build() -> None:
    with params_on_meta() as kept:
        model = _Bare()
    assert not model.mask.is_meta and model.scale.is_meta
    named = kept_by_name(model, kept)
    assert list(named) == ["scale"]  # lin resets itself: its values are not held
    materialize(model, torch.device("cpu"))
    assert torch.equal(model.mask, torch.tril(torch.ones(4, 4)))
    report = initialize(model, None, 0, write_in_place, sharded=True, kept=named)
    assert torch.equal(model.scale.detach(), torch.ones(4))
    assert (report.reset, report.constructor, report.held_bytes) == (2, 1, 16)

    class Fixes:
        def init_weights(self, module: nn.Module) -> None:
            if isinstance(module, _Bare):
                nn.init.constant_(module.scale, 2.0)

    report = initialize(model, Fixes(), 0, write_in_place, sharded=True, kept=named)
    assert torch.equal(model.scale.detach(), torch.full((4,), 2.0))
    assert (report.custom, report.custom_name) == (1, "the task's init_weights")


def test_a_parameter_no_pass_sets_and_nothing_kept_is_named() -> None:
    with params_on_meta() as kept:
        model = _HalfReset()
    assert not kept  # it resets itself: nothing held
    materialize(model, torch.device("cpu"))
    with pytest.raises(InitError, match=r"\['gain'\].*reset_parameters\(\).*init_weights"):
        initialize(model, None, 0, write_in_place, sharded=True)
    eager = _HalfReset()  # built whole, the constructor's gain simply stays
    assert initialize(eager, None, 0, write_in_place, sharded=False).constructor == 1


def test_params_on_meta_leaves_torch_as_it_was() -> None:
    before = nn.Linear.__init__
    with params_on_meta():

        class Defined(nn.Module):  # a class defined while building is converted too
            def __init__(self) -> None:
                super().__init__()
                self.w = nn.Parameter(torch.ones(2))

        assert Defined().w.is_meta
    assert nn.Linear.__init__ is before and "__init_subclass__" not in nn.Module.__dict__
    assert not Defined().w.is_meta and not nn.Linear(2, 2).weight.is_meta


# ---------------------------------------------------------------- on 2 ranks


def whole_params(engine: Any) -> dict[str, torch.Tensor]:
    """The full parameters of any engine (collective for FSDP2 and ZeRO-3)."""
    from raylift.strategies.deepspeed import DeepSpeedEngine
    from tests.helpers import full_params

    if not isinstance(engine, DeepSpeedEngine):
        return full_params(engine.model)
    import deepspeed

    module = engine.ds.module
    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        return {k: v.detach().float().clone() for k, v in module.state_dict().items()}


def initial_params(rank: int, world: int, runs: dict[str, dict], out: str) -> None:
    from tests.helpers import make_trainer

    found: dict[str, Any] = {}
    for name, cfg_dict in runs.items():
        cfg = config_from_dict(cfg_dict)
        trainer = make_trainer(cfg, rank, world, LocalReporter(Path(out).parent / name))
        model = getattr(trainer.engine, "ds", trainer.engine.model)
        found[name] = {
            "params": whole_params(trainer.engine),
            "meta_or_partitioned": trainer.sharded_init,
            "local": sum(p.numel() for p in _local_tensors(model)),
        }
    if rank == 0:
        torch.save(found, out)


def _local_tensors(model: nn.Module) -> list[torch.Tensor]:
    """What this rank stores of each parameter: its DTensor shard, ZeRO-3 partition or all."""
    out = []
    for p in model.parameters():
        if hasattr(p, "ds_tensor"):
            out.append(p.ds_tensor)
        elif hasattr(p, "to_local"):
            out.append(p.to_local())
        else:
            out.append(p)
    return out


def test_sharded_strategies_start_from_the_eager_weights(tmp_path: Path) -> None:
    runs = {
        name: make_config(**merge(GPT_SMALL, {"strategy": s})).to_dict()
        for name, s in STRATEGIES.items()
    }
    run_ranks(2, tmp_path, initial_params, runs, str(tmp_path / "init.pt"))
    found = torch.load(tmp_path / "init.pt", weights_only=True)
    ref = found["ddp"]["params"]
    total = sum(v.numel() for k, v in ref.items() if k != "head.weight")  # tied to tok
    assert not found["ddp"]["meta_or_partitioned"]
    for name in ("fsdp", "zero3"):
        assert found[name]["meta_or_partitioned"], name
        got = found[name]["params"]
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=0, atol=0, msg=f"{name} {k}")
        # each rank stores about half: its shards, never the whole model
        assert found[name]["local"] <= 0.55 * total, (name, found[name]["local"], total)
    assert found["ddp"]["local"] == total


class _Encoder(nn.Module):
    """torch's encoder deep-copies its layer (whose attention has no reset_parameters), a
    scale drawn by the constructor, a tied head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
        self.layers = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(16))
        self.head = nn.Linear(16, 64, bias=False)
        self.head.weight = self.emb.weight


def test_constructor_values_of_cloned_and_random_parameters_match_the_eager_build() -> None:
    torch.manual_seed(0)
    eager_model = _Encoder()
    initialize(eager_model, None, 0, write_in_place, sharded=False)
    torch.manual_seed(0)
    with params_on_meta() as kept:
        shell = _Encoder()
    named = kept_by_name(shell, kept)
    assert "layers.layers.1.self_attn.in_proj_weight" in named  # a clone's, kept too
    materialize(shell, torch.device("cpu"))
    initialize(shell, None, 0, write_in_place, sharded=True, kept=named)
    ref = eager_model.state_dict()
    for k, v in shell.state_dict().items():
        torch.testing.assert_close(v, ref[k], rtol=0, atol=0, msg=k)
    assert shell.head.weight is shell.emb.weight
