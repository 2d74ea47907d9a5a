"""MLflow: one run per training run, created by the driver, written to by rank 0 only.

A rerun of the same ``name`` in the same ``storage`` continues the same MLflow
run: the run carries a ``raylift.run_key`` tag made of both.

Only the driver's node talks to the tracking store, through the tracking actor
(:func:`start_service`): a :class:`Store` that runs on the driver's node and owns the
MLflow client there. The driver, rank 0 of the workers and a sweep's trials, which run
wherever Ray places them, hand it their writes. So the default store, a sqlite file
beside the driver, works when rank 0 lands on another node, and MLflow is imported once
per run, by the actor: the workers never import it, nor does ``raylift train``'s driver
(one that has it already, or a Ray Client driver, keeps a client of its own).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import re
import tempfile
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from raylift.core import hub
from raylift.core.config import Config
from raylift.core.parsing import flatten

# Keys whose values are credentials, by the last part of their name: a password, a
# secret, a token (``hf_token``, ``aws_session_token``), an API or access key. Not every
# name that contains one of those words: ``num_key_value_heads``, ``tokenizer`` and
# ``max_tokens`` are a model's settings, and masking them breaks the saved config.
SECRET = re.compile(
    r"^(?:.*[_-])?(?:password|passwd|secret|token|credentials?|api_?key|access_?key(?:_id)?"
    r"|secret_?(?:access_)?key|private_?key|auth)$",
    re.IGNORECASE,
)
# The password of a URI's ``user:password@`` (a tracking server's, a database's).
URI_PASSWORD = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^/\s:@]+:)([^/\s@]+)(@)", re.IGNORECASE)
REDACTED = "***"


# Set by `raylift submit` in its job: the job runs in Ray's copy of the shipped folder,
# which Ray replaces or deletes, so its default store lives in $RAYLIFT_HOME on the head.
SUBMITTED = "RAYLIFT_SUBMITTED_JOB"
HOME_VAR, HOME_DEFAULT = "RAYLIFT_HOME", "~/.raylift"


def default_uri() -> str:
    """``sqlite:///<cwd>/mlflow.db`` (a submitted job's: ``$RAYLIFT_HOME/mlflow.db``, by
    default ``~/.raylift``), absolute, so every process of the run names the same store."""
    if not os.environ.get(SUBMITTED):
        return f"sqlite:///{Path.cwd().resolve() / 'mlflow.db'}"
    folder = Path(os.environ.get(HOME_VAR) or HOME_DEFAULT).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{folder.resolve() / 'mlflow.db'}"


def tracking_uri(cfg: Config) -> str:
    return cfg.tracking.uri or default_uri()


def server_problem(uri: str, timeout_s: float = 5.0) -> str | None:
    """For a tracking server (``http(s)://``): None when something listens at its address,
    else the problem with its fix. MLflow itself retries an unreachable server for about
    four minutes, then raises; this takes a connect, before any data or worker."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return (
            f"tracking.uri: nothing answers at {uri} ({why}); start the MLflow server, "
            "correct the URI, or leave tracking.uri empty for a local store"
        )
    return None


def is_secret(key: str) -> bool:
    """Whether ``key`` (dotted or not) names a credential."""
    return bool(SECRET.match(key.rsplit(".", 1)[-1]))


def _masked(key: str, value: Any) -> Any:
    if isinstance(value, Mapping):
        return redact_tree(value)
    if isinstance(value, list):
        return [_masked("", v) for v in value]
    if value and is_secret(key):
        return REDACTED
    if isinstance(value, str):
        return URI_PASSWORD.sub(rf"\1{REDACTED}\3", value)
    return value


def redact(params: Mapping[str, Any]) -> dict[str, Any]:
    """Credentials never reach MLflow or the console: the values of credential keys, and
    the password in a URI's ``user:password@``. Everything else is kept as it is, so the
    config a run saves loads back to the one it ran."""
    return {k: _masked(k, v) for k, v in params.items()}


