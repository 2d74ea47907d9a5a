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
from raylift.validation import config_from_dict, load_config
from tests.helpers import HANG_S

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted((REPO / "docs").rglob("*.md"))
PAGES = [REPO / "README.md", REPO / "CONTRIBUTING.md", *DOCS]
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
        if prefix + field.name in reference.CHECKED_BY_COMMAND:
            out += every_key(reference.CHECKED_BY_COMMAND[prefix + field.name], f"{field.name}.")
            continue
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


def test_the_configuration_page_shows_the_real_defaults() -> None:
    """The configuration page's config is every default as ``load_config`` fills it in, and
    the reference names every built-in task and every precision the config accepts."""
    from raylift.tasks import BUILTINS
    from raylift.tensors.precision import ACCEPTED

    page = (REPO / "docs" / "configuration.md").read_text()
    marker = "<!-- defaults: python -m raylift.core.reference --defaults -->\n```yaml\n"
    assert marker + reference.defaults_yaml() + "```" in page, (
        "docs/configuration.md: paste python -m raylift.core.reference --defaults after its marker"
    )
    assert config_from_dict(yaml.safe_load(reference.defaults_yaml())) == Config()
    rows = {k.name: k.doc for k in reference.all_keys()}
    assert all(name in rows["task"] for name in BUILTINS), rows["task"]
    assert all(name in rows["precision"].split(" | ") for name in ACCEPTED), rows["precision"]


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


# A measured quantity as the pages quote one: a number with a unit of time, size, rate,
# or a ratio (``1.19x``; ``12 x parameters`` is a formula). Version numbers, counts and
# config values carry none of these.
MEASURED = re.compile(
    r"(?<![\w.~<-])\d[\d,]*(?:\.\d+)?(?:x|\s?(?:ms|s|min|h|%|KiB|MiB|GiB|KB|MB|GB|GB/s|MB/s|"
    r"rows/s|samples/s|tokens/s|examples/s))(?![\w/])"
)
# What the pages may say by hand: values the code fixes rather than measures, each as the
# words around it, and where the code fixes it: (module, name, the value the words say).
FIXED = {
    "blocks of 1 MiB": ("raylift.tensors.ranged", "BLOCK", 1 << 20),
    "block (1 MiB": ("raylift.tensors.ranged", "BLOCK", 1 << 20),
    "block of every file (1 MiB": ("raylift.tensors.ranged", "BLOCK", 1 << 20),
    "--max-shard-size 5GB": ("raylift.cli", "DEFAULT_MAX_SHARD", "5GB"),
    "(default `5GB`": ("raylift.cli", "DEFAULT_MAX_SHARD", "5GB"),
    "sharded above 5 GB": ("raylift.cli", "DEFAULT_MAX_SHARD", "5GB"),
    "does not answer in 3 s": ("raylift.run.snapshots", "CATALOG_TIMEOUT_S", 3.0),
    "no heartbeat for 60 s": ("raylift.core.runlock", "STALE_S", 60.0),
    "with each try, up to 20 s": ("raylift.core.stores", "MAX_BACKOFF_S", 20.0),
    "`tests.helpers.HANG_S`, 15 min": ("tests.helpers", "HANG_S", 900),
    "plus 2 s": ("raylift.run.checkpointing", "LAST_SAVE_SLACK_S", 2.0),
    "`scaling.placement_timeout_s` (300 s)": (
        "raylift.core.config",
        "ScalingConfig().placement_timeout_s",
        300.0,
    ),
    "at most 30% of Ray's object store": ("raylift.data.shards", "SHUFFLE_MEMORY_SHARE", 0.3),
    "every 10 s how many MiB": ("raylift.data.shards", "PROGRESS_EVERY_S", 10.0),
    "by window: 5% of the windows": (
        "raylift.tasks.gpt",
        "inspect.signature(GPTTask).parameters['val_percent'].default",
        5,
    ),
    "refreshed every 20 s": (
        "ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator",
        "_AutoscalingCoordinatorActor.TICK_INTERVAL_S",
        20,
    ),
}


def test_the_values_the_pages_quote_by_hand_are_the_codes() -> None:
    import importlib
    import inspect

    for words, (module, name, value) in FIXED.items():
        scope = {"inspect": inspect, **vars(importlib.import_module(module))}
        found = eval(name, scope)  # a name, or an expression such as ScalingConfig().key
        assert found == value, f"the pages say {words!r}; {module}.{name} is {found!r}"


def _rendered_spans(text: str) -> str:
    """``text`` without what the renderer writes: markers' numbers, tables, transcripts,
    the README's results table."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import render_results
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    text = render_results.NUMBER.sub("", text)
    text = render_results.TABLE.sub("", text)
    text = render_results.TRANSCRIPT.sub("", text)
    text = render_results.COMMAND.sub("", text)
    return re.sub(
        re.escape(render_results.BEGIN) + ".*?" + re.escape(render_results.END),
        "",
        text,
        flags=re.S,
    )


def unrendered_numbers(page: Path) -> list[str]:
    """Each measured number ``page`` quotes outside the renderer's markers, as
    ``page:line: number``."""
    text = _rendered_spans(page.read_text())
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        fixed = [(line.find(words), len(words)) for words in FIXED if words in line]
        for m in MEASURED.finditer(line):
            if any(at <= m.start() < at + length for at, length in fixed):
                continue
            found.append(f"{page.relative_to(REPO)}:{n}: {m.group()!r} in {line.strip()[:100]!r}")
    return found


def test_every_measured_number_is_rendered_from_a_results_file() -> None:
    """The README and the manual quote a measured number only through a marker the
    renderer fills from benchmarks/results/*.json (the results page is rendered whole);
    a console example shows placeholders such as ``<seconds>`` instead of numbers."""
    pages = [p for p in PAGES if p.name != "results.md"]
    found = [hit for page in pages for hit in unrendered_numbers(page)]
    assert not found, "measured numbers typed by hand:\n" + "\n".join(found)


# Files the pages name that are not this repository's: the tasks page's example, which the
# reader writes, and DeepSpeed's own conversion script.
EXAMPLE_FILES = {"mytasks.py", "zero_to_fp32.py"}


def test_every_file_the_pages_name_exists() -> None:
    """A path under one of the repository's folders, or a script's bare name (``x.py``),
    in backticks or a link of the README, the manual or a results file, is a file here."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import render_results
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    tops = ("benchmarks/", "tests/", "src/", "configs/", "cluster/", "docs/", ".ci/")
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    scripts = {Path(f).name for f in tracked if f.endswith(".py")} | EXAMPLE_FILES
    named = [(page.relative_to(REPO), page.read_text()) for page in PAGES]
    named += [(Path("benchmarks/results") / r["file"], f"`{r['benchmark']}`")
              for r in render_results.load()]  # fmt: skip
    missing = []
    for where, text in named:
        for m in re.finditer(r"`([^`\s]+)`|\]\(([^)\s#]+)", text):
            for path in re.findall(r"[\w./-]+\.(?:py|ya?ml|json|md|sh|toml)\b", m[1] or m[2]):
                path = path.removeprefix("./")
                under_a_folder = path.startswith(tops) and path not in tracked
                a_script = "/" not in path and path.endswith(".py") and path not in scripts
                if under_a_folder or a_script:
                    missing.append(f"{where}: {path}")
    assert not missing, "pages name files that do not exist:\n" + "\n".join(missing)
