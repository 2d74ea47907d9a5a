"""Corpora and tasks for the data tests, written from text on this machine (imported by
Ray workers, so they live in an importable module)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from raylift.tasks.digits import DigitsTask


def documents(n: int) -> list[str]:
    """``n`` distinct documents: the standard library's module docstrings and code."""
    from raylift.tasks.gpt import corpus_files, stdlib_root

    out = []
    for path in corpus_files(stdlib_root()):
        text = path.read_text(errors="replace")
        if len(text) > 200:
            out.append(text[:4000])
        if len(out) == n:
            return out
    raise RuntimeError(f"the standard library has fewer than {n} modules")


def write_text_file(path: Path, n: int) -> Path:
    """One text file of ``n`` standard-library documents, a blank line between them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(documents(n)))
    return path


def write_jsonl(folder: Path, n: int, files: int = 3, field: str = "body") -> Path:
    """``n`` documents as JSONL rows with the text in ``field``, over ``files`` files."""
    folder.mkdir(parents=True, exist_ok=True)
    docs = documents(n)
    for i in range(files):
        with open(folder / f"part-{i}.jsonl", "w") as f:
            for j, text in enumerate(docs[i::files]):
                f.write(json.dumps({"id": i * n + j, field: text}) + "\n")
    return folder


class ParquetDigits(DigitsTask):
    """Digits whose raw data is a folder of parquet files per split, read with
    ``ray.data.read_parquet``: the README's example of a user task at scale."""

    def __init__(self, root: str = "", **kwargs: Any):
        super().__init__(**kwargs)
        self.root = root

    def sources(self) -> dict[str, Any]:
        import ray.data

        return {s: ray.data.read_parquet(f"{self.root}/{s}") for s in ("train", "val")}

    def preprocess(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        images = np.stack(batch["pixels"]).reshape(-1, 8, 8).astype(np.uint8)
        return super().preprocess({"image": images, "label": batch["label"]})


def write_digits_parquet(root: Path) -> Path:
    """The digits splits as parquet files (flat pixel lists), three files per split."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for split, cols in DigitsTask().sources().items():
        (root / split).mkdir(parents=True, exist_ok=True)
        pixels = cols["image"].reshape(len(cols["label"]), -1)
        for i in range(3):
            table = pa.table({"pixels": list(pixels[i::3]), "label": cols["label"][i::3]})
            pq.write_table(table, root / split / f"part-{i}.parquet")
    return root


SHAPES = ("circle", "square", "triangle")


def write_image_folder(root: Path, per_class: int, size: int = 32, seed: int = 0) -> Path:
    """``root/<shape>/<i>.jpg`` (and some .png): a shape of random place, size and colour
    on a random background, per class. Deterministic for a seed."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    for label, shape in enumerate(SHAPES):
        (root / shape).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            bg = tuple(int(c) for c in rng.integers(0, 120, 3))
            fg = tuple(int(c) for c in rng.integers(130, 256, 3))
            img = Image.new("RGB", (size, size), bg)
            r = int(rng.integers(size // 5, size // 3))
            cx, cy = (int(c) for c in rng.integers(r, size - r, 2))
            draw = ImageDraw.Draw(img)
            box = (cx - r, cy - r, cx + r, cy + r)
            if shape == "circle":
                draw.ellipse(box, fill=fg)
            elif shape == "square":
                draw.rectangle(box, fill=fg)
            else:
                draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fg)
            ext = "png" if i % 4 == 0 else "jpg"
            img.save(root / shape / f"{label}-{i:05d}.{ext}")
    return root
