"""HSDP (FSDP on a 2-D mesh: shard within a node, replicate across nodes) against DDP on
four gloo ranks, fp32, 30 steps: gpt and the zoo's Llama, Qwen3 and Mixtral (full) and
Llama with LoRA. Then a checkpoint saved under one mesh resumed under others.

The ranks here share one host, so the mesh is asked for by its numbers
(``dp_replicate: 2``); ``auto`` builds the same mesh from two nodes' placement (the unit
tests of raylift.strategies.mesh, and the drained HSDP run on a two-node Ray of
test_drain)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from raylift.artifacts.export import consolidated_state_dict
from raylift.core.parsing import merge
from raylift.run.checkpointing import replica_place, write_replica
from raylift.tensors.checkpoints import done_file, seal_checkpoint
from raylift.validation import config_from_dict
from tests.helpers import (
    GPT_SMALL,
    ListTracker,
    LocalReporter,
    make_config,
    make_trainer,
    resume_and_record,
    run_ranks,
    train_keep_checkpoints,
    train_runs,
)

pytestmark = pytest.mark.slow

WORLD = 4
HSDP = {"name": "fsdp", "dp_replicate": 2}  # 2 copies x 2 shards
FULL = {"name": "fsdp"}  # 1 x 4 on one host
TOLERANCE = 1e-5
THIRTY = {"max_steps": 30, "max_epochs": 100}


def gpt(strategy: dict[str, Any], **more: Any) -> dict[str, Any]:
    cfg = merge(GPT_SMALL, {"strategy": strategy, "precision": "32", **more})
    return make_config(**cfg).to_dict()


def zoo_thirty(folder: Path, strategy: dict[str, Any], lora: bool = False) -> dict[str, Any]:
    """A zoo model's config (tests/zoo.py) for 30 steps, one checkpoint at the end."""
    from tests.zoo import zoo_config

    thirty = {"train": THIRTY, "checkpoint": {"every_n_steps": 30}}
    return merge(zoo_config(folder, strategy, lora), thirty)


