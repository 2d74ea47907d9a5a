"""Does ``raylift doctor``'s first suggestion make the run faster? Before and after, per case.

    python benchmarks/doctor.py [--steps 40] [--repeats 3] [--only plain sync input]

The cases are the ones the doctor's integration test diagnoses (``tests/bottlenecks.py``):
the plain quickstart, the quickstart logging every step, and a task with a slow host
transform and no prefetching. For each, the script runs the doctor on the case, applies
its first suggestion and runs the doctor again, ``--repeats`` times, interleaved, on one
local Ray; it prints the measured window's samples/s before and after (medians) and the
median of the per-repeat ratios next to the doctor's own estimate of the gain.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from machine import describe  # noqa: E402
from results import save  # noqa: E402

sys.path.insert(0, str(REPO))
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p
)

from raylift.commands.doctor import run_doctor  # noqa: E402
from raylift.run.probe import PREFIX  # noqa: E402
from raylift.validation import load_config  # noqa: E402
from tests.bottlenecks import CASES  # noqa: E402

QUICKSTART = REPO / "configs" / "quickstart.yaml"


def rate(home: Path, overrides: list[str], steps: int) -> tuple[float, dict]:
    """The measured window's samples/s, and the first suggestion, of one doctor run."""
    common = [f"storage={home / 'runs'}", f"tracking.uri=sqlite:///{home / 'mlflow.db'}"]
    result = run_doctor(load_config(QUICKSTART, [*common, *overrides]), steps, log=lambda s: None)
    first = result.diagnosis.suggestions[0]
    return result.metrics[PREFIX + "samples_per_s"], {
        "change": f"{first.key}={first.value}",
        "gain": first.gain,
        "verdict": result.diagnosis.verdict,
    }


def measure(case: str, steps: int, repeats: int, home: Path) -> None:
    extra, intended = CASES[case]
    before, after, ratios = [], [], []
    for _ in range(repeats):
        b, first = rate(home, extra, steps)
        a, _ = rate(home, [*extra, first["change"]], steps)
        before.append(b)
        after.append(a)
        ratios.append(a / b)
    ROWS.append([case, first["verdict"], intended, first["change"],
                 f"{statistics.median(before):,.0f}", f"{statistics.median(after):,.0f}",
                 f"{statistics.median(ratios):.2f}x", f"{first['gain']:.2f}x"])  # fmt: skip
    print(
        f"{case:<6} {first['verdict']:<17} (intended {intended}) first fix {first['change']:<28} "
        f"{statistics.median(before):>8,.0f} -> {statistics.median(after):>8,.0f} samples/s  "
        f"x{statistics.median(ratios):.2f} (per repeat {', '.join(f'{r:.2f}' for r in ratios)}; "
        f"doctor expected ~x{first['gain']:.2f})",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="steps per doctor window")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", nargs="*", default=list(CASES), choices=list(CASES))
    args = parser.parse_args()
    print(describe())
    with tempfile.TemporaryDirectory(prefix="raylift-bench-doctor-") as tmp:
        for case in args.only:
            measure(case, args.steps, args.repeats, Path(tmp))
    right = sum(r[1] == r[2] for r in ROWS)
    save(
        __file__,
        "the doctor's verdict on runs built to have a bottleneck, then its first suggestion",
        ["case", "verdict", "intended", "first fix", "samples/s before", "after", "gain",
         "doctor expected"],
        ROWS,
        {"what": "raylift doctor on runs with a known bottleneck",
         "raylift": f"{right} of {len(ROWS)} verdicts as intended",
         "baseline": "the run before the suggested change",
         "ratio": ", ".join(f"{r[0]} {r[6]}" for r in ROWS)},
    )  # fmt: skip


ROWS: list[list[str]] = []  # one per case, for the results file


if __name__ == "__main__":
    main()
