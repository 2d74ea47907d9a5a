"""Plain dicts into dataclass trees, and YAML into plain dicts: each value checked against
its field's annotation, unknown keys named with the closest known one, dotted
``key=value`` overrides, and the config a run folder recorded. Knows no config section:
the schema is :mod:`raylift.core.config`."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import os
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from raylift.core import storage


def yaml_key(field: dataclasses.Field[Any]) -> str:
    """A field's key in YAML: its name, or the Python keyword it stands for (``async``)."""
    return str(field.metadata.get("key", field.name))


def as_dict(obj: Any) -> Any:
    """``dataclasses.asdict`` with each field under its YAML key."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {yaml_key(f): as_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: as_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(as_dict(v) for v in obj)
    return copy.deepcopy(obj)


def _type_name(tp: Any) -> str:
    names = {int: "an integer", float: "a number", bool: "true/false", str: "a string"}
    if tp in names:
        return names[tp]
    origin = typing.get_origin(tp)
    if origin in (list, Sequence):
        return "a list"
    if origin in (dict, Mapping):
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return str(tp)


def _coerce(value: Any, tp: Any, key: str, problems: list[str]) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted where floats are."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        section = next((o for o in options if dataclasses.is_dataclass(o)), None)
        if section is not None and isinstance(value, Mapping):
            return _coerce(value, section, key, problems)  # its own problems, by key
        for opt in options:
            if opt is type(None):
                continue
            trial: list[str] = []
            out = _coerce(value, opt, key, trial)
            if not trial:
                return out
        wanted = " or ".join(_type_name(o) for o in options if o is not type(None))
        nullable = ", or null" if type(None) in options else ""
        problems.append(f"{key}: expected {wanted}{nullable}, got {value!r}")
        return None
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            problems.append(f"{key}: expected a mapping, got {value!r}")
            return None
        return build_dataclass(tp, value, key, problems)
    if origin is list:
        (item_tp,) = typing.get_args(tp) or (Any,)
        if not isinstance(value, list):
            problems.append(f"{key}: expected a list, got {value!r}")
            return None
        return [_coerce(v, item_tp, f"{key}[{i}]", problems) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            problems.append(f"{key}: expected a mapping, got {value!r}")
            return None
        return dict(value)
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        # YAML 1.1 reads `1e-3` (no dot) as a string; accept it as the number it is.
        with contextlib.suppress(ValueError):
            return float(value)
    if tp is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # `precision: 32` is written as a number in YAML
    if (tp in (int, float) and isinstance(value, bool)) or not isinstance(value, tp):
        problems.append(f"{key}: expected {_type_name(tp)}, got {value!r}")
        return None
    return value


def build_dataclass(cls: Any, raw: Mapping[str, Any], prefix: str, problems: list[str]) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {yaml_key(f): f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            problems.append(_unknown_key(full, str(key), fields))
            continue
        field_problems: list[str] = []
        coerced = _coerce(value, hints[fields[key]], full, field_problems)
        problems.extend(field_problems)
        if not field_problems:
            kwargs[fields[key]] = coerced
    # Fields that failed keep their defaults, so the remaining checks still run and
    # the user sees every problem in one pass.
    obj = cls(**kwargs)
    problems.extend(obj.problems())
    return obj


def _unknown_key(full: str, key: str, allowed: Iterable[str]) -> str:
    allowed = sorted(allowed)
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{full}: unknown key{hint}; allowed keys here: {', '.join(allowed)}"


def parse_overrides(overrides: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """Turn ``a.b=1`` strings into a nested dict; values are parsed as YAML scalars."""
    pairs: list[tuple[str, Any]] = []
    problems: list[str] = []
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            problems.append(f"{item}: an override is key=value, e.g. optim.lr=1e-3")
            continue
        try:
            value = yaml.safe_load(text) if text else ""
        except yaml.YAMLError:
            value = text
        pairs.append((key, value))
    return nest(pairs), problems


def nest(pairs: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """``[("a.b", 1)]`` -> ``{"a": {"b": 1}}``, applied in order: a later key wins, and a
    dotted key under a plain value replaces it with a dict (``a=1 a.b=2``)."""
    tree: dict[str, Any] = {}
    for key, value in pairs:
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                nxt = node[part] = {}
            node = nxt
        node[leaf] = value
    return tree


def merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """Recursive dict merge; ``update`` wins. Neither input is modified."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


RUN_CONFIG = "config.yaml"  # in every run folder: the config the run last ran with


def read_yaml(path: str | Path) -> tuple[dict[str, Any], list[str]]:
    """A YAML config file, or the config a run folder (``storage/name``, local or a URI)
    recorded when it ran."""
    text = run_config_text(str(path))
    if text is None:
        return {}, [
            f"{path}: config file not found; pass the path to a YAML file, e.g. "
            f"configs/quickstart.yaml, or a run folder (storage/name) holding {RUN_CONFIG}"
        ]
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        return {}, [f"{path}: not valid YAML ({exc})"]
    if not isinstance(raw, dict):
        return {}, [f"{path}: the top level must be a mapping of config keys"]
    return raw, []


def run_config_text(path: str) -> str | None:
    """The config a run recorded: ``path`` is the run folder, one of its checkpoint
    folders, or a YAML file (local or a URI); None where there is none."""
    if not storage.is_remote(path) and Path(path).is_file():
        return Path(path).read_text()
    candidates = [storage.join(path, RUN_CONFIG), storage.join(path, "..", RUN_CONFIG)]
    if storage.is_remote(path):
        parent = path.rstrip("/").rsplit("/", 1)[0]
        candidates = [path, storage.join(path, RUN_CONFIG), storage.join(parent, RUN_CONFIG)]
    for candidate in candidates:
        try:
            text = storage.read_text(candidate)
        except (OSError, ValueError):  # a remote store that cannot be reached, say
            text = None
        if text is not None:
            return text
    return None


def local_path(value: Any) -> Any:
    """A task argument naming a file or folder relative to where the command runs, made
    absolute: the workers run elsewhere (a task's model folder, its data)."""
    if not isinstance(value, str) or not value or "://" in value or os.path.isabs(value):
        return value
    return str(Path(value).resolve()) if Path(value).exists() else value


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists stay values."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        full = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{full}."))
        else:
            out[full] = value
    return out
