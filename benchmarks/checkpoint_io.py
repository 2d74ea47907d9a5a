"""Checkpoint I/O at a model's size: what a resume and an export read, what a save stops.

    python benchmarks/checkpoint_io.py [--layers 8 --d-model 768] [--only fsdp zero3]

A gpt of ``--layers`` x ``--d-model`` (57M parameters by default; fp32 weights and two
AdamW moments: 12 bytes a parameter in a checkpoint), 2 workers (CPU, or a GPU each
where there are 2), precision 32, the run's storage on an S3 server on 127.0.0.1
(moto's server mode) reached through a proxy that counts the bytes the server sends:
what every rank read, counted outside raylift. For each strategy (fsdp, DeepSpeed ZeRO-3):

- ``raylift train`` for 3 steps with a checkpoint at each, ``checkpoint.async: true``,
  then the same run with ``false``: the loop's stall per checkpoint
  (``checkpoint_blocked_s``) and the save's time until complete in storage
  (``checkpoint_save_s``), medians, from the run's MLflow metrics;
- the run resumed at 2 workers, then at 1 (one more step each, no model logged):
  the bytes the server sent against the newest checkpoint's bytes (goal <= 1.2x);
- ``raylift export --format safetensors``: the bytes the server sent against the model
  file's (goal <= 1.2x), and the export's peak RSS against the model's size and against
  a process that imports what the export imports.

And each on local storage: the stall async against sync (goal <= 0.25x).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from machine import describe  # noqa: E402
from results import save  # noqa: E402

from tests.helpers import CountingProxy  # noqa: E402

CONFIG = REPO / "configs" / "gpt-tiny.yaml"
STRATEGIES = {
    "fsdp": ["strategy.name=fsdp"],
    "zero3": ["strategy.name=deepspeed", "strategy.zero_stage=3"],
}
MiB = 2**20
SYNC = "checkpoint.async=false"


class S3:
    """moto's S3 server on 127.0.0.1 with a bucket ``runs``; stopped by its pid."""

    def __init__(self) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        exe = str(Path(sys.executable).with_name("moto_server"))
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        self.proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], **quiet)
        self.endpoint = f"http://127.0.0.1:{port}"
        while True:
            try:
                urllib.request.urlopen(self.endpoint, timeout=1).close()
                break
            except OSError:
                if self.proc.poll() is not None:
                    raise SystemExit("moto_server did not start") from None
                time.sleep(0.2)
        self.env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": self.endpoint}  # fmt: skip
        os.environ.update(self.env)
        import boto3

        boto3.client("s3").create_bucket(Bucket="runs")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=30)


