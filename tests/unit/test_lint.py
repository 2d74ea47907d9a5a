"""ruff, mypy and the layers contract (import-linter) run as part of the test command, so
CI enforces them; and raylift's own imports sit at the top of each module, in no cycle."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import finish_output

REPO = Path(__file__).resolve().parents[2]
# mypy's cache lives with the other compiled caches: a warm run takes seconds, not a minute.
CACHE = Path(os.environ.get("RAYLIFT_TEST_CACHE", Path.home() / ".cache" / "raylift-tests"))


LINTERS = {
    "ruff-check": ["ruff", "check", "src", "tests"],
    "ruff-format": ["ruff", "format", "--check", "src", "tests"],
    "mypy": ["mypy", "--cache-dir", str(CACHE / "mypy"), "src"],
    # pyproject.toml's [tool.importlinter]: the layers, the independent engines, no cycles
    "lint-imports": ["lint-imports", "--no-cache"],
}
# The entry point, which loads each command when it runs (its docstring says why).
LATE_IMPORTS_ALLOWED = {"cli.py"}


def start(name: str) -> subprocess.Popen[str] | None:
    cmd = LINTERS[name]
    exe = shutil.which(cmd[0], path=str(Path(sys.executable).parent))
    if exe is None:
        return None
    return subprocess.Popen(
        [exe, *cmd[1:]], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.mark.parametrize("name", list(LINTERS))
def test_clean(name: str) -> None:
    proc = start(name)
    if proc is None:
        pytest.skip(f"{LINTERS[name][0]} is not installed (pip install -e '.[dev]')")
    out, _ = finish_output(proc, name)
    assert proc.returncode == 0, out


def test_no_module_cycle_anywhere_in_raylift() -> None:
    """Across packages too (import-linter's cycle contract looks within each one)."""
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("raylift")
    cycles = [
        (m, n)
        for m in graph.modules
        for n in graph.find_modules_directly_imported_by(m)
        if graph.chain_exists(importer=n, imported=m)
    ]
    assert cycles == []


def test_raylift_modules_are_imported_at_the_top_of_each_module() -> None:
    """An import inside a function hides a dependency from the reader (and once hid the
    cycles the layers removed); only the entry point defers its imports."""
    late = []
    for path in sorted((REPO / "src" / "raylift").rglob("*.py")):
        if path.relative_to(REPO / "src" / "raylift").as_posix() in LATE_IMPORTS_ALLOWED:
            continue
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if any(n == "raylift" or n.startswith("raylift.") for n in names):
                    late.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert late == []
