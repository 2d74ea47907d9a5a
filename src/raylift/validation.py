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


def pin_hub_names(cfg: Config, recorded: object = None) -> tuple[Config, str]:
    """``cfg`` with every Hub name in it (``task_args.model``, ``model.weights``,
    ``model.adapter.weights``) pinned to the commit its revision names now, so that every
    process of the run reads that one; and the lines that say so ("" where nothing was
    pinned). ``recorded``: the ``task_args.model`` the run folder's config holds, where
    the run resumes: the commit the run read before is read again, unless the config
    names a commit of its own. Raises :class:`ConfigError` with the Hub's refusal."""
    cfg, said = _pin_model(cfg, recorded)
    lines = [said] if said else []
    weights, said = _pin_uri(cfg.model.weights, "model.weights")
    lines += [said] if said else []
    adapter, said = _pin_uri(cfg.model.adapter.weights, "model.adapter.weights")
    lines += [said] if said else []
    if lines and (weights, adapter) != (cfg.model.weights, cfg.model.adapter.weights):
        pinned = dataclasses.replace(cfg.model.adapter, weights=adapter)
        cfg = dataclasses.replace(
            cfg, model=dataclasses.replace(cfg.model, weights=weights, adapter=pinned)
        )
    return cfg, "\n".join(lines)


def _pin_model(cfg: Config, recorded: object) -> tuple[Config, str]:
    model = cfg.task_args.get("model")
    ref = hub.parse(model) if cfg.task in HUB_TASKS and isinstance(model, str) else None
    if ref is None:
        return cfg, ""
    before = hub.parse(recorded) if isinstance(recorded, str) else None
    again = before is not None and before.pinned and before.repo == ref.repo and not ref.pinned
    pinned = _pinned(before if again and before else ref, "task_args.model")
    args = {**cfg.task_args, "model": str(pinned)}
    line = f"raylift: task_args.model {ref} is the Hub's commit {pinned.revision}"
    if again:
        line = (
            f"raylift: task_args.model {ref}: resuming on the commit this run read, "
            f"{pinned.revision} (name another commit, {ref.repo}@<commit>, to move it)"
        )
    return dataclasses.replace(cfg, task_args=args), line


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


def recorded_model(run_dir: str) -> object:
    """The ``task_args.model`` a run folder's config recorded; None where it has none."""
    raw, problems = read_yaml(run_dir)
    args = raw.get("task_args") if not problems else None
    return args.get("model") if isinstance(args, dict) else None
