"""``raylift tune``: a Ray Tune sweep whose every trial is a distributed raylift run.

Each trial is a Tune function trainable that asks for almost no resources and
launches its own ``TorchTrainer`` (Train V2), the same loop ``raylift train`` runs;
every evaluation is relayed back to Tune (:func:`reports_to_tune`), so a scheduler
can stop a trial between epochs, and a stopped trial's workers go with it. MLflow
gets one parent run for the sweep and one child per trial (``mlflow.parentRunId``);
a trial restarted after a failure, or a sweep resumed after Ctrl-C, continues its
own runs: every run is found again by its name and storage. A resume never unpickles
what Tune saved (:mod:`raylift.commands.sweep_record`): a fresh Tuner makes the same
trials again, and each finds its own run and its record.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import yaml
from ray.train import UserCallback

from raylift.artifacts import mlmodel, tracking, tracking_service
from raylift.commands.sweep_record import (
    TrialKeys,
    Trials,
    finished,
    read_record,
    recorder,
)
from raylift.core import console, runlock, storage
from raylift.core import storage as stores
from raylift.core.config import (
    Config,
    ConfigError,
    EnvironmentProblem,
    TuneConfig,
    TuneSchedulerConfig,
)
from raylift.core.parsing import merge, nest, parse_overrides
from raylift.core.storage import join, resolve
from raylift.data.shards import shards_for_run
from raylift.run.auto import resolve_auto
from raylift.run.check import writable
from raylift.run.connect import connect_ray
from raylift.run.launch import ray_storage, tracking_for_run, train
from raylift.tasks import build_task
from raylift.tensors.weights import absolute
from raylift.validation import config_from_dict

DISTRIBUTIONS = ("loguniform", "uniform", "randint", "choice", "grid")
SCHEDULERS = ("asha", "median", "none")
SEARCHES = ("random", "optuna")
TIME_ATTR = "epochs_done"  # reported with every evaluation; whole numbers at epoch ends


# ---------------------------------------------------------------- the tune: section


def parse_sweep(cfg: Config) -> TuneConfig:
    """The config's ``tune:`` section, checked; every problem at once as a ConfigError."""
    raw = dict(cfg.tune or {})
    known = {f.name for f in dataclasses.fields(TuneConfig)}
    problems = [f"tune.{k}: unknown key; allowed: {sorted(known)}" for k in raw if k not in known]
    scheduler, sched_problems = _parse_scheduler(raw.pop("scheduler", "asha"))
    fields = {k: v for k, v in raw.items() if k in known}
    spec = TuneConfig(**{"space": {}, **fields}, scheduler=scheduler)
    problems += sched_problems + _spec_problems(spec, cfg)
    if problems:
        raise ConfigError(problems)
    return spec


def _parse_scheduler(raw: Any) -> tuple[TuneSchedulerConfig, list[str]]:
    """``asha`` or ``{name: asha, grace_period: 1, ...}``; null means none."""
    fields = {"name": raw} if isinstance(raw, str) else dict(raw or {"name": "none"})
    try:
        return TuneSchedulerConfig(**fields), []
    except TypeError:
        allowed = [f.name for f in dataclasses.fields(TuneSchedulerConfig)]
        return TuneSchedulerConfig(), [f"tune.scheduler: allowed keys are {allowed}"]


def _spec_problems(spec: TuneConfig, cfg: Config) -> list[str]:
    out = []
    if not spec.space:
        out.append("tune.space: empty; e.g. {optim.lr: {loguniform: [1.0e-4, 1.0e-2]}}")
    for key, dist in spec.space.items():
        out += _dist_problems(key, dist, cfg)
    if spec.num_samples < 1 or spec.max_concurrent < 1:
        out.append("tune.num_samples and tune.max_concurrent: must be >= 1")
    if spec.mode not in ("min", "max"):
        out.append(f"tune.mode: 'min' or 'max', got {spec.mode!r}")
    if spec.scheduler.name not in SCHEDULERS:
        hint = " (pbt is not offered: see the README)" if spec.scheduler.name == "pbt" else ""
        out.append(f"tune.scheduler: {spec.scheduler.name!r} unknown; one of {SCHEDULERS}{hint}")
    if spec.search not in SEARCHES:
        out.append(f"tune.search: {spec.search!r} unknown; one of {SEARCHES}")
    if spec.search == "optuna" and any("grid" in d for d in spec.space.values()):
        out.append("tune.space: grid needs tune.search: random (optuna samples, it does not grid)")
    return out


