"""The quickstart as a new user runs it: ``raylift train configs/quickstart.yaml`` from an
empty folder (a fresh local Ray, the shards prepared on the way, MLflow in ./mlflow.db),
timed from the command to its exit, its console saved whole. The README and the getting
started page show that console, rendered from this file's result; nothing else is
compared, so the result has no baseline.

    python benchmarks/quickstart.py            # --keep 10 12: console lines shown at each end
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import save

REPO = Path(__file__).resolve().parents[1]
HOME = "/home/me/raylift"  # the folder the console shows, wherever it ran


def run(folder: Path) -> tuple[float, list[str], int]:
    """The quickstart from ``folder``: seconds to exit, console lines, exit code."""
    raylift = Path(sys.executable).with_name("raylift")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    started = time.perf_counter()
    done = subprocess.run(
        [str(raylift), "train", str(REPO / "configs" / "quickstart.yaml")],
        cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    seconds = time.perf_counter() - started
    lines = done.stdout.splitlines()
    return seconds, [line.replace(str(folder), HOME) for line in lines], done.returncode


def shortened(lines: list[str], head: int, tail: int) -> list[str]:
    """The first ``head`` and last ``tail`` lines, ``...`` between where lines are left out."""
    if len(lines) <= head + tail + 1:
        return lines
    return [*lines[:head], "...", *lines[-tail:]]


def final(lines: list[str], key: str) -> str:
    """The value of ``key`` on the run's last line (``val_acc 0.9889``)."""
    found = [m.group(1) for line in lines if (m := re.search(rf"\b{key} ([\d.]+)", line))]
    return found[-1] if found else "-"


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--keep", type=int, nargs=2, default=(10, 12), metavar=("HEAD", "TAIL"))
    opts = args.parse_args()
    with tempfile.TemporaryDirectory(prefix="raylift-quickstart-") as tmp:
        seconds, lines, code = run(Path(tmp))
    print("\n".join(lines))
    if code != 0:
        raise SystemExit(f"the quickstart exited {code}")
    shown = f"{seconds:.0f} s"
    save(
        __file__,
        "the quickstart from an empty folder: raylift train configs/quickstart.yaml",
        ["measure", "value"],
        [
            ["command to exit", shown],
            ["val_acc", final(lines, "val_acc")],
            ["console lines", str(len(lines))],
        ],
        {
            "what": "the quickstart from an empty folder, a fresh local Ray, to its exit",
            "raylift": f"{shown}, val_acc {final(lines, 'val_acc')}",
            "baseline": "-",
            "ratio": "-",
        },
        notes="The console is shown whole in the README and on the getting started page.",
        tables=[],
        transcript=shortened(lines, *opts.keep),
    )


if __name__ == "__main__":
    main()
