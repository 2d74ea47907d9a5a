"""The manual and the README: the site builds strictly, the config reference is the
dataclasses' own, every YAML config in them loads, every `raylift` command in them
parses, the README stays a front door, and the results tables are the JSON files'."""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from raylift.cli import build_parser
from raylift.core import reference
from raylift.core.config import Config, ConfigError
from raylift.core.parsing import yaml_key
from raylift.validation import load_config
from tests.helpers import HANG_S

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted((REPO / "docs").rglob("*.md"))
PAGES = [REPO / "README.md", *DOCS]
NO_CHECK = "<!-- not a whole config -->"  # before a YAML block that shows a fragment


def blocks(lang: str) -> list[tuple[Path, str]]:
    """Every fenced block of ``lang`` ("" for unlabelled) in the README and the manual,
    but those right after a ``NO_CHECK`` line."""
    found = []
    for page in PAGES:
        lines, body, fence, skip, before = page.read_text().splitlines(), [], None, False, ""
        for line in lines:
            if fence is None and line.startswith("```"):
                fence, body, skip = line[3:].strip(), [], NO_CHECK in before
            elif fence is not None and line.startswith("```"):
                if fence == lang and not skip:
                    found.append((page, "\n".join(body) + "\n"))
                fence = None
            elif fence is not None:
                body.append(line)
            before = line
    return found


def test_the_manual_builds_strictly(tmp_path: Path) -> None:
    mkdocs = Path(sys.executable).with_name("mkdocs")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [str(mkdocs), "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "site" / "reference" / "config" / "index.html").is_file()
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "build_model" in api and "load_config" in api  # docstrings rendered


def every_key(cls: type = Config, prefix: str = "") -> list[str]:
    out = []
    for field in dataclasses.fields(cls):
        out.append(prefix + yaml_key(field))
        inner = [
            c for c in (*getattr(field.type, "__args__", ()), field.type) if isinstance(c, type)
        ]
        nested = next((c for c in inner if dataclasses.is_dataclass(c)), None)
        if nested is None and isinstance(field.type, str):
            nested = next(
                (c for c in _sections() if re.search(rf"\b{c.__name__}\b", field.type)), None
            )
        if nested is not None:
            out += every_key(nested, f"{prefix}{field.name}.")
    return out


def _sections() -> list[type]:
    import raylift.core.config as config

    return [v for v in vars(config).values() if dataclasses.is_dataclass(v) and v is not Config]


def test_the_config_reference_lists_every_key_and_is_up_to_date() -> None:
    page = (REPO / "docs" / "reference" / "config.md").read_text()
    assert page == reference.page(), (
        "run: python -m raylift.core.reference > docs/reference/config.md"
    )
    listed = re.findall(r"^\| `([\w.]+)` \|", page, re.M)
    assert listed == [k.name for k in reference.all_keys()]
    assert set(listed) == set(every_key()), set(listed) ^ set(every_key())
    assert all(k.doc for k in reference.all_keys()), [
        k.name for k in reference.all_keys() if not k.doc
    ]


def test_every_yaml_config_in_the_docs_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tasks = (REPO / "docs" / "tasks.md").read_text()
    (tmp_path / "mytasks.py").write_text(
        re.findall(r"```python\n(# mytasks\.py.*?)```", tasks, re.S)[0]
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    checked = 0
    for page, text in blocks("yaml"):
        raw = yaml.safe_load(text)
        if not isinstance(raw, dict) or not set(raw) & {f.name for f in dataclasses.fields(Config)}:
            continue
        config = tmp_path / "block.yaml"
        config.write_text(text)
        try:
            load_config(config)
        except ConfigError as exc:
            pytest.fail(f"{page.relative_to(REPO)}: a YAML block does not load:\n{exc}\n{text}")
        checked += 1
    assert checked >= 3


def test_every_raylift_command_in_the_docs_parses() -> None:
    parser = build_parser()
    checked = 0
    shown = [(page, text) for page, text in blocks("") if "$ raylift " in text]
    for page, text in [*blocks("bash"), *shown]:
        joined = re.sub(r"\\\n\s*", " ", text)
        for line in joined.splitlines():
            line = line.split("  #")[0].strip().removeprefix("$ ")
            if not line.startswith("raylift "):
                continue
            args = shlex.split(line)[1:]
            parsed, _ = parser.parse_known_args(args)
            config = getattr(parsed, "config", None) or ""  # export: --config is optional
            if config.startswith("configs/"):
                assert (REPO / config).is_file(), f"{page.name}: {line}"
            checked += 1
    assert checked >= 10


def test_the_readme_is_a_front_door() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) < 260
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (REPO / link).is_file(), link


def test_the_results_tables_are_rendered_from_the_json_files(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "render_results.py"), "--check"],
        capture_output=True, text=True, timeout=HANG_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import render_results
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    results = render_results.load()
    assert results, "benchmarks/results/ holds no results"
    results[0]["rows"][0][-1] = "a changed number"
    assert render_results.page(results) != (REPO / "docs" / "results.md").read_text()
