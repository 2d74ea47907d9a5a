"""Peak host memory of training workers, measured in fresh processes, against the plan.

Each measurement spawns its own ranks (a process's peak RSS cannot be shared with an
earlier run's), joins them over gloo, records each rank's resident set after imports
and data, then trains a few steps and reads the kernel's high-water mark (``VmHWM``).
The peak minus that baseline is what the model, its optimizer, activations and the
strategy's buffers cost the rank. Used by tests/unit/test_memory.py and
benchmarks/memory.py.
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from raylift.core.config import Config
from raylift.core.parsing import merge
from raylift.run.plan import count_params, make_plan
from raylift.strategies import plan_row_for

MIB = 2**20
# Every parameter partitioned, however small (DeepSpeed keeps those under 1e5 elements whole).
ZERO3 = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


def gpt_config(strategy: dict, d_model: int, n_layer: int, optim: str = "sgd") -> dict:
    """A gpt of ``12 * n_layer * d_model**2`` parameters or so, for a few steps; SGD with
    momentum (one state tensor per parameter) unless ``optim`` says otherwise."""
    from tests.helpers import make_config

    return make_config(
        task="gpt",
        task_args={
            "block_size": 32,
            "n_layer": n_layer,
            "n_head": 8,
            "d_model": d_model,
            "max_bytes": 20_000,
        },
        data={"batch_size": 2, "eval_batch_size": 64},  # one evaluation forward
        precision="32",
        strategy=strategy,
        optim={"name": optim, "lr": 1e-3},
        train={"max_steps": 3, "log_every_n_steps": 3, "seed": 0},
        checkpoint={"every_n_steps": None},
    ).to_dict()


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _rank(rank: int, world: int, port: int, cfg_dicts: list[dict], out: str) -> None:
    import gc

    import torch.distributed as dist

    from raylift.core.parsing import merge
    from raylift.strategies.deepspeed import import_deepspeed
    from raylift.tasks import build_task
    from tests.helpers import LocalReporter, config_from_dict, make_trainer, tensors

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import torch.distributed.fsdp  # imports are not the model's memory

    import_deepspeed("cpu")
    found = []
    for i, cfg_dict in enumerate(cfg_dicts):
        cfg = config_from_dict(cfg_dict)
        data = tensors(build_task(cfg.task, cfg.task_args))
        # A tiny run of the same strategy first: the code its build and steps import
        # (DeepSpeed's engine alone brings in some 900 modules, ~70 MiB), its threads and
        # malloc arenas are in the baseline, not counted as the model's memory.
        tiny = merge(cfg_dict, {"task_args": {"d_model": 64, "n_layer": 1}})
        make_trainer(
            config_from_dict(tiny), rank, world, LocalReporter(Path(out).parent / f"w{i}")
        ).run()
        gc.collect()
        dist.barrier()
        base = _status_kib("VmRSS") * 1024
        Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again here
        reporter = LocalReporter(Path(out).parent / f"ck{i}")
        trainer = make_trainer(cfg, rank, world, reporter, data=data)
        built = _status_kib("VmHWM") * 1024  # the peak while building and wrapping
        trainer.run()
        peak = _status_kib("VmHWM") * 1024
        found.append({"base": base, "built": built, "peak": peak, "states": trainer.memory})
        del trainer
    torch.save(found, f"{out}.{rank}")
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(cfg_dicts: list[dict], world: int = 2) -> list[list[dict[str, Any]]]:
    """Per run, per rank: ``base`` and ``peak`` RSS bytes, ``states`` (model-state bytes).

    The runs go one after another in the same ranks. Every allocation above 64 KiB is
    its own mapping (``MALLOC_MMAP_THRESHOLD_``), so what a run frees leaves the
    process and the next run's peak is its own.
    """
    env = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with tempfile.TemporaryDirectory(prefix="rl-mem-") as tmp:
            out = str(Path(tmp) / "mem")
            args = (world, _free_port(), cfg_dicts, out)
            mp.start_processes(_rank, args=args, nprocs=world, start_method="spawn")
            ranks = [torch.load(f"{out}.{r}", weights_only=True) for r in range(world)]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return [[ranks[r][i] for r in range(world)] for i in range(len(cfg_dicts))]


def planned_bytes(cfg: Config, world: int = 2) -> dict[str, int]:
    """What ``raylift plan`` says one rank holds: model states, buffers and activations."""
    row = plan_row_for(cfg.strategy)
    assert row is not None, cfg.strategy
    planned = next(r for r in make_plan(cfg, world, 1e6).rows if r.label == row.label)
    return {
        "states": planned.states,
        "buffers": planned.buffers,
        "activations": planned.activations,
        "total": planned.fixed + planned.activations,
    }


def full_model_bytes(cfg: Config) -> int:
    return count_params(cfg) * 4


def with_strategy(cfg_dict: dict, strategy: dict) -> dict:
    return merge({k: v for k, v in cfg_dict.items() if k != "strategy"}, {"strategy": strategy})
