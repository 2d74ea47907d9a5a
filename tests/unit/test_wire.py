"""Bytes on the wire, read from the collectives the process groups ran (torch's Flight
Recorder): each collective's bytes on four gloo ranks placed as two nodes of two, and a
run's step under DDP, FSDP and HSDP against what raylift plan predicts for it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from raylift.run.wire import entries_since, measure, sent
from tests.helpers import GPT_SMALL, make_config, run_ranks, train_runs

NODES = ["a", "a", "b", "b"]


def test_ring_bytes_per_rank() -> None:
    assert sent("all_reduce", 4, 1000) == 1500
    assert sent("all_gather", 4, 250) == 750
    assert sent("reduce_scatter", 4, 1000) == 750
    assert sent("all_reduce", 1, 1000) == 0  # a group of one sends nothing


def collectives(rank: int, world: int, out: str) -> None:
    """An all-reduce on the world, an all-gather within each 'node', a reduce-scatter
    across them: measured on every rank."""
    within = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    across = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    started = time.time_ns()
    dist.all_reduce(torch.ones(1000))  # 4000 bytes on the world: 2 x 3/4 x 4000 = 6000
    gathered = torch.empty(2 * 500, dtype=torch.bfloat16)
    dist.all_gather_into_tensor(gathered, torch.ones(500, dtype=torch.bfloat16), group=within)
    part = torch.empty(256)
    dist.reduce_scatter_tensor(part, torch.ones(512), group=across)
    got = measure(entries_since(started, time.time_ns()), NODES)
    torch.save({"within": got.within, "across": got.across}, f"{out}.{rank}")


def test_each_collective_counted_where_its_group_is(tmp_path: Path) -> None:
    run_ranks(4, tmp_path, collectives, str(tmp_path / "wire"))
    for rank in range(4):
        got = torch.load(tmp_path / f"wire.{rank}", weights_only=True)
        # bf16: 1000 gathered elements are 2000 bytes, half from the other rank.
        assert got["within"] == {"all_gather": 1000.0}, got
        # gloo runs a reduce-scatter as an all-reduce of the whole input: 2 x 1/2 x 2048.
        assert got["across"] == {"all_reduce": 6000.0 + 2048.0}, got


@pytest.mark.slow
def test_a_step_is_measured_once_and_matches_the_plan(tmp_path: Path) -> None:
    """Each run logs one step's bytes; DDP's all-reduce of the gradients, FSDP's and
    HSDP's gathers and reductions, and tensor parallel's activations beside FSDP's gathers
    of the slices are those the plan predicts for the model."""
    from raylift.run.plan import predicted_wire

    short = {**GPT_SMALL, "precision": "32", "train": {**GPT_SMALL["train"], "max_steps": 3}}
    runs = {
        name: make_config(**short, strategy=strategy).to_dict()
        for name, strategy in {
            "ddp": {"name": "ddp"},
            "fsdp": {"name": "fsdp"},
            "hsdp": {"name": "fsdp", "dp_replicate": 2},
            "tp": {"name": "fsdp", "tp": 2},
        }.items()
    }
    run_ranks(4, tmp_path, train_runs, runs, str(tmp_path / "out.pt"))
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    for name, raw in runs.items():
        wire = got[name]["wire"]
        assert list(wire) == [2], (name, wire)  # the second step of the start, once
        measured = wire[2]["wire/within_node_bytes_per_step"]  # one host: all within
        assert wire[2]["wire/across_nodes_bytes_per_step"] == 0
        # HSDP's mesh as two nodes would give it: its two kinds of traffic, here all within.
        label, nodes = {
            "ddp": ("ddp", 1),
            "fsdp": ("fsdp-full", 1),
            "hsdp": ("fsdp", 2),
            "tp": ("fsdp-tp", 2),  # tp 2 within each of 2 nodes, sharded over them
        }[name]
        predicted = sum(predicted_wire(make_config(**raw), label, gpus=4, nodes=nodes))
        print(f"{name}: measured {measured:,.0f} bytes a step, the plan {predicted:,.0f}")
        assert measured == pytest.approx(predicted, rel=0.01), (name, wire[2], predicted)
