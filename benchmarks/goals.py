"""What each benchmark is for: its goal, and whether its saved result meets it.

A goal lives here once; ``render_results.py`` shows it beside every result, with
``met`` or ``missed`` decided from the numbers in the result's own file, so a result that
misses its goal says so wherever it is shown. A benchmark without an entry has no goal
(it measures, as ``strategies.py`` does); ``script:variant`` names one run of a script.
Where a goal has no number to hold a result to, it is shown without a verdict.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

Result = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Goal:
    text: str
    judge: Callable[[Result], bool] | None = None  # None: no number to judge by

    def verdict(self, result: Result) -> str:
        if self.judge is None:
            return self.text
        return f"{self.text}: {'met' if self.judge(result) else '**missed**'}"


def number(cell: Any) -> float:
    """The first number in a cell as shown (``"1,298"``, ``"37.5 s"``, ``"0.97x"``, ``"3.5%"``)."""
    found = re.search(r"-?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?", str(cell))
    if found is None:
        raise ValueError(f"no number in {cell!r}")
    return float(found.group().replace(",", ""))


def cell(rows: list[list[Any]], columns: list[str], row: str, column: str) -> Any:
    """The cell of the row whose first cell is ``row``, in the column named ``column``."""
    found = next((r for r in rows if r[0] == row), None)
    if found is None:
        raise KeyError(f"no row {row!r}")
    return found[columns.index(column)]


def at(result: Result, row: str, column: str, table: str | None = None) -> float:
    """The number in one cell of a result's main table, or of its table titled ``table``."""
    where = result if table is None else next(t for t in result["tables"] if t["title"] == table)
    return number(cell(where["rows"], where["columns"], row, column))


def _column(result: Result, column: str) -> list[float]:
    i = result["columns"].index(column)
    return [number(r[i]) for r in result["rows"]]


def _overhead(r: Result) -> bool:
    return at(r, "raylift", "median step ms") <= 1.03 * at(r, "hand-written", "median step ms")


def _launch(r: Result) -> bool:
    table = "raylift against Ray Train alone, to the first step"
    fresh = at(r, "fresh local Ray", "ratio", table)
    running = at(r, "running Ray", "ratio", table)
    return fresh <= 1.0 and running <= 1.1


def _checksum(r: Result) -> bool:
    seal = next(row for row in r["rows"] if row[0].startswith("seal"))
    return number(seal[3]) < 5.0


def _memory(r: Result) -> bool:
    ratios = _column(r, "peak / plan")
    ddp = at(r, "ddp", "rank 0 MiB")
    sharded = [number(row[1]) for row in r["rows"] if row[0] != "ddp"]
    return all(0.75 <= x <= 1.25 for x in ratios) and all(s < ddp for s in sharded)


def _pipeline(r: Result) -> bool:
    return at(r, "naive", "to exit") >= 5 * at(r, "raylift", "to exit")


def _ingest(r: Result) -> bool:
    ours = at(r, "raylift ShardSource (prefetch 4)", "median rows/s")
    batched = [number(row[2]) for row in r["rows"] if row[0].startswith("DataLoader batched")]
    return ours > max(batched)


def _doctor(r: Result) -> bool:
    # The verdict as intended, and its first fix pays at least 80% of the gain expected.
    return all(row[1] == row[2] and number(row[6]) >= 0.8 * number(row[7]) for row in r["rows"])


def _prep(r: Result) -> bool:
    rss = _column(r, "driver peak RSS MiB")
    return max(rss) <= 1.2 * min(rss) and min(_column(r, "raylift / Pool throughput")) >= 0.8


def _curves(r: Result) -> bool:
    return max(_column(r, "max relative difference vs DDP")) < 1e-5


def _faults(r: Result) -> bool:
    judged = [row[3] for row in r["rows"] if "off:" in row[3]]
    return all(cell.endswith("off: yes)") for cell in judged)


def _checkpoint_io(r: Result) -> bool:
    reads = [row[c] for row in r["rows"] for c in (3, 4, 5) if row[c] != "-"]
    stalls = [re.search(r"\(([\d.]+)x\)", row[7]) for row in r["rows"]]
    return (
        bool(reads)
        and all(number(x) <= 1.2 for x in reads)
        and all(m is not None and float(m.group(1)) <= 0.25 for m in stalls)
    )


def _suite(r: Result) -> bool:
    minutes = re.fullmatch(r"(\d+) min (\d+) s", cell(r["rows"], r["columns"], "pytest", "value"))
    exit_code = cell(r["rows"], r["columns"], "exit", "value")
    return (
        minutes is not None and exit_code == "0" and int(minutes[1]) * 60 + int(minutes[2]) <= 1800
    )


def _parallelism(r: Result) -> bool:
    """The plan within 10% of every measured byte count of DDP, FSDP, HSDP and FSDP+TP."""
    measured = ("ddp", "fsdp", "fsdp-full", "fsdp-tp")
    pairs = [(row[i], row[i + 1]) for row in r["rows"] if row[0] in measured
             for i in (1, 3)]  # fmt: skip
    return bool(pairs) and all(abs(m - p) <= 0.1 * max(p, 1.0) for m, p in pairs)


def _mesh_curves(r: Result) -> bool:
    return bool(r["rows"]) and max(_column(r, "max rel. diff from DDP")) <= 1e-5


GOALS: dict[str, Goal] = {
    "overhead.py": Goal("step time <= 1.03x the hand-written loop", _overhead),
    "launch.py": Goal(
        "to the first step <= 1.1x Ray Train alone on a running Ray, <= 1.0x on a fresh one",
        _launch,
    ),
    "checksum.py": Goal("the seal < 5% of the save", _checksum),
    "memory.py": Goal("peak within 25% of the plan, sharded below DDP", _memory),
    "pipeline.py": Goal(">= 5x the naive loop to exit (CPU)", _pipeline),
    "ingest.py": Goal("faster than the batched DataLoader", _ingest),
    "doctor.py": Goal(
        "every verdict as intended, its first fix paying >= 0.8x the gain it expected", _doctor
    ),
    "prep.py": Goal("driver RSS <= 1.2x between sizes, >= 0.8x the Pool's throughput", _prep),
    "strategy_curves.py": Goal("every strategy within 1e-5 of DDP in fp32", _curves),
    "faults.py": Goal("every run that trains on ends within 2% of the reference", _faults),
    "checkpoint_io.py": Goal(
        "resume and export read <= 1.2x the bytes; an async save stalls <= 0.25x a sync one",
        _checkpoint_io,
    ),
    "log_model.py": Goal("a small share of the training"),
    "parallelism.py": Goal(
        "raylift plan within 10% of the measured bytes within and across nodes", _parallelism
    ),
    "mesh_curves.py": Goal(
        "every mesh within 1e-5 of DDP in fp32 on a Ray of two nodes", _mesh_curves
    ),
    "suite.py": Goal("passes within 30 min on a fresh clone, caches empty", _suite),
    "suite.py:quick": Goal(
        "passes", lambda r: cell(r["rows"], r["columns"], "exit", "value") == "0"
    ),
}


def verdict(result: Result) -> str:
    """The goal of ``result``'s benchmark with met or missed; ``-`` where it has none."""
    variant = result.get("variant")
    goal = GOALS.get(f"{result['benchmark']}:{variant}") or GOALS.get(result["benchmark"])
    return "-" if goal is None else goal.verdict(result)
