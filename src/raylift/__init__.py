"""raylift: one YAML to a distributed PyTorch training run on Ray.

The public API::

    import raylift

    cfg = raylift.load_config("configs/quickstart.yaml", ["optim.lr=1e-3"])
    result = raylift.train(cfg)  # a raylift.TrainResult; raylift.RunFailed if it fails

A user's own model and data come as a :class:`Task` (``task: package.module:Class``).
``import raylift`` stays light: torch and Ray load when first needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from raylift.config import Config, ConfigError, load_config

if TYPE_CHECKING:
    from raylift.launch import RunFailed, TrainResult, train
    from raylift.tasks.base import Task

__version__ = "0.1.0"

__all__ = [
    "Config",
    "ConfigError",
    "RunFailed",
    "Task",
    "TrainResult",
    "__version__",
    "load_config",
    "train",
]

# Names that pull in torch or Ray, imported on first use.
_LAZY = {
    "train": "raylift.launch",
    "TrainResult": "raylift.launch",
    "RunFailed": "raylift.launch",
    "Task": "raylift.tasks.base",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'raylift' has no attribute {name!r}")
    if _LAZY[name] == "raylift.launch":
        from raylift import console

        # Before Ray's import reads them: a script or notebook that calls raylift.train()
        # gets the console `raylift train` gets (raylift's lines without Ray's prefixes).
        console.quiet_driver()
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip this hook
    return value