class Bench:
    def __init__(self, root: Path, s3: S3, model: list[str]):
        self.root, self.s3, self.model = root, s3, model
        self.gpu = _gpus() >= 2

    def command(
        self, verb: str, *args: str, through: CountingProxy | None = None
    ) -> tuple[str, int]:
        """Run ``raylift VERB ARGS`` in ``root``; its output and peak RSS (KiB)."""
        env = {**os.environ, **self.s3.env, "PYTHONUNBUFFERED": "1"}
        if through is not None:
            env["AWS_ENDPOINT_URL"] = through.endpoint
        cmd = [sys.executable, "-m", "raylift.cli", verb, *args]
        proc = subprocess.Popen(cmd, cwd=self.root, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip
        out = proc.stdout.read() if proc.stdout else ""
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            raise SystemExit(f"raylift {verb} failed ({proc.returncode}):\n{out[-4000:]}")
        return out, int(usage.ru_maxrss)

    def train(
        self, name: str, storage: str, *more: str, through: CountingProxy | None = None
    ) -> str:
        scaling = ["scaling.use_gpu=true"] if self.gpu else []
        tracking = f"tracking.uri=sqlite:///{self.root / 'mlflow.db'}"
        args = [str(CONFIG), f"name={name}", f"storage={storage}", *self.model, *scaling,
                f"data.shards={self.root / 'shards'}", tracking,
                "data.batch_size=4", "precision=32", "train.eval_every_n_steps=null",
                "train.log_every_n_steps=1", "checkpoint.every_n_steps=1", "checkpoint.keep=2",
                "optim.warmup_steps=1", *more]  # fmt: skip
        out, _ = self.command("train", *args, through=through)
        return out

    def costs(self, out: str) -> dict[str, float]:
        """Medians of ``checkpoint_blocked_s``, ``checkpoint_wait_s`` (the part of it
        spent waiting for the save before) and ``checkpoint_save_s`` of the run that
        printed ``out``."""
        from mlflow.tracking import MlflowClient

        run_id = re.search(r"MLflow run (\w+)", out).group(1)  # type: ignore[union-attr]
        client = MlflowClient(f"sqlite:///{self.root / 'mlflow.db'}")
        keys = ("checkpoint_blocked_s", "checkpoint_wait_s", "checkpoint_save_s")
        history = {k: [m.value for m in client.get_metric_history(run_id, k)] for k in keys}
        return {k.split("_")[1]: statistics.median(v) for k, v in history.items()}


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def checkpoint_bytes(run: str) -> int:
    from raylift.core import storage
    from raylift.tensors.checkpoints import checkpoint_dirs

    newest = checkpoint_dirs(run)[-1]
    return sum(size for _, size in storage.files_under(newest))


def stalls(bench: Bench, strategy: str, storage: str) -> dict[str, float]:
    extra = STRATEGIES[strategy]
    got = bench.costs(bench.train(f"{strategy}-async", storage, *extra, "train.max_steps=3"))
    sync = bench.costs(bench.train(f"{strategy}-sync", storage, *extra, "train.max_steps=3", SYNC))
    return {
        "blocked_async": got["blocked"],
        "waited_async": got["wait"],
        "blocked_sync": sync["blocked"],
        "save_async": got["save"],
        "save_sync": sync["save"],
    }


def stall_cell(cost: dict[str, float]) -> str:
    """The stall both ways, and the async one's own part: without its wait for the save
    before it (a checkpoint every step queues behind the previous upload)."""
    blocked, waited, sync = cost["blocked_async"], cost["waited_async"], cost["blocked_sync"]
    return (
        f"{blocked:.2f} / {sync:.2f} s ({blocked / sync:.2f}x); without the wait for the save "
        f"before {blocked - waited:.2f} s ({(blocked - waited) / sync:.2f}x)"
    )


def reads(bench: Bench, strategy: str, storage: str) -> dict[str, float]:
    """Bytes the server sent to resume at 2 and at 1 worker, and to export."""
    extra, run = STRATEGIES[strategy], f"{storage}/{strategy}-async"
    out: dict[str, float] = {}
    for workers, steps in ((2, 4), (1, 5)):
        size = checkpoint_bytes(run)
        proxy = CountingProxy(bench.s3.endpoint)
        try:
            more = [f"train.max_steps={steps}", f"scaling.num_workers={workers}"]
            bench.train(f"{strategy}-async", storage, *extra, *more, "tracking.log_model=none",
                        through=proxy)  # fmt: skip
        finally:
            proxy.close()
        out[f"resume_2to{workers}"] = proxy.served / size
        out[f"checkpoint_mib_2to{workers}"] = size / MiB
    proxy = CountingProxy(bench.s3.endpoint)
    target = bench.root / f"{strategy}.safetensors"
    try:
        _, rss = bench.command(
            "export", run, "--format", "safetensors", "--out", str(target), through=proxy
        )
    finally:
        proxy.close()
    model = target.stat().st_size
    out["export_read"] = proxy.served / model
    out["model_mib"] = model / MiB
    out["export_rss_mib"] = rss / 1024
    return out


def gpt_shape(layers: int, d_model: int) -> tuple[list[str], int]:
    """gpt-tiny's overrides for a gpt of ``layers`` x ``d_model`` (a head per 64 wide),
    and its parameters."""
    heads = max(1, d_model // 64)
    model = [f"task_args.n_layer={layers}", f"task_args.d_model={d_model}",
             f"task_args.n_head={heads}", "task_args.max_bytes=300000"]  # fmt: skip
    return model, count_params(layers, d_model, heads)


def count_params(layers: int, d_model: int, heads: int) -> int:
    import torch

    from raylift.tasks import build_task

    args = {"n_layer": layers, "d_model": d_model, "n_head": heads, "max_bytes": 300000}
    with torch.device("meta"):
        model = build_task("gpt", args).build_model()
    return sum(p.numel() for p in model.parameters())


def import_rss() -> float:
    """Peak RSS (MiB) of a process that only imports what ``raylift export`` imports."""
    code = (
        "import raylift.cli, raylift.artifacts.export, raylift.tensors.streaming, "
        "torch.distributed.checkpoint"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    _, _, usage = os.wait4(proc.pid, 0)
    return usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--only", nargs="*", default=list(STRATEGIES))
    opts = parser.parse_args()
    model, params = gpt_shape(opts.layers, opts.d_model)
    root = Path(tempfile.mkdtemp(prefix="raylift-bench-ckpt-"))
    s3 = S3()
    rows: list[list[Any]] = []
    stall_costs: dict[tuple[str, str], dict[str, float]] = {}
    try:
        bench = Bench(root, s3, model)
        # The shards on local disk, prepared once: the bytes counted are the checkpoint's.
        bench.command("prep", str(CONFIG), *model, f"data.shards={root / 'shards'}")
        baseline = import_rss()
        for strategy in opts.only:
            local = stall_costs[(strategy, "local")] = stalls(bench, strategy, str(root / "runs"))
            rows.append([strategy, "local", "-", "-", "-", "-", "-", stall_cell(local),
                         f"{local['save_async']:.1f} / {local['save_sync']:.1f} s"])  # fmt: skip
            print(rows[-1], flush=True)
        for strategy in opts.only:
            uri = f"s3://runs/{root.name}"
            cost = stall_costs[(strategy, "s3")] = stalls(bench, strategy, uri)
            got = reads(bench, strategy, uri)
            rows.append([
                strategy, "s3", f"{got['checkpoint_mib_2to2']:,.0f} MiB",
                f"{got['resume_2to2']:.2f}x", f"{got['resume_2to1']:.2f}x",
                f"{got['export_read']:.2f}x of {got['model_mib']:,.0f} MiB",
                f"{got['export_rss_mib']:,.0f} MiB (imports {baseline:,.0f})",
                stall_cell(cost),
                f"{cost['save_async']:.1f} / {cost['save_sync']:.1f} s",
            ])  # fmt: skip
            print(rows[-1], flush=True)
    finally:
        s3.stop()
        shutil.rmtree(root, ignore_errors=True)
    columns = [
        "strategy",
        "storage",
        "checkpoint",
        "resume 2->2 read",
        "resume 2->1 read",
        "export read",
        "export peak RSS",
        "stall async / sync",
        "save async / sync",
    ]
    print(f"{describe()}; gpt {params / 1e6:.0f}M parameters, 2 workers, fp32")
    for row in [columns, *rows]:
        print(" | ".join(str(c) for c in row))
    first = opts.only[0]
    row = next(r for r in rows if r[0] == first and r[1] == "s3")
    local = stall_costs[(first, "local")]
    save(
        __file__,
        f"Checkpoint I/O: a {params / 1e6:.0f}M-parameter gpt, 2 workers, storage local "
        "and on an S3 server",
        columns,
        rows,
        {
            "what": f"checkpoint I/O ({first}, S3): read to resume 2->2 / to export; "
            "stall per save (local disk)",
            "raylift": f"{row[3]} / {row[5].split(' of ')[0]}; "
            f"stall {local['blocked_async']:.2f} s",
            "baseline": "the checkpoint's / model's bytes; a synchronous save's stall",
            "ratio": f"{local['blocked_async'] / local['blocked_sync']:.2f}x",
        },
        notes="Bytes counted by a proxy in front of the S3 server (what it sent), not by raylift. "
        "Goals: resume and export read <= 1.2x; stall with checkpoint.async <= 0.25x of sync. "
        "A checkpoint every step: on S3 a save waits for the upload before it, shown apart.",
    )


if __name__ == "__main__":
    main()
