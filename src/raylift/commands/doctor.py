"""``raylift doctor``: a short profiled slice of the real run, a verdict and what to change.

The run is the user's config with a fresh name, no checkpoints and no early stopping,
for three windows of ``steps`` optimizer steps each:

1. warm-up (allocator, kernel choice, compile, the first prefetches);
2. measured: the loop's own phase clock over all ranks (no profiler overhead);
3. profiled: ``torch.profiler`` on rank 0, for the Chrome trace, host syncs per
   step and time in collectives.

The windows are measured on the workers by :class:`~raylift.run.probe.DoctorProbe`.
The driver turns what they measured into a verdict (:func:`diagnose`), a
PNG chart of the step-time breakdown and a ranked list of config changes, and logs
all three, with the trace, to the run's MLflow run and its folder.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import yaml

from raylift.artifacts import tracking
from raylift.core import storage
from raylift.core.config import Config
from raylift.core.startup import PREFIX as PREFIX_STARTUP
from raylift.core.startup import Startup, from_metrics, table
from raylift.run import launch
from raylift.run.probe import PREFIX, ProbeSettings
from raylift.run.wire import wire_line
from raylift.strategies import plan_row_for, plan_rows
from raylift.tasks import build_task
from raylift.tensors.metrics import PHASES
from raylift.tensors.precision import resolve_precision

Metrics = dict[str, float]


# ---------------------------------------------------------------- the verdict


@dataclasses.dataclass
class Suggestion:
    key: str  # the config key to change, or "code" for a change to the task
    value: str  # what to set it to
    why: str
    gain: float  # expected speed-up factor of samples_per_s (1.0 = none), a rough model

    def line(self) -> str:
        change = f"{self.key}={self.value}" if self.value else self.key
        return f"{change:<36} ~{self.gain:.2f}x  {self.why}"


@dataclasses.dataclass
class Diagnosis:
    verdict: str
    evidence: list[str]
    suggestions: list[Suggestion]
    shares: dict[str, float]  # the step-time breakdown behind the verdict

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _amdahl(removed: float) -> float:
    """Speed-up from removing ``removed`` of the step time."""
    return 1.0 / max(1.0 - removed, 0.05)


def shares_of(m: dict[str, float]) -> dict[str, float]:
    """The measured window's step-time fractions (``doctor_step_<phase>_frac``)."""
    out = {p: m.get(f"{PREFIX}step_{p}_frac", 0.0) for p in PHASES}
    out["other"] = m.get(f"{PREFIX}step_other_frac", 0.0)
    return out


def comm_share(m: dict[str, float]) -> float:
    """Time in collectives (gloo ops, NCCL kernels) in the profiled window, overlap included."""
    return m.get(f"{PREFIX}profiled_comm_frac", 0.0)


def memory_use(m: dict[str, float]) -> float:
    """Peak memory as a share of what a worker has (GPU memory, or its share of host RAM)."""
    if m.get(f"{PREFIX}cuda"):
        total = m.get(f"{PREFIX}cuda_total_bytes", 0.0)
        return m.get(f"{PREFIX}cuda_reserved_bytes", 0.0) / total if total else 0.0
    host = m.get(f"{PREFIX}host_mem_bytes", 0.0)
    world = m.get(f"{PREFIX}world_size", 1.0)
    return m.get(f"{PREFIX}mem_rss_bytes", 0.0) * world / host if host else 0.0


def diagnose(m: dict[str, float], cfg: Config, task: object = None) -> Diagnosis:
    """The bottleneck of a doctor run's measurements, with changes ranked by expected gain.

    Config changes come first, by expected gain; changes to the task's code follow."""
    s = shares_of(m)
    comm = comm_share(m)
    syncs = m.get(f"{PREFIX}syncs_per_step", 0.0)
    wait = max(m.get(f"{PREFIX}data_wait_frac", 0.0), s["data_wait"])
    compute = s["h2d"] + s["forward"] + s["backward"] + s["optimizer"]
    evidence = [
        "step time: " + ", ".join(f"{k} {v:.0%}" for k, v in s.items()),
        f"collectives in flight: {comm:.0%} of step time; host syncs per step: {syncs:.2f}",
        f"{m.get(PREFIX + 'samples_per_s', math.nan):,.0f} samples/s, "
        f"{m.get(PREFIX + 'step_time_s', math.nan) * 1e3:.1f} ms per step"
        + (f", MFU {m[PREFIX + 'mfu']:.1%}" if PREFIX + "mfu" in m else ""),
        f"peak memory {memory_use(m):.0%} of what a worker has",
    ]
    memory = memory_use(m)
    if memory >= 0.9:
        verdict = "memory-bound"
    elif wait >= 0.2:
        verdict = "input-bound"
    elif s["sync"] >= 0.15 or (m.get(f"{PREFIX}cuda") and syncs >= 1 and s["other"] >= 0.2):
        verdict = "host-sync-bound"
    elif comm >= 0.5 * compute and comm >= 0.25:
        verdict = "communication-bound"
    elif s["other"] >= 0.3:
        verdict = "cpu-bound"
    else:
        verdict = "compute-bound"
    found = SUGGEST[verdict](m, cfg, s, comm)
    if verdict == "input-bound" and callable(getattr(task, "transform", None)):
        found.append(
            Suggestion(
                "code",
                "",
                "move the task's per-batch transform into preprocess, done once by raylift prep",
                _amdahl(wait),
            )
        )
    found.sort(key=lambda x: (x.key == "code", -x.gain))
    return Diagnosis(verdict, evidence, found, {**s, "comm": comm})