def redact_tree(tree: Mapping[str, Any]) -> dict[str, Any]:
    """``redact`` for a nested config, as printed on the console and saved with the run."""
    return redact(tree)


def redacted_yaml(cfg: Config) -> str:
    """The config as YAML, secrets masked: what ``raylift validate`` prints and a run saves."""
    import yaml

    return yaml.safe_dump(redact_tree(cfg.to_dict()), sort_keys=False)


def _quiet_mlflow() -> None:
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    # A server's client prints "View run ... at: URL" when a run ends: raylift names the run.
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


_IMPORTING = threading.Lock()


@contextlib.contextmanager
def process_uri(uri: str) -> Iterator[None]:
    """MLflow resolves ``models:/`` and ``runs:/`` URIs through the process-wide tracking
    and registry URIs, whatever client is asked: both point at ``uri`` inside the block
    (a registered version's source, a model's download), then back.

    MLflow 3.17 takes the URIs as arguments but does not pass them on there:
    ``download_artifacts(tracking_uri=, registry_uri=)`` resolves a ``models:/NAME/V``
    through ``mlflow.get_registry_uri()`` and a logged model through ``MlflowClient()``,
    and a sqlite registry's ``create_model_version`` looks a ``models:/ID`` source up with
    ``MlflowClient()`` too. tests/unit/test_library_private.py says when that changes."""
    import mlflow

    before = mlflow.get_tracking_uri(), mlflow.get_registry_uri()
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(before[0])
        mlflow.set_registry_uri(before[1])


def client(uri: str) -> Any:
    """An MLflow client for ``uri``."""
    _quiet_mlflow()
    # MLflow's package imports itself circularly: imported from two threads at once, one
    # can see a half-built module and the process's MLflow stays broken. raylift imports
    # it here, on the caller's thread, before any of its own threads touch it.
    with _IMPORTING:
        import mlflow.entities  # noqa: F401  (imported for its side effect: loaded once)
        from mlflow.tracking import MlflowClient

    with one_at_a_time(uri):  # a new sqlite store is created and migrated here
        # The registry is the same store: by default MLflow would use its process-wide one.
        return MlflowClient(tracking_uri=uri, registry_uri=uri)


def metric_since(uri: str, run_id: str, key: str, since_s: float) -> float | None:
    """The latest value of ``key`` logged at or after ``since_s`` (epoch seconds), if any."""
    history = client(uri).get_metric_history(run_id, key)
    recent = [m for m in history if m.timestamp >= since_s * 1000]
    return float(recent[-1].value) if recent else None


def latest_metrics(uri: str, run_id: str, prefixes: tuple[str, ...]) -> dict[str, float]:
    """The run's latest value of every metric whose name starts with one of ``prefixes``."""
    metrics = client(uri).get_run(run_id).data.metrics
    return {k: float(v) for k, v in metrics.items() if k.startswith(prefixes)}


def metric_max(uri: str, run_id: str, key: str) -> float | None:
    """The largest value of ``key`` the run has logged, if any."""
    history = client(uri).get_metric_history(run_id, key)
    return max((float(m.value) for m in history), default=None)


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


_HELD = threading.RLock()  # this process's share of the host-wide lock below
_DEPTH: dict[str, int] = {}


