"""The naive image pipeline the speed guides warn about against raylift's, on one device.

    python benchmarks/pipeline.py [--images 3000] [--size 32] [--epochs 15] [--target 0.95]
        [--no-save]

A folder of JPEGs (and some PNGs) of drawn shapes, three classes, 256 px as photos
are at least (``tests/corpora.py``; written once, not timed), the same train/val split (the
``images`` task's hash of the path), the same ResNet (``raylift.tasks.images``), the
same global batch (64), AdamW settings, crop-and-flip augmentation and image size.
Both sides run on the same device: the GPU when there is one, else the CPU.

- naive, torchvision's ``ImageFolder`` recipe written out: per sample in
  ``__getitem__``, PIL decode, resize and centre crop, reflection pad, random crop and
  flip, ``ToTensor`` and normalise, all in fp32 on the host; ``DataLoader(num_workers=0)``;
  fp32; ``loss.item()`` after every step; a fixed number of epochs (``--epochs``) with an
  evaluation after each and no early stopping; one process.
- raylift: ``raylift prep configs/images.yaml`` (decode and resize once into uint8
  shards; timed separately, it runs once per dataset), then ``raylift train`` from a
  fresh local Ray: the prefetching stream, uint8 to the device, crop, flip and
  normalise there, ``precision: auto``, early stopping on val_loss (patience 4); the
  same ``--epochs`` cap. 2 CPU workers, or one per GPU.

Prints, per side, the wall time to exit, the val accuracy at exit and the time at which
val accuracy first reached ``--target`` (raylift's from the timestamps of its MLflow
metrics, measured from the command's start), then naive / raylift for each, with and
without prep (goal, to exit: >= 5x on a CPU, >= 10x on one GPU).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from machine import describe  # noqa: E402
from results import save  # noqa: E402

sys.path.insert(0, str(REPO))
from launch import prep_shards, raylift_train  # noqa: E402

from raylift.data.sources import in_val  # noqa: E402
from raylift.tasks.images import MEAN, STD, ResNet, list_images  # noqa: E402
from tests.corpora import write_image_folder  # noqa: E402

CONFIG = REPO / "configs" / "images.yaml"
BATCH, LR, WEIGHT_DECAY, PAD, VAL_PERCENT = 64, 3e-3, 0.05, 4, 10


def split(root: Path) -> tuple[list[str], dict[str, list[tuple[str, int]]]]:
    """The images task's classes and train/val split, as (path, label) pairs."""
    classes, found = list_images(str(root))
    paths = found[""]
    base = str(root)
    val = {p for p in paths if in_val(p[len(base) :].lstrip("/").encode(), VAL_PERCENT)}
    label = {c: i for i, c in enumerate(classes)}
    pairs = {p: label[Path(p).parent.name] for p in paths}
    return classes, {
        "train": [(p, y) for p, y in pairs.items() if p not in val],
        "val": [(p, y) for p, y in pairs.items() if p in val],
    }


class ImageFolderLike(Dataset):
    """``ImageFolder`` with Resize, CenterCrop, [RandomCrop(pad), RandomHorizontalFlip],
    ToTensor and Normalize, in ``__getitem__``, one sample at a time."""

    def __init__(self, items: list[tuple[str, int]], size: int, train: bool):
        self.items, self.size, self.train = items, size, train
        self.mean = np.asarray(MEAN, np.float32)[:, None, None]
        self.std = np.asarray(STD, np.float32)[:, None, None]
        self.rng = np.random.default_rng(0)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        path, label = self.items[i]
        s = self.size
        with Image.open(path) as raw:
            img = raw.convert("RGB")
        w, h = img.size
        scale = s / min(w, h)
        img = img.resize((max(s, round(w * scale)), max(s, round(h * scale))))
        left, top = (img.size[0] - s) // 2, (img.size[1] - s) // 2
        x = np.asarray(img.crop((left, top, left + s, top + s)), np.float32) / 255.0
        x = x.transpose(2, 0, 1)
        if self.train:
            x = np.pad(x, ((0, 0), (PAD, PAD), (PAD, PAD)), mode="reflect")
            r, c = self.rng.integers(0, 2 * PAD + 1, 2)
            x = x[:, r : r + s, c : c + s]
            if self.rng.random() < 0.5:
                x = x[:, :, ::-1]
        x = (x - self.mean) / self.std
        return torch.from_numpy(np.ascontiguousarray(x)), label


def naive(items: dict[str, list[tuple[str, int]]], opts: argparse.Namespace) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    started = time.perf_counter()
    torch.manual_seed(0)
    model = ResNet(3, opts.width).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    train = DataLoader(ImageFolderLike(items["train"], opts.size, True), BATCH, shuffle=True)
    val = DataLoader(ImageFolderLike(items["val"], opts.size, False), BATCH)
    losses, reached, acc = [], math.nan, 0.0
    for epoch in range(opts.epochs):
        model.train()
        for x, y in train:
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())  # the per-step host sync
        model.eval()
        correct = 0
        with torch.no_grad():
            for x, y in val:
                correct += int((model(x.to(device)).argmax(-1) == y.to(device)).sum())
        acc = correct / len(items["val"])
        print(f"  naive epoch {epoch}: val_acc {acc:.4f}", flush=True)
        if acc >= opts.target and math.isnan(reached):
            reached = time.perf_counter() - started
    return {"seconds": time.perf_counter() - started, "val_acc": acc, "reached": reached}


