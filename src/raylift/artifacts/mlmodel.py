"""The trained model in MLflow: logged with its run, registered, and read back as
``model.weights``.

After the last step the driver consolidates the chosen checkpoint exactly as ``raylift
export`` does (safetensors; a Hugging Face folder where the task's model is one), adds
the config the run recorded and a note of its task and checkpoint, and logs the folder
as the run's MLflow logged model ``model``: the UI lists it beside the run's metrics and
``runs:/RUN_ID/model`` finds it. ``tracking.register_as`` makes it a new version of a
registered model. ``model.weights: models:/NAME/VERSION`` (or ``runs:/RUN_ID/model``)
brings it back: the driver downloads it once into the run's folder (``weights/``), which
every node reads like any ``model.weights`` folder, local or in an object store.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raylift.artifacts import tracking
from raylift.artifacts.adapter_export import export_peft
from raylift.artifacts.export import export, export_hf, hf_config_or_none
from raylift.artifacts.tracking import DatasetRecord, redact
from raylift.core import console, storage
from raylift.core.config import Config
from raylift.core.errors import first_line
from raylift.core.names import NOTE, is_mlflow_uri
from raylift.core.parsing import RUN_CONFIG
from raylift.tasks import build_task
from raylift.tensors.checkpoints import (
    CheckpointError,
    check_listing,
    checkpoint_dirs,
    checkpoint_step,
    newest_complete,
    read_loop_state,
    verify_checkpoint,
)
from raylift.tensors.preflight import check_adapter_weights, check_for_config
from raylift.tensors.weights import WeightsError, base_of, weights_path

WEIGHTS_DIR = "weights"  # in the run's folder: model.weights fetched from MLflow
ADAPTERS_DIR = "adapter-weights"  # and model.adapter.weights
SOURCE_FILE = ".source"  # in WEIGHTS_DIR: the URI it was fetched from


@dataclasses.dataclass(frozen=True)
class LoggedModel:
    model_id: str
    checkpoint: str  # the checkpoint its weights are
    format: str  # "safetensors" or "hf"
    bytes: int
    seconds: float  # consolidating, writing and uploading it
    registered: str | None  # models:/NAME/VERSION where tracking.register_as asked

    @property
    def uri(self) -> str:
        return f"models:/{self.model_id}"


def monitored(cfg: Config) -> tuple[str, str]:
    """The metric and mode that make a checkpoint the best: early stopping's, else val_loss."""
    es = cfg.train.early_stopping
    return (es.monitor, es.mode) if es is not None else ("val_loss", "min")


def choose_checkpoint(
    run_dir: str, which: str, metric: str, mode: str, log: Callable[[str], None] = print
) -> str | None:
    """The newest complete checkpoint (``final``), or the complete one whose last
    evaluation scored best on ``metric`` (``best``; the later one on a tie), from the
    run's folder. A better-scored one that is not complete (a rank never finished it, a
    file is damaged) is passed over, and said so."""
    if which == "final":  # the export checks each block as it reads it
        return newest_complete(run_dir, log, check_listing)
    scored: list[tuple[float, int, str]] = []
    for ckpt in checkpoint_dirs(run_dir):
        try:
            value = read_loop_state(ckpt).get("metrics", {}).get(metric)
        except CheckpointError:
            continue
        if isinstance(value, (int, float)) and math.isfinite(value):
            sign = 1.0 if mode == "min" else -1.0
            scored.append((sign * float(value), -checkpoint_step(ckpt), ckpt))
    for _, _, ckpt in sorted(scored):
        try:
            verify_checkpoint(ckpt)
            return ckpt
        except CheckpointError as exc:
            log(f"raylift: passing over {ckpt} for the best model: {exc}")
    return newest_complete(run_dir, log)


