"""The configuration reference page, made from the config dataclasses themselves: every
key, its type, its default and what it does (the comment beside the field), so the
manual cannot drift from what ``load_config`` accepts; and the configuration page's
config of every default, made the same way.

    python -m raylift.core.reference > docs/reference/config.md
    python -m raylift.core.reference --defaults   # the YAML docs/configuration.md shows
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from collections.abc import Iterator
from typing import Any

import yaml

from raylift.core.config import Config, TuneConfig
from raylift.core.parsing import yaml_key

# Sections a config carries as a mapping, checked by their command rather than at load:
# the reference lists their keys from the dataclass that command checks them against.
CHECKED_BY_COMMAND = {"tune": TuneConfig}

HEADER = """# Configuration reference

Every key a config accepts, with its default and what it does. This page is generated
from the config's dataclasses (`python -m raylift.core.reference > docs/reference/config.md`),
and a test fails when it differs from them. Overrides use the same dotted keys:
`raylift train CONFIG optim.lr=1e-3`. See [Configuration](../configuration.md) for how
the sections fit together.
"""


@dataclasses.dataclass(frozen=True)
class Key:
    name: str  # dotted: train.early_stopping.patience
    type: str
    default: str
    doc: str


def all_keys(cls: type = Config, prefix: str = "") -> Iterator[Key]:
    """Every key of ``cls``, depth first, in the order the dataclass declares them."""
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    for field in dataclasses.fields(cls):
        name = f"{prefix}{yaml_key(field)}"
        nested = section_class(hints[field.name]) or CHECKED_BY_COMMAND.get(name)
        default = default_of(field)
        if nested is not None:
            yield Key(
                name, "section", "null" if default is None else "", comments.get(field.name, "")
            )
            yield from all_keys(nested, f"{name}.")
            continue
        yield Key(name, type_name(hints[field.name]), render(default), comments.get(field.name, ""))


def section_class(hint: Any) -> type | None:
    """The dataclass a field holds (``EarlyStoppingConfig | None`` too), else None."""
    candidates = typing.get_args(hint) or (hint,)
    found = [c for c in candidates if dataclasses.is_dataclass(c)]
    return found[0] if found and isinstance(found[0], type) else None


def default_of(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def render(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if dataclasses.is_dataclass(value):
        return ""
    return str(value)


def type_name(hint: Any) -> str:
    text = str(hint).replace("typing.", "")
    return re.sub(r"<class '([\w.]+)'>", r"\1", text).replace("NoneType", "None")


def field_comments(cls: type) -> dict[str, str]:
    """``name: type = default  # comment`` -> {name: comment}, from the class's source; a
    comment on the lines just above a field counts for it too."""
    out: dict[str, str] = {}
    above: list[str] = []
    for line in inspect.getsource(cls).splitlines()[1:]:
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("# ").strip())
            continue
        match = re.match(r"(\w+): [^=]+?(?:=.*?)?(?:#\s*(.*))?$", stripped)
        if match and not stripped.startswith(("def ", "return", "@")):
            out[match.group(1)] = " ".join([*above, match.group(2) or ""]).strip()
        above = []
    return out


def page() -> str:
    rows = ["| key | type | default | what it does |", "|---|---|---|---|"]
    for key in all_keys():
        doc = key.doc.replace("|", "\\|")
        kind = key.type.replace("|", "\\|")
        rows.append(f"| `{key.name}` | {kind} | `{key.default}` | {doc} |".replace("``", ""))
    return HEADER + "\n" + "\n".join(rows) + "\n"


def defaults_yaml(cls: type = Config, indent: str = "") -> str:
    """A config of every default, as YAML, each key with what it does beside it."""
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    lines = []
    for field in dataclasses.fields(cls):
        key, default = yaml_key(field), default_of(field)
        nested = section_class(hints[field.name])
        note = f"  # {comments[field.name]}" if comments.get(field.name) else ""
        if nested is not None and default is not None:
            lines.append(f"{indent}{key}:{note}")
            lines.append(defaults_yaml(nested, indent + "  ").rstrip("\n"))
            continue
        lines.append(f"{indent}{key}: {flow(default)}{note}")
    return "\n".join(lines) + "\n"


def flow(value: Any) -> str:
    """``value`` as one line of YAML: null, true, [0.9, 0.999], {}."""
    if value is None or isinstance(value, bool):
        return render(value)
    if isinstance(value, (list, dict)):
        return yaml.safe_dump(value, default_flow_style=True).strip()
    return yaml.safe_dump(value).strip().removesuffix("\n...")


if __name__ == "__main__":
    import sys

    print(defaults_yaml() if "--defaults" in sys.argv else page(), end="")