def _input(m: Metrics, cfg: Config, s: Metrics, comm: float) -> list[Suggestion]:
    wait = max(m.get(f"{PREFIX}data_wait_frac", 0.0), s["data_wait"])
    out = []
    left = wait  # the wait that is left once the suggestions before this one are taken
    if cfg.data.prefetch_batches < 8:
        # Prefetching overlaps loading with the step: the wait shrinks to what loading
        # takes beyond the step itself.
        busy = 1.0 - wait
        hidden = min(wait, busy) if cfg.data.prefetch_batches == 0 else min(wait, busy) / 2
        out.append(
            Suggestion(
                "data.prefetch_batches",
                str(max(4, 2 * cfg.data.prefetch_batches)),
                f"{wait:.0%} of each step waits for the next batch; load it during the step",
                _amdahl(hidden),
            )
        )
        left = wait - hidden
    if not cfg.data.cache:
        # Caching removes the parquet reads, not the task's transform: at most half
        # of what prefetching leaves (measured: x0.96 where a transform dominated).
        out.append(
            Suggestion(
                "data.cache",
                "true",
                "keep the prepared rows in Ray's object store instead of re-reading parquet",
                _amdahl(left / 2),
            )
        )
    return out


def _sync(m: Metrics, cfg: Config, s: Metrics, comm: float) -> list[Suggestion]:
    out = []
    every = cfg.train.log_every_n_steps
    if every < 50:
        new = max(50, every * 10)
        out.append(
            Suggestion(
                "train.log_every_n_steps",
                str(new),
                f"{s['sync']:.0%} of step time goes to syncing and logging every {every} "
                "step(s); each log is a host sync and a collective",
                _amdahl(s["sync"] * (1 - every / new)),
            )
        )
    if cfg.train.on_nan == "skip":
        out.append(
            Suggestion(
                "train.on_nan",
                "stop",
                "skip reads the gradient norm on the host every step; stop keeps it on the device",
                _amdahl(s["optimizer"] / 2),
            )
        )
    out.append(
        Suggestion(
            "code",
            "",
            "a .item(), .cpu(), print or Python branch on a device tensor in the task's loss "
            "or finish syncs every step; keep values on the device",
            _amdahl(s["other"] / 2),
        )
    )
    return out


def _comm(m: Metrics, cfg: Config, s: Metrics, comm: float) -> list[Suggestion]:
    accum = cfg.train.grad_accum
    out = [
        Suggestion(
            "train.grad_accum",
            str(accum * 2),
            f"collectives take {comm:.0%} of step time; accumulating twice as many "
            "micro-batches all-reduces half as often per sample",
            _amdahl(comm / 2),
        ),
        Suggestion(
            "data.batch_size",
            str(cfg.data.batch_size * 2),
            "twice the rows per all-reduce (raise optim.lr with it)",
            _amdahl(comm / 2) * 0.95,
        ),
    ]
    row = plan_row_for(cfg.strategy)
    if row is not None and row.shards.params:
        replica = next(r for r in plan_rows() if not r.shards.params)
        key, value = (
            ("strategy.name", str(replica.strategy["name"]))
            if set(replica.strategy) == {"name"}
            else ("strategy", _section(replica.strategy))
        )
        out.append(
            Suggestion(
                key,
                value,
                f"if a replica fits in memory (raylift plan), {replica.label} gathers no "
                "parameters",
                _amdahl(comm / 3),
            )
        )
    return out


