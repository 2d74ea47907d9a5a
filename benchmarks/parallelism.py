"""Layouts across nodes: the bytes each worker sends a step within its node and across
nodes, measured at the process groups and as ``raylift plan`` predicts them, with the
model state each rank holds, its peak memory and the step time.

    python benchmarks/parallelism.py [--layers 8 --d-model 768] [--steps 4]

A local Ray of two nodes on this host (``ray start --head`` and a second ``ray start``,
as the drain test starts them), two workers on each (two CPUs a node; on a machine with
4 GPUs, one GPU a worker), a gpt of ``--layers`` x ``--d-model`` (57M parameters by
default, as benchmarks/checkpoint_io.py), fp32, ``raylift train`` for ``--steps`` steps
under DDP, FSDP sharded over all four workers (``fsdp-full``), HSDP (``fsdp`` with the
mesh ``auto``: shard within each node, replicate across the two), tensor parallel over
each node's two workers sharded over the nodes (``fsdp-tp``) and DeepSpeed ZeRO-3, with hpZ
(``zero3``: backward gathers within each node) and without (``zero3-flat``).

The bytes are those raylift logs to MLflow (``wire/*``: one step's collectives, read
from torch's Flight Recorder); the prediction is ``raylift plan --gpus 4 --nodes 2``'s.
Two "nodes" on one host share its links: the step times here say what the layouts cost
in compute and copies, not what a slow link between real nodes would add. The bytes
across nodes are the measure of that.
"""

from __future__ import annotations

import argparse
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

CONFIG = REPO / "configs" / "gpt-tiny.yaml"
LAYOUTS = {
    "ddp": ["strategy.name=ddp"],
    "fsdp-full": ["strategy.name=fsdp", "strategy.dp_replicate=1"],
    "fsdp": ["strategy.name=fsdp"],  # HSDP from the placement
    # Tensor parallel over each node's 2 workers, sharded over the 2 nodes.
    "fsdp-tp": ["strategy.name=fsdp", "strategy.dp_replicate=1", "strategy.tp=2"],
    # ZeRO-3 over all four, its backward gathers within each node from hpZ's partition
    # (strategy.hpz: auto), and without it.
    "zero3": ["strategy.name=deepspeed", "strategy.zero_stage=3"],
    "zero3-flat": ["strategy.name=deepspeed", "strategy.zero_stage=3", "strategy.hpz=false"],
}
MiB = 2**20
ROWS = ("ddp", "fsdp-full", "fsdp", "fsdp-tp", "zero3")  # raylift plan's labels


def gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def model_args(layers: int, d_model: int) -> list[str]:
    heads = max(d_model // 64, 1)
    task_args = f"{{block_size: 128, n_layer: {layers}, n_head: {heads}, d_model: {d_model}}}"
    return [f"task_args={task_args}", "task_args.max_bytes=2000000"]


def train(root: Path, env: dict[str, str], name: str, layout: str, extra: list[str]) -> str:
    placement = ["scaling.use_gpu=true"] if gpus() >= 4 else ["scaling.cpus_per_worker=0.8"]
    cmd = [sys.executable, "-m", "raylift.cli", "train", str(CONFIG), f"name={name}",
           f"storage={root / 'runs'}", f"tracking.uri=sqlite:///{root / 'mlflow.db'}",
           "precision=32", "scaling.num_workers=4", "data.batch_size=4", "train.max_epochs=100",
           "train.log_every_n_steps=1", "checkpoint.every_n_steps=1000",
           "train.early_stopping=null", *placement, *LAYOUTS[layout], *extra]  # fmt: skip
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    out = done.stdout + done.stderr
    if done.returncode != 0:
        raise SystemExit(f"{layout}: raylift train failed:\n{out[-4000:]}")
    return out


def logged(root: Path, name: str) -> dict[str, Any]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    experiments = [e.experiment_id for e in client.search_experiments()]
    (run,) = client.search_runs(experiments, f"tags.mlflow.runName = '{name}'")
    history = {
        key: [m.value for m in client.get_metric_history(run.info.run_id, key)]
        for key in ("step_time_s", "mem_rss_bytes", "cuda_peak_allocated_bytes")
    }
    return {"metrics": run.data.metrics, "history": history}


def predicted(extra: list[str]) -> dict[str, tuple[float, float]]:
    from raylift.run.plan import param_split, predicted_wire
    from raylift.validation import load_config

    cfg = load_config(CONFIG, ["precision=32", "data.batch_size=4", *extra])
    split = param_split(cfg)
    plan = {label: predicted_wire(cfg, label, 4, 2, split) for label in LAYOUTS if label in ROWS}
    # Without hpZ every ZeRO-3 collective spans both nodes: all of one node's traffic, across.
    plan["zero3-flat"] = (0.0, sum(predicted_wire(cfg, "zero3", 4, 1, split)))
    return plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--only", nargs="*", choices=list(LAYOUTS), default=list(LAYOUTS))
    args = parser.parse_args()
    extra = [*model_args(args.layers, args.d_model), f"train.max_steps={args.steps}"]
    root = Path(tempfile.mkdtemp(prefix="raylift-parallelism-"))
    plan = predicted(extra)
    shell = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "VIRTUAL_ENV")}
    results, consoles = {}, {}
    with two_nodes(root, shell, cpus=2) as (env, _, _):
        for layout in args.only:
            name = f"par-{layout}"
            consoles[layout] = train(root, env, name, layout, extra)
            results[layout] = logged(root, name)
            print(layout, {k: v for k, v in results[layout]["metrics"].items() if "wire" in k})
    report(args, results, plan, consoles)