@contextlib.contextmanager
def one_at_a_time(uri: str) -> Iterator[None]:
    """Processes on this host open a sqlite store one at a time while inside: MLflow
    creates and migrates a new database on first use, and two processes that do it at
    once (two commands started together, a driver and its tracking actor) collide and
    one fails; so would two creating the same experiment. Re-entrant within a process;
    servers need no lock."""
    db = sqlite_file(uri)
    if db is None:
        yield
        return
    import fcntl

    with _HELD:
        if _DEPTH.get(db):
            _DEPTH[db] += 1
            try:
                yield
            finally:
                _DEPTH[db] -= 1
            return
        name = hashlib.sha1(db.encode()).hexdigest()[:16]
        with open(Path(tempfile.gettempdir()) / f"raylift-mlflow-{name}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            _DEPTH[db] = 1
            try:
                yield
            finally:
                _DEPTH.pop(db, None)
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

    # A sweep's trial is one child whatever its attempts: one stopped (Ctrl-C) before
    # its first checkpoint starts afresh on the resumed sweep, in the child it had.
    trial = "mlflow.parentRunId" in (extra_tags or {})
    run_id = find_run(uri, cfg.tracking.experiment, key) if resume or trial else None
    params = {k: str(v)[:6000] for k, v in redact(flatten(cfg.to_dict())).items()}
    tags = {
        "raylift.run_key": key,
        "raylift.strategy": cfg.strategy.name,
        "raylift.precision": cfg.precision,
        "raylift.world_size": str(world_size),
        "raylift.task": cfg.task,
        "mlflow.runName": cfg.name,
        **hub.tags(cfg.task_args.get("model")),  # what the run read: its ID and commit
        **(extra_tags or {}),
    }
    if run_id is None:
        exp_id = experiment_id(mlflow, cfg.tracking.experiment, artifact_location(uri))
        run_id = mlflow.create_run(exp_id, tags=tags).info.run_id
        # The client cuts a batch into the store's limit (100 params) itself.
        mlflow.log_batch(run_id, params=[Param(k, v) for k, v in params.items()])
        return str(run_id)
    mlflow.update_run(run_id, status="RUNNING")
    old = mlflow.get_run(run_id).data.params
    # Params are immutable in MLflow: record what this resume changed as tags.
    changed = [
        RunTag(f"raylift.resume_override.{k}", v) for k, v in params.items() if old.get(k) != v
    ]
    mlflow.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()] + changed)
    return str(run_id)


def artifact_location(uri: str) -> str | None:
    """Where a new experiment of a sqlite store keeps its artifacts: ``mlruns`` beside the
    file. MLflow's default is ``./mlruns`` of whichever process creates the experiment;
    for a submitted job that is Ray's copy of the shipped folder, deleted after the job."""
    db = sqlite_file(uri)
    if db is None:
        return None  # a server's or a database's own artifact root
    return (Path(db).parent / "mlruns").as_uri()


def sqlite_file(uri: str) -> str | None:
    """The database file a ``sqlite:///`` store URI names, else None."""
    return uri.removeprefix("sqlite:///") if uri.startswith("sqlite:///") else None


def experiment_id(mlflow: Any, name: str, artifacts: str | None = None) -> str:
    """The experiment's id, created if missing (its artifacts under ``artifacts``, when
    given). Two commands that start together against one server may both create it: the
    loser finds the winner's."""
    exp = mlflow.get_experiment_by_name(name)
    if exp is not None:
        return str(exp.experiment_id)
    try:
        location = f"{artifacts}/{name}" if artifacts else None
        return str(mlflow.create_experiment(name, artifact_location=location))
    except Exception:  # the server's error types: "already exists", or its unique constraint
        exp = mlflow.get_experiment_by_name(name)
        if exp is None:
            raise
        return str(exp.experiment_id)


def end_run(uri: str, run_id: str, status: str, tags: Mapping[str, str] | None = None) -> None:
    mlflow = client(uri)
    for k, v in (tags or {}).items():
        mlflow.set_tag(run_id, k, v)
    mlflow.set_terminated(run_id, status=status)


@dataclasses.dataclass(frozen=True)
class DatasetRecord:
    """One MLflow dataset input: what a run trained on, told apart by its digest."""

    name: str
    digest: str
    source: str  # a URI or path
    source_type: str  # "local", "s3", "gs", ... (the URI's scheme); "code" for a package's data
    context: str  # "training": the shards read; "source": the raw data they came from
    profile: dict[str, Any]


def is_local_store(uri: str) -> bool:
    """A store that is a file on some machine (sqlite, file:, a bare path), not a server."""
    return uri.startswith(("sqlite:", "file:")) or "://" not in uri