def _dist_problems(key: str, dist: Any, cfg: Config) -> list[str]:
    where = f"tune.space.{key}"
    if not isinstance(dist, dict) or len(dist) != 1 or next(iter(dist)) not in DISTRIBUTIONS:
        return [f"{where}: one of {DISTRIBUTIONS} with its arguments, e.g. {{uniform: [0.0, 0.3]}}"]
    ((kind, args),) = dist.items()
    if kind in ("loguniform", "uniform", "randint"):
        if not (isinstance(args, list) and len(args) == 2 and args[0] < args[1]):
            return [f"{where}: {kind} takes [low, high] with low < high"]
        if kind == "loguniform" and args[0] <= 0:
            return [f"{where}: loguniform needs low > 0"]
    elif not (isinstance(args, list) and args):
        return [f"{where}: {kind} takes a non-empty list of values"]
    # The key must name a real config key: try the lowest value on the base config.
    sample = args[0]
    tree, _ = parse_overrides([f"{key}={yaml.safe_dump(sample).strip()}"])
    try:
        config_from_dict(merge(cfg.to_dict(), tree))
    except ConfigError as exc:
        return [f"{where}: {p}" for p in exc.problems]
    return []


def param_space(spec: TuneConfig) -> dict[str, Any]:
    from ray import tune

    make = {
        "loguniform": lambda a: tune.loguniform(*a),
        "uniform": lambda a: tune.uniform(*a),
        "randint": lambda a: tune.randint(a[0], a[1] + 1),  # inclusive, as the YAML reads
        "choice": lambda a: tune.choice(a),
        "grid": lambda a: tune.grid_search(a),
    }
    return {
        key: make[kind](args) for key, dist in spec.space.items() for kind, args in dist.items()
    }


def trial_config(base: dict[str, Any], params: dict[str, Any], name: str) -> Config:
    """The base config with one trial's sampled values (dotted keys) and its own name."""
    tree = nest(params.items())
    return config_from_dict(merge(merge(base, tree), {"name": name, "tune": None}))


# ---------------------------------------------------------------- Tune objects


def scheduler(spec: TuneConfig, max_epochs: int) -> Any:
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, MedianStoppingRule

    s = spec.scheduler
    if s.name == "asha":
        return ASHAScheduler(
            time_attr=TIME_ATTR,
            max_t=s.max_t or max_epochs,
            grace_period=s.grace_period,
            reduction_factor=s.reduction_factor,
        )
    if s.name == "median":
        return MedianStoppingRule(time_attr=TIME_ATTR, grace_period=s.grace_period)
    return FIFOScheduler()


def search_alg(spec: TuneConfig, seed: int) -> Any:
    """Both searches are seeded by ``train.seed``: the same config samples the same trials.

    Each limits how many trials run at once itself (Tune ignores ``max_concurrent_trials``
    beside a variant generator).
    """
    if spec.search != "optuna":
        from ray.tune.search import BasicVariantGenerator

        return BasicVariantGenerator(random_state=seed, max_concurrent=spec.max_concurrent)
    try:
        from ray.tune.search.optuna import OptunaSearch
    except ImportError:  # pragma: no cover - depends on the install
        raise ConfigError(["tune.search: optuna needs `pip install optuna`"]) from None
    from ray.tune.search import ConcurrencyLimiter

    return ConcurrencyLimiter(OptunaSearch(seed=seed), max_concurrent=spec.max_concurrent)


# ---------------------------------------------------------------- one trial


class _ToTune(UserCallback):
    """Runs in the Train controller: each report waits in a one-place queue for the trial."""

    def __init__(self, queue: Any) -> None:
        self._queue = queue

    def after_report(
        self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any
    ) -> None:
        # Rank 0's metrics, as Ray's TuneReportCallback passes; a full queue holds the
        # controller until Tune has taken the last one, so a stopped trial trains no further.
        self._queue.put(dict(metrics[0]))


@contextlib.contextmanager
def reports_to_tune() -> Iterator[UserCallback]:
    """A callback for the trial's Train run, and a thread that reports what it sends.

    Ray's ``TuneReportCallback`` has the trial actor's main thread report on the trial's
    behalf, into the queue only that thread empties: when the run returned straight after
    its last report, that thread could take the report after the trial function's closing
    result filled the queue, and wait on itself forever (a resumed sweep hung in the suite).
    Here a thread of the trial's own reports them, and the trial returns only once it has.
    """
    from ray.util.queue import Full, Queue

    queue = Queue(1, actor_options={"num_cpus": 0})
    failed: list[BaseException] = []
    relay = threading.Thread(target=_relay, args=(queue, failed), daemon=True)
    relay.start()
    try:
        yield _ToTune(queue)
    finally:
        # The run has returned, its reports are all queued: the end goes in behind them.
        while relay.is_alive():  # not once Tune has stopped the trial
            try:
                queue.put(None, timeout=1.0)
                break
            except Full:
                continue
        relay.join()
        queue.shutdown(force=True)  # nothing in it is wanted now: no grace period
    if failed:
        raise failed[0]


