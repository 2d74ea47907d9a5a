"""A restart of a large model: its state from the cluster's memory against from storage.

    python benchmarks/memory_restore.py [--layers 8 --d-model 768] [--kill-at 115]

The gpt of ``checkpoint_io.py`` (57M parameters by default: a 654 MiB checkpoint of fp32
weights and two AdamW moments), 2 workers on a Ray of two nodes on this host (``ray
start --head`` and ``ray start --address``, one worker each), fp32, its storage on an S3
server on 127.0.0.1 (moto's server mode), a storage checkpoint every 100 steps. One Ray
Train worker is SIGKILLed once the run has logged step ``--kill-at``; Ray Train restarts
the group (``train.max_failures``) and the run trains on to its end. Twice:

- with a memory snapshot every 10 steps (``checkpoint.memory``): the restart restores
  from the keepers' copies;
- without: the restart restores from the S3 server.

For each: the bytes restored, from where, in how long and at what rate, the steps
redone and the whole restart's time, from raylift's own restart line. The JSON goes to
``benchmarks/results/memory_restore.json``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from checkpoint_io import S3, gpt_shape  # noqa: E402
from goodput import RESTART, gpus, kill_a_worker, two_nodes  # noqa: E402
from machine import describe  # noqa: E402
from results import save  # noqa: E402

CONFIG = REPO / "configs" / "gpt-tiny.yaml"
STEP = re.compile(r"^epoch\s+\d+\s+step\s+(\d+)/")
WHY = ("raylift: restored from memory", "raylift: restoring from storage")


def run(root: Path, s3: S3, name: str, model: list[str], opts: argparse.Namespace,
        memory: bool) -> dict[str, Any]:  # fmt: skip
    """One run with a worker killed at ``--kill-at``; what its restart line says."""
    snapshots = [f"checkpoint.memory.every_n_steps={opts.memory_every}"] if memory else []
    args = [str(CONFIG), f"name={name}", f"storage=s3://runs/{root.name}", *model, *snapshots,
            f"data.shards={root / 'shards'}", f"tracking.uri=sqlite:///{root / 'mlflow.db'}",
            "tracking.log_model=none", "data.batch_size=4", "precision=32",
            "train.eval_every_n_steps=null", "train.log_every_n_steps=1", "train.max_failures=1",
            f"train.max_steps={opts.steps}", "train.max_epochs=1000", "optim.warmup_steps=1",
            f"checkpoint.every_n_steps={opts.storage_every}", "checkpoint.keep=1",
            f"scaling.use_gpu={bool(gpus())}", "scaling.cpus_per_worker=1"]  # fmt: skip
    with two_nodes() as cluster:
        env = {**cluster.env, **s3.env}
        proc = subprocess.Popen([sys.executable, "-m", "raylift.cli", "train", *args],
                                cwd=root, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip
        lines, killed = [], None
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            step = STEP.match(line)
            if step and killed is None and int(step.group(1)) >= opts.kill_at:
                killed = (int(step.group(1)), kill_a_worker(cluster), time.time())
        proc.wait()
    out = "".join(lines)
    if proc.returncode:
        raise SystemExit(f"run {name} failed:\n{out[-4000:]}")
    (m,) = RESTART.findall(out)
    return {
        "killed_at": killed[0] if killed else None,
        "cost_s": float(m[1]), "mib": float(m[2].replace(",", "")), "source": m[3],
        "gbps": float(m[4]), "redone": int(m[5]),
        "restore_s": _restore_s(out), "line": next(x for x in lines if "restart 1 cost" in x),
        "why": next((x.strip() for x in lines if x.startswith(WHY)), ""),
    }  # fmt: skip


def _restore_s(out: str) -> float:
    found = re.search(r"MiB restored from \w+ in ([\d.]+) s", out)
    return float(found.group(1)) if found else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--steps", type=int, default=125)
    parser.add_argument("--kill-at", type=int, default=115)
    parser.add_argument("--memory-every", type=int, default=10)
    parser.add_argument("--storage-every", type=int, default=100)
    opts = parser.parse_args()
    model, params = gpt_shape(opts.layers, opts.d_model)
    root = Path(tempfile.mkdtemp(prefix="raylift-bench-memory-"))
    print(f"memory against storage restores on {describe()}: gpt {params / 1e6:.0f}M", flush=True)
    s3 = S3()
    try:
        subprocess.run([sys.executable, "-m", "raylift.cli", "prep", str(CONFIG), *model,
                        f"data.shards={root / 'shards'}"], check=True, capture_output=True,
                       env={**os.environ, **s3.env})  # fmt: skip
        got = {}
        for name, memory in (("memory", True), ("storage", False)):
            got[name] = run(root, s3, name, model, opts, memory)
            print(name, got[name], flush=True)
    finally:
        s3.stop()
    report(got, opts, params)


def report(got: dict[str, dict[str, Any]], opts: argparse.Namespace, params: int) -> None:
    mem, sto = got["memory"], got["storage"]
    rows = [
        [f"{name}: {opts.memory_every if name == 'memory' else '-'} / {opts.storage_every}",
         r["source"], f"{r['mib']:,.0f}", f"{r['restore_s']:.1f}", f"{r['gbps']:.2f}",
         str(r["killed_at"]), str(r["redone"]), f"{r['cost_s']:.1f}"]
        for name, r in got.items()
    ]  # fmt: skip
    save(
        __file__,
        f"a restart's state from memory against from storage: gpt {params / 1e6:.0f}M, "
        "2 workers on 2 nodes, fp32, storage on the S3 server, a worker SIGKILLed once",
        ["run: memory / storage every (steps)", "restored from", "MiB (all ranks)", "restore s",
         "GB/s", "killed at step", "steps redone", "restart s"],
        rows,
        {
            "what": f"a restart of the {params / 1e6:.0f}M gpt (S3): its state from memory "
            f"(a snapshot every {opts.memory_every} steps) against from storage (every "
            f"{opts.storage_every})",
            "raylift": f"memory {mem['restore_s']:.1f} s ({mem['gbps']:.2f} GB/s), "
            f"{mem['redone']} redone",
            "baseline": f"storage {sto['restore_s']:.1f} s ({sto['gbps']:.2f} GB/s), "
            f"{sto['redone']} redone",
            "ratio": f"{sto['restore_s'] / max(mem['restore_s'], 1e-9):.1f}x faster restore",
        },
        notes="The restore: from the restore's start (the keepers asked, the parts fetched, "
        "or the reads from the S3 server) to the state loaded on every rank; the bytes: "
        "what every rank fetched together. Each restart line: "
        + " | ".join(r["line"].strip() for r in got.values()),
    )  # fmt: skip


if __name__ == "__main__":
    main()
