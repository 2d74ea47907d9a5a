"""A config checked whole: the schema (:mod:`raylift.core.config`) and what only the
registries know, the strategy's name and its own checks, the precision and the task.

Its own layer, above the strategies and tasks it asks, so that the schema below imports
none of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from raylift.core import hub
from raylift.core.config import AUTO, Config, ConfigError, build_config, read_config
from raylift.core.names import is_mlflow_uri
from raylift.core.parsing import read_yaml
from raylift.strategies import REGISTRY, config_problems
from raylift.tasks import task_problems
from raylift.tensors.precision import ACCEPTED


def registry_problems(cfg: Config) -> list[str]:
    """What the strategy, precision and task registries find wrong with ``cfg``."""
    names = (*REGISTRY, AUTO)
    out = []
    if cfg.strategy.name not in names:
        out.append(f"strategy.name: unknown strategy {cfg.strategy.name!r}; choose one of {names}")
    out += config_problems(cfg)
    if cfg.precision not in ACCEPTED:
        out.append(f"precision: unknown precision {cfg.precision!r}; choose one of {ACCEPTED}")
    return out + task_problems(cfg.task, cfg.task_args)


def config_from_dict(raw: Mapping[str, Any]) -> Config:
    """The config of a plain dict, validated; raises :class:`ConfigError` naming every problem."""
    cfg, problems = build_config(raw)
    problems += registry_problems(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Load ``path``, apply ``key=value`` overrides and validate; raises :class:`ConfigError`."""
    return config_from_dict(read_config(path, overrides))


# The built-in tasks whose ``task_args.model`` may name a Hugging Face Hub model.
HUB_TASKS = ("hf-causal-lm", "hf-sft")


def pin_hub_names(cfg: Config, recorded: Mapping[str, Any] | None = None) -> tuple[Config, str]:
    """``cfg`` with every Hub name in it (``task_args.model``, ``model.weights``,
    ``model.adapter.weights``, and the data sets ``task_args.corpus`` of
    ``hf-causal-lm`` and ``data``, ``val_data`` of ``hf-sft``) pinned to the commit its
    revision names now, so that every process of the run reads that one; and the lines
    that say so ("" where nothing was pinned).
    ``recorded``: the ``task_args`` the run folder's config holds, where the run resumes:
    the commits the run read before are read again, unless the config names commits of
    its own. Raises :class:`ConfigError` with the Hub's refusal."""
    cfg, lines = _pin_args(cfg, recorded or {})
    weights, said = _pin_uri(cfg.model.weights, "model.weights")
    lines += [said] if said else []
    adapter, said = _pin_uri(cfg.model.adapter.weights, "model.adapter.weights")
    lines += [said] if said else []
    if (weights, adapter) != (cfg.model.weights, cfg.model.adapter.weights):
        pinned = dataclasses.replace(cfg.model.adapter, weights=adapter)
        cfg = dataclasses.replace(
            cfg, model=dataclasses.replace(cfg.model, weights=weights, adapter=pinned)
        )
    return cfg, "\n".join(lines)


def _hub_args(task: str) -> dict[str, str]:
    """The task arguments that may name a Hub repo, and the kind of repo each names."""
    if task == "hf-sft":
        return {"model": "model", "data": "dataset", "val_data": "dataset"}
    return {"model": "model", "corpus": "dataset"} if task in HUB_TASKS else {}


def _pin_args(cfg: Config, recorded: Mapping[str, Any]) -> tuple[Config, list[str]]:
    args, lines = dict(cfg.task_args), []
    for name, kind in _hub_args(cfg.task).items():
        value, before = args.get(name), recorded.get(name)
        ref = hub.parse(value, kind) if isinstance(value, str) else None
        if ref is None:
            continue
        was = hub.parse(before, kind) if isinstance(before, str) else None
        again = was is not None and was.pinned and was.repo == ref.repo and not ref.pinned
        pinned = _pinned(was if again and was else ref, f"task_args.{name}")
        args[name] = str(pinned)
        lines.append(
            f"raylift: task_args.{name} {ref}: resuming on the commit this run read, "
            f"{pinned.revision} (name another commit, {ref.repo}@<commit>, to move it)"
            if again
            else f"raylift: task_args.{name} {ref} is the Hub's commit {pinned.revision}"
        )
    return (dataclasses.replace(cfg, task_args=args) if lines else cfg), lines


def _pin_uri(value: str | None, key: str) -> tuple[str | None, str]:
    """A Hub name of weights as the URI of one commit (``hf://org/name@<commit>``), which
    every reader of weights opens as it opens an object store's; other values as they are."""
    ref = hub.parse(value) if value and not is_mlflow_uri(value) else None
    if ref is None:
        return value, ""
    pinned = _pinned(ref, key)
    return pinned.uri(), f"raylift: {key} {ref} is the Hub's commit {pinned.revision}"


def _pinned(ref: hub.HubRef, key: str) -> hub.HubRef:
    try:
        return hub.pin(ref, key)
    except hub.HubError as exc:
        raise ConfigError([str(exc)]) from None


def recorded_args(run_dir: str) -> dict[str, Any]:
    """The ``task_args`` a run folder's config recorded; {} where it has none."""
    raw, problems = read_yaml(run_dir)
    args = raw.get("task_args") if not problems else None
    return dict(args) if isinstance(args, dict) else {}