def _relay(queue: Any, failed: list[BaseException]) -> None:
    from ray import tune

    try:
        while (metrics := queue.get()) is not None:
            tune.report(metrics)  # returns when Tune asks for the next result
    except SystemExit:  # Tune stopped the trial: its actor, and the run, go with it
        pass
    except Exception as exc:  # raised again in the trial's thread
        failed.append(exc)


def run_trial(params: dict[str, Any], sweep: dict[str, Any]) -> None:
    """A Tune function trainable: one distributed raylift run with this trial's values."""
    from ray import tune

    console.route_ray_process()
    key = tune.get_context().get_trial_name()  # TrialKeys': the same on a resume
    done = sweep.get("done", {}).get(key)
    if done is not None:  # finished before the sweep was resumed: its last result again
        tune.report(done)
        return
    cfg = trial_config(sweep["base"], params, f"{sweep['name']}-{key}")
    with reports_to_tune() as to_tune:
        train(
            cfg,
            log=print,
            parent_run_id=sweep["parent_run_id"],
            callbacks=[to_tune],
            extra_tags={"raylift.sweep": sweep["name"], "raylift.trial_id": key},
            # Tune runs one attempt of a trial at a time, and its worker process may
            # outlive a stopped attempt: the sweep's own lock keeps commands apart.
            lock=False,
            # The trial runs on any node: MLflow is reached through the sweep's
            # tracking actor, on the sweep driver's node.
            service=sweep["tracking"],
        )


# ---------------------------------------------------------------- the sweep


@dataclasses.dataclass
class TrialRow:
    trial_id: str
    status: str
    params: dict[str, Any]
    metric: float | None
    epochs: float
    stopped: str  # "scheduler", "early stopping" or ""


@dataclasses.dataclass
class SweepResult:
    name: str
    rows: list[TrialRow]
    best: TrialRow | None
    best_config: str | None
    parent_run_id: str
    seconds: float


def tune_run(cfg: Config, log: Any = print) -> SweepResult:
    """Run (or resume) the sweep in ``cfg.tune``; returns the trial table and the best config.

    One sweep per name and storage at a time: a second raises :class:`RunLocked`."""
    spec = parse_sweep(cfg)
    if problem := tracking.server_problem(tracking.tracking_uri(cfg)):
        raise EnvironmentProblem(problem)
    writable(resolve(cfg.storage), "storage")
    with runlock.hold(storage.join(resolve(cfg.storage), cfg.name), f"sweep {cfg.name!r}", log):
        connect_ray(cfg, workers=_trial_workers(cfg, spec) * spec.max_concurrent)
        with tracking_for_run(tracking.tracking_uri(cfg)) as (_, service):
            return _tune_run(cfg, spec, log, service)


def _tune_run(cfg: Config, spec: TuneConfig, log: Any, service: Any) -> SweepResult:
    from ray import tune

    started = time.perf_counter()
    storage = resolve(cfg.storage)
    base = _resolved(_trial_base(cfg, spec, storage), log)
    # The data is prepared once here; trials whose task_args differ prepare their own.
    shards_for_run(cfg, build_task(cfg.task, cfg.task_args), log)
    parent = _parent_run(cfg, storage, spec)
    path = join(storage, cfg.name)
    trials = read_record(path)  # raylift's own record, JSON: Tune's pickles stay unread
    log(f"raylift: sweep {cfg.name!r} -> {path} ({'resuming' if trials else 'new sweep'})")
    # Every trial writes to MLflow through the sweep's tracking actor, on this node.
    payload = {"base": base, "name": cfg.name, "parent_run_id": parent, "tracking": service,
               "done": finished(trials)}  # fmt: skip
    trainable = tune.with_resources(
        tune.with_parameters(run_trial, sweep=payload),
        {"CPU": 0.01},  # the trial's workers hold the real resources; this only launches them
    )
    tuner = _tuner(trainable, spec, cfg, storage, recorder(path, trials))
    with _ctrl_c_stops_tune() as interrupted:
        grid = tuner.fit()
    if interrupted.is_set():  # the record says which trials finished: a rerun resumes
        tracking.end_run(tracking.tracking_uri(cfg), parent, "KILLED")
        raise KeyboardInterrupt(f"sweep {cfg.name!r} interrupted")
    rows = _rows(grid, spec, cfg)
    rows += _recorded_rows(trials, {r.trial_id for r in rows}, spec, cfg)
    best = _best(rows, spec)
    best_path = _write_best(cfg, best, storage) if best else None
    if best is not None:
        _log_best_model(cfg, spec, parent, best, storage, log)
    _finish_parent(cfg, parent, rows, best, spec, storage)
    return SweepResult(cfg.name, rows, best, best_path, parent, time.perf_counter() - started)


