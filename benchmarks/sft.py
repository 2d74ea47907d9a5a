"""Instruction tuning with ``hf-sft``: packed against padded windows, and what the model
learns.

    python benchmarks/sft.py [--steps 600] [--rows 4000] [--device auto|cpu|cuda]

A small Llama (hidden 64, 2 layers; its byte-level BPE tokenizer trained on the file's
words, ChatML template) fine-tuned through the real per-worker loop (no Ray), ddp, fp32,
on 2 processes over gloo (one on a GPU), on a chat file made here (``tests/chats.py``:
"Repeat: w1 w2 w3" answered with the three words). Both runs train on the same
conversations for the same steps and global batch of windows: ``packing: true`` (whole
examples, best fit, into 128-token windows) against ``packing: false`` (one example a
window, each batch cut to its longest example, as a run's loader cuts it). Reported:
examples/s and trained tokens/s (the median logged interval after the first, times the
examples and trained tokens a window holds on average), the share of the positions the
model computes that are padding, and after training, how many of 200 held-out triples
each run's model answers exactly through the chat template with ``generate``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))
from machine import describe  # noqa: E402
from results import save  # noqa: E402

from raylift.data.ingest import TensorSource  # noqa: E402
from raylift.tasks import build_task  # noqa: E402
from raylift.validation import config_from_dict  # noqa: E402
from tests.chats import answers, model_folder, sft_tensors, write_chats  # noqa: E402
from tests.helpers import (  # noqa: E402
    ListTracker,
    LocalReporter,
    close_pools,
    make_trainer,
    run_ranks,
)

BLOCK = 128
LOG_EVERY = 10


def config(folder: Path, data: Path, packing: bool, steps: int, cuda: bool) -> dict:
    return {
        "task": "hf-sft",
        "task_args": {"model": str(folder), "data": str(data), "block_size": BLOCK,
                      "packing": packing, "val_percent": 5},
        "data": {"batch_size": 8},
        "optim": {"name": "adamw", "lr": 3.0e-3, "weight_decay": 0.0, "warmup_steps": 20},
        "train": {"max_steps": steps, "log_every_n_steps": LOG_EVERY, "eval_every_n_steps": steps,
                  "seed": 0, "max_epochs": 1000},
        "precision": "32",
        "scaling": {"num_workers": 1 if cuda else 2, "use_gpu": cuda},
        "checkpoint": {"every_n_steps": None},
    }  # fmt: skip


def train(rank: int, world: int, cfg_dict: dict, data: str, out: str) -> None:
    cfg = config_from_dict(cfg_dict)
    task = build_task(cfg.task, cfg.task_args)
    tracker = ListTracker()
    reporter = LocalReporter(Path(out).parent / f"r{rank}")
    device = torch.device("cuda", rank) if cfg.scaling.use_gpu else None
    cols = sft_tensors(task, Path(data))
    batch = cfg.data.batch_size
    source = TensorSource(cols["train"], cols["val"], rank, world, batch, batch)
    source.transform = task.transform  # as a run's loader: unpacked batches cut to their longest
    trainer = make_trainer(cfg, rank, world, reporter, tracker, device=device, source=source)
    trainer.run()
    if rank == 0:
        module = getattr(trainer.engine.module, "module", trainer.engine.module)
        samples = tracker.series("samples_per_s")
        state = {k: v.cpu() for k, v in module.state_dict().items()}
        torch.save({"samples_per_s": [samples[s] for s in sorted(samples)][1:],
                    "val_loss": tracker.series("val_loss"), "state": state}, out)  # fmt: skip


def window_shares(task: Any, data: Path, batch: int) -> dict[str, float]:
    """Per window of the train split: examples and trained tokens; and the share of the
    positions the model computes that are padding, in batches as the loader cuts them."""
    cols = {k: v.numpy() for k, v in sft_tensors(task, data)["train"].items()}
    padding = positions = 0
    for i in range(0, len(cols["example"]), batch):
        cut = task.transform({k: v[i : i + batch] for k, v in cols.items()}, None)
        padding += int((cut["example"] == 0).sum())
        positions += cut["example"].size
    return {
        "windows": float(len(cols["example"])),
        "examples_per_window": float(cols["examples"].mean()),
        "trained_per_window": float((cols["labels"] != -100).sum(1).mean()),
        "padding_share": padding / positions,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    opts = parser.parse_args()
    cuda = opts.device == "cuda" or (opts.device == "auto" and torch.cuda.is_available())
    results: dict = {}
    try:
        with tempfile.TemporaryDirectory() as tmp_name:
            tmp = Path(tmp_name)
            folder = model_folder(tmp / "model")
            data = tmp / "chats.jsonl"
            held_out = write_chats(data, opts.rows)
            for packing in (True, False):
                name = "packed" if packing else "padded"
                cfg = config(folder, data, packing, opts.steps, cuda)
                out = tmp / name / "out.pt"
                out.parent.mkdir()
                world = 1 if cuda else 2
                if cuda:
                    torch.multiprocessing.spawn(
                        _on_gpu, (cfg, str(data), str(out), str(tmp / f"pg-{name}")), nprocs=1
                    )
                else:
                    run_ranks(world, tmp, train, cfg, str(data), str(out))
                got = torch.load(out, weights_only=True)
                task = build_task("hf-sft", cfg["task_args"])
                shares = window_shares(task, data, cfg["data"]["batch_size"])
                per_s = statistics.median(got["samples_per_s"])
                results[name] = {**shares, "windows_per_s": per_s,
                                 "examples_per_s": per_s * shares["examples_per_window"],
                                 "trained_tokens_per_s": per_s * shares["trained_per_window"],
                                 "val_loss": got["val_loss"][max(got["val_loss"])]}  # fmt: skip
                model = task.build_model().eval()
                model.load_state_dict(got["state"])
                results[name]["held_out_exact"] = answers(model, task.tokenizer, held_out)
                results[name]["held_out"] = len(held_out)
    finally:
        close_pools()
    report(results, opts, cuda)


def _on_gpu(rank: int, cfg: dict, data: str, out: str, init_file: str) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=1)
    try:
        train(rank, 1, cfg, data, out)
    finally:
        dist.destroy_process_group()


def report(results: dict, opts: argparse.Namespace, cuda: bool) -> None:
    packed, padded = results["packed"], results["padded"]
    header = ["windows", "examples/s", "trained tokens/s", "padding", "val_loss", "held-out exact"]
    rows = [
        [name, f"{r['examples_per_s']:.1f}", f"{r['trained_tokens_per_s']:.0f}",
         f"{r['padding_share']:.1%}", f"{r['val_loss']:.3f}",
         f"{r['held_out_exact']}/{r['held_out']}"]
        for name, r in results.items()
    ]  # fmt: skip
    for row in rows:
        print("  ".join(f"{h} {v}" for h, v in zip(["", *header[1:]], row, strict=True)))
    ratio = packed["examples_per_s"] / padded["examples_per_s"]
    save(
        "sft.py",
        f"hf-sft: packed against padded {BLOCK}-token windows, {opts.steps} steps, "
        f"{'1 GPU' if cuda else '2 CPU processes'}",
        header,
        rows,
        {"what": "hf-sft packed vs padded windows (small Llama, chat file)",
         "raylift": f"packed {packed['examples_per_s']:.1f} examples/s, "
                    f"{packed['padding_share']:.0%} padding",
         "baseline": f"padded {padded['examples_per_s']:.1f} examples/s, "
                     f"{padded['padding_share']:.0%} padding",
         "ratio": f"{ratio:.2f}x examples/s"},
        notes=f"{describe()}. Examples/s: the median logged windows/s after the first interval "
        "times the examples a window holds on average; held-out exact: of 200 word triples "
        "the file never holds, answered exactly through the chat template with generate.",
    )  # fmt: skip


if __name__ == "__main__":
    main()
