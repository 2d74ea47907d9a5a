"""Handwritten digits (the 8x8 set that scikit-learn ships) with a small CNN.

Images are stored as uint8 and only become floats, normalised, on the device:
four times less data through the object store and the host-to-device copy.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from raylift.tasks.base import Batch, Columns, ImageClassifier, not_hf

# Mean and std of the digits images after scaling to [0, 1].
_MEAN, _STD = 0.3045, 0.3760


class DigitsNet(nn.Module):
    def __init__(self, width: int = 32, dropout: float = 0.1):
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.fc1 = nn.Linear(2 * width * 16, 128)
        self.fc2 = nn.Linear(128, 10)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = self.dropout(F.relu(self.fc1(x.flatten(1))))
        return self.fc2(x)


def digits_file() -> Path | None:
    """scikit-learn's ``digits.csv.gz``, found without importing scikit-learn."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")  # finds the package; imports nothing
    origin = spec.origin if spec else None
    path = Path(origin).parent / "datasets" / "data" / "digits.csv.gz" if origin else None
    return path if path is not None and path.is_file() else None


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 images (uint8, values 0..16) and labels, read from scikit-learn's copy of
    the file without importing scikit-learn (seconds of imports for 1,797 rows)."""
    import gzip

    path = digits_file()
    if path is None:
        from sklearn.datasets import load_digits as sklearn_digits

        digits = sklearn_digits()
        return digits.images.astype(np.uint8), digits.target.astype(np.int64)
    with gzip.open(path, "rt") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1].astype(np.uint8).reshape(-1, 8, 8), data[:, -1].astype(np.int64)


class DigitsTask(ImageClassifier):
    """Classify 8x8 digit images; ``val_fraction`` of them, drawn by ``split_seed``, held out."""

    hf_config = not_hf  # its model is raylift's own: export writes safetensors

    def __init__(
        self, width: int = 32, dropout: float = 0.1, val_fraction: float = 0.2, split_seed: int = 0
    ):
        if not 0 < val_fraction < 1:
            raise ValueError("task_args.val_fraction: must be between 0 and 1")
        self.width, self.dropout = width, dropout
        self.val_fraction, self.split_seed = val_fraction, split_seed

    def build_model(self) -> nn.Module:
        return DigitsNet(self.width, self.dropout)

    def raw_source(self) -> str:
        """scikit-learn's copy of the digits file, which every install has."""
        return str(digits_file() or "sklearn.datasets.load_digits")

    def sources(self) -> dict[str, Columns]:
        images, labels = load_digits()
        order = np.random.default_rng(self.split_seed).permutation(len(labels))
        n_val = int(len(labels) * self.val_fraction)
        val, train = order[:n_val], order[n_val:]
        return {
            "train": {"image": images[train], "label": labels[train]},
            "val": {"image": images[val], "label": labels[val]},
        }

    def preprocess(self, batch: Columns) -> Columns:
        # 0..16 -> 0..255 keeps full uint8 resolution for the device-side normalisation.
        image = (batch["image"].astype(np.uint16) * 255 // 16).astype(np.uint8)
        return {"image": image, "label": batch["label"].astype(np.int64)}

    def finish(self, batch: Batch, dtype: torch.dtype) -> Batch:
        x = batch["image"].to(dtype).div_(255.0).sub_(_MEAN).div_(_STD)
        return {"image": x.unsqueeze(1), "label": batch["label"].long()}

    def flops_per_sample(self, model: nn.Module) -> float:
        """Forward multiply-adds of the CNN x 2 FLOPs each, x 3 for forward + backward."""
        w = self.width
        conv1 = 8 * 8 * w * 9  # 8x8 outputs, w channels, 3x3 kernel over 1 input channel
        conv2 = 8 * 8 * 2 * w * 9 * w
        fc = 2 * w * 16 * 128 + 128 * 10
        return 3 * 2 * float(conv1 + conv2 + fc)
