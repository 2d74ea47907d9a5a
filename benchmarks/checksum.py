"""What the checkpoints' xxh3-64 checksum costs, against the save it protects.

    python benchmarks/checksum.py [--params 50e6] [--repeats 3]

Saves a model's fp32 weights and its two AdamW moments (``--params`` parameters each,
on CUDA when one is present, as a checkpoint would copy them off the device) with
``torch.save``, then runs raylift's checksum over the files written. Prints the median
of each and their ratio (goal: the checksum costs under 5% of the save).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from machine import describe  # noqa: E402
from results import save as save_result  # noqa: E402

from raylift.checkpoint import file_digest  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=50e6)
    parser.add_argument("--repeats", type=int, default=3)
    opts = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n = int(opts.params)
    state = {k: torch.randn(n, device=device) for k in ("weights", "exp_avg", "exp_avg_sq")}
    folder = Path(tempfile.mkdtemp(prefix="rl-crc-"))
    saves, crcs = [], []
    try:
        for r in range(opts.repeats):
            files = [folder / f"{k}-{r}.pt" for k in state]
            started = time.perf_counter()
            for (_, tensor), path in zip(state.items(), files, strict=True):
                torch.save(tensor, path)
            saves.append(time.perf_counter() - started)
            started = time.perf_counter()
            for path in files:
                file_digest(path)
            crcs.append(time.perf_counter() - started)
        size = sum(p.stat().st_size for p in folder.glob("*-0.pt"))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    save, crc = statistics.median(saves), statistics.median(crcs)
    print(f"{describe()}; {n / 1e6:.0f}M params, fp32 weights + 2 AdamW moments")
    print(f"{'step':<12}{'median':>10}{'MB/s':>10}")
    print(f"{'save':<12}{save:>8.2f} s{size / save / 1e6:>10.0f}")
    print(f"{'xxh3':<12}{crc:>8.2f} s{size / crc / 1e6:>10.0f}")
    print(f"checksum / save: {crc / save:.1%} of {size / 2**20:.0f} MiB")
    save_result(
        __file__,
        f"xxh3 checksums of a checkpoint against writing it ({n / 1e6:.0f}M params, fp32 "
        "weights + 2 AdamW moments)",
        ["step", "median s", "MB/s"],
        [["torch.save", f"{save:.2f}", f"{size / save / 1e6:.0f}"],
         ["xxh3 checksum", f"{crc:.2f}", f"{size / crc / 1e6:.0f}"]],
        {"what": f"checksumming a {size / 2**20:.0f} MiB checkpoint",
         "raylift": f"{crc:.2f} s", "baseline": f"torch.save {save:.2f} s",
         "ratio": f"{crc / save:.1%} of the save"},
    )  # fmt: skip


if __name__ == "__main__":
    main()
