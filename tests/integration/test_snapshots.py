"""Memory snapshots on the session's Ray: every strategy, and adapters, restored from the
run's keepers (real actors, the parts moved by Ray's object store) onto the curve of an
uninterrupted run, at 2 -> 2 and 2 -> 1 workers; a run whose node cannot hold its
snapshots is refused before its first step."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from raylift.core.parsing import merge
from raylift.run.snapshots import KeeperSet, Snapshots
from raylift.run.worker import from_memory
from raylift.validation import config_from_dict
from tests.helpers import (
    GPT_SMALL,
    HANG_S,
    ListTracker,
    LocalReporter,
    full_params,
    make_config,
    make_trainer,
    run_ranks,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "raylift-test-snapshots"
ZERO3 = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
STRATEGIES = {
    "ddp": {"strategy": {"name": "ddp"}},
    "fsdp": {"strategy": {"name": "fsdp"}},
    "fairscale": {"strategy": {"name": "fairscale"}},
    "zero1": {"strategy": {"name": "deepspeed", "zero_stage": 1}},
    "zero2": {"strategy": {"name": "deepspeed", "zero_stage": 2}},
    "zero3": {"strategy": {"name": "deepspeed", "zero_stage": 3, "config": ZERO3}},
    "zero2-offload": {
        "strategy": {"name": "deepspeed", "zero_stage": 2, "offload_optimizer": True}
    },
    "lora-fsdp": {"strategy": {"name": "fsdp"}, "model": {"adapter": {"type": "lora", "r": 4}}},
}
# No storage checkpoint but the run's last: what a restart restores is memory's. Past
# the warm-up, a snapshot at RESUME_AT and one after it that the restart abandons.
STEPS, RESUME_AT = 20, 10
MEMORY = {
    "checkpoint": {"every_n_steps": None, "memory": {"every_n_steps": 5, "keep": 10}},
    "train": {"max_steps": STEPS},
}


def connect(address: str) -> None:
    import ray

    if not ray.is_initialized():  # a rank of the session's pool, joined to its Ray once
        ray.init(address=address, namespace=NAMESPACE, logging_level="ERROR", log_to_driver=False)


def snapshots(name: str, rank: int, world: int) -> Snapshots:
    import ray

    return Snapshots(ray.get_actor(f"keepers-{name}"), rank, world)


def train_into_memory(rank: int, world: int, runs: dict, address: str, out: str) -> None:
    """Each run to its end, a snapshot every 5 steps with its keepers."""
    connect(address)
    curves = {}
    for name, raw in runs.items():
        tracker = ListTracker()
        trainer = make_trainer(config_from_dict(raw), rank, world,
                               LocalReporter(Path(out).parent / f"{name}-{rank}"), tracker,
                               keepers=snapshots(name, rank, world))  # fmt: skip
        trainer.run()
        curves[name] = tracker.series("train_loss")
    if rank == 0:
        torch.save(curves, out)


def resume_from_memory(rank: int, world: int, runs: dict, address: str, out: str) -> None:
    """Each run from its snapshot at RESUME_AT (the keepers told that the steps after it
    were abandoned, as after a restart there), at this world size, to its end."""
    connect(address)
    got = {}
    for name, raw in runs.items():
        keepers = snapshots(name, rank, world)
        keepers.forget_after(RESUME_AT)
        if world > 1:
            dist.barrier()
        lines: list[str] = []
        tracker = ListTracker()
        trainer = make_trainer(config_from_dict(raw), rank, world,
                               LocalReporter(Path(out).parent / f"r-{name}-{rank}"), tracker,
                               log=lines.append, keepers=keepers)  # fmt: skip
        assert from_memory(trainer, keepers, found=None), lines
        params = None if "zero3" in name else full_params(trainer.engine.eval_model)
        trainer.run()
        got[name] = {"loss": tracker.series("train_loss"), "lines": lines, "params": params}
    if rank == 0:
        torch.save(got, out)


@pytest.mark.parametrize("names", [["ddp", "fsdp", "fairscale", "lora-fsdp"],
                                   ["zero1", "zero2", "zero3", "zero2-offload"]],
                         ids=["torch", "deepspeed"])  # fmt: skip
def test_every_strategy_restores_from_memory_onto_the_uninterrupted_curve(
    ray_cluster: str, tmp_path: Path, names: list[str]
) -> None:
    import ray

    runs = {
        n: make_config(**merge(GPT_SMALL, merge(STRATEGIES[n], MEMORY))).to_dict() for n in names
    }
    sets = [
        ray.remote(num_cpus=0)(KeeperSet)
        .options(name=f"keepers-{n}", namespace=NAMESPACE)
        .remote(10)
        for n in names
    ]
    try:
        run_ranks(2, tmp_path, train_into_memory, runs, ray_cluster, str(tmp_path / "full.pt"))
        full = torch.load(tmp_path / "full.pt", weights_only=True)
        restored = {}
        for world in (2, 1):
            shaped = runs if world == 2 else {n: merge(r, {"scaling": {"num_workers": [1, 2]}})
                                              for n, r in runs.items()}  # fmt: skip
            out = tmp_path / f"resumed-{world}.pt"
            run_ranks(world, tmp_path, resume_from_memory, shaped, ray_cluster, str(out))
            got = restored[world] = torch.load(out, weights_only=False)
            for name in names:
                said = [x for x in got[name]["lines"] if "from memory" in x]
                assert said == [f"raylift: restored from memory: the memory snapshot at step "
                                f"{RESUME_AT} is complete on every rank and newer than "
                                "storage's step -1"], got[name]["lines"]  # fmt: skip
                loss = got[name]["loss"]
                assert sorted(loss) == list(range(RESUME_AT + 1, STEPS + 1)), (name, world)
                for step, value in loss.items():
                    assert value == pytest.approx(full[name][step], rel=1e-6), (name, world, step)
        # One snapshot, two world sizes: the same weights, to the bit, resharded or not.
        for name in names:
            two, one = restored[2][name]["params"], restored[1][name]["params"]
            if two is not None:
                assert two.keys() == one.keys()
                for key, value in two.items():
                    torch.testing.assert_close(one[key], value, rtol=0, atol=0)
    finally:
        for keeper_set in sets:
            ray.kill(keeper_set)
    # The keepers are their set's: ended with it (as with the driver that owns the set).
    wait_until(lambda: not alive_keepers(), "the keepers to end with their set",
               seen=alive_keepers)  # fmt: skip


def alive_keepers() -> list:
    from ray.util.state import list_actors

    return list_actors(filters=[("class_name", "=", "Keeper"), ("state", "=", "ALIVE")])


def test_a_node_that_cannot_hold_its_snapshots_is_refused_before_the_first_step(
    ray_cluster: str, in_tmp: Path
) -> None:
    """Snapshots of the quickstart's model, a billion kept: more than any node here holds.
    The run stops before its first step with exit 2, both numbers and the fix."""
    from tests.integration.test_train import cli_env

    done = subprocess.run(
        [sys.executable, "-m", "raylift.cli", "train", str(REPO / "configs" / "quickstart.yaml"),
         "name=too-much", "checkpoint.memory.every_n_steps=5", "checkpoint.memory.keep=1000000000"],
        cwd=in_tmp, env=cli_env(), capture_output=True, text=True, timeout=HANG_S,
    )  # fmt: skip
    said = done.stdout + done.stderr
    assert done.returncode == 2, said[-3000:]
    refusal = re.search(
        r"checkpoint\.memory: the keeper on this node would hold about ([\d.]+) (\w+) of memory "
        r"snapshots \(1000000000 kept and the one arriving, of its ranks' parts and a peer "
        r"node's\) and the node has ([\d.]+) (\w+) available: lower checkpoint\.memory\.keep",
        done.stderr,
    )
    assert refusal, said[-3000:]
    assert not re.search(r"^epoch\s+\d+\s+step", done.stdout, re.M), done.stdout  # no step ran
