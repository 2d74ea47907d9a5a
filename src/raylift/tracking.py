"""MLflow: one run per training run, created by the driver, written to by rank 0 only.

A rerun of the same ``name`` in the same ``storage`` continues the same MLflow
run: the run carries a ``raylift.run_key`` tag made of both.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from raylift.config import Config, flatten

SECRET = re.compile(r"token|secret|password|passwd|key", re.IGNORECASE)
REDACTED = "***"


def default_uri() -> str:
    """``sqlite:///<cwd>/mlflow.db``, absolute so workers elsewhere write to the same store."""
    return f"sqlite:///{Path.cwd().resolve() / 'mlflow.db'}"


def tracking_uri(cfg: Config) -> str:
    return cfg.tracking.uri or default_uri()


def redact(params: Mapping[str, Any]) -> dict[str, Any]:
    """Values of keys that look like credentials never reach MLflow or the console."""
    return {
        k: (REDACTED if SECRET.search(k.rsplit(".", 1)[-1]) and v else v) for k, v in params.items()
    }


def redact_tree(tree: Mapping[str, Any]) -> dict[str, Any]:
    """``redact`` for a nested config, as printed on the console."""
    return {
        k: redact_tree(v) if isinstance(v, Mapping) else (REDACTED if SECRET.search(k) and v else v)
        for k, v in tree.items()
    }


def _quiet_mlflow() -> None:
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


_IMPORTING = threading.Lock()


def client(uri: str) -> Any:
    """An MLflow client for ``uri``."""
    _quiet_mlflow()
    # MLflow's package imports itself circularly: imported from two threads at once, one
    # can see a half-built module and the process's MLflow stays broken. raylift imports
    # it here, on the caller's thread, before any of its own threads touch it.
    with _IMPORTING:
        import mlflow.entities  # noqa: F401  (imported for its side effect: loaded once)
        from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def metric_since(uri: str, run_id: str, key: str, since_s: float) -> float | None:
    """The latest value of ``key`` logged at or after ``since_s`` (epoch seconds), if any."""
    history = client(uri).get_metric_history(run_id, key)
    recent = [m for m in history if m.timestamp >= since_s * 1000]
    return float(recent[-1].value) if recent else None


def latest_metrics(uri: str, run_id: str, prefixes: tuple[str, ...]) -> dict[str, float]:
    """The run's latest value of every metric whose name starts with one of ``prefixes``."""
    metrics = client(uri).get_run(run_id).data.metrics
    return {k: float(v) for k, v in metrics.items() if k.startswith(prefixes)}


def run_key(cfg: Config, storage: str, name: str | None = None) -> str:
    """The tag that finds a run again; ``name`` picks another run under ``cfg``'s storage
    (a sweep's trial) instead of ``cfg.name``."""
    return f"{storage.rstrip('/')}/{name or cfg.name}"


def find_run(uri: str, experiment: str, key: str) -> str | None:
    mlflow = client(uri)
    exp = mlflow.get_experiment_by_name(experiment)
    if exp is None:
        return None
    runs = mlflow.search_runs(
        [exp.experiment_id],
        filter_string=f"tags.`raylift.run_key` = '{key}'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    return runs[0].info.run_id if runs else None


def start_run(
    cfg: Config,
    storage: str,
    resume: bool,
    world_size: int,
    extra_tags: Mapping[str, str] | None = None,
) -> str:
    """Create the run (or reopen the one being resumed); returns its id.

    ``extra_tags`` may carry ``mlflow.parentRunId``: a sweep's trials are its children.
    """
    uri = tracking_uri(cfg)
    with one_at_a_time(uri):
        return _start_run(cfg, uri, run_key(cfg, storage), resume, world_size, extra_tags)


@contextlib.contextmanager
def one_at_a_time(uri: str) -> Iterator[None]:
    """Processes on this host open a sqlite store one at a time while inside: MLflow
    creates and migrates a new database on first use, and two commands started together
    in one folder (a sweep beside a run) would migrate it at once and one would fail;
    so would two creating the same experiment. Servers need no lock."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    import fcntl

    db = uri.removeprefix("sqlite:///")
    name = hashlib.sha1(db.encode()).hexdigest()[:16]
    with open(Path(tempfile.gettempdir()) / f"raylift-mlflow-{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _start_run(
    cfg: Config,
    uri: str,
    key: str,
    resume: bool,
    world_size: int,
    extra_tags: Mapping[str, str] | None,
) -> str:
    mlflow = client(uri)
    from mlflow.entities import Param, RunTag

    run_id = find_run(uri, cfg.tracking.experiment, key) if resume else None
    params = {k: str(v)[:6000] for k, v in redact(flatten(cfg.to_dict())).items()}
    tags = {
        "raylift.run_key": key,
        "raylift.strategy": cfg.strategy.name,
        "raylift.precision": cfg.precision,
        "raylift.world_size": str(world_size),
        "raylift.task": cfg.task,
        "mlflow.runName": cfg.name,
        **(extra_tags or {}),
    }
    if run_id is None:
        exp = mlflow.get_experiment_by_name(cfg.tracking.experiment)
        exp_id = exp.experiment_id if exp else mlflow.create_experiment(cfg.tracking.experiment)
        run_id = mlflow.create_run(exp_id, tags=tags).info.run_id
        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            mlflow.log_batch(run_id, params=items[i : i + 100])
        return str(run_id)
    mlflow.update_run(run_id, status="RUNNING")
    old = mlflow.get_run(run_id).data.params
    # Params are immutable in MLflow: record what this resume changed as tags.
    changed = [
        RunTag(f"raylift.resume_override.{k}", v) for k, v in params.items() if old.get(k) != v
    ]
    mlflow.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()] + changed)
    return str(run_id)


def end_run(uri: str, run_id: str, status: str, tags: Mapping[str, str] | None = None) -> None:
    mlflow = client(uri)
    for k, v in (tags or {}).items():
        mlflow.set_tag(run_id, k, v)
    mlflow.set_terminated(run_id, status=status)


class MlflowTracker:
    """Rank 0's writer; other ranks get a NullTracker.

    Writes run in order on one background thread, so the loop never waits on a slow
    store or server. Timestamps are taken when the loop logs. A failed write is raised
    by the next call, and :meth:`close` waits for all of them. MLflow itself is imported
    here, on the loop's thread: see :func:`client`.
    """

    def __init__(self, uri: str, run_id: str):
        self.client, self.run_id = client(uri), run_id
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="mlflow-log")
        self._pending: list[Future[None]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        rows = [(k, float(v)) for k, v in metrics.items()]
        self._submit(self._write_metrics, rows, now, step)

    def set_tags(self, tags: dict[str, str]) -> None:
        self._submit(self._write_tags, dict(tags))

    def log_artifact(self, path: Path, folder: str) -> None:
        self._submit(lambda: self.client.log_artifact(self.run_id, str(path), folder))

    def close(self) -> None:
        """Wait for every write; raises the first that failed."""
        pending, self._pending = self._pending, []
        try:
            for write in pending:
                write.result()
        finally:
            self._writer.shutdown(wait=True)

    def _submit(self, fn: Any, *args: Any) -> None:
        for write in [w for w in self._pending if w.done()]:
            self._pending.remove(write)
            write.result()  # raises a failed write where the loop can see it
        self._pending.append(self._writer.submit(fn, *args))

    def _write_metrics(self, rows: list[tuple[str, float]], now: int, step: int) -> None:
        from mlflow.entities import Metric  # loaded by client() already: no import race

        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in rows])

    def _write_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