def model_folder(ckpt: str, cfg: Config, run_dir: str, out: Path) -> str:
    """``raylift export``'s output of ``ckpt`` in ``out``, the run's recorded config and a
    note beside it; returns the format written."""
    task = build_task(cfg.task, cfg.task_args)
    fmt = "hf" if hf_config_or_none(task) is not None else "safetensors"
    base = None
    if cfg.model.adapter.type:  # the adapters alone (small), naming their base
        fmt = "peft"
        export_peft(ckpt, out, cfg, task)
        base = base_of(cfg, weights_path(cfg, task))
    elif fmt == "hf":
        export_hf(ckpt, out, task)
    else:
        export(ckpt, out / "model.safetensors", "safetensors")
    recorded = storage.read_text(storage.join(run_dir, RUN_CONFIG))
    if recorded is not None:
        (out / RUN_CONFIG).write_text(recorded)
    note = {
        "task": cfg.task,
        "task_args": redact(cfg.task_args),
        "format": fmt,
        "base": base["weights"] if base else None,
        "base_headers": base["headers"] if base else None,  # a rerun checks it trains on it
        "checkpoint": ckpt,
        "step": checkpoint_step(ckpt),
        "metrics": read_loop_state(ckpt).get("metrics", {}),
    }
    (out / NOTE).write_text(json.dumps(note, indent=2, default=str))
    return fmt


def log_model(
    store: Any,
    run_id: str,
    cfg: Config,
    run_dir: str,
    which: str,
    log: Callable[[str], None],
    metric: tuple[str, str] | None = None,
) -> LoggedModel | None:
    """Log the run's ``which`` checkpoint (final or best: by ``metric``, a name and
    min/max, else the run's own) as the MLflow model of ``run_id``, registered where
    ``tracking.register_as`` asks; None where the run left no checkpoint."""
    name, mode = metric or monitored(cfg)
    ckpt = choose_checkpoint(run_dir, which, name, mode, log)
    if ckpt is None:
        log(f"raylift: no checkpoint in {run_dir} to log as the run's model")
        return None
    started = time.perf_counter()
    with storage.scratch("model") as tmp:
        with console.library_quiet():  # DeepSpeed's converter prints and draws bars
            fmt = model_folder(ckpt, cfg, run_dir, Path(tmp))
        size = sum(f.stat().st_size for f in Path(tmp).rglob("*") if f.is_file())
        tags = {"raylift.checkpoint": ckpt, "raylift.task": cfg.task, "raylift.format": fmt}
        model_id, registered = store.log_model(run_id, tmp, tags, cfg.tracking.register_as)
    logged = LoggedModel(model_id, ckpt, fmt, size, time.perf_counter() - started, registered)
    log(
        f"raylift: model logged to MLflow as {logged.uri} ({which}: {storage.name(ckpt)}, "
        f"{fmt}, {size / 2**20:.1f} MiB, {logged.seconds:.1f} s)"
        + (f"; registered as {registered}" if registered else "")
    )
    return logged


# ---------------------------------------------------------------- model.weights from MLflow


def fetch_weights(
    cfg: Config, run_dir: str, tracking_uri: str, log: Callable[[str], None]
) -> Config:
    """``cfg`` with an MLflow ``model.weights`` (and ``model.adapter.weights``) replaced by
    its copy in the run's folder, downloaded there once (a rerun that resumes finds it);
    other weights pass through."""

    def task() -> Any:  # built only where a model is fetched and checked
        return build_task(cfg.task, cfg.task_args)

    weights = _fetched("model.weights", cfg.model.weights, run_dir, WEIGHTS_DIR, tracking_uri,
                       log, lambda tmp: check_for_config(cfg, task(), tmp))  # fmt: skip
    model = dataclasses.replace(cfg.model, weights=weights)
    adapters = _fetched("model.adapter.weights", cfg.model.adapter.weights, run_dir,
                        ADAPTERS_DIR, tracking_uri, log,
                        lambda tmp: _check_adapters(cfg, task(), tmp, weights))  # fmt: skip
    model = dataclasses.replace(model, adapter=dataclasses.replace(model.adapter, weights=adapters))
    return dataclasses.replace(cfg, model=model)


def _check_adapters(cfg: Config, task: Any, folder: str, weights: str | None) -> None:
    base = weights or weights_path(cfg, task)
    check_adapter_weights(cfg, task, folder, None if base is None else base_of(cfg, base))