def report(args: Any, results: dict, plan: dict, consoles: dict) -> None:
    columns = ["layout", "within MiB (measured)", "within MiB (plan)", "across MiB (measured)",
               "across MiB (plan)", "model state MiB/rank", "peak MiB/rank", "step s"]  # fmt: skip
    rows = []
    for layout, got in results.items():
        m, h = got["metrics"], got["history"]
        within, across = (
            m.get(f"wire/{w}_bytes_per_step", 0.0) for w in ("within_node", "across_nodes")
        )
        peak = max(h["cuda_peak_allocated_bytes"] or h["mem_rss_bytes"])
        steady = sorted(h["step_time_s"][1:] or h["step_time_s"])
        rows.append([
            layout, round(within / MiB, 2), round(plan[layout][0] / MiB, 2),
            round(across / MiB, 2), round(plan[layout][1] / MiB, 2),
            round(m["model_state_bytes_per_rank"] / MiB, 1), round(peak / MiB, 1),
            round(steady[len(steady) // 2], 3),
        ])  # fmt: skip
    by = {r[0]: r for r in rows}
    summary = {"what": "bytes across nodes a step, HSDP against full sharding (2 nodes x 2)"}
    if "fsdp" in by and "fsdp-full" in by and by["fsdp"][3]:
        ratio = by["fsdp-full"][3] / by["fsdp"][3]
        summary.update(raylift=f"{by['fsdp'][3]} MiB", baseline=f"{by['fsdp-full'][3]} MiB",
                       ratio=f"{ratio:.1f}x less")  # fmt: skip
    worst = max(
        (abs(r[i] - r[i + 1]) / r[i + 1] for r in rows if not r[0].startswith("zero3")
         for i in (1, 3) if r[i + 1]), default=0.0,
    )  # fmt: skip
    notes = (
        f"gpt {args.layers} x {args.d_model}, fp32, {args.steps} steps, 4 workers on two "
        f"nodes of one host; the plan within {worst:.1%} of the measured bytes for DDP, FSDP, "
        "HSDP and FSDP+TP; ZeRO-3's prediction takes FSDP's pattern, DeepSpeed's buckets differ"
    )
    # The console's mesh and wire lines, each layout's, for the manual to quote.
    mesh = [
        line for out in consoles.values() for line in out.splitlines()
        if line.startswith(("raylift: mesh:", "raylift: wire:"))
    ]  # fmt: skip
    save(__file__, "Layouts across two nodes: bytes on the wire, memory, step time",
         columns, rows, summary, notes, transcript=mesh)  # fmt: skip


if __name__ == "__main__":
    main()
