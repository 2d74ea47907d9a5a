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
import json
import os
import re
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from raylift.core import storage
from raylift.core.config import Config, flatten
from raylift.core.names import MODEL_NAME

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
    (a registered version's source, a model's download), then back."""
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
        exp_id = experiment_id(mlflow, cfg.tracking.experiment, artifact_location(uri))
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


class Store:
    """What raylift asks of one tracking store. As the tracking actor on the driver's node
    it serves the driver, the workers and a sweep's trials; a sweep's driver and a driver
    on a Ray Client connection use one in their own process."""

    def __init__(self, uri: str):
        self.uri = uri
        self._client: Any = None
        self._workers: dict[str, dict[str, Any]] = {}

    # The run's worker processes by actor id, for a crash's report (raylift.run.faults): its
    # rank, node, pid and stderr file, and its node's memory at its last logging interval.
    def worker_started(self, actor_id: str, record: dict[str, Any]) -> None:
        self._workers[actor_id] = dict(record)

    def worker_memory(self, actor_id: str, used: float, total: float) -> None:
        if actor_id in self._workers:
            self._workers[actor_id]["memory"] = (used, total)

    def worker_record(self, actor_id: str | None, rank: int) -> dict[str, Any] | None:
        """By the dead actor's id; else (Ray's error did not carry it) the newest process
        of that rank."""
        if actor_id in self._workers:
            return self._workers[actor_id]
        same = [r for r in self._workers.values() if r["rank"] == rank]
        return same[-1] if same else None

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = client(self.uri)
        return self._client

    def warm(self) -> None:
        """Import MLflow and open the store ahead of the first write."""
        _ = self.client

    def log_batch(
        self,
        run_id: str,
        metrics: list[tuple[str, float]],
        step: int,
        timestamp_ms: int,
        tags: dict[str, str] | None = None,
    ) -> None:
        from mlflow.entities import Metric, RunTag

        self.client.log_batch(
            run_id,
            metrics=[Metric(k, v, timestamp_ms, step) for k, v in metrics],
            tags=[RunTag(k, v) for k, v in (tags or {}).items()],
        )

    def log_artifact(self, run_id: str, filename: str, data: bytes, folder: str | None) -> None:
        """A file of a worker's, sent as its bytes: the worker's disk is not this node's."""

        with storage.scratch("artifact") as tmp:
            path = Path(tmp) / filename
            path.write_bytes(data)
            self.client.log_artifact(run_id, str(path), folder)

    def log_model(
        self, run_id: str, folder: str, tags: dict[str, str], register_as: str | None
    ) -> tuple[str, str | None]:
        """``folder`` as the run's MLflow logged model (its id), and as a new version of
        the registered model ``register_as`` where given (``models:/NAME/VERSION``)."""
        mlflow = self.client
        exp_id = mlflow.get_run(run_id).info.experiment_id
        model = mlflow.create_logged_model(
            exp_id, name=MODEL_NAME, source_run_id=run_id, tags=tags, model_type="raylift"
        )
        try:
            mlflow.log_model_artifacts(model.model_id, folder)
        except BaseException:
            mlflow.finalize_logged_model(model.model_id, "FAILED")
            raise
        mlflow.finalize_logged_model(model.model_id, "READY")
        if not register_as:
            return model.model_id, None
        from mlflow.exceptions import MlflowException

        try:
            mlflow.create_registered_model(register_as)
        except MlflowException as exc:
            if "ALREADY_EXISTS" not in str(exc.error_code):
                raise
        with process_uri(self.uri):  # the source models:/ resolves in this store
            version = mlflow.create_model_version(
                register_as, source=f"models:/{model.model_id}", run_id=run_id,
                model_id=model.model_id, await_creation_for=0,  # a new version is READY at once
            )  # fmt: skip
        return model.model_id, f"models:/{register_as}/{version.version}"

    def log_datasets(self, run_id: str, datasets: list[DatasetRecord]) -> None:
        """The data a run trained on, as MLflow dataset inputs (one per record)."""
        from mlflow.entities import Dataset, DatasetInput, InputTag

        inputs = []
        for d in datasets:
            source = json.dumps({"uri": d.source})
            found = Dataset(d.name, d.digest, d.source_type, source, profile=json.dumps(d.profile))
            inputs.append(DatasetInput(found, [InputTag("mlflow.data.context", d.context)]))
        try:
            self.client.log_inputs(run_id, datasets=inputs)
        except Exception as exc:  # the store's error type: sqlite's, a database's, a server's
            # MLflow looks a dataset up, then inserts it: two runs that log the same shards
            # at once (a sweep's trials, a team's jobs) collide on the second insert. The
            # winner's row is there now, and the retry links it.
            if "unique constraint" not in str(exc).lower():
                raise
            self.client.log_inputs(run_id, datasets=inputs)

    def metric_since(self, run_id: str, key: str, since_s: float) -> float | None:
        return metric_since(self.uri, run_id, key, since_s)

    def latest_metrics(self, run_id: str, prefixes: tuple[str, ...]) -> dict[str, float]:
        return latest_metrics(self.uri, run_id, prefixes)

    def metric_max(self, run_id: str, key: str) -> float | None:
        return metric_max(self.uri, run_id, key)

    def start_run(
        self,
        cfg: Config,
        storage: str,
        resume: bool,
        world_size: int,
        extra_tags: Mapping[str, str] | None = None,
    ) -> str:
        # This store's URI, whatever the config names: they are the same for a run.
        ours = dataclasses.replace(cfg, tracking=dataclasses.replace(cfg.tracking, uri=self.uri))
        return start_run(ours, storage, resume, world_size, extra_tags)

    def end_run(self, run_id: str, status: str, tags: Mapping[str, str] | None = None) -> None:
        end_run(self.uri, run_id, status, tags)