@contextlib.contextmanager
def _ctrl_c_stops_tune() -> Iterator[threading.Event]:
    """Ctrl-C ends the sweep the way Tune's own handler does (SIGUSR1: stop, save state),
    and the returned event says that it happened, which Tune's return value does not."""
    interrupted = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield interrupted
        return

    def on_sigint(signum: int, frame: Any) -> None:
        interrupted.set()
        os.kill(os.getpid(), signal.SIGUSR1)

    os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"
    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, previous)


def _trial_base(cfg: Config, spec: TuneConfig, storage: str) -> dict[str, Any]:
    """The config every trial starts from. Tune runs trials in folders of their own,
    so every relative path (storage, the MLflow store, shards) is made absolute here."""
    fixed: dict[str, Any] = {
        "scaling": spec.scaling,
        "tune": None,
        "storage": storage,
        # Each trial's model stays in its checkpoints; the sweep logs the best trial's.
        "tracking": {"uri": tracking.tracking_uri(cfg), "log_model": "none", "register_as": None},
    }
    if cfg.data.shards:
        fixed["data"] = {"shards": resolve(cfg.data.shards)}
    if cfg.model.weights:
        fixed["model"] = {"weights": absolute(cfg.model.weights)}
    return merge(cfg.to_dict(), fixed)


def _resolved(base: dict[str, Any], log: Any) -> dict[str, Any]:
    """``base`` with ``auto`` settings resolved here, once for every trial: a trial's
    placement group has no room for the probe that resolves them."""
    return resolve_auto(config_from_dict(base), log).to_dict()


def _trial_workers(cfg: Config, spec: TuneConfig) -> int:
    workers = spec.scaling.get("num_workers", cfg.scaling.num_workers)
    return int(workers[-1] if isinstance(workers, list) else workers)


def _tuner(trainable: Any, spec: TuneConfig, cfg: Config, storage: str, record: Any) -> Any:
    """A fresh Tuner, resumed sweep or not (``Tuner.restore`` would unpickle Tune's saved
    state): the same search, seeded alike, makes the same trials under the same keys."""
    from ray import tune

    keys = TrialKeys()
    return tune.Tuner(
        trainable,
        param_space=param_space(spec),
        tune_config=tune.TuneConfig(
            metric=spec.metric,
            mode=spec.mode,
            num_samples=spec.num_samples,
            scheduler=scheduler(spec, cfg.train.max_epochs),
            search_alg=search_alg(spec, cfg.train.seed),
            trial_name_creator=keys,
            trial_dirname_creator=keys,
        ),
        run_config=tune.RunConfig(
            name=cfg.name,
            **ray_storage(storage),
            failure_config=tune.FailureConfig(max_failures=spec.max_failures),
            callbacks=[record],
            verbose=0,
        ),
    )


def _rows(grid: Any, spec: TuneConfig, cfg: Config) -> list[TrialRow]:
    return [_row(result, spec, cfg) for result in grid]


def _row(result: Any, spec: TuneConfig, cfg: Config) -> TrialRow:
    m = result.metrics or {}
    epochs = float(m.get(TIME_ATTR, 0.0))
    return TrialRow(
        trial_id=str(result.path).rstrip("/").rsplit("/", 1)[-1],  # its key (TrialKeys)
        status="ERROR" if result.error else "TERMINATED",
        params=dict(result.config or {}),
        metric=_finite(m.get(spec.metric)),
        epochs=epochs,
        stopped=_stopped(result.error, m, epochs, cfg),
    )


def _recorded_rows(trials: Trials, seen: set[str], spec: TuneConfig, cfg: Config) -> list[TrialRow]:
    """Trials an earlier session of the sweep finished that this one did not make again
    (a search that suggests from results may suggest otherwise): from the record."""
    rows = []
    for key, trial in sorted(trials.items()):
        if key in seen or trial.get("status") not in ("TERMINATED", "ERROR"):
            continue
        m, error = trial.get("metrics", {}), trial.get("status") == "ERROR" or None
        epochs = float(m.get(TIME_ATTR, 0.0))
        params = dict(trial.get("params", {}))
        stopped = _stopped(error, m, epochs, cfg)
        metric = _finite(m.get(spec.metric))
        rows.append(TrialRow(key, trial["status"], params, metric, epochs, stopped))
    return rows


