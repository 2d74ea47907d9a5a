"""Benchmark results as data. Each script saves what it measured as
``benchmarks/results/<script>.json``, with the machine it ran on; ``render_results.py``
turns those files into the README's results table and the manual's results page. A new
run replaces its file (the old numbers live in git)."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    """CPU model and cores, GPU, versions, date: what a reader needs to compare a row."""
    from machine import cpu_model

    facts: dict[str, Any] = {"cpu": cpu_model(), "cores": os.cpu_count(), "gpu": "none"}
    facts["python"] = platform.python_version()
    try:
        import torch

        facts["torch"] = torch.__version__
        if torch.cuda.is_available():
            facts["gpu"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
    except ImportError:
        pass
    for package in ("ray", "deepspeed", "raylift"):
        try:  # the installed version, without importing the package (DeepSpeed's import prints)
            facts[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    facts["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    return facts


def save(
    script: str,
    title: str,
    columns: list[str],
    rows: list[list[Any]],
    summary: dict[str, str],
    notes: str = "",
    tables: list[dict[str, Any]] | None = None,
    folder: Path = RESULTS,
    variant: str | None = None,
    transcript: list[str] | None = None,
) -> Path:
    """Write ``benchmarks/results/<script>.json``. ``summary`` is the README's one row:
    ``what``, ``raylift``, ``baseline``, ``ratio`` (strings as they are to be shown).
    ``tables``: more of the same run's numbers, each a ``title``, ``columns``, ``rows``.
    ``folder``: elsewhere than the results (a smoke run's numbers are no result).
    ``variant``: one of several runs of the same script (``bf16-mixed``, ``noclip``), saved
    as ``<script>_<variant>.json``; the benchmark is still the script that ran.
    ``transcript``: console lines of the run, which pages show as the renderer quotes them."""
    folder.mkdir(parents=True, exist_ok=True)
    stem = Path(script).stem + (f"_{variant}" if variant else "")
    out = folder / f"{stem}.json"
    data = {
        "benchmark": Path(script).name,
        "variant": variant,
        "title": title,
        "machine": machine(),
        "columns": columns,
        "rows": rows,
        "summary": summary,
        "notes": notes,
        "tables": tables or [],
    }
    if transcript is not None:
        data["transcript"] = transcript
    out.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"saved {out.relative_to(RESULTS.parent.parent) if out.is_relative_to(RESULTS) else out}")
    return out
