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

from raylift.core import console
from raylift.core.config import Config, ConfigError
from raylift.core.names import VERSION

if TYPE_CHECKING:
    from raylift.run.launch import RunFailed, TrainResult, train
    from raylift.tasks.base import Task
    from raylift.validation import load_config

__version__ = VERSION

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

# Names that pull in torch or Ray, imported on first use (load_config: the registries).
_LAZY = {
    "load_config": "raylift.validation",
    "train": "raylift.run.launch",
    "TrainResult": "raylift.run.launch",
    "RunFailed": "raylift.run.launch",
    "Task": "raylift.tasks.base",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'raylift' has no attribute {name!r}")
    if _LAZY[name] == "raylift.run.launch":
        # Before Ray's import reads them: a script or notebook that calls raylift.train()
        # gets the console `raylift train` gets (raylift's lines without Ray's prefixes).
        console.quiet_driver()
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip this hook
    return value
