"""raylift's per-worker loop against a hand-written PyTorch loop, one process.

    python benchmarks/overhead.py [--steps 60] [--repeats 5] [--precision 32]
        [--device auto|cpu|cuda] [--compile] [--no-save] [key=value ...]

Same task (the gpt task: configs/gpt-tiny.yaml's model on a CPU, GPT-2-small's shape
on a GPU: 12 layers, d_model 768, block 1024, batch 16), same data, batch, precision,
optimizer and clipping. The hand-written loop is written the way the PyTorch
performance guide says: data on the device, fused AdamW on CUDA, ``zero_grad(
set_to_none=True)``, autocast, no per-step sync; with ``--compile`` it is
``torch.compile``d whole, and raylift runs with ``train.compile: true``. Each repeat
times ``--steps`` optimizer steps after a warm-up; the loops alternate so both see the
same machine load. raylift logs every 20 steps (each log is one host sync). Prints the
median step time of each, their ratio, the median of the per-repeat ratios raylift /
hand-written (goal: <= 1.03), and MFU both ways.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from machine import describe  # noqa: E402
from results import save  # noqa: E402

sys.path.insert(0, str(REPO))

from raylift.core.config import Config  # noqa: E402
from raylift.run.loop import seed_everything  # noqa: E402
from raylift.tasks import build_task  # noqa: E402
from raylift.tasks.base import flops_per_sample  # noqa: E402
from raylift.tensors.metrics import peak_flops  # noqa: E402
from raylift.tensors.optim import param_groups  # noqa: E402
from raylift.tensors.precision import resolve_precision  # noqa: E402
from raylift.validation import load_config  # noqa: E402
from tests.helpers import LocalReporter, make_trainer, tensors  # noqa: E402

WARMUP = 20


class StepClock:
    """A tracker that notes the wall clock whenever the loop logs a training interval."""

    def __init__(self) -> None:
        self.at: dict[int, float] = {}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if "train_loss" in metrics:
            self.at[step] = time.perf_counter()

    def set_tags(self, tags: dict[str, str]) -> None:
        pass

    def log_artifact(self, path: Path, folder: str) -> None:
        pass


def raylift_step_time(
    cfg: Config, data: dict, steps: int, tmp: Path, device: torch.device
) -> float:
    clock = StepClock()
    trainer = make_trainer(cfg, 0, 1, LocalReporter(tmp), clock, data, device=device)
    trainer.run()
    return (clock.at[WARMUP + steps] - clock.at[WARMUP]) / steps


def plain_step_time(cfg: Config, data: dict, steps: int, device: torch.device) -> float:
    """The loop a user writes by hand: no engine, no hooks, one sync at the end."""
    task = build_task(cfg.task, cfg.task_args)
    seed_everything(cfg.train.seed)
    model: nn.Module = task.build_model().to(device)
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(
        param_groups(model.named_parameters(), cfg.optim.weight_decay), lr=cfg.optim.lr, **fused
    )
    precision = resolve_precision(cfg.precision)
    precision.configure_matmul(device)
    forward = torch.compile(model) if cfg.train.compile else model
    train = {k: v.to(device) for k, v in data["train"].items()}  # on the device up front
    b = cfg.data.batch_size
    started = 0.0
    for step in range(WARMUP + steps):
        if step == WARMUP:
            sync(device)
            started = time.perf_counter()
        raw = {k: v[step * b : (step + 1) * b] for k, v in train.items()}
        batch = task.finish(raw, precision.input_dtype)
        with precision.autocast(device):
            loss = task.loss(forward, batch)
        loss.backward()
        if cfg.train.grad_clip:
            nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    float(loss.detach())  # wait for the last step, as the raylift loop's last log does
    return (time.perf_counter() - started) / steps


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mfu(cfg: Config, step_s: float, device: torch.device) -> str:
    """Model FLOPs utilisation of a step time, against the device's peak (a datasheet's on
    a GPU, the best measured matmul on a CPU)."""
    task = build_task(cfg.task, cfg.task_args)
    with torch.device("meta"):
        model = task.build_model()
    achieved = flops_per_sample(task, model) * cfg.data.batch_size / step_s
    peak, _ = peak_flops(device, resolve_precision(cfg.precision).compute_dtype)
    return f"{achieved / peak:.1%}" if peak else "n/a"


# The gpt task at each device's size: configs/gpt-tiny.yaml's on a CPU, GPT-2-small's on a GPU.
SIZES = {
    "cpu": ["task_args.max_bytes=1000000"],
    "cuda": [
        "task_args.n_layer=12",
        "task_args.n_head=12",
        "task_args.d_model=768",
        "task_args.block_size=1024",
        "task_args.max_bytes=2000000",
        "data.batch_size=16",
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="a multiple of 20")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--precision", default=None, help="default: bf16-mixed on CUDA, else 32")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--compile", action="store_true", help="both loops compiled")
    parser.add_argument("--no-save", action="store_true", help="print only (benchmarks/gpu.py)")
    parser.add_argument("overrides", nargs="*", help="config overrides after the sizes")
    args = parser.parse_args()
    if args.steps % WARMUP:
        parser.error(f"--steps must be a multiple of {WARMUP}: the loop logs every {WARMUP}")
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    precision = args.precision or ("bf16-mixed" if cuda else "32")
    total = WARMUP + args.steps
    cfg = load_config(
        REPO / "configs" / "gpt-tiny.yaml",
        [
            *SIZES[device.type],
            f"precision={precision}",
            f"train.max_steps={total}",
            f"train.log_every_n_steps={WARMUP}",
            "train.eval_every_n_steps=null",
            f"train.compile={str(args.compile).lower()}",
            "optim.warmup_steps=0",
            "checkpoint.every_n_steps=null",
            "scaling.num_workers=1",
            f"scaling.use_gpu={str(cuda).lower()}",
            *args.overrides,
        ],
    )
    data = tensors(build_task(cfg.task, cfg.task_args))
    # The raylift loop shuffles nothing here (an in-memory source in storage order).
    rows = len(next(iter(data["train"].values())))
    if rows < total * cfg.data.batch_size:
        raise SystemExit(f"need {total * cfg.data.batch_size} rows, have {rows}")
    ours, plain = repeat(cfg, data, args, device)
    a, b = statistics.median(ours), statistics.median(plain)
    # Each repeat runs both loops back to back: the ratio within a repeat cancels the
    # machine's drift between repeats (on a shared VM, CPU steal comes and goes).
    paired = statistics.median(o / p for o, p in zip(ours, plain, strict=True))
    print(describe())
    print(
        f"median step time over {args.repeats} repeats of {args.steps} steps on {device.type} "
        f"({cfg.precision}, batch {cfg.data.batch_size}, compile {args.compile}, "
        f"{torch.get_num_threads()} threads): hand-written {b * 1e3:.2f} ms "
        f"(MFU {mfu(cfg, b, device)}), raylift {a * 1e3:.2f} ms (MFU {mfu(cfg, a, device)}), "
        f"ratio {a / b:.3f}; median of the per-repeat ratios {paired:.3f}"
    )
    if args.no_save:
        return
    what = f"step time, gpt-tiny, {cfg.precision}, 1 process on {device.type}" + (
        ", train.compile" if args.compile else ""
    )
    save(
        f"overhead{'_compile' if args.compile else ''}.py",
        f"raylift's loop against a hand-written PyTorch loop ({what})",
        ["loop", "median step ms", "MFU"],
        [["hand-written", f"{b * 1e3:.2f}", mfu(cfg, b, device)],
         ["raylift", f"{a * 1e3:.2f}", mfu(cfg, a, device)]],
        {"what": what, "raylift": f"{a * 1e3:.2f} ms", "baseline": f"{b * 1e3:.2f} ms",
         "ratio": f"{a / b:.3f} (per-repeat median {paired:.3f})"},
        notes=f"Median of {args.repeats} repeats of {args.steps} steps, batch "
        f"{cfg.data.batch_size}, {torch.get_num_threads()} threads.",
    )  # fmt: skip


def repeat(
    cfg: Config, data: dict, args: argparse.Namespace, device: torch.device
) -> tuple[list[float], list[float]]:
    ours: list[float] = []
    plain: list[float] = []
    backend = "nccl" if device.type == "cuda" else "gloo"
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(backend, init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        try:
            for r in range(args.repeats):
                plain.append(plain_step_time(cfg, data, args.steps, device))
                ours.append(raylift_step_time(cfg, data, args.steps, Path(tmp) / f"r{r}", device))
                ms = plain[-1] * 1e3, ours[-1] * 1e3
                print(
                    f"repeat {r}: hand-written {ms[0]:.2f} ms  raylift {ms[1]:.2f} ms", flush=True
                )
        finally:
            dist.destroy_process_group()
    return ours, plain


if __name__ == "__main__":
    main()
