"""Tasks built to have one bottleneck each, for ``raylift doctor``'s tests (imported by workers)."""

from __future__ import annotations

import time

import numpy as np

from raylift.tasks.digits import DigitsTask

Columns = dict[str, np.ndarray]

# Each case: overrides of the quickstart, and the verdict raylift doctor must give.
CASES = {
    # The plain quickstart: small CNN, batch 32 -- fixed per-step costs weigh.
    "plain": ([], "compute-bound"),
    # Logging (a host sync, two collectives and an MLflow write) after every step.
    "sync": (["train.log_every_n_steps=1"], "host-sync-bound"),
    # A 50 ms host transform per batch and no prefetching: the step waits for it (a
    # step of this model takes 20-150 ms on CPUs, so the wait is 25-70% of it).
    "input": (
        ["task=tests.bottlenecks:SlowInputDigits", "data.prefetch_batches=0"],
        "input-bound",
    ),
}


class SlowInputDigits(DigitsTask):
    """Digits whose per-batch host transform takes ``delay_ms``: a stand-in for a slow
    decoder or augmentation. It sleeps, holding no core, so only how the loader overlaps
    it with the step decides how long the step waits."""

    def __init__(self, delay_ms: float = 50.0, **kwargs: object):
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.delay = delay_ms / 1000.0

    def transform(self, batch: Columns, rng: np.random.Generator) -> Columns:
        time.sleep(self.delay)
        return batch
