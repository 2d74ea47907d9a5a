"""The hand-written prep of ``prep.py`` in Ray Data alone, with nothing of raylift's.

    RAY_ADDRESS=<a running Ray> python benchmarks/ray_data_prep.py DATA OUT

What a plain Ray Data pipeline pays on this machine for the ``multiprocessing.Pool``
prep's work (no train/val split, no shuffle, no manifest): for a folder of JSONL files,
``read_json`` -> ``map_batches`` packing 1,024 documents into ``block_size + 1`` windows
per batch -> ``write_parquet``; for a folder of images, ``read_binary_files`` ->
``map_batches`` decoding and resizing 64 images per batch -> ``write_parquet``.
``prep.py`` runs it beside ``raylift prep`` and the Pool.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

BLOCK = 128
IMAGE_SIZE = 32
SEP = b"\x00"


def pack(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    arr = np.frombuffer(SEP.join(str(t).encode() for t in batch["text"]), dtype=np.uint8)
    n = max((len(arr) - 1) // BLOCK, 0)
    return {"tokens": arr[np.arange(n)[:, None] * BLOCK + np.arange(BLOCK + 1)[None, :]]}


def decode_batch(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    from raylift.tasks.images import decode
    from tests.corpora import SHAPES

    images = [decode(bytes(b), IMAGE_SIZE) for b in batch["bytes"]]
    labels = [SHAPES.index(Path(str(p)).parent.name) for p in batch["path"]]
    return {"image": np.stack(images), "label": np.asarray(labels, dtype=np.int64)}


def main() -> None:
    import ray
    import ray.data

    data, out = Path(sys.argv[1]), sys.argv[2]
    ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR")
    ray.data.DataContext.get_current().enable_progress_bars = False
    jsonl = sorted(str(p) for p in data.glob("*.jsonl"))
    if jsonl:
        ds = ray.data.read_json(jsonl).map_batches(pack, batch_size=1024, batch_format="numpy")
    else:
        files = sorted(str(p) for p in data.rglob("*.*"))
        ds = ray.data.read_binary_files(files, include_paths=True)
        ds = ds.map_batches(decode_batch, batch_size=64, batch_format="numpy")
    ds.write_parquet(out, row_group_size=128)


if __name__ == "__main__":
    main()
