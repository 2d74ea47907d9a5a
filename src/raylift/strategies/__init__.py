"""Strategies turn (model, config, precision, device) into an :class:`Engine`.

Each strategy declares itself once, as the ``SPEC`` of its module; ``REGISTRY`` is
where config, plan, export, submit and doctor look them up.
"""

from __future__ import annotations

import dataclasses

from raylift.core.config import AUTO, Config, StrategyConfig
from raylift.strategies import ddp, deepspeed, fairscale, fsdp
from raylift.strategies.base import Engine, TorchEngine
from raylift.strategies.registry import TP_PER_NODE, PlanRow, Shards, StrategySpec

# In the order the config lists the choices.
REGISTRY: dict[str, StrategySpec] = {
    s.name: s for s in (ddp.SPEC, fsdp.SPEC, deepspeed.SPEC, fairscale.SPEC)
}

__all__ = [
    "REGISTRY",
    "Engine",
    "PlanRow",
    "Shards",
    "StrategySpec",
    "TorchEngine",
    "config_problems",
    "plan_row",
    "plan_row_for",
    "plan_rows",
    "spec_for",
]


def spec_for(name: str) -> StrategySpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"strategy.name: {name!r} has no engine; choose one of {sorted(REGISTRY)}"
        ) from None


def config_problems(cfg: Config) -> list[str]:
    """What the config alone shows wrong with its strategy section and how it meets the rest.

    An unknown name is left to :func:`raylift.validation.registry_problems`; ``auto``
    reads no option, since the plan sets the options of the strategy it picks.
    """
    spec = REGISTRY.get(cfg.strategy.name)
    if spec is None:
        return _unread_options(cfg.strategy, ()) if cfg.strategy.name == AUTO else []
    return _unread_options(cfg.strategy, spec.reads) + spec.problems(cfg)


def _unread_options(strategy: StrategyConfig, reads: tuple[str, ...]) -> list[str]:
    """Options moved off their defaults that the chosen strategy would silently ignore."""
    default = StrategyConfig()
    out: list[str] = []
    for field in dataclasses.fields(StrategyConfig):
        key = field.name
        if key == "name" or key in reads or getattr(strategy, key) == getattr(default, key):
            continue
        users = ", ".join(s.name for s in REGISTRY.values() if key in s.reads)
        out.append(f"strategy.{key}: applies to {users}, not to {strategy.name!r}; remove it")
    return out


def plan_rows() -> list[PlanRow]:
    """Every strategy's plan candidates, least communication per step first."""
    return sorted((r for s in REGISTRY.values() for r in s.plan_rows), key=lambda r: r.comm_rank)


def plan_row(label: str) -> PlanRow:
    try:
        return next(r for r in plan_rows() if r.label == label)
    except StopIteration:
        raise ValueError(f"no plan row {label!r}; see raylift plan for the labels") from None


def plan_row_for(strategy: StrategyConfig) -> PlanRow | None:
    """The plan row a strategy section runs as: the most specific one whose keys it matches;
    None where no row describes it (``auto``, or DeepSpeed's stage 0)."""
    matches = [r for r in plan_rows() if all(_is(strategy, k, v) for k, v in r.strategy.items())]
    return max(matches, key=lambda r: len(r.strategy), default=None)


def _is(strategy: StrategyConfig, key: str, value: object) -> bool:
    got = getattr(strategy, key)
    if value == TP_PER_NODE and key == "tp":  # any tensor-parallel size above 1
        return isinstance(got, int) and got > 1
    return bool(got == value)
