"""Step time and model-state bytes per rank of every strategy on a gpt config, world size 2.

    python benchmarks/strategies.py [--config configs/gpt-tiny.yaml] [--steps 40]
        [--precision bf16-mixed 32] [--only fsdp zero3] [--device auto|cpu|cuda]

Runs the real per-worker loop (no Ray: the same data order for every strategy),
logging every 10 steps: on CPUs in 2 processes over gloo; on a GPU (``--device cuda``,
the default where one is present) in 1 process over NCCL, world size 1, as a smoke
test of every strategy x precision there. The step time is the median of the
logged intervals after the first (warm-up); model-state bytes are what rank 0 holds
after its first step (parameters, gradients, optimizer state; counted from the
tensors). Prints a table with both, and each as a ratio to DDP.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from machine import describe  # noqa: E402
from results import save  # noqa: E402

sys.path.insert(0, str(REPO))
# DeepSpeed's CPU Adam (offload) is compiled once; share the tests' cache of it.
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "raylift-tests" / "torch_extensions")
)

from raylift.core.config import ConfigError  # noqa: E402
from raylift.validation import config_from_dict, load_config  # noqa: E402
from tests.helpers import (  # noqa: E402
    ListTracker,
    LocalReporter,
    close_pools,
    make_trainer,
    run_ranks,
)

LOG_EVERY = 10
STRATEGIES = {
    "ddp": ["strategy.name=ddp"],
    "fsdp": ["strategy.name=fsdp"],
    "fairscale": ["strategy.name=fairscale"],
    "zero1": ["strategy.name=deepspeed", "strategy.zero_stage=1"],
    "zero2": ["strategy.name=deepspeed", "strategy.zero_stage=2"],
    "zero3": ["strategy.name=deepspeed", "strategy.zero_stage=3"],
    "zero3+offload": ["strategy.name=deepspeed", "strategy.zero_stage=3", "strategy.offload=true"],
}


def measure(rank: int, world: int, cfg_dict: dict, out: str, cuda: bool = False) -> None:
    cfg = config_from_dict(cfg_dict)
    tracker = ListTracker()
    reporter = LocalReporter(Path(out).parent / f"r{rank}")
    device = torch.device("cuda", rank) if cuda else None
    trainer = make_trainer(cfg, rank, world, reporter, tracker, device=device)
    trainer.run()
    if rank == 0:
        steps = tracker.series("step_time_s")
        torch.save({"step_time_s": [steps[s] for s in sorted(steps)][1:], **trainer.memory}, out)


def _on_gpu(rank: int, cfg_dict: dict, out: str, init_file: str) -> None:
    """One rank on one GPU, over NCCL (spawned: DeepSpeed and FSDP leave global state)."""
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=1)
    try:
        measure(rank, 1, cfg_dict, out, cuda=True)
    finally:
        dist.destroy_process_group()


def run(cfg_dict: dict, out: Path, tmp: Path, cuda: bool) -> None:
    if cuda:
        init_file = tmp / f"pg-{out.parent.name}"
        torch.multiprocessing.spawn(_on_gpu, (cfg_dict, str(out), str(init_file)), nprocs=1)
    else:
        run_ranks(2, tmp, measure, cfg_dict, str(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "gpt-tiny.yaml"))
    parser.add_argument("--steps", type=int, default=40, help="a multiple of 10")
    parser.add_argument("--precision", nargs="+", default=["bf16-mixed"])
    parser.add_argument("--only", nargs="*", default=list(STRATEGIES), help="strategies to run")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    opts = parser.parse_args()
    cuda = opts.device == "cuda" or (opts.device == "auto" and torch.cuda.is_available())
    try:
        for precision in opts.precision:
            report(measure_all(opts, precision, cuda), opts, precision, 1 if cuda else 2)
    finally:
        close_pools()  # the spawned ranks wait for work until told to stop


def measure_all(opts: argparse.Namespace, precision: str, cuda: bool) -> dict:
    common = [
        f"train.max_steps={opts.steps}",
        f"train.log_every_n_steps={LOG_EVERY}",
        "train.eval_every_n_steps=null",
        f"precision={precision}",
        "checkpoint.every_n_steps=null",
        f"scaling.use_gpu={str(cuda).lower()}",
    ]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in STRATEGIES.items():
            if name != "ddp" and name not in opts.only:
                continue
            try:
                cfg = load_config(opts.config, [*common, *overrides])
            except ConfigError as exc:  # a combination the strategy refuses (fairscale + fp16)
                print(f"{name} x {precision}: refused: {exc}", flush=True)
                continue
            out = Path(tmp) / name / "m.pt"
            run(cfg.to_dict(), out, Path(tmp), cuda)
            results[name] = torch.load(out, weights_only=True)
            ms = statistics.median(results[name]["step_time_s"]) * 1e3
            print(f"{name} x {precision}: {ms:.1f} ms per step", flush=True)
    return results


def report(results: dict, opts: argparse.Namespace, precision: str, world: int) -> None:
    def step(name: str) -> float:
        return statistics.median(results[name]["step_time_s"])

    def held(name: str) -> float:
        return results[name]["model_state_bytes_per_rank"]

    print(
        f"\n{Path(opts.config).name}, world size {world}, {precision}, {opts.steps} steps "
        f"(median of {opts.steps // LOG_EVERY - 1} intervals of {LOG_EVERY}); "
        f"{describe()}"
    )
    print(
        f"{'strategy':<15}{'step (ms)':>11}{'vs ddp':>8}{'model state MiB/rank':>23}{'vs ddp':>8}"
    )
    rows = []
    for name in results:
        print(
            f"{name:<15}{step(name) * 1e3:>11.1f}{step(name) / step('ddp'):>7.2f}x"
            f"{held(name) / 2**20:>23.2f}{held(name) / held('ddp'):>7.2f}x"
        )
        rows.append([name, f"{step(name) * 1e3:.1f}", f"{step(name) / step('ddp'):.2f}x",
                     f"{held(name) / 2**20:.2f}", f"{held(name) / held('ddp'):.2f}x"])  # fmt: skip
    least = min(results, key=held)
    save(
        __file__,
        f"step time and model state per rank of each strategy ({Path(opts.config).name}, "
        f"world size {world}, {precision})",
        ["strategy", "step ms", "vs ddp", "model state MiB/rank", "vs ddp"],
        rows,
        {"what": f"strategies on {Path(opts.config).name}, world {world}, {precision}",
         "raylift": f"{least}: {held(least) / 2**20:.2f} MiB/rank, {step(least) * 1e3:.1f} ms",
         "baseline": f"ddp: {held('ddp') / 2**20:.2f} MiB/rank, {step('ddp') * 1e3:.1f} ms",
         "ratio": f"{held(least) / held('ddp'):.2f}x memory, "
         f"{step(least) / step('ddp'):.2f}x time"},
        notes=f"Median of {opts.steps // LOG_EVERY - 1} logging intervals of {LOG_EVERY} steps.",
        variant=precision,
    )  # fmt: skip


if __name__ == "__main__":
    main()