def _fetched(
    key: str,
    source: str | None,
    run_dir: str,
    folder: str,
    tracking_uri: str,
    log: Callable[[str], None],
    check: Callable[[str], None],
) -> str | None:
    """``source``'s copy in the run's ``folder`` where it is an MLflow URI, else itself."""
    if source is None or not is_mlflow_uri(source):
        return source
    staged = storage.join(run_dir, folder)
    if storage.read_text(storage.join(staged, SOURCE_FILE)) != source:
        started = time.perf_counter()
        size = download(source, staged, tracking_uri, check, key)
        log(
            f"raylift: {key} {source} -> {staged} "
            f"({size / 2**20:.1f} MiB, {time.perf_counter() - started:.1f} s)"
        )
    return staged


def download(
    source: str,
    staged: str,
    tracking_uri: str,
    check: Callable[[str], None],
    key: str = "model.weights",
) -> int:
    """The MLflow model at ``source`` (the config's ``key``), passed by ``check`` (a local
    folder), into ``staged`` (a folder or a URI); its bytes."""
    import pyarrow.fs as pafs

    with storage.scratch("weights") as tmp:
        try:
            tracking.client(tracking_uri)  # MLflow imported and quieted as raylift does
            import mlflow.artifacts

            with tracking.process_uri(tracking_uri):
                mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=tmp)
        except Exception as exc:  # MLflow's own error types: a missing model, a bad URI
            raise WeightsError(
                f"{key}: cannot fetch {source} from the tracking store "
                f"{tracking_uri}: {first_line(exc)}; check the name and version "
                "(models:/NAME/VERSION) or run id (runs:/RUN_ID/model), and tracking.uri"
            ) from exc
        check(tmp)
        size = sum(f.stat().st_size for f in Path(tmp).rglob("*") if f.is_file())
        fs, where = storage.filesystem(staged)
        fs.create_dir(where, recursive=True)
        fs.delete_dir_contents(where, missing_dir_ok=True)  # another source's files
        local = pafs.LocalFileSystem()
        pafs.copy_files(tmp, where, source_filesystem=local, destination_filesystem=fs)
    # Last: a copy cut off half-way has no source and is fetched again.
    storage.write_text(storage.join(staged, SOURCE_FILE), source)
    return size


# ---------------------------------------------------------------- the data a run trained on


def dataset_records(cfg: Config, manifest: Any) -> list[Any]:
    """The shards the run reads and the raw data they were prepared from, as MLflow
    dataset inputs: the shards' fingerprint is their digest (it changes with the raw
    data, the task's code and its args), their rows per split the profile."""
    import hashlib

    task = build_task(cfg.task, cfg.task_args)
    version = getattr(task, "data_version", None)
    raw = raw_source(cfg, task)
    raw_version = str(version()) if callable(version) else raw
    return [
        DatasetRecord(
            name=storage.name(manifest.root),
            digest=manifest.fingerprint[:36],
            source=manifest.root,
            source_type=scheme(manifest.root),
            context="training",
            profile={"rows": {s: manifest.rows(s) for s in manifest.splits}},
        ),
        DatasetRecord(
            name=f"{cfg.task} raw data",
            digest=hashlib.sha256(raw_version.encode()).hexdigest()[:36],
            source=raw,
            source_type=scheme(raw),
            context="source",
            profile={"task_args": redact(cfg.task_args)},
        ),
    ]


def raw_source(cfg: Config, task: Any) -> str:
    """Where the task's raw data comes from: its ``raw_source()`` where it says, else its
    corpus or image folder, else the task itself (data it makes or ships)."""
    hook = getattr(task, "raw_source", None)
    if callable(hook):
        return str(hook())
    for attr in ("corpus", "root"):
        value = getattr(task, attr, None)
        if isinstance(value, (str, Path)) and str(value):
            return storage.resolve(str(value))
    return f"task:{cfg.task}"


def scheme(uri: str) -> str:
    """``s3`` of ``s3://...``; ``local`` for a path; ``code`` for a task's own data."""
    if uri.startswith("task:"):
        return "code"
    return uri.split("://", 1)[0] if storage.is_remote(uri) else "local"
