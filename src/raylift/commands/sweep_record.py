"""A sweep's progress in raylift's own record, so that a rerun resumes it without
unpickling anything Ray Tune saved.

Tune saves a sweep as pickles (``tuner.pkl``, its search algorithm's state, each trial's
fields inside ``experiment_state-*.json``, ``error.pkl``), and ``Tuner.restore`` unpickles
them with no restriction. Saved by a real sweep they hold functions pickled by value (a
local function of argparse inside the variant generator, Ray's exception classes made
on the fly) and a storage syncer's upload command: no list of globals could admit them
and still refuse code, so raylift never restores them. The sweep's driver keeps its own
record instead, JSON beside them (:data:`RECORD`): each trial's key, values, status and
last result. A rerun builds a fresh Tuner over the same search, seeded alike, whose
trials get the same keys in the same order (:class:`TrialKeys`: the order they are made
in, and a digest of their values): a trial the record holds as finished reports its last
result again and ends, without training; any other resumes its own raylift run, from its
own checkpoints (checked as every checkpoint is), or starts it.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from raylift.core import storage
from raylift.core.config import EnvironmentProblem

RECORD = "raylift-sweep.json"
FINISHED = "TERMINATED"
# What Tune adds to every result by itself: not reported again by a finished trial.
TUNE_KEYS = frozenset({"trial_id", "config", "done", "experiment_tag", "date", "timestamp",
                       "pid", "hostname", "node_ip", "training_iteration", "time_this_iter_s",
                       "time_total_s", "time_since_restore", "iterations_since_restore",
                       "checkpoint_dir_name", "should_checkpoint"})  # fmt: skip

Trials = dict[str, dict[str, Any]]  # key -> {"params", "status", "metrics"}


def trial_key(index: int, params: dict[str, Any]) -> str:
    """A trial's name, its run's suffix and its folder's: a digest of its values and its
    place in the order the search made it (``3f9a1_00002``, shaped like Tune's ids)."""
    digest = hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode())
    return f"{digest.hexdigest()[:5]}_{index:05d}"


class TrialKeys:
    """Tune's ``trial_name_creator`` and ``trial_dirname_creator``: in the driver, each
    trial's :func:`trial_key`, by the order Tune makes the trials in."""

    def __init__(self) -> None:
        self.keys: dict[str, str] = {}  # Tune's trial id -> key

    def __deepcopy__(self, memo: dict) -> TrialKeys:
        # Tune copies an experiment's spec for each trial it makes: one count for all.
        return self

    def __call__(self, trial: Any) -> str:
        if trial.trial_id not in self.keys:
            self.keys[trial.trial_id] = trial_key(len(self.keys), dict(trial.config))
        return self.keys[trial.trial_id]


def read_record(folder: str) -> Trials:
    """The trials the sweep in ``folder`` recorded (empty for a new sweep)."""
    path = storage.join(folder, RECORD)
    text = storage.read_text(path)
    if text is None:
        return {}
    try:
        trials = json.loads(text)["trials"]
        if not isinstance(trials, dict):
            raise TypeError(f"its trials are a {type(trials).__name__}")
        return trials
    except (ValueError, KeyError, TypeError) as exc:
        raise EnvironmentProblem(
            f"{path}: not the record a raylift sweep writes ({exc}); delete it to start the "
            "sweep over (each trial's run is kept), or run the sweep under another name"
        ) from exc


def finished(trials: Trials) -> dict[str, dict[str, Any]]:
    """Each finished trial's last result, by key: what it reports again on a resume."""
    return {k: t.get("metrics", {}) for k, t in trials.items() if t.get("status") == FINISHED}


def kept(result: dict[str, Any]) -> dict[str, Any]:
    """A result as the record keeps it: the trial's own numbers, not what Tune adds."""
    return {
        k: v
        for k, v in result.items()
        if k not in TUNE_KEYS
        and isinstance(v, (int, float, str, bool))
        and not (isinstance(v, float) and not math.isfinite(v))
    }


def recorder(folder: str, trials: Trials) -> Any:
    """A Tune callback, run in the driver, that keeps ``trials`` (the record so far, from
    an earlier session too) up to date in ``folder``'s :data:`RECORD`."""
    from ray.tune import Callback

    class SweepRecord(Callback):
        def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            self.set(trial, "RUNNING")

        def on_trial_result(
            self, iteration: int, trials: list, trial: Any, result: dict, **info: Any
        ) -> None:
            self.set(trial, None, kept(result))

        def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            self.set(trial, FINISHED)

        def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            self.set(trial, "ERROR")

        def set(self, trial: Any, status: str | None, metrics: dict | None = None) -> None:
            entry = record.setdefault(trial.custom_trial_name, {"params": dict(trial.config)})
            if status is not None:
                entry["status"] = status
            if metrics is not None:
                entry["metrics"] = metrics
            text = json.dumps({"version": 1, "trials": record}, indent=1, sort_keys=True)
            storage.write_text(storage.join(folder, RECORD), text)

    record = trials
    return SweepRecord()
