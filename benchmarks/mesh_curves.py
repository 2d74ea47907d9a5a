"""Every mesh's fp32 loss curve against DDP's, on a Ray of two nodes: 30 steps each.

    python benchmarks/mesh_curves.py

A local Ray of two nodes on this host (``ray start --head`` and a second ``ray start``,
as the drain test starts them). Ray Train places the workers (two a node, then four a
node), and raylift's trainer builds each mesh from that placement, as in a run:

- on 2 nodes x 2 workers: DDP, and FSDP with the mesh ``auto`` (HSDP: replicate 2 over
  the nodes x shard 2 within each), and FSDP + tensor parallel 2 within each node sharded
  across the nodes, on gpt-tiny's shape and on the test zoo's Llama (tied embeddings),
  Qwen3 and Mixtral, saved as ``save_pretrained`` writes them, and Llama with LoRA
  (HSDP; TP on Llama and Qwen3, whose Hugging Face plans raylift applies);
- on 2 nodes x 4 workers: DDP and replicate 2 x shard 2 x tp 2 on a smaller gpt.

Each curve is compared with DDP's of the same model and data, step by step: the largest
relative difference over the 30 steps is the number, held to 1e-5.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from results import save  # noqa: E402

from tests.integration.test_drain import two_nodes  # noqa: E402

STEPS = 30
GOAL = 1e-5
HSDP = {"name": "fsdp"}  # the mesh auto: replicate over the nodes, shard within
TP = {"name": "fsdp", "dp_replicate": 1, "tp": 2}  # TP within a node, FSDP across


def group(config: dict[str, Any]) -> None:
    """One Ray Train worker: each job's runs on this rank, one after another."""
    import ray.train

    from tests.helpers import train_runs
    from tests.zoo import zoo_train

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    for fn, runs, out in config["jobs"]:
        {"gpt": train_runs, "zoo": zoo_train}[fn](rank, world, runs, out)


def fit(jobs: list[tuple[str, dict, str]], workers: int, cpus: float) -> None:
    """The jobs on one Ray Train worker group, ``workers`` of ``cpus`` each: with nodes
    of ``2 * cpus`` CPUs, two a node or four."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    trainer = TorchTrainer(
        group,
        train_loop_config={"jobs": jobs},
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": cpus}),
        run_config=RunConfig(storage_path=str(Path(jobs[0][2]).parent / "ray")),
    )
    trainer.fit()


def gpt_jobs(root: Path) -> list[tuple[str, dict, str]]:
    from tests.unit.test_hsdp import gpt

    runs = {"ddp": gpt({"name": "ddp"}), "hsdp": gpt(HSDP), "fsdp-tp": gpt(TP)}
    return [("gpt", runs, str(root / "gpt" / "out.pt"))]


def zoo_jobs(root: Path) -> tuple[list[tuple[str, dict, str]], dict[str, Path]]:
    from raylift.core.parsing import merge
    from tests.zoo import save_zoo, zoo_config

    zoo = save_zoo(root / "zoo", ["llama-tied", "qwen3", "mixtral"])
    more = {"train": {"max_steps": STEPS, "max_epochs": 100}, "checkpoint": {"every_n_steps": 30}}
    jobs = []
    for name, strategy in (("ddp", {"name": "ddp"}), ("hsdp", HSDP), ("fsdp-tp", TP)):
        runs = {
            f"{arch}{'-lora' if lora else ''}": merge(zoo_config(folder, strategy, lora), more)
            for arch, folder in zoo.items()
            for lora in ((False, True) if arch == "llama-tied" else (False,))
            if name != "fsdp-tp" or (arch in ("llama-tied", "qwen3") and not lora)
        }
        jobs.append(("zoo", runs, str(root / f"zoo-{name}")))
    return jobs, zoo


def eight_jobs(root: Path) -> list[tuple[str, dict, str]]:
    from tests.helpers import GPT_SMALL
    from tests.unit.test_hsdp import gpt

    tiny = {
        "task_args": {**GPT_SMALL["task_args"], "n_layer": 1, "d_model": 32},
        "scaling": {"num_workers": 8},
    }
    runs = {"ddp": gpt({"name": "ddp"}, **tiny), "hsdp-tp": gpt({"name": "fsdp", "tp": 2}, **tiny)}
    return [("gpt", runs, str(root / "eight" / "out.pt"))]


def worst(curve: dict[int, float], ref: dict[int, float]) -> float:
    if sorted(curve) != sorted(ref) or sorted(ref) != list(range(1, STEPS + 1)):
        raise SystemExit(f"the curves are not {STEPS} steps each: {sorted(curve)}, {sorted(ref)}")
    return max(abs(curve[s] - v) / abs(v) for s, v in ref.items())


def rows_of(got: dict[str, dict], model: str, workers: str, runs: list[str]) -> list[list[Any]]:
    ref = got["ddp"]
    return [
        [f"{model}: {run}", workers, got[run]["layout"].removeprefix("mesh: "),
         f"{worst(got[run]['loss'], ref['loss']):.2e}", f"{ref['loss'][STEPS]:.4f}"]
        for run in runs
    ]  # fmt: skip


def drive(root: Path) -> None:
    """The driver, in a process of its own started with the Ray's environment (its
    address and token mode are read as Ray is imported): both worker groups' jobs."""
    import ray

    ray.init(logging_level="ERROR", log_to_driver=False)
    try:
        fit([*gpt_jobs(root), *zoo_jobs(root)[0]], workers=4, cpus=2)
        fit(eight_jobs(root), workers=8, cpus=1)
    finally:
        ray.shutdown()


