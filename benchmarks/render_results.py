"""The README's results table, the manual's results page, and every number the README and
the manual quote, rendered from ``benchmarks/results/*.json`` (what each benchmark script
saved when it last ran).

    python benchmarks/render_results.py          # rewrite whatever differs from the files
    python benchmarks/render_results.py --check  # exit 1 where a page differs from the files

The README's table sits between the two ``results`` markers. Elsewhere in the README and
in ``docs/``, a number is quoted through a marker that names the file and the cell:

    <!-- n goodput.json::rows::Ray Train alone, no fault::training s -->157.1<!-- /n -->

(``FILE::key::...``: keys of the JSON, ``rows::ROW::COLUMN`` for the cell of the row whose
first cell is ROW, ``tables::TITLE`` for one of its further tables, ``goal`` for the goal
and whether the result meets it, ``machine`` for the line naming the machine;
``match=TEXT`` and ``first=TEXT`` keep the lines of a transcript holding TEXT), and a
console transcript saved with a result is a fenced block right after
``<!-- transcript FILE::key -->``. One of a result's further tables is rendered whole
between ``<!-- table FILE::tables::TITLE -->`` and ``<!-- /table -->``. Everything else
in the pages is left alone. A test runs ``--check``: a JSON file changed without
rendering again fails, and so does a measured number quoted outside a marker
(tests/unit/test_docs.py).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
README = REPO / "README.md"
PAGE = REPO / "docs" / "results.md"
sys.path.insert(0, str(REPO / "benchmarks"))
from goals import verdict  # noqa: E402

# The pages whose quoted numbers are rendered: the README, the contributors' guide and every
# page of the manual (the results page is written whole).
CONTRIBUTING = REPO / "CONTRIBUTING.md"
PAGES = [README, CONTRIBUTING, *sorted(p for p in (REPO / "docs").rglob("*.md") if p != PAGE)]
NUMBER = re.compile(r"<!-- n (?P<spec>[^>]*?) -->(?P<value>.*?)<!-- /n -->", re.S)
# A block whose first line is ``$ raylift ...`` after this marker shows what that command
# prints: the renderer runs it (a command that reads only the config, such as ``plan``).
COMMAND = re.compile(
    r"(<!-- command output -->\n```\w*\n\$ (?P<command>raylift (?:[^\n\\]|\\\n)*)\n)"
    r"(?P<body>.*?)(^```$)",
    re.S | re.M,
)
TRANSCRIPT = re.compile(
    r"(<!-- transcript (?P<spec>[^>]*?) -->\n```\w*\n)(?P<body>.*?)(^```$)", re.S | re.M
)
TABLE = re.compile(r"(<!-- table (?P<spec>[^>]*?) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)
BEGIN = "<!-- results: rendered by benchmarks/render_results.py from benchmarks/results/ -->"
END = "<!-- results: end -->"


def load(folder: Path = RESULTS) -> list[dict[str, Any]]:
    return [{**json.loads(p.read_text()), "file": p.name} for p in sorted(folder.glob("*.json"))]


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


def named(r: dict[str, Any]) -> str:
    """The script that ran, and which of its runs where it saves several."""
    variant = r.get("variant")
    return f"`{r['benchmark']}`" + (f" ({variant})" if variant else "")


def readme_table(results: list[dict[str, Any]]) -> str:
    rows = [
        [
            named(r),
            r["summary"]["what"],
            r["summary"]["raylift"],
            r["summary"]["baseline"],
            r["summary"]["ratio"],
            verdict(r),
            where(r["machine"]),
        ]
        for r in results
    ]
    if not measured_on_gpu(results):
        rows.append(["`gpu.py`", GPU_WHAT, NOT_ON_GPU, "-", "-", "-", "-"])
    columns = ["benchmark", "what", "raylift", "baseline", "ratio", "goal", "machine"]
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
        "each baseline is: `benchmarks/README.md`; each goal, and how a result is held "
        "to it: `benchmarks/goals.py`.\n",
    ]
    for r in results:
        parts.append(f"## {named(r)}: {r['title']}\n")
        parts.append(f"On {where(r['machine'])}. Goal: {verdict(r)}.\n")
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


def by_file(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each result under the name of its file: ``strategies_bf16-mixed.json``."""
    return {r["file"]: r for r in results}


def lookup(results: dict[str, dict[str, Any]], spec: str) -> Any:
    """The value a marker's ``FILE::key::...`` names (the module docstring)."""
    file, *keys = [k.strip() for k in spec.split("::")]
    if file not in results:
        raise KeyError(f"{spec}: no benchmarks/results/{file}")
    node: Any = results[file]
    while keys:
        key = keys.pop(0)
        if key == "goal":
            return verdict(node)
        if key == "machine":
            return where(node["machine"])
        if key == "rows":
            row, column = keys.pop(0), keys.pop(0)
            found = next((r for r in node["rows"] if r[0] == row), None)
            if found is None or column not in node["columns"]:
                raise KeyError(f"{spec}: no row {row!r} or column {column!r}")
            node = found[node["columns"].index(column)]
        elif key.startswith(("match=", "first=")):
            kind, text = key.split("=", 1)
            node = [line for line in node if text in line][: 1 if kind == "first" else None]
            if not node:
                raise KeyError(f"{spec}: no line with {text!r}")
        elif key == "tables":
            title = keys.pop(0)
            node = next((t for t in node.get("tables", []) if t["title"] == title), None)
            if node is None:
                raise KeyError(f"{spec}: no table {title!r}")
        else:
            node = node[key]
    return node


def quoted(text: str, results: dict[str, dict[str, Any]]) -> str:
    """``text`` with every marker's number and transcript rendered from the results."""

    def number(m: re.Match[str]) -> str:
        return f"<!-- n {m['spec']} -->{lookup(results, m['spec'])}<!-- /n -->"

    def transcript(m: re.Match[str]) -> str:
        value = lookup(results, m["spec"])
        lines = value if isinstance(value, list) else str(value).split(" | ")
        return m.group(1) + "".join(f"{line}\n" for line in lines) + m.group(4)

    def whole(m: re.Match[str]) -> str:
        found = lookup(results, m["spec"])
        return m.group(1) + table(found["columns"], found["rows"]) + "\n" + m.group(4)

    text = TABLE.sub(whole, NUMBER.sub(number, text))
    return COMMAND.sub(command_output, TRANSCRIPT.sub(transcript, text))


def command_output(m: re.Match[str]) -> str:
    """A ``<!-- command output -->`` block with what its command prints now."""
    argv = shlex.split(m["command"].replace("\\\n", " "))
    raylift = Path(sys.executable).with_name("raylift")
    done = subprocess.run([str(raylift), *argv[1:]], cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{m['command']} exited {done.returncode}:\n{done.stderr[-2000:]}")
    return m.group(1) + done.stdout + m.group(4)


def rendered(results: list[dict[str, Any]]) -> dict[Path, str]:
    """Every page as the results make it."""
    files = by_file(results)
    want = {p: quoted(p.read_text(), files) for p in PAGES}
    want[README] = spliced(want[README], readme_table(results))
    want[PAGE] = page(results)
    return want


def main() -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--check", action="store_true", help="compare, write nothing")
    opts = args.parse_args()
    want = rendered(load())
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
