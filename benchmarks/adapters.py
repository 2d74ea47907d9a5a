"""LoRA against full fine-tuning of the same pretrained model: memory held per rank and speed.

    python benchmarks/adapters.py [--shape small|8b] [--steps 30] [--only fsdp zero3]
        [--device auto|cpu|cuda]

A Llama of ``--shape`` (``small``: hidden 512, 4 layers, 8 heads; ``8b``: Llama-3-8B's
shape, for a GPU) saved with ``save_pretrained`` (random weights: the shapes are what
count), fine-tuned by ``hf-causal-lm`` through the real per-worker loop (no Ray), fp32 on
CPUs in 2 processes over gloo, bf16-true on a GPU (one process, NCCL). For fsdp and
ZeRO-3, full fine-tuning against ``model.adapter.type: lora`` (r 8, every linear
layer): the model state rank 0 holds after its first step (weights, trainable and
frozen, gradients, optimizer state: counted from the tensors), on a GPU the peak
allocated, and samples/s (the median logged interval after the first).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))
from machine import describe  # noqa: E402
from results import save  # noqa: E402
from strategies import run  # noqa: E402

from raylift.validation import config_from_dict  # noqa: E402
from tests.helpers import close_pools  # noqa: E402

SHAPES = {
    "small": {"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 4,
              "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 256},
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256},
}  # fmt: skip
STRATEGIES = ("fsdp", "zero3")
LOG_EVERY = 5
BATCH = 4


def pretrained(shape: str, folder: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type="llama", max_position_embeddings=512,
                                  **SHAPES[shape])  # fmt: skip
    with torch.device("meta" if shape == "8b" else "cpu"):
        model = AutoModelForCausalLM.from_config(config)
    if shape == "8b":  # random weights, written in bf16 without holding fp32 copies
        model = model.to_empty(device="cpu").to(torch.bfloat16)
    model.save_pretrained(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--steps", type=int, default=30, help="a multiple of 5")
    parser.add_argument("--only", nargs="*", default=list(STRATEGIES))
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    opts = parser.parse_args()
    cuda = opts.device == "cuda" or (opts.device == "auto" and torch.cuda.is_available())
    results: dict[tuple[str, str], dict] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            base = pretrained(opts.shape, Path(tmp) / "base")
            for name in opts.only:
                for mode in ("full", "lora"):
                    results[name, mode] = measure(opts, base, name, mode, cuda, Path(tmp))
    finally:
        close_pools()
    report(results, opts, 1 if cuda else 2, cuda)


def measure(
    opts: argparse.Namespace, base: Path, name: str, mode: str, cuda: bool, tmp: Path
) -> dict:
    strategy = {"name": "fsdp"} if name == "fsdp" else {"name": "deepspeed", "zero_stage": 3}
    cfg = config_from_dict({
        "task": "hf-causal-lm",
        "task_args": {"model": str(base), "block_size": 128, "max_bytes": 2_000_000},
        "model": {"adapter": {"type": "lora" if mode == "lora" else None}},
        "data": {"batch_size": BATCH},
        "optim": {"lr": 1e-4},
        "train": {"max_steps": opts.steps, "log_every_n_steps": LOG_EVERY,
                  "eval_every_n_steps": None},
        "checkpoint": {"every_n_steps": None},
        "precision": "bf16-true" if cuda else "32",
        "scaling": {"use_gpu": cuda},
        "strategy": strategy,
    })  # fmt: skip
    out = tmp / f"{name}-{mode}" / "m.pt"
    run(cfg.to_dict(), out, tmp, cuda)
    found = torch.load(out, weights_only=True)
    step = statistics.median(found["step_time_s"])
    found["samples_per_s"] = BATCH * (1 if cuda else 2) / step
    print(f"{name} {mode}: {step * 1e3:.1f} ms per step", flush=True)
    return found


def report(results: dict, opts: argparse.Namespace, world: int, cuda: bool) -> None:
    def mib(r: dict, key: str = "model_state_bytes_per_rank") -> float:
        return r.get(key, 0.0) / 2**20

    header = ["strategy", "fine-tuning", "model state MiB/rank", "of it frozen", "samples/s"]
    if cuda:
        header.append("peak GiB")
    rows = []
    for (name, mode), r in results.items():
        row = [name, mode, f"{mib(r):,.1f}", f"{mib(r, 'model_state_frozen_bytes'):,.1f}",
               f"{r['samples_per_s']:.2f}"]  # fmt: skip
        if cuda:
            row.append(f"{r.get('cuda_peak_allocated_bytes', 0) / 2**30:.1f}")
        rows.append(row)
        print(" | ".join(row))
    name = opts.only[0]
    full, lora = results[name, "full"], results[name, "lora"]
    memory = lora["model_state_bytes_per_rank"] / full["model_state_bytes_per_rank"]
    speed = lora["samples_per_s"] / full["samples_per_s"]
    save(
        "adapters.py",
        f"LoRA (r 8, every linear layer) against full fine-tuning of a Llama ({opts.shape} "
        f"shape), world size {world}",
        header,
        rows,
        {"what": f"LoRA vs full fine-tuning ({name}, Llama {opts.shape}): model state per rank",
         "raylift": f"LoRA {mib(lora):,.1f} MiB/rank, {lora['samples_per_s']:.2f} samples/s",
         "baseline": f"full {mib(full):,.1f} MiB/rank, {full['samples_per_s']:.2f} samples/s",
         "ratio": f"{memory:.2f}x memory, {speed:.2f}x samples/s"},
        notes=f"{describe()}. Model state counted from the tensors rank 0 holds after its "
        "first step; samples/s from the median logged interval after the first.",
    )  # fmt: skip


if __name__ == "__main__":
    main()
