"""The run's one MLflow writer, reachable from every node: a Ray actor on the driver's node
(:func:`start_service`) that serves the driver, each worker (:class:`ServiceTracker`) and
a sweep's trials, so tracking works from any node without MLflow's credentials there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from raylift.artifacts.tracking import (
    DatasetRecord,
    client,
    end_run,
    latest_metrics,
    metric_max,
    metric_since,
    process_uri,
    start_run,
)
from raylift.core import storage, stores
from raylift.core.config import Config
from raylift.core.names import MODEL_NAME
from raylift.core.parsing import RUN_CONFIG


@dataclasses.dataclass(frozen=True)
class Goodput:
    training_s: float  # from the first step to the end
    lost_s: float  # each restart's death-to-back time, added up
    restarts: int

    @property
    def share(self) -> float:
        return max(0.0, 1.0 - self.lost_s / self.training_s) if self.training_s > 0 else 1.0

    def line(self) -> str:
        return (
            f"goodput {self.share:.2f}: {self.restarts} restart(s) cost {self.lost_s:.1f} s "
            f"of {self.training_s:.1f} s of training"
        )


class RunClock:
    """Kept by the tracking actor for each run: rank 0's progress, each failure the
    controller reported, and each restart's lost time."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.step = 0
        self.faults: list[dict[str, Any]] = []  # {"at", "step", "claimed"}
        self.lost: list[float] = []

    def progress(self, step: int, at: float) -> None:
        self.first = at if self.first is None else self.first
        self.step = max(self.step, step)

    def fault(self, at: float) -> None:
        self.faults.append({"at": at, "step": self.step, "claimed": False})

    def claim_fault(self) -> dict[str, Any] | None:
        """The failure a new group restarts after: the first unclaimed one's time and the
        furthest step any reached (a group that died while starting claims none)."""
        open_ = [f for f in self.faults if not f["claimed"]]
        for f in open_:
            f["claimed"] = True
        return {"at": open_[0]["at"], "step": max(f["step"] for f in open_)} if open_ else None

    def goodput(self, end: float) -> Goodput | None:
        if self.first is None:
            return None
        return Goodput(end - self.first, sum(self.lost), len(self.lost))


class Store:
    """What raylift asks of one tracking store. As the tracking actor on the driver's node
    it serves the driver, the workers and a sweep's trials; a sweep's driver and a driver
    on a Ray Client connection use one in their own process."""

    def __init__(self, uri: str):
        # boto3, under MLflow's artifacts in S3, retries as raylift's S3 client does where
        # nothing set it otherwise: this may be a process of its own, on any node.
        os.environ.update(stores.client_retries_env())
        self.uri = uri
        self._client: Any = None
        self._workers: dict[str, dict[str, Any]] = {}
        self._clocks: dict[str, RunClock] = {}

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

    def ranks_on(self, node_ids: list[str]) -> dict[int, str]:
        """The ranks whose newest process ran on one of ``node_ids``, with its address."""
        newest = {r["rank"]: r for r in self._workers.values()}  # in the order they started
        return {k: r["ip"] for k, r in newest.items() if r["node_id"] in node_ids}

    # Restarts (raylift.run.restarts): rank 0's progress, each failure the controller
    # reported, each restart's lost time; the driver asks for the run's goodput at the end.
    def progress(self, run_id: str, step: int, at: float) -> None:
        self._clocks.setdefault(run_id, RunClock()).progress(step, at)

    def fault(self, run_id: str, at: float) -> None:
        self._clocks.setdefault(run_id, RunClock()).fault(at)

    def claim_fault(self, run_id: str) -> dict[str, Any] | None:
        return self._clocks.setdefault(run_id, RunClock()).claim_fault()

    def recovered(self, run_id: str, seconds: float) -> None:
        self._clocks.setdefault(run_id, RunClock()).lost.append(seconds)

    def goodput(self, run_id: str, end: float) -> Goodput | None:
        clock = self._clocks.get(run_id)
        return clock.goodput(end) if clock else None

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

    def open_run(
        self, cfg: Config, storage: str, resume: bool, world_size: int,
        extra_tags: Mapping[str, str], config_yaml: bytes, datasets: list[DatasetRecord],
    ) -> str:  # fmt: skip
        """:meth:`start_run`, then the run's description: its config as it ran (an
        artifact) and the data it trains on (dataset inputs). Returns the run's id."""
        run_id = self.start_run(cfg, storage, resume, world_size, extra_tags)
        self.log_artifact(run_id, RUN_CONFIG, config_yaml, None)
        self.log_datasets(run_id, datasets)
        return run_id

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