class RemoteStore:
    """A :class:`Store` served by the tracking actor: each call waits for its answer."""

    def __init__(self, service: Any):
        self.service = service

    def __getattr__(self, name: str) -> Any:
        import ray

        method = getattr(self.service, name)
        return lambda *args, **kwargs: ray.get(method.remote(*args, **kwargs))


def start_service(uri: str) -> Any:
    """The tracking actor for ``uri``, on this process's node (it takes no CPU)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    actor = ray.remote(num_cpus=0)(Store).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
    )
    return actor.remote(uri)


def is_local_store(uri: str) -> bool:
    """A store that is a file on some machine (sqlite, file:, a bare path), not a server."""
    return uri.startswith(("sqlite:", "file:")) or "://" not in uri


class ServiceTracker:
    """Rank 0's writer: every write goes to the tracking actor without the loop waiting
    (one caller's calls run in order); :meth:`close` waits for them all and raises the
    first that failed, and a failure surfaces at the next write where the loop sees it."""

    def __init__(self, service: Any, run_id: str):
        self.service, self.run_id = service, run_id
        self._pending: list[Any] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        rows = [(k, float(v)) for k, v in metrics.items()]
        now = int(time.time() * 1000)  # taken when the loop logs, not when it lands
        self._send(self.service.log_batch.remote(self.run_id, rows, step, now))

    def set_tags(self, tags: dict[str, str]) -> None:
        now = int(time.time() * 1000)
        self._send(self.service.log_batch.remote(self.run_id, [], 0, now, dict(tags)))

    def log_artifact(self, path: Path, folder: str) -> None:
        data = path.read_bytes()
        self._send(self.service.log_artifact.remote(self.run_id, path.name, data, folder))

    def restarts(self) -> int:
        import ray

        self.close()  # what this rank logged before, counted too
        most = ray.get(self.service.metric_max.remote(self.run_id, "restarts"))
        return int(most or 0)

    def close(self) -> None:
        import ray

        pending, self._pending = self._pending, []
        ray.get(pending)

    def _send(self, ref: Any) -> None:
        import ray

        if self._pending:
            done, self._pending = ray.wait(self._pending, num_returns=len(self._pending), timeout=0)
            ray.get(done)  # raises a failed write where the loop can see it
        self._pending.append(ref)
