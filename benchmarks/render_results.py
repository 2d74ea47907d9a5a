"""The README's results table and the manual's results page, rendered from
``benchmarks/results/*.json`` (what each benchmark script saved when it last ran).

    python benchmarks/render_results.py          # rewrite README.md's table and docs/results.md
    python benchmarks/render_results.py --check  # exit 1 where either differs from the files

The README's table sits between the two ``results`` markers; everything else in it is
left alone. A test runs ``--check``: a JSON file changed without rendering again fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
README = REPO / "README.md"
PAGE = REPO / "docs" / "results.md"
BEGIN = "<!-- results: rendered by benchmarks/render_results.py from benchmarks/results/ -->"
END = "<!-- results: end -->"


def load(folder: Path = RESULTS) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


def where(m: dict[str, Any]) -> str:
    """One line naming the machine: CPU, cores, GPU, versions, date."""
    gpu = "" if m.get("gpu", "none") == "none" else f", {m['gpu']}"
    torch = str(m.get("torch", "?")).split("+")[0]
    return (
        f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores{gpu}; torch {torch}, "
        f"ray {m.get('ray', '?')}; {m.get('date', '?')}"
    )


def table(columns: list[str], rows: list[list[Any]]) -> str:
    cells = [columns, *[[str(c) for c in row] for row in rows]]
    lines = ["| " + " | ".join(row) + " |" for row in cells]
    lines.insert(1, "|" + "---|" * len(columns))
    return "\n".join(lines)


def readme_table(results: list[dict[str, Any]]) -> str:
    rows = [
        [
            f"`{r['benchmark']}`",
            r["summary"]["what"],
            r["summary"]["raylift"],
            r["summary"]["baseline"],
            r["summary"]["ratio"],
            where(r["machine"]),
        ]
        for r in results
    ]
    if not measured_on_gpu(results):
        rows.append(["`gpu.py`", GPU_WHAT, NOT_ON_GPU, "-", "-", "-"])
    columns = ["benchmark", "what", "raylift", "baseline", "ratio", "machine"]
    return f"{BEGIN}\n{table(columns, rows)}\n{END}"


GPU_WHAT = "GPT-2-small through raylift train (MFU); LoRA against a full 1B fine-tune; checkpoints"
NOT_ON_GPU = "not measured on a GPU yet"


def measured_on_gpu(results: list[dict[str, Any]]) -> bool:
    """Whether ``benchmarks/gpu.py`` has run on a GPU machine (its file: gpu-<device>.json)."""
    return any(r["benchmark"].startswith("gpu-") for r in results)


def page(results: list[dict[str, Any]]) -> str:
    parts = [
        "# Results\n",
        "What each benchmark script measured when it last ran, rendered from "
        "`benchmarks/results/*.json` by `benchmarks/render_results.py`; a new run "
        "replaces its section (the old numbers live in git). How to run them, and what "
        "each baseline is: `benchmarks/README.md`. Earlier measurements, each with its "
        "machine, are on the [Measured (history)](measured.md) page; where they differ, "
        "this page is current.\n",
    ]
    for r in results:
        parts.append(f"## `{r['benchmark']}`: {r['title']}\n")
        parts.append(f"On {where(r['machine'])}.\n")
        parts.append(table(r["columns"], r["rows"]) + "\n")
        for more in r.get("tables", []):
            parts.append(f"{more['title']}:\n")
            parts.append(table(more["columns"], more["rows"]) + "\n")
        if r.get("notes"):
            parts.append(r["notes"].strip() + "\n")
    if not measured_on_gpu(results):
        parts.append(f"## `gpu.py`: {GPU_WHAT}\n")
        parts.append(
            f"{NOT_ON_GPU.capitalize()}: no GPU machine has run `benchmarks/gpu.py`. Its "
            "`--smoke` run on a CPU (a test runs it) checks the script, not the numbers.\n"
        )
    return "\n".join(parts)


def spliced(readme: str, block: str) -> str:
    head, found, rest = readme.partition(BEGIN)
    _, found_end, tail = rest.partition(END)
    if not (found and found_end):
        raise SystemExit(f"README.md has no results markers ({BEGIN!r} ... {END!r})")
    return head + block + tail


def main() -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--check", action="store_true", help="compare, write nothing")
    opts = args.parse_args()
    results = load()
    want = {README: spliced(README.read_text(), readme_table(results)), PAGE: page(results)}
    stale = [p for p, text in want.items() if not p.exists() or p.read_text() != text]
    if opts.check:
        for p in stale:
            print(f"{p.relative_to(REPO)} differs from benchmarks/results: run "
                  "python benchmarks/render_results.py", file=sys.stderr)  # fmt: skip
        return 1 if stale else 0
    for p in stale:
        p.write_text(want[p])
        print(f"wrote {p.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
