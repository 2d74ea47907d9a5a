"""Which implementation of the optimizer's update runs: fused on CUDA, torch's default
elsewhere."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from raylift.core.config import OptimConfig
from raylift.tensors.optim import build_optimizer, describe, implementation


def fake(device: str, dtype: torch.dtype = torch.float32) -> SimpleNamespace:
    """What the choice reads of a parameter: where it lives and its dtype."""
    return SimpleNamespace(device=torch.device(device), dtype=dtype)


def test_adam_is_fused_on_cuda_and_sgd_foreach() -> None:
    on_gpu = [fake("cuda"), fake("cuda", torch.bfloat16)]
    assert implementation("adamw", on_gpu) == {"fused": True}
    assert implementation("adam", on_gpu) == {"fused": True}
    assert implementation("sgd", on_gpu) == {"foreach": True}
    assert implementation("adamw", [fake("cuda", torch.int8)]) == {"foreach": True}


def test_tensors_off_the_gpu_keep_torchs_default() -> None:
    assert implementation("adamw", [fake("cpu")]) == {}
    assert implementation("adamw", [fake("cuda"), fake("cpu")]) == {}  # offloaded master
    assert implementation("adamw", []) == {}
    model = torch.nn.Linear(4, 2)
    opt = build_optimizer(model, OptimConfig(name="adamw"))
    assert describe(opt) == "AdamW (torch default)"


@pytest.mark.gpu
@pytest.mark.parametrize("name, how", [("adamw", "fused"), ("adam", "fused"), ("sgd", "foreach")])
def test_the_optimizer_is_fused_on_cuda(name: str, how: str) -> None:
    model = torch.nn.Linear(64, 64).cuda()
    opt = build_optimizer(model, OptimConfig(name=name))
    assert opt.defaults[how] is True and describe(opt).endswith(f"({how})")
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    opt.step()  # the fused kernel runs
