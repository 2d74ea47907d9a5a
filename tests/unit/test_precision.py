"""``precision: auto``: what it picks for each kind of device, and why."""

from __future__ import annotations

import pytest
import torch

from raylift.tensors.precision import ACCEPTED, PRECISIONS, DeviceFacts, choose, resolve_precision

CPU = "AMD EPYC 7B13"


@pytest.mark.parametrize(
    "device, picked",
    [
        (DeviceFacts("cuda", "NVIDIA H100", (9, 0)), "bf16-mixed"),
        (DeviceFacts("cuda", "NVIDIA A100", (8, 0)), "bf16-mixed"),
        (DeviceFacts("cuda", "Tesla T4", (7, 5)), "16-mixed"),  # no bf16 tensor cores
        (DeviceFacts("cpu", CPU, cpu_flags=frozenset({"avx2", "avx512f"})), "32"),
        (
            DeviceFacts("cpu", "Xeon 8480", cpu_flags=frozenset({"amx_bf16", "avx512f"})),
            "bf16-mixed",
        ),
        (DeviceFacts("cpu", "Xeon 8380", cpu_flags=frozenset({"avx512_bf16"})), "bf16-mixed"),
    ],
)
def test_auto_picks_what_the_device_computes_fast(device: DeviceFacts, picked: str) -> None:
    name, why = choose(device)
    assert name == picked
    assert device.name in why  # the reason names the device it was chosen for
    assert resolve_precision("auto", device) is PRECISIONS[picked]


def test_a_cpu_without_native_bf16_is_told_why_it_gets_fp32() -> None:
    _, why = choose(DeviceFacts("cpu", CPU))
    assert "no native bf16" in why and "amx_bf16" in why


def test_this_host_is_described_and_auto_resolves_here() -> None:
    here = DeviceFacts.here(use_gpu=False)
    assert here.kind == "cpu" and here.name
    assert resolve_precision("auto").name in PRECISIONS


def test_named_precisions_carry_their_dtypes_and_unknown_names_are_refused() -> None:
    assert resolve_precision("bf16-mixed").compute_dtype == torch.bfloat16
    assert resolve_precision("bf16-true").param_dtype == torch.bfloat16
    assert resolve_precision("16-mixed").use_scaler
    assert ACCEPTED[0] == "auto"
    with pytest.raises(ValueError, match="choose one of"):
        resolve_precision("fp8")


def test_fp32_allows_tf32_on_cuda_and_32_true_keeps_it_exact() -> None:
    assert PRECISIONS["32"].tf32 and not PRECISIONS["32-true"].tf32
    assert "32-true" in ACCEPTED and PRECISIONS["32-true"].compute_dtype == torch.float32
    before = torch.backends.cuda.matmul.allow_tf32
    PRECISIONS["32"].configure_matmul(torch.device("cpu"))  # a CPU's fp32 is always exact
    assert torch.backends.cuda.matmul.allow_tf32 == before


@pytest.mark.gpu
def test_tf32_follows_the_precision_on_cuda() -> None:
    from raylift.tensors.metrics import math_key

    try:
        PRECISIONS["32"].configure_matmul(torch.device("cuda"))
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert math_key(torch.float32) == "tf32"  # MFU against the TF32 peak
        PRECISIONS["32-true"].configure_matmul(torch.device("cuda"))
        assert not torch.backends.cuda.matmul.allow_tf32
        assert math_key(torch.float32) == "fp32"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