def main() -> None:
    import torch

    if len(sys.argv) == 3 and sys.argv[1] == "--drive":
        drive(Path(sys.argv[2]))
        return
    root = Path(tempfile.mkdtemp(prefix="raylift-mesh-curves-"))
    for folder in ("gpt", "eight", "zoo-ddp", "zoo-hsdp", "zoo-fsdp-tp"):
        (root / folder).mkdir()
    shell = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "VIRTUAL_ENV")}
    with two_nodes(root, shell, cpus=4) as (env, _, _):
        done = subprocess.run([sys.executable, __file__, "--drive", str(root)], env=env)
    if done.returncode != 0:
        raise SystemExit(f"the runs failed (exit {done.returncode}); their output is above")
    load = lambda p: torch.load(p, weights_only=True)  # noqa: E731
    rows = rows_of(load(root / "gpt" / "out.pt"), "gpt", "2 x 2", ["hsdp", "fsdp-tp"])
    zoo = {name: load(root / f"zoo-{name}" / "train.pt") for name in ("ddp", "hsdp", "fsdp-tp")}
    for model in zoo["ddp"]:
        got = {name: runs[model] for name, runs in zoo.items() if model in runs}
        rows += rows_of(got, model, "2 x 2", [n for n in ("hsdp", "fsdp-tp") if n in got])
    rows += rows_of(load(root / "eight" / "out.pt"), "gpt (1 x 32)", "2 x 4", ["hsdp-tp"])
    report(rows)


def report(rows: list[list[Any]]) -> None:
    columns = ["model: layout", "nodes x workers", "mesh (from Ray's placement)",
               "max rel. diff from DDP", "DDP loss at step 30"]  # fmt: skip
    largest = max(float(r[3]) for r in rows)
    summary = {
        "what": f"fp32 loss curves of HSDP, FSDP+TP and HSDP+TP meshes on a Ray of two "
        f"nodes against DDP's, {STEPS} steps",
        "raylift": f"{largest:.1e} at most",
        "baseline": "DDP",
        "ratio": f"{len(rows)} curves",
    }
    notes = (
        f"{len(rows)} runs, each its model's largest relative difference from DDP's curve "
        f"over {STEPS} fp32 steps; the goal {GOAL:.0e}. Workers placed by Ray Train on two "
        "nodes of one host, gloo"
    )
    for row in rows:
        print(*row, sep="  |  ")
    save(__file__, "Every mesh against DDP on a Ray of two nodes: fp32 loss curves",
         columns, rows, summary, notes)  # fmt: skip


if __name__ == "__main__":
    main()
