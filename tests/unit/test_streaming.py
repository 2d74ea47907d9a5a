"""Streaming safetensors writes every dtype at every shape, 0-dim tensors included (a
BatchNorm's ``num_batches_tracked``), as safetensors itself reads them back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from raylift.tensors.streaming import (
    CODES,
    Spec,
    recorded_ties,
    write_hf_shards,
    write_safetensors,
)

SHAPES = [(), (0,), (1,), (3, 257, 129)]


def sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Values that use the dtype's range: not all zeros, so a wrong layout shows."""
    gen = torch.Generator().manual_seed(len(shape) * 31 + 7)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 3).to(dtype)
    return torch.randint(0, 120, shape, generator=gen).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)  # NaN-safe and exact, at any shape


def cases() -> list[tuple[str, torch.Tensor]]:
    return [
        (
            f"{str(dtype).split('.')[1]}.{'x'.join(map(str, shape)) or 'scalar'}",
            sample(dtype, shape),
        )
        for dtype in CODES
        for shape in SHAPES
    ]


@pytest.mark.parametrize("sharded", [False, True])
def test_every_dtype_and_shape_reads_back_as_written(tmp_path: Path, sharded: bool) -> None:
    named = cases()
    specs = [Spec(name, list(t.shape), t.dtype, name) for name, t in named]
    stream = iter((spec, t) for spec, (_, t) in zip(specs, named, strict=True))
    if sharded:  # several files and their index, as an export above --max-shard-size writes
        assert write_hf_shards(tmp_path, specs, stream, max_bytes=64 << 10) > 2
        files = sorted(tmp_path.glob("model-*.safetensors"))
    else:
        write_safetensors(tmp_path / "model.safetensors", specs, stream)
        files = [tmp_path / "model.safetensors"]
    read: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            read.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (not a dict)
    assert sorted(read) == sorted(name for name, _ in named)
    for name, want in named:
        got = read[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(bits(got), bits(want)), name


def test_the_bytes_are_safetensors_own(tmp_path: Path) -> None:
    """Byte for byte what safetensors' own writer puts after the header."""
    named = cases()
    ours = tmp_path / "ours.safetensors"
    specs = [Spec(name, list(t.shape), t.dtype, name) for name, t in named]
    write_safetensors(ours, specs, iter(zip(specs, (t for _, t in named), strict=True)))
    theirs = tmp_path / "theirs.safetensors"
    save_file(dict(named), str(theirs))
    with safe_open(str(ours), framework="pt") as a, safe_open(str(theirs), framework="pt") as b:
        for name, _ in named:
            assert torch.equal(bits(a.get_tensor(name)), bits(b.get_tensor(name))), name


def test_only_recorded_ties_of_two_alike_saved_tensors_are_aliases() -> None:
    """A DCP checkpoint's record of its tied names is data: an entry naming a tensor not
    saved, one of another shape or dtype, a chain, or anything not a name is left out
    (that tensor written on its own); an older checkpoint without the record has none."""
    f32 = torch.float32
    specs = [Spec(name, shape, dtype, f"model.{name}") for name, shape, dtype in [
        ("embed.weight", [8, 4], f32), ("head.weight", [8, 4], f32),
        ("other.weight", [4, 8], f32), ("ids", [8, 4], torch.int64), ("third", [8, 4], f32),
    ]]  # fmt: skip
    record = {
        "head.weight": "embed.weight",  # kept
        "other.weight": "embed.weight",  # another shape
        "ids": "embed.weight",  # another dtype
        "missing": "embed.weight",  # not saved
        "third": "head.weight",  # a chain: head.weight is not written
        "embed.weight": "embed.weight",
        7: "embed.weight",
    }
    assert recorded_ties({"engine_extra": {"tied": record}}, specs) == {
        "head.weight": "embed.weight"
    }
    for loop in ({}, {"engine_extra": None}, {"engine_extra": {"tied": ["head.weight"]}},
                 {"engine_extra": {"tied": {"head.weight": ["embed.weight"]}}}):  # fmt: skip
        assert recorded_ties(loop, specs) == {}, loop
