"""Built-in tasks and the resolver for user tasks given as ``package.module:ClassName``."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from raylift.tasks.base import Batch, Columns, Task

BUILTINS = {
    "digits": "raylift.tasks.digits:DigitsTask",
    "gpt": "raylift.tasks.gpt:GPTTask",
    "hf-causal-lm": "raylift.tasks.hf:HFCausalLM",
    "hf-sft": "raylift.tasks.sft:HFSFT",
    "images": "raylift.tasks.images:ImagesTask",
}

__all__ = ["BUILTINS", "Batch", "Columns", "Task", "build_task", "resolve_task", "task_problems"]


def resolve_task(spec: str) -> type:
    """A built-in name or ``package.module:ClassName`` -> the task class."""
    target = BUILTINS.get(spec, spec)
    module_name, sep, class_name = target.partition(":")
    if not sep or not module_name or not class_name:
        raise ValueError(
            f"task: {spec!r} is neither a built-in ({', '.join(BUILTINS)}) "
            "nor 'package.module:ClassName'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"task: cannot import {module_name!r} ({exc}); make sure the package is "
            "installed or its folder is on PYTHONPATH"
        ) from exc
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise ValueError(f"task: {module_name!r} has no class named {class_name!r}")
    return cls


def task_problems(spec: str, task_args: dict[str, Any]) -> list[str]:
    """Config problems with ``task`` / ``task_args``, without building anything heavy."""
    try:
        cls = resolve_task(spec)
    except ValueError as exc:
        return [str(exc)]
    missing = [
        m
        for m in (
            "build_model",
            "sources",
            "preprocess",
            "finish",
            "loss",
            "eval_sums",
            "summarize",
        )
        if not callable(getattr(cls, m, None))
    ]
    if missing:
        return [f"task: {spec!r} does not implement the Task protocol; missing {missing}"]
    params = inspect.signature(cls).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        unknown = [
            f"task_args.{key}: {spec!r} takes no argument {key!r}; it takes {sorted(params)}"
            for key in task_args
            if key not in params
        ]
        if unknown:
            return unknown
    # The task's own checks of its arguments. Constructors read no data; a Hugging Face
    # task reads its model's config and tokenizer (from the Hub, for a Hub ID).
    try:
        cls(**task_args)
    except ValueError as exc:
        return [str(exc)]
    return []


def build_task(spec: str, task_args: dict[str, Any]) -> Task:
    task = resolve_task(spec)(**task_args)
    return task