def overrides(root: Path, opts: argparse.Namespace, gpus: int) -> list[str]:
    return [
        f"task_args.root={root}",
        f"task_args.image_size={opts.size}",
        f"task_args.width={opts.width}",
        f"train.max_epochs={opts.epochs}",
        f"scaling.num_workers={gpus or 2}",
        f"data.batch_size={BATCH // (gpus or 2)}",  # per worker: the same global batch
        f"scaling.use_gpu={str(gpus > 0).lower()}",
        *opts.overrides,
    ]


def raylift(home: Path, extra: list[str], target: float) -> dict[str, Any]:
    from mlflow.tracking import MlflowClient

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    started = time.time()
    out = raylift_train(home, "pipeline", env, extra, config=CONFIG)
    seconds = time.time() - started
    found = re.search(r"at step (\d+): .*val_acc ([\d.]+)", out)
    run_id = re.search(r"MLflow run (\w+)", out)
    assert found and run_id, out[-2000:]
    history = MlflowClient(f"sqlite:///{home / 'mlflow.db'}").get_metric_history(
        run_id.group(1), "val_acc"
    )
    hits = sorted(m.timestamp for m in history if m.value >= target)
    return {
        "seconds": seconds,
        "val_acc": float(found.group(2)),
        "step": int(found.group(1)),
        "reached": hits[0] / 1000 - started if hits else math.nan,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=3000, help="in all, three classes")
    parser.add_argument("--source-size", type=int, default=256, help="the JPEGs' size, px")
    parser.add_argument("--size", type=int, default=32, help="training image size, px")
    parser.add_argument("--width", type=int, default=16, help="the ResNet's first width")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--no-save", action="store_true", help="print only (benchmarks/gpu.py)")
    parser.add_argument("overrides", nargs="*", help="for raylift, e.g. data.prefetch_batches=8")
    opts = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="rl-pipe-", dir="/tmp"))  # short: Ray's sockets
    gpus = torch.cuda.device_count()
    try:
        root = write_image_folder(home / "images", opts.images // 3, size=opts.source_size)
        _, items = split(root)
        slow = naive(items, opts)
        print(f"naive: {slow}", flush=True)
        extra = overrides(root, opts, gpus)
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        prep_started = time.perf_counter()
        prep_shards(home, env, CONFIG, tuple(extra))
        prep = time.perf_counter() - prep_started
        fast = raylift(home, extra, opts.target)
        print(f"raylift: {fast}", flush=True)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    report(slow, fast, prep, items, opts, gpus)


def report(
    slow: dict, fast: dict, prep: float, items: dict, opts: argparse.Namespace, gpus: int
) -> None:
    device = f"{gpus} GPU" if gpus else "CPU"
    print(
        f"\n{describe()}; {device}; {len(items['train'])} train / {len(items['val'])} val "
        f"images, {opts.size} px, target val_acc {opts.target}; "
        f"raylift prep (once per dataset) {prep:.1f} s"
    )
    print(f"{'pipeline':<22}{'to exit':>10}{'val_acc':>9}{'to target':>11}")
    for name, r in (("naive", slow), ("raylift", fast)):
        print(f"{name:<22}{r['seconds']:>8.1f} s{r['val_acc']:>9.4f}{r['reached']:>9.1f} s")
    print(f"raylift stopped early at step {fast['step']}")
    print(f"{'naive / raylift':<22}{'to exit':>10}{'to target':>11}")
    for label, extra in (("without prep", 0.0), ("with prep", prep)):
        print(
            f"{label:<22}{slow['seconds'] / (fast['seconds'] + extra):>9.2f}x"
            f"{slow['reached'] / (fast['reached'] + extra):>10.2f}x"
        )
    if opts.no_save:
        return
    rows = [[name, f"{r['seconds']:.1f} s", f"{r['val_acc']:.4f}", f"{r['reached']:.1f} s"]
            for name, r in (("naive", slow), ("raylift", fast))]  # fmt: skip
    save(
        __file__,
        f"an image pipeline end to end: raylift against the naive ImageFolder loop ({device}, "
        f"{len(items['train'])} train images, {opts.size} px, target val_acc {opts.target})",
        ["pipeline", "to exit", "val_acc", "to target"],
        rows,
        {"what": f"{len(items['train'])} JPEGs to val_acc {opts.target}, {device}",
         "raylift": f"{fast['seconds']:.1f} s to exit, {fast['reached']:.1f} s to the target "
                    f"(+ prep {prep:.1f} s once)",
         "baseline": f"naive loop {slow['seconds']:.1f} s, {slow['reached']:.1f} s",
         "ratio": f"{slow['seconds'] / fast['seconds']:.2f}x to exit, "
                  f"{slow['reached'] / fast['reached']:.2f}x to the target"},
    )  # fmt: skip


if __name__ == "__main__":
    main()
