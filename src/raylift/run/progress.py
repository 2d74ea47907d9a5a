"""What each logging interval reports: loss, step-time breakdown, throughput, MFU, memory.

Losses are kept on the device during the interval; at its end one sum and one max
collective carry everything (the loss sums, the phase times, the worst data wait and
memory, and whatever the caller packs in, such as the NaN check), which is the
interval's only host sync.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from raylift.run.context import WorkerContext
from raylift.strategies import Engine
from raylift.tensors.metrics import (
    PHASES,
    PhaseClock,
    StepTimes,
    achieved_flops,
    all_reduce_max,
    all_reduce_sum,
    breakdown,
    memory_now,
    mfu,
    system_now,
)
from raylift.tensors.optim import describe


@dataclasses.dataclass
class Interval:
    """One logging interval: its micro-batches' losses and its phase times.

    The losses stay on the device as they came, one reference each: nothing runs per
    micro-step that a hand-written loop would not run. They are summed, and checked for
    inf/NaN, once, where the loop syncs anyway (the interval's log, an evaluation, a
    checkpoint)."""

    times: StepTimes
    losses: list[torch.Tensor] = dataclasses.field(default_factory=list)
    steps: list[int] = dataclasses.field(default_factory=list)  # the step each loss is for

    @classmethod
    def fresh(cls, clock: PhaseClock) -> Interval:
        return cls(clock.open())

    @property
    def micro_batches(self) -> int:
        return len(self.losses)

    def add(self, loss: torch.Tensor, step: int) -> None:
        """Keep one micro-batch's loss, for the optimizer step ``step``."""
        self.losses.append(loss.detach())
        self.steps.append(step)

    def summary(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """The sum of the finite losses and their count, on the device (a skipped step
        does not poison the mean), and the first step whose loss was inf/NaN, or -1:
        one stack of the losses, one host read."""
        values = torch.stack(self.losses).float()
        finite = torch.isfinite(values)
        at = int(torch.where(finite.all(), -1, (~finite).int().argmax()))
        bad = float(self.steps[at]) if at >= 0 else -1.0
        return torch.where(finite, values, 0.0).sum(), finite.sum().float(), bad

    def first_bad_step(self) -> float:
        """The first step whose loss was inf/NaN, or -1 (a host sync)."""
        return self.summary()[2] if self.losses else -1.0


@dataclasses.dataclass(frozen=True)
class Rates:
    """What turns seconds into throughput and MFU."""

    global_batch: int  # samples per optimizer step, all ranks
    flops_per_sample: float  # 0: unknown, no MFU
    tokens_per_sample: int  # 0: not a token task
    peak_flops: float | None  # of one worker's device at the compute dtype


class IntervalMeter:
    """Opens, closes and reduces logging intervals; logs the model state once."""

    def __init__(self, ctx: WorkerContext, clock: PhaseClock, rates: Rates):
        self.ctx, self.clock, self.rates = ctx, clock, rates
        self.current = Interval.fresh(clock)
        self.memory: dict[str, float] = {}  # model-state bytes, after the first step
        system_now(ctx.device)  # CPU utilisation counts from here to the first interval

    def rotate(self) -> Interval:
        """End the current interval and open the next.

        The next one opens before the ending one is logged, so it carries that log's sync
        time: each interval then holds exactly one logging sync, as in steady state."""
        ending = self.current
        self.clock.close(ending.times)
        self.clock.drain()
        self.current = Interval.fresh(self.clock)
        return ending

    def reduce(
        self, times: StepTimes, sums: list[torch.Tensor], maxes: list[float]
    ) -> tuple[list[float], dict[str, float], list[float]]:
        """Step-time breakdown, throughput, MFU and memory of ``times`` over all ranks.

        ``sums`` and ``maxes`` ride along in the same two collectives; their reduced
        values come back first and last. Phase times are averaged over ranks; the data
        wait and memory are the worst rank's."""
        seconds, elapsed = times.resolve(), times.elapsed()
        device = self.ctx.device
        head = torch.stack(sums).double() if sums else torch.zeros(0, dtype=torch.float64)
        local = torch.tensor([seconds[p] for p in PHASES] + [elapsed], dtype=torch.float64)
        total = all_reduce_sum(torch.cat([head.to(device), local.to(device)])).tolist()
        memory = memory_now(device)
        worst = all_reduce_max([*maxes, seconds["data_wait"] / elapsed, *memory.values()], device)
        n, m = len(sums), len(maxes)
        metrics = breakdown(dict(zip(PHASES, total[n : n + len(PHASES)], strict=True)), total[-1])
        metrics["data_wait_frac"] = min(worst[m], 1.0)
        metrics.update(self._rates(total[-1] / self.ctx.world_size, times))
        metrics.update(zip(memory, worst[m + 1 :], strict=True))
        return total[:n], metrics, worst[:m]

    def _rates(self, mean_elapsed: float, times: StepTimes) -> dict[str, float]:
        r = self.rates
        out = {
            "step_time_s": mean_elapsed / max(times.steps, 1),
            "samples_per_s": times.samples / mean_elapsed,
        }
        if r.tokens_per_sample:
            out["tokens_per_s"] = out["samples_per_s"] * r.tokens_per_sample
        value = mfu(out["samples_per_s"], self.ctx.world_size, r.flops_per_sample, r.peak_flops)
        if math.isfinite(value) and value > 1.0:
            # The peak was an underestimate (a CPU's is measured): what the model just
            # achieved is the better bound, for this interval and every later one.
            achieved = achieved_flops(out["samples_per_s"], self.ctx.world_size, r.flops_per_sample)
            self.rates = dataclasses.replace(r, peak_flops=achieved)
            value = 1.0
        if math.isfinite(value):
            out["mfu"] = value
        return out

    def log_model_state(self, engine: Engine, step: int) -> None:
        """Model-state bytes this rank holds, counted from the tensors after the first step."""
        held = engine.model_state_bytes()
        metrics = {f"model_state_{k}_bytes": float(v) for k, v in held.items()}
        metrics["model_state_bytes_per_rank"] = float(sum(held.values()))
        if self.ctx.device.type == "cuda":
            metrics["cuda_peak_allocated_bytes"] = float(torch.cuda.max_memory_allocated())
        self.ctx.tracker.log_metrics(metrics, step)
        self.memory = metrics
        mib = metrics["model_state_bytes_per_rank"] / 2**20
        self.ctx.log(
            f"model state held by rank 0: {mib:.2f} MiB "
            + " ".join(f"{k} {v / 2**20:.2f}" for k, v in held.items())
            + f"; optimizer {describe(engine.optimizer)}"
        )


def console_line(
    m: dict[str, float], epoch: int, step: int, total_steps: int, estimated_peak: bool = False
) -> str:
    """``estimated_peak``: MFU is against a measured estimate (a CPU's), not a datasheet."""
    eta = (total_steps - step) * m["step_time_s"]
    tok = f"  {m['tokens_per_s']:,.0f} tok/s" if "tokens_per_s" in m else ""
    util = f"  mfu {'~' if estimated_peak else ''}{m['mfu']:.1%}" if "mfu" in m else ""
    return (
        f"epoch {epoch:>3}  step {step:>6}/{total_steps}  "
        f"loss {m['train_loss']:.4f}  lr {m['lr']:.2e}  {m['samples_per_s']:,.0f} samples/s"
        f"{tok}{util}  data wait {m['data_wait_frac']:.0%}  eta {_fmt_time(eta)}"
    )


def _fmt_time(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