def _stopped(error: Any, m: dict[str, Any], epochs: float, cfg: Config) -> str:
    """Why a trial ended before its budget: its own early stopping, or the scheduler."""
    if m.get("stopped_early"):
        return "early stopping"
    hit_max_steps = cfg.train.max_steps is not None and m.get("step", 0) >= cfg.train.max_steps
    if error is None and epochs < cfg.train.max_epochs and not hit_max_steps:
        return "scheduler"
    return ""


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _best(rows: list[TrialRow], spec: TuneConfig) -> TrialRow | None:
    scored = [r for r in rows if r.metric is not None]
    if not scored:
        return None
    pick = min if spec.mode == "min" else max
    return pick(scored, key=lambda r: r.metric if r.metric is not None else math.inf)


def _write_best(cfg: Config, best: TrialRow, storage: str) -> str:
    """The best trial's full config at the config's own scale (not a trial's), as YAML
    that ``raylift train`` takes as it is, in the sweep's folder (local or a URI)."""
    best_cfg = trial_config(cfg.to_dict(), best.params, f"{cfg.name}-best")
    out = join(storage, cfg.name, "best.yaml")
    data = best_cfg.to_dict()
    data.pop("tune", None)
    stores.write_text(out, yaml.safe_dump(data, sort_keys=False))
    return out


# ---------------------------------------------------------------- MLflow parent


def _log_best_model(
    cfg: Config, spec: TuneConfig, parent: str, best: TrialRow, storage: str, log: Any
) -> None:
    """``tracking.log_model`` of the sweep: the best trial's final (or best-scored, by the
    sweep's metric) checkpoint, as the parent run's model."""
    if cfg.tracking.log_model == "none":
        return
    name = f"{cfg.name}-{best.trial_id}"
    trial = trial_config(cfg.to_dict(), best.params, name)
    store = tracking_service.Store(tracking.tracking_uri(cfg))
    mlmodel.log_model(
        store, parent, trial, join(storage, name), cfg.tracking.log_model, log,
        metric=(spec.metric, spec.mode),
    )  # fmt: skip


def _parent_run(cfg: Config, storage: str, spec: TuneConfig) -> str:
    """The sweep's MLflow run: found again by name and storage when the sweep resumes."""
    uri, key = tracking.tracking_uri(cfg), tracking.run_key(cfg, storage)
    resume = tracking.find_run(uri, cfg.tracking.experiment, key) is not None
    tags = {"raylift.sweep": "parent"}
    return tracking.start_run(cfg, storage, resume, _trial_workers(cfg, spec), tags)


def _finish_parent(
    cfg: Config,
    parent: str,
    rows: list[TrialRow],
    best: TrialRow | None,
    spec: TuneConfig,
    storage: str,
) -> None:
    """Close every child the scheduler killed mid-run, then record the best on the parent."""
    uri = tracking.tracking_uri(cfg)
    mlflow = tracking.client(uri)
    for row in rows:
        key = tracking.run_key(cfg, storage, name=f"{cfg.name}-{row.trial_id}")
        run_id = tracking.find_run(uri, cfg.tracking.experiment, key)
        if run_id is None:
            continue
        mlflow.set_tag(run_id, "raylift.stopped", row.stopped or "no")
        # Tune ends a trial by killing its process (the scheduler, or ASHA at max_t), so
        # the child's own status may be stale: the trial's outcome decides it.
        status = (
            "FAILED"
            if row.status == "ERROR"
            else "KILLED"
            if row.stopped == "scheduler"
            else "FINISHED"
        )
        mlflow.set_terminated(run_id, status=status)
    if best is not None:
        for key, value in best.params.items():
            mlflow.set_tag(parent, f"raylift.best.{key}", str(value))
        if best.metric is not None:
            mlflow.log_metric(parent, f"best_{spec.metric}", best.metric)
        mlflow.set_tag(parent, "raylift.best_trial", best.trial_id)
    mlflow.set_terminated(parent, status="FINISHED")


def render(result: SweepResult, spec_metric: str) -> str:
    keys = sorted({k for r in result.rows for k in r.params})
    head = ["trial", "status", *keys, spec_metric, "epochs", "stopped"]
    lines = [head]
    for r in sorted(result.rows, key=lambda r: r.trial_id):
        lines.append(
            [
                r.trial_id,
                r.status,
                *(_fmt(r.params.get(k)) for k in keys),
                "-" if r.metric is None else f"{r.metric:.4f}",
                f"{r.epochs:g}",
                r.stopped or "-",
            ]
        )
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in lines
    )


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