def _memory(m: Metrics, cfg: Config, s: Metrics, comm: float) -> list[Suggestion]:
    out = []
    if not cfg.strategy.activation_checkpointing:
        out.append(
            Suggestion(
                "strategy.activation_checkpointing",
                "true",
                "recompute each block's activations in backward instead of keeping them",
                1.0,
            )
        )
    row = plan_row_for(cfg.strategy)
    if row is not None and not row.shards.params:
        sharding = [r for r in plan_rows() if r.shards.params]
        # The same strategy where it can shard parameters (ZeRO-3), else the first that does.
        to = next((r for r in sharding if r.strategy["name"] == cfg.strategy.name), sharding[0])
        out.append(
            Suggestion(
                "strategy",
                _section(to.strategy),
                "shard parameters, gradients and optimizer state (raylift plan compares)",
                1.0,
            )
        )
    out.append(
        Suggestion(
            "data.batch_size",
            str(max(cfg.data.batch_size // 2, 1)),
            f"with train.grad_accum={cfg.train.grad_accum * 2}: same global batch, half the "
            "activations",
            0.95,
        )
    )
    return out


def _section(strategy: Mapping[str, Any]) -> str:
    """A strategy section as one line of YAML, e.g. ``{name: fsdp}``."""
    return yaml.safe_dump(dict(strategy), default_flow_style=True, sort_keys=False).strip()


def _cpu(m: Metrics, cfg: Config, s: Metrics, comm: float) -> list[Suggestion]:
    out = [
        Suggestion(
            "data.batch_size",
            str(cfg.data.batch_size * 2),
            f"{s['other']:.0%} of step time is Python and launch overhead outside the phases; "
            "bigger batches spread it over more samples",
            _amdahl(s["other"] / 2),
        )
    ]
    if not cfg.train.compile:
        out.append(
            Suggestion(
                "train.compile", "true", "fuse small ops, fewer launches", _amdahl(s["other"] / 3)
            )
        )
    return out


def _compute(
    m: dict[str, float], cfg: Config, s: dict[str, float], comm: float
) -> list[Suggestion]:
    compute = s["forward"] + s["backward"]
    out: list[Suggestion] = []
    fp32, bf16 = m.get(f"{PREFIX}peak_fp32_flops", math.nan), m.get(f"{PREFIX}peak_bf16_flops")
    dtype = resolve_precision(cfg.precision).compute_dtype
    if dtype == torch.float32 and bf16 and bf16 > 1.2 * fp32:
        out.append(
            Suggestion(
                "precision",
                "bf16-mixed",
                f"this device multiplies bf16 at {bf16 / fp32:.1f}x its fp32 rate",
                _amdahl(compute * (1 - fp32 / bf16)),
            )
        )
    if dtype == torch.bfloat16 and bf16 and bf16 < fp32:
        out.append(
            Suggestion(
                "precision",
                "32",
                f"this device multiplies bf16 at {bf16 / fp32:.1f}x its fp32 rate: no gain",
                _amdahl(compute * (1 - bf16 / fp32)),
            )
        )
    if cfg.strategy.activation_checkpointing:
        out.append(
            Suggestion(
                "strategy.activation_checkpointing",
                "false",
                "recomputation costs about a third of backward; turn it off if memory allows",
                _amdahl(s["backward"] / 3),
            )
        )
    # Fixed per-step costs (optimizer, launches, the all-reduce latency) shrink per sample.
    fixed = s["optimizer"] + s["other"] + s["sync"]
    out.append(
        Suggestion(
            "data.batch_size",
            str(cfg.data.batch_size * 2),
            f"per-step fixed costs (optimizer, overhead) are {fixed:.0%} of a step; "
            "twice the batch halves them per sample (raise optim.lr with it)",
            _amdahl(fixed / 2),
        )
    )
    if not cfg.train.compile:
        out.append(
            Suggestion("train.compile", "true", "fused kernels for forward and backward", 1.05)
        )
    return out


SUGGEST = {
    "input-bound": _input,
    "host-sync-bound": _sync,
    "communication-bound": _comm,
    "memory-bound": _memory,
    "cpu-bound": _cpu,
    "compute-bound": _compute,
}


# ---------------------------------------------------------------- driver side


@dataclasses.dataclass
class DoctorResult:
    name: str
    diagnosis: Diagnosis
    metrics: dict[str, float]
    folder: str  # the run's doctor folder: local, or in an object store
    chart: Path  # a local copy
    run_id: str
    startup: dict[str, float] = dataclasses.field(default_factory=dict)  # startup/* metrics
    wire: dict[str, float] = dataclasses.field(default_factory=dict)  # wire/* metrics

    def render(self) -> str:
        d = self.diagnosis
        lines = [f"verdict: {d.verdict}", "evidence:"]
        lines += [f"  {e}" for e in d.evidence]
        lines.append("what to change, by expected gain:")
        lines += [f"  {i}. {s.line()}" for i, s in enumerate(d.suggestions, 1)]
        if self.wire:
            lines.append(f"bytes on the wire: {wire_line(self.wire).removeprefix('wire: ')}")
        seconds = from_metrics(self.startup)
        if seconds:
            lines.append("start-up, from the command to the first step:")
            lines += table(seconds, self.startup.get(PREFIX_STARTUP + "total_s", 0.0))
        return "\n".join(lines)


def doctor_config(cfg: Config, steps: int) -> Config:
    """The user's run, renamed, for 3 windows of ``steps``: no early stop, and one checkpoint
    at the end only (Ray hands back the metrics of the latest checkpoint)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    train = dataclasses.replace(
        cfg.train,
        max_steps=3 * steps,
        max_epochs=10**6,
        early_stopping=None,
        eval_every_n_steps=None,
    )
    ckpt = dataclasses.replace(cfg.checkpoint, every_n_steps=None)
    return dataclasses.replace(cfg, name=f"{cfg.name}-doctor-{stamp}", train=train, checkpoint=ckpt)


def run_doctor(
    cfg: Config, steps: int = 20, log: Any = print, startup: Startup | None = None
) -> DoctorResult:
    """Profile ``cfg`` on Ray (local or ``RAY_ADDRESS``) and diagnose it; ``startup`` is
    the CLI's start-up clock, begun at its process's start."""
    if steps < 2:
        raise ValueError("--steps: at least 2 steps per window")
    run = doctor_config(cfg, steps)
    folder = storage.join(storage.resolve(run.storage), run.name, "doctor")  # local or a URI
    probe = ProbeSettings(steps, folder)
    result = launch.train(run, log, probe=probe, startup=startup)
    if PREFIX + "samples_per_s" not in result.metrics:
        raise RuntimeError(
            f"the doctor run {run.name!r} ended before its measured window (steps "
            f"{steps + 1}-{2 * steps}); lower --steps"
        )

    # Judged as it ran (``auto`` resolved), with the user's own run settings.
    ran = dataclasses.replace(
        cfg, precision=result.config.precision, strategy=result.config.strategy
    )
    diagnosis = diagnose(result.metrics, ran, build_task(cfg.task, cfg.task_args))
    out = Path(tempfile.mkdtemp(prefix="raylift-doctor-"))  # drawn here, then copied
    chart = draw_chart(diagnosis, result.metrics, out / "breakdown.png")
    report = out / "verdict.json"
    measured = {k: v for k, v in result.metrics.items() if k.startswith(PREFIX)}
    report.write_text(
        json.dumps({"name": run.name, **diagnosis.to_dict(), "metrics": measured}, indent=2)
    )
    client = tracking.client(result.tracking_uri)
    for path in (chart, report):
        client.log_artifact(result.run_id, str(path), "doctor")
        storage.write_bytes(storage.join(folder, path.name), path.read_bytes())
    client.set_tag(result.run_id, "raylift.doctor.verdict", diagnosis.verdict)
    logged = client.get_run(result.run_id).data.metrics
    startup_metrics = {k: v for k, v in logged.items() if k.startswith(PREFIX_STARTUP)}
    wire = {k: v for k, v in logged.items() if k.startswith("wire/")}
    return DoctorResult(
        run.name, diagnosis, result.metrics, folder, chart, result.run_id, startup_metrics, wire
    )


def draw_chart(diagnosis: Diagnosis, m: dict[str, float], path: Path) -> Path:
    """A stacked bar of where a step's time goes, the verdict and the first changes."""
    import matplotlib

    matplotlib.use("Agg")  # no display on workers and CI machines
    import matplotlib.pyplot as plt

    shares = {k: v for k, v in diagnosis.shares.items() if k != "comm"}
    colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#bbbbbb"]
    fig = plt.figure(figsize=(10, 3.8))
    bar = fig.add_axes((0.07, 0.45, 0.66, 0.38))
    left = 0.0
    for i, (phase, share) in enumerate(shares.items()):
        color = colors[i % len(colors)]
        bar.barh(1, share, left=left, color=color, label=f"{phase} {share:.0%}")
        if share >= 0.06:
            bar.text(left + share / 2, 1, phase, ha="center", va="center", fontsize=8)
        left += share
    comm = diagnosis.shares.get("comm", 0.0)
    bar.barh(0, comm, color="black", height=0.5, label=f"collectives {comm:.0%} (overlap)")
    bar.set_xlim(0, 1)
    bar.set_yticks([0, 1], ["comm", "step"])
    bar.set_xlabel("share of step time")
    step_ms = m.get(PREFIX + "step_time_s", math.nan) * 1e3
    rate = m.get(PREFIX + "samples_per_s", math.nan)
    bar.set_title(f"{diagnosis.verdict}: {step_ms:.1f} ms per step, {rate:,.0f} samples/s")
    bar.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    lines = [f"{i}. {s.line()}" for i, s in enumerate(diagnosis.suggestions[:4], 1)]
    text = "\n".join(line if len(line) <= 120 else line[:117] + "..." for line in lines)
    fig.text(0.04, 0.04, "what to change:\n" + text, family="monospace", fontsize=7.5)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