def zoo_runs(zoo: dict[str, Path], strategy: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The zoo's Llama (with and without LoRA), Qwen3 and Mixtral under ``strategy``."""
    return {
        f"{arch}{'-lora' if lora else ''}": zoo_thirty(folder, strategy, lora)
        for arch, folder in zoo.items()
        for lora in ((False, True) if arch == "llama-tied" else (False,))
    }


def worst(curve: dict[int, float], ref: dict[int, float]) -> float:
    assert sorted(curve) == sorted(ref) == list(range(1, 31))
    return max(abs(curve[s] - v) / abs(v) for s, v in ref.items())


def test_hsdp_follows_ddp_on_gpt(tmp_path: Path, ddp_on_four: dict[str, Any]) -> None:
    runs = {
        "hsdp": gpt(HSDP),
        "hsdp-ac": gpt({**HSDP, "activation_checkpointing": True}),
        "fsdp": gpt(FULL),
    }
    run_ranks(WORLD, tmp_path, train_runs, runs, str(tmp_path / "out.pt"))
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    ref = ddp_on_four["gpt"]["loss"]
    assert ref[30] < 0.8 * ref[1]  # it learned
    table = {name: worst(got[name]["loss"], ref) for name in runs}
    print(table)
    assert all(v <= TOLERANCE for v in table.values()), table
    # Sharded over 2, not 4: each rank holds half the optimizer state, not a quarter.
    full, hsdp = got["fsdp"]["bytes"]["optimizer"], got["hsdp"]["bytes"]["optimizer"]
    assert hsdp == pytest.approx(2 * full, rel=0.05), (hsdp, full)


def test_hsdp_follows_ddp_on_the_zoo(
    tmp_path_factory: pytest.TempPathFactory, ddp_on_four: dict[str, Any]
) -> None:
    """Then each HSDP run exported (``--format hf``, and ``peft`` for LoRA) and loaded back
    by transformers, with the trained model's logits."""
    from tests.unit.test_zoo import export_and_reload
    from tests.zoo import zoo_train

    root = tmp_path_factory.mktemp("hsdp")
    runs = zoo_runs(ddp_on_four["zoo"], HSDP)
    run_ranks(WORLD, root, zoo_train, runs, str(root))
    curves = torch.load(root / "train.pt", weights_only=True)
    ref = ddp_on_four["zoo_curves"]
    table = {run: worst(curves[run]["loss"], ref[run]["loss"]) for run in runs}
    print(table)
    assert set(table) == {"llama-tied", "llama-tied-lora", "qwen3", "mixtral"}
    assert all(v <= TOLERANCE for v in table.values()), table
    for run, cfg in runs.items():
        export_and_reload(run, cfg, root, curves[run]["logits"])


@pytest.mark.parametrize(
    "saved, resumed, world",
    [
        (HSDP, FULL, 2),  # 2 x 2 -> 1 x 2: a node lost
        (HSDP, {"name": "ddp"}, 2),
        (FULL, HSDP, WORLD),  # full sharding -> HSDP
    ],
    ids=["hsdp-to-fsdp", "hsdp-to-ddp", "fsdp-to-hsdp"],
)
def test_a_checkpoint_resumes_under_another_mesh(
    saved_runs: Callable[[dict], Path], tmp_path: Path, saved: dict, resumed: dict, world: int
) -> None:
    """Resumed at step 15 under another mesh (on fewer ranks, as after a lost node,
    accumulating what the others did): the uninterrupted curve goes on, within 1e-6, from
    exactly the saved weights. Under HSDP each replica also wrote its whole copy at step 15,
    as each node's memory snapshot: the second node's copy alone resumes the same way."""
    root = saved_runs(saved)
    full = torch.load(root / "loss.pt", weights_only=True)
    ckpt = root / "checkpoint-step00000015"
    exported = consolidated_state_dict(ckpt)
    # The same rows a step: each of fewer ranks accumulates what the others did.
    accum = {**GPT_SMALL["train"], "grad_accum": WORLD // world}
    again = gpt(resumed, checkpoint={"every_n_steps": 5}, train=accum)
    sources = {"storage": ckpt}
    if saved is HSDP and resumed is FULL:  # the first node lost: the second's copy serves
        sources["copy"] = merged_copy(root, COPIES[1], tmp_path)
    for source, folder in sources.items():
        out = tmp_path / f"r-{source}.pt"
        run_ranks(world, tmp_path, resume_and_record, again, str(folder), str(out))
        got = torch.load(out, weights_only=True)
        assert sorted(got["loss"]) == list(range(16, 31))
        for step, loss in got["loss"].items():
            assert loss == pytest.approx(full[step], rel=1e-6), (source, step)
        assert got["params"].keys() == exported.keys()
        for key, value in exported.items():
            torch.testing.assert_close(got["params"][key], value, rtol=0, atol=0)


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[dict], Path]:
    """30 steps under a layout, a checkpoint every 5 (under HSDP, each replica's copy at
    step 15 too): trained once for every resume from that layout."""
    roots: dict[str, Path] = {}

    def saved(layout: dict) -> Path:
        key = "hsdp" if layout is HSDP else "fsdp"
        if key not in roots:
            root = tmp_path_factory.mktemp(f"saved-{key}") / "full"
            saving = train_keeping_copies if layout is HSDP else train_keep_checkpoints
            cfg = gpt(layout, checkpoint={"every_n_steps": 5})
            run_ranks(WORLD, root.parent, saving, cfg, str(root))
            roots[key] = root
        return roots[key]

    return saved


# Two nodes' replicas, as Mesh.replicas() names them where Ray put ranks 0, 1 on one node
# and 2, 3 on another (here the ranks share one host, so they are named by hand).
COPIES = ((0, 1), (2, 3))


def train_keeping_copies(rank: int, world: int, cfg_dict: dict, root: str) -> None:
    """As train_keep_checkpoints, and at step 15 each replica's ranks also write their
    whole copy of the state (write_replica, as each node's memory snapshot does), each
    rank's part in a folder of its own."""
    cfg = config_from_dict(cfg_dict)
    tracker = ListTracker()
    trainer = make_trainer(cfg, rank, world, LocalReporter(Path(root)), tracker)
    trainer.engine.replicas = COPIES  # type: ignore[misc]
    save = trainer.saver.save

    def save_and_copy(step: int, loop: dict, metrics: dict, to_storage: bool = True) -> None:
        save(step, loop, metrics, to_storage)
        if step == 15:
            folder = Path(root) / f"part-{rank}"
            items = write_replica(folder, trainer.engine, loop, rank, world)()
            listing = seal_checkpoint(folder, items)
            (folder / done_file(replica_place(trainer.engine, rank))).write_text(listing)

    trainer.saver.save = save_and_copy  # type: ignore[method-assign]
    trainer.run()
    if rank == 0:
        torch.save(tracker.series("train_loss"), Path(root) / "loss.pt")


def merged_copy(root: Path, ranks: tuple[int, ...], tmp: Path) -> Path:
    """One replica's parts in one folder under ``tmp``, as a restore fetches them from a
    node's keeper; the copy holds the whole state: about the storage checkpoint's bytes,
    not a share."""
    into = tmp / f"copy-{'-'.join(map(str, ranks))}"
    for rank in ranks:
        shutil.copytree(root / f"part-{rank}", into, dirs_exist_ok=True)
    engine = sum(p.stat().st_size for p in (into / "engine").iterdir())
    stored = sum(p.stat().st_size for p in (root / "checkpoint-step00000015" / "engine").iterdir())
    assert 0.9 * stored < engine < 1.1 * stored, (engine, stored)
    return into
