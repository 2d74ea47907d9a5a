"""raylift: one YAML to a distributed PyTorch training run on Ray."""

from raylift.config import Config, ConfigError, load_config

__version__ = "0.1.0"

__all__ = ["Config", "ConfigError", "__version__", "load_config", "train"]


def train(config: Config):  # type: ignore[no-untyped-def]
    """Run one training run; see :func:`raylift.launch.train`."""
    from raylift.launch import train as _train

    return _train(config)
