"""The elastic run's task: the digits, with batches that wait while a hold file exists.

The autoscaler test (tests/integration/test_autoscaler.py) holds its elastic run this way
until the cluster has grown and shrunk under it: the run cannot finish before the cluster
changes however fast this machine trains, and once the hold is lifted the rest of it runs
at full speed.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from raylift.tasks.digits import DigitsTask

Columns = dict[str, np.ndarray]

HOLD_S = 0.05  # per batch while held: sets a floor on the run's length, not a duration


class HeldDigits(DigitsTask):
    """Digits whose batches wait ``HOLD_S`` while the file ``hold`` exists."""

    def __init__(self, hold: str = "", hold_s: float = HOLD_S, **kwargs: Any):
        super().__init__(**kwargs)
        self.hold, self.hold_s = Path(hold), hold_s

    def transform(self, batch: Columns, rng: np.random.Generator) -> Columns:
        if self.hold.exists():
            time.sleep(self.hold_s)
        return batch
