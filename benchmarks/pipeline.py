"""The naive pipeline the speed guides warn about against raylift's, to the same accuracy.

    python benchmarks/pipeline.py [--target 0.98] [--epochs 30] [key=value ...]

Same task (the digits CNN of configs/quickstart.yaml, the same train/val split), same
global batch (64), optimizer and learning rate, judged by the same val accuracy target.

- naive: the images as PNG files on disk (written once, not timed), decoded one by one
  in ``Dataset.__getitem__``, converted to float32 and normalised on the CPU there,
  ``DataLoader(num_workers=0)``, fp32, ``loss.item()`` after every step, a fixed number
  of epochs (``--epochs``, the quickstart's ``max_epochs``) with an evaluation after
  each, no early stopping: one process using every core.
- raylift: ``raylift train configs/quickstart.yaml`` from shards ``raylift prep`` wrote
  (uint8, timed separately: it runs once per dataset), streamed with prefetch, bf16-mixed,
  early stopping, 2 workers; from a fresh local Ray, and joining a running Ray.

Prints the wall time of each to exit, its final val accuracy, when the naive run first
reached the target, and the ratio naive / raylift (goal: >= 5x).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from machine import describe  # noqa: E402

sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from launch import prep_shards, raylift_train, start_head  # noqa: E402

from raylift.tasks.digits import _MEAN, _STD, DigitsNet, DigitsTask  # noqa: E402


def write_pngs(root: Path) -> dict[str, list[tuple[Path, int]]]:
    """The dataset as it often sits on disk: one 8-bit PNG per image."""
    from PIL import Image

    out: dict[str, list[tuple[Path, int]]] = {}
    for split, cols in DigitsTask().sources().items():
        (root / split).mkdir(parents=True)
        items = []
        for i, (image, label) in enumerate(zip(cols["image"], cols["label"], strict=True)):
            path = root / split / f"{i:05d}_{label}.png"
            Image.fromarray((image.astype(np.uint16) * 255 // 16).astype(np.uint8)).save(path)
            items.append((path, int(label)))
        out[split] = items
    return out


class PngDigits(Dataset):
    def __init__(self, items: list[tuple[Path, int]]):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        path, label = self.items[i]
        x = np.asarray(Image.open(path), dtype=np.float32) / 255.0
        x = (x - _MEAN) / _STD
        return torch.from_numpy(x)[None], label


def naive(files: dict[str, list[tuple[Path, int]]], epochs: int, target: float) -> dict:
    started = time.perf_counter()
    torch.manual_seed(0)
    model = DigitsNet(32, 0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    train = DataLoader(PngDigits(files["train"]), batch_size=64, shuffle=True, num_workers=0)
    val = DataLoader(PngDigits(files["val"]), batch_size=64, num_workers=0)
    losses, reached, acc = [], math.nan, 0.0
    for _ in range(epochs):
        model.train()
        for x, y in train:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())  # the per-step host sync
        model.eval()
        correct = 0
        with torch.no_grad():
            for x, y in val:
                correct += int((model(x).argmax(-1) == y).sum())
        acc = correct / len(files["val"])
        if acc >= target and math.isnan(reached):
            reached = time.perf_counter() - started
    return {"seconds": time.perf_counter() - started, "val_acc": acc, "reached": reached}


def raylift(home: Path, name: str, env: dict[str, str], overrides: list[str]) -> dict:
    started = time.perf_counter()
    out = raylift_train(home, name, env, overrides)
    found = re.search(r"at step (\d+): .*val_acc ([\d.]+)", out)
    assert found, out[-2000:]
    return {
        "seconds": time.perf_counter() - started,
        "val_acc": float(found.group(2)),
        "step": int(found.group(1)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=float, default=0.98)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("overrides", nargs="*", help="for raylift train, e.g. scaling.use_gpu=true")
    opts = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="rl-pipe-", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    files = write_pngs(home / "png")
    slow = naive(files, opts.epochs, opts.target)
    print(f"naive: {slow}", flush=True)
    prep_started = time.perf_counter()
    prep_shards(home, env)
    prep = time.perf_counter() - prep_started
    fresh = raylift(home, "fresh", env, opts.overrides)
    print(f"raylift (fresh local Ray): {fresh}", flush=True)
    address, ray = start_head(home)
    try:
        ray_env = {**env, "RAY_ADDRESS": address, "RAY_AUTH_MODE": "token"}
        joined = raylift(home, "joined", ray_env, opts.overrides)
    finally:
        ray.shutdown()  # type: ignore[attr-defined]
    print(f"raylift (running Ray): {joined}", flush=True)
    print(
        f"\n{describe()}; target val_acc "
        f"{opts.target}; raylift prep (once per dataset) {prep:.1f} s"
    )
    print(f"{'pipeline':<28}{'wall time':>11}{'val_acc':>9}{'naive / this':>14}")
    for name, r in (
        ("naive", slow),
        ("raylift, fresh local Ray", fresh),
        ("raylift, running Ray", joined),
    ):
        print(
            f"{name:<28}{r['seconds']:>9.1f} s{r['val_acc']:>9.4f}"
            f"{slow['seconds'] / r['seconds']:>13.2f}x"
        )
    print(f"the naive run first reached {opts.target} after {slow['reached']:.1f} s")


if __name__ == "__main__":
    main()
