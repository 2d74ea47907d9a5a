"""What the checkpoints' xxh3-64 checksums cost, against the save they protect.

    python benchmarks/checksum.py [--params 50e6] [--repeats 3]

Saves a model's fp32 weights and its two AdamW moments (``--params`` parameters each,
on CUDA when one is present, as a checkpoint would copy them off the device) with
``torch.save``, then checksums the files written as a save seals its part
(``seal_checkpoint``: each file's zip records, its whole xxh3 and one per block) and as
``raylift verify`` checks them (the whole file's xxh3 alone). Prints the median of each
and the seal's share of the save (goal: under 5%). The share follows the save's speed
too: a save into the page cache (GB/s) leaves it less room than one to disk.
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

from raylift.tensors.checkpoints import file_digest, seal_checkpoint  # noqa: E402

NOTES = """
The seal reads each file once, 1 MiB at a time, and hashes each byte twice (the whole
file, and its block) while that 1 MiB is in the CPU's cache. Earlier runs (in git) read
64 MiB at a time, which went through memory: 1.65 GB/s on this machine for the whole file
alone, 23.4% of a 1.55 s save; the first, through a memory map, of the whole file alone:
9.6 GB/s, 4.6% of a 1.36 s save. The share follows the save's speed as much as the
checksum's: on this VM a save of the same 572 MiB took from 0.39 s (into the page cache)
to 3.3 s (held up by the disk) between runs, which puts the seal's share between about
30% and 3.5%; the rates (MB/s) are what compare between runs.
""".strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=50e6)
    parser.add_argument("--repeats", type=int, default=3)
    opts = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n = int(opts.params)
    state = {k: torch.randn(n, device=device) for k in ("weights", "exp_avg", "exp_avg_sq")}
    root = Path(tempfile.mkdtemp(prefix="rl-crc-"))
    saves, seals, wholes = [], [], []
    try:
        for r in range(opts.repeats):
            folder = root / str(r)
            folder.mkdir()
            files = [folder / f"{k}.pt" for k in state]
            started = time.perf_counter()
            for (_, tensor), path in zip(state.items(), files, strict=True):
                torch.save(tensor, path)
            saves.append(time.perf_counter() - started)
            started = time.perf_counter()
            seal_checkpoint(folder, {})  # what a save runs over its part before the upload
            seals.append(time.perf_counter() - started)
            started = time.perf_counter()
            for path in files:
                file_digest(path)
            wholes.append(time.perf_counter() - started)
        size = sum(p.stat().st_size for p in (root / "0").glob("*.pt"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    save, seal, whole = (statistics.median(t) for t in (saves, seals, wholes))
    print(f"{describe()}; {n / 1e6:.0f}M params, fp32 weights + 2 AdamW moments")
    print(f"{'step':<14}{'median':>10}{'MB/s':>10}")
    for name, t in (("save", save), ("seal (xxh3)", seal), ("verify (xxh3)", whole)):
        print(f"{name:<14}{t:>8.3f} s{size / t / 1e6:>10.0f}")
    print(f"seal / save: {seal / save:.1%}, verify / save: {whole / save:.1%} of "
          f"{size / 2**20:.0f} MiB")  # fmt: skip
    save_result(
        __file__,
        f"xxh3 checksums of a checkpoint against writing it ({n / 1e6:.0f}M params, fp32 "
        "weights + 2 AdamW moments)",
        ["step", "median s", "MB/s", "share of the save"],
        [["torch.save", f"{save:.3f}", f"{size / save / 1e6:.0f}", ""],
         ["seal: zip records, whole-file and 1 MiB block xxh3", f"{seal:.3f}",
          f"{size / seal / 1e6:.0f}", f"{seal / save:.1%}"],
         ["verify: whole-file xxh3", f"{whole:.3f}", f"{size / whole / 1e6:.0f}",
          f"{whole / save:.1%}"]],
        {"what": f"checksumming a {size / 2**20:.0f} MiB checkpoint as a save seals it",
         "raylift": f"{seal:.3f} s ({size / seal / 1e9:.1f} GB/s)",
         "baseline": f"torch.save {save:.3f} s ({size / save / 1e9:.2f} GB/s)",
         "ratio": f"{seal / save:.1%} of the save"},
        NOTES,
    )  # fmt: skip


if __name__ == "__main__":
    main()
