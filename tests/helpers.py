"""Shared test helpers: a process group without Ray, a local reporter, in-memory data."""

from __future__ import annotations

import contextlib
import math
import os
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from raylift.core.config import Config
from raylift.core.parsing import merge
from raylift.data.ingest import TensorSource
from raylift.run.context import WorkerContext
from raylift.run.loop import Trainer
from raylift.tasks import build_task
from raylift.validation import config_from_dict


def init_pg(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)


def tensors(task: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Task sources -> preprocess -> tensors, as Ray Data would deliver them."""
    out = {}
    for split, cols in task.sources().items():
        done = task.preprocess({k: np.asarray(v) for k, v in cols.items()})
        out[split] = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in done.items()}
    return out


class LocalReporter:
    """Checkpoints under ``root/name`` (every rank uploads its part there, as on Ray);
    metrics kept; crashes and preemption notices on cue."""

    def __init__(
        self,
        root: Path,
        crash_after_step: int | None = None,
        preempt_at_call: int | None = None,
        cut_write: bool = False,
        deadline_at_call: int | None = None,
    ):
        self.root, self.crash_after_step, self.cut_write = root, crash_after_step, cut_write
        self.metrics: list[dict[str, float]] = []
        self.checkpoints: list[Path] = []
        self.preempt_at_call, self.preempt_calls = preempt_at_call, 0
        self.deadline_at_call = deadline_at_call

    def leaving_in(self) -> float | None:
        """A preemption notice from the ``preempt_at_call``-th question on: with no deadline,
        or with one far off until the ``deadline_at_call``-th question, and due from then."""
        self.preempt_calls += 1
        if self.preempt_at_call is None or self.preempt_calls < self.preempt_at_call:
            return None
        if self.deadline_at_call is None:
            return math.inf
        return 0.0 if self.preempt_calls >= self.deadline_at_call else 1e6

    def report(self, metrics: dict[str, float]) -> None:
        self.metrics.append(metrics)

    def destination(self, name: str) -> str:
        return str(self.root / name)

    def register(self, metrics: dict[str, float], name: str) -> None:
        self.metrics.append(metrics)
        dest = self.root / name
        crash = self.crash_after_step is not None and metrics["step"] >= self.crash_after_step
        if crash and self.cut_write:
            cut_off(dest)
            raise KeyboardInterrupt("simulated crash while writing a checkpoint")
        self.checkpoints.append(dest)
        if crash:
            raise KeyboardInterrupt("simulated crash after checkpoint")


def cut_off(folder: Path) -> None:
    """Leave a checkpoint as a write cut off half-way does: the largest file truncated,
    the files after it (in write order, the ranks' completion lists last) never written."""
    files = sorted(
        (p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.name.startswith("complete-")
    )
    biggest = max(files, key=lambda p: p.stat().st_size)
    after = files[files.index(biggest) + 1 :]
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
    for path in after:
        path.unlink()


class ListTracker:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []
        self.tags: dict[str, str] = {}
        self.artifacts: list[str] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append((step, dict(metrics)))

    def set_tags(self, tags: dict[str, str]) -> None:
        self.tags.update(tags)

    def log_artifact(self, path: Path, folder: str) -> None:
        self.artifacts.append(f"{folder}/{path.name}")

    def close(self) -> None:
        pass

    def restarts(self) -> int:
        return int(max(self.series("restarts").values(), default=0))

    def series(self, key: str) -> dict[int, float]:
        return {step: m[key] for step, m in self.rows if key in m}

    def wire(self) -> dict[int, dict[str, float]]:
        """The bytes measured on the wire (raylift.run.wire), by the step they were of."""
        return {step: m for step, m in self.rows if any(k.startswith("wire/") for k in m)}


BASE = {
    "task": "digits",
    "task_args": {"dropout": 0.0, "width": 8},
    "data": {"batch_size": 32},
    "precision": "32",
    "optim": {"lr": 1e-3},
    "train": {"max_epochs": 1, "log_every_n_steps": 1},
    "checkpoint": {"every_n_steps": None},
}


def make_config(**overrides: Any) -> Config:
    base = dict(BASE)
    if overrides.get("task", "digits") != "digits":
        base.pop("task_args")  # digits' arguments mean nothing to another task
    return config_from_dict(merge(base, overrides))


def make_trainer(
    cfg: Config,
    rank: int,
    world: int,
    reporter: Any,
    tracker: Any = None,
    data: dict | None = None,
    device: torch.device | None = None,
    now: Any = None,
    source: Any = None,
    log: Any = None,
    keepers: Any = None,
) -> Trainer:
    """A trainer on in-memory ``data`` (the task's own when not given), or on ``source``."""
    task = build_task(cfg.task, cfg.task_args)
    if source is None:
        data = data or tensors(task)
        source = TensorSource(
            data["train"],
            data["val"],
            rank,
            world,
            cfg.data.batch_size,
            cfg.data.eval_batch_size or cfg.data.batch_size,
        )
    ctx = WorkerContext(
        rank=rank,
        world_size=world,
        device=device or torch.device("cpu"),
        source=source,
        reporter=reporter,
        tracker=tracker or ListTracker(),
        log=log or (lambda s: None),
        keepers=keepers,
    )
    if now is not None:
        ctx.now = now
    return Trainer(cfg, task, ctx)


RANK_NICENESS = 10
# Each gloo process group a job creates (a mesh's dimensions, DeepSpeed's and fairscale's
# groups) keeps a gloo_tcp_loop thread that wakes about 100 times a second for as long as its
# process lives, and a pool's ranks live for the whole session: half an hour into the suite,
# six ranks held 50 to 70 such threads each and spent about 0.4 of the two cores in the
# kernel while idle. Past this many a rank retires after its job; the next job starts a
# fresh pool.
MAX_GLOO_LOOPS = 8


def gloo_loops() -> int:
    """This process's gloo_tcp_loop threads (one per gloo process group it created)."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return 0
    names = []
    for task in tasks.iterdir():
        with contextlib.suppress(OSError):  # a thread that ended while listed
            names.append((task / "comm").read_text().strip())
    return names.count("gloo_tcp_loop")


def _pool_rank(
    rank: int, world: int, init_file: str, env: dict[str, str], jobs: Any, results: Any
) -> None:
    """One rank of a :class:`RankPool`: joins the group once, then runs jobs until told to
    stop. After a failed job it leaves: its group may be mid-collective. After a job that
    left it holding more than ``MAX_GLOO_LOOPS`` groups it leaves too, saying so."""
    import traceback

    # Forked from the fork server, which holds the environment of the pool that started it:
    # this rank's is the test's at the pool's start, as a spawned process's would be.
    os.environ.clear()
    os.environ.update(env)

    # One thread a rank, as Ray gives a one-CPU worker (OMP_NUM_THREADS=1): two ranks of
    # two threads each on two cores spend their time preempting each other in gloo waits.
    torch.set_num_threads(1)
    # The session's Ray tests run one after another and set the suite's length: ranks
    # that run beside them on this machine's few cores take the CPU they leave idle.
    os.nice(RANK_NICENESS)
    init_pg(rank, world, init_file)
    try:
        while (job := jobs.get()) is not None:
            fn, args = job
            try:
                fn(rank, world, *args)
                # No rank starts the next job while another still talks in this one.
                dist.barrier()
            except BaseException:
                results.put((rank, traceback.format_exc(), True))
                return
            retire = gloo_loops() > MAX_GLOO_LOOPS
            results.put((rank, None, retire))
            if retire:
                return
    finally:
        dist.destroy_process_group()


# What the ranks' jobs import, imported once in the fork server that every rank is forked
# from. A rank started fresh spent 6 to 10 CPU-seconds importing these, and the pools of a
# suite start about a hundred ranks (a pool retires past MAX_GLOO_LOOPS).
PRELOAD = [
    "torch", "torch.distributed", "transformers", "transformers.modeling_utils", "peft",
    "deepspeed", "fairscale", "raylift.strategies.registry", "raylift.tasks.hf", "tests.helpers",
    "tests.zoo",
    # DeepSpeed's engine imports it at its first start: torch.compile at import, inductor.
    "deepspeed.runtime.zero.muon.muon_optimizer",
]  # fmt: skip


class RankPool:
    """``world`` processes joined by gloo, reused for every job of a test session: a job
    pays for its own work, not for a process start, a torch import and a group. Forked from
    a fork server that has imported ``PRELOAD`` (nothing in it has run a torch op or
    started a thread pool: a fork is as safe as a DataLoader worker's)."""

    def __init__(self, world: int):
        import tempfile

        import torch.multiprocessing as mp

        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # read once, when the server starts
        self.world = world
        self.jobs = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        init_file = str(Path(tempfile.mkdtemp(prefix="rl-pg-")) / "pg")
        env = dict(os.environ)
        self.procs = [
            ctx.Process(
                target=_pool_rank, args=(r, world, init_file, env, self.jobs[r], self.results)
            )
            for r in range(world)
        ]
        for proc in self.procs:
            proc.start()

    def run(self, fn: Any, args: tuple, timeout: float = 900.0) -> None:
        """``fn(rank, world, *args)`` on every rank; raises with a failed rank's traceback."""
        import queue

        for q in self.jobs:
            q.put((fn, args))
        failures, retired = [], False
        try:
            for _ in range(self.world):
                rank, failure, retiring = self.results.get(timeout=timeout)
                retired |= retiring
                if failure:
                    failures.append(f"rank {rank}:\n{failure}")
                    break  # the other ranks may wait forever in a collective
        except queue.Empty:
            failures.append(f"no rank finished {fn.__name__} within {timeout:.0f} s")
        if failures or retired:
            self.close()  # the next job starts a fresh pool (run_ranks)
        if failures:
            raise RuntimeError(failures[0])

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self) -> None:
        for q in self.jobs:
            q.put(None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


_POOLS: dict[int, RankPool] = {}


def run_ranks(world: int, tmp: Path, fn: Any, *args: Any) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks joined by gloo: the session's
    pool of that size, started on first use and again after a failure."""
    pool = _POOLS.get(world)
    if pool is None or not pool.alive():
        pool = _POOLS[world] = RankPool(world)
    pool.run(fn, args)


def close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


def stop_fork_server() -> None:
    """The fork server the ranks came from: it would end with this process, but the
    suite's last check (tests/survivors.py) wants nothing of the suite left before that.
    Python has no public call for it: this private one is Python 3.11's, and
    test_rank_pool stops a server with it and sees another start."""
    from multiprocessing import forkserver

    forkserver._forkserver._stop()


def train_and_save_params(rank: int, world: int, cfg_dict: dict, out: str) -> None:
    """Run a trainer on this rank; rank 0 saves the final parameters to ``out``."""
    cfg = config_from_dict(cfg_dict)
    trainer = make_trainer(cfg, rank, world, LocalReporter(Path(out).parent / f"ck-{rank}"))
    trainer.run()
    if rank == 0:
        state = {k: v.detach().clone() for k, v in trainer.engine.eval_model.state_dict().items()}
        torch.save(state, out)


def train_and_record(rank: int, world: int, cfg_dict: dict, out: str) -> None:
    """Run a trainer on this rank; rank 0 saves its per-step train_loss series to ``out``."""
    cfg = config_from_dict(cfg_dict)
    tracker = ListTracker()
    trainer = make_trainer(
        cfg, rank, world, LocalReporter(Path(out).parent / f"ck-{rank}"), tracker
    )
    trainer.run()
    if rank == 0:
        torch.save(tracker.series("train_loss"), out)
        torch.save(trainer.memory, f"{out}.memory")  # model-state bytes rank 0 held


# Shaped and trained like configs/gpt-tiny.yaml (weight decay, betas, warm-up, clipping,
# a tied head), smaller: what holds here holds for the shipped configs' settings.
SHIPPED_TRAINING = {
    # The held-out rows in one batch a rank: the curves compared are training's, and two
    # evaluations of 5% in batches of 8 were a fifth of a sharded run's time.
    "data": {"batch_size": 8, "eval_batch_size": 64},
    "optim": {"lr": 3e-3, "warmup_steps": 5, "weight_decay": 0.1, "betas": [0.9, 0.95]},
    "train": {"max_steps": 30, "log_every_n_steps": 1, "seed": 0, "grad_clip": 1.0},
}
GPT_SMALL = {
    "task": "gpt",
    "task_args": {
        "block_size": 32,
        "n_layer": 2,
        "n_head": 4,
        "d_model": 64,
        "max_bytes": 300_000,
        "val_percent": 1,
    },
    **SHIPPED_TRAINING,
}


def full_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) parameters of any wrapped or sharded model, on the CPU."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {
        k: v.detach().float().clone() for k, v in get_model_state_dict(module, options=opts).items()
    }


def train_keep_checkpoints(rank: int, world: int, cfg_dict: dict, root: str) -> None:
    """Train to the end, keeping every checkpoint under ``root`` (ranks merge, as in Ray)."""
    cfg = config_from_dict(cfg_dict)
    tracker = ListTracker()
    trainer = make_trainer(cfg, rank, world, LocalReporter(Path(root)), tracker)
    trainer.run()
    if rank == 0:
        torch.save(tracker.series("train_loss"), Path(root) / "loss.pt")


def resume_and_record(rank: int, world: int, cfg_dict: dict, ckpt: str, out: str) -> None:
    """Restore ``ckpt`` at this world size, save the restored params, train on, save losses."""
    cfg = config_from_dict(cfg_dict)
    tracker = ListTracker()
    trainer = make_trainer(cfg, rank, world, LocalReporter(Path(out).parent / f"r{rank}"), tracker)
    trainer.restore(Path(ckpt))
    restored = full_params(trainer.engine.module)
    trainer.run()
    if rank == 0:
        torch.save({"params": restored, "loss": tracker.series("train_loss")}, out)


def probe_tokens(length: int = 32) -> torch.Tensor:
    """The same tokens on every rank (block_size 32: 33 make one training window)."""
    return torch.randint(0, 256, (4, length), generator=torch.Generator().manual_seed(7))


def settle(engine: Any) -> None:
    """Let gloo finish with ZeRO-3's prefetching all-gathers before the process exits: one
    left in flight gets dropped by a gloo thread during interpreter shutdown, which aborts."""
    from raylift.strategies.deepspeed import DeepSpeedEngine

    if isinstance(engine, DeepSpeedEngine) and engine.stage == 3:
        engine.ds.empty_partition_cache()  # waits for the gathers in flight, frees them
    dist.barrier()


def train_runs(rank: int, world: int, runs: dict[str, dict], out: str) -> None:
    """Train each config in turn; rank 0 saves per run: loss curve, bytes, probe outputs."""
    results: dict[str, dict] = {}
    for name, raw in runs.items():
        tracker = ListTracker()
        reporter = LocalReporter(Path(out).parent / name)  # both ranks merge into one folder
        trainer = make_trainer(config_from_dict(raw), rank, world, reporter, tracker)
        trainer.run()
        with torch.no_grad():
            output = trainer.engine.eval_model(probe_tokens())
            logits = getattr(output, "logits", output).float()  # a Hugging Face model's
        results[name] = {
            "loss": tracker.series("train_loss"),
            "bytes": trainer.engine.model_state_bytes(),
            "logits": logits,
            "memory": trainer.memory,  # the model-state metrics rank 0 logged
            "wire": tracker.wire(),
            "layout": trainer.engine.layout,
        }
        settle(trainer.engine)
    if rank == 0:
        torch.save(results, out)


def stop_ray_of(temp_dir: str, timeout: float = 15.0) -> int:
    """Stop every process of the Ray started with ``--temp-dir=temp_dir`` (its GCS,
    raylets, monitor, agents and their children, fake nodes included), by pid: ``ray
    stop`` would stop every Ray on the host. The head's Ray Client server names no folder,
    only its node: it is found by that, else it would wait out Ray's 60 s for a GCS that
    is gone before it ends. Returns how many there were."""
    import psutil

    me = psutil.Process()
    spared = {me.pid, *(p.pid for p in me.parents())}  # whatever named the folder to us
    found: set[psutil.Process] = set()
    procs = [(p, " ".join(p.info["cmdline"] or [])) for p in psutil.process_iter(["cmdline"])]
    nodes = {n for _, cmd in procs if temp_dir in cmd for n in re.findall(r"--node_id=(\w+)", cmd)}
    for proc, cmd in procs:
        node = re.search(r"--node-id=(\w+)", cmd) if "ray.util.client.server" in cmd else None
        if proc.pid not in spared and (temp_dir in cmd or (node and node.group(1) in nodes)):
            found.add(proc)
            with contextlib.suppress(psutil.Error):
                found.update(proc.children(recursive=True))
    for proc in found:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(list(found), timeout=timeout)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    return len(found)


def raylets_of(temp_dir: str) -> list[tuple[int, str]]:
    """(pid, node id) of the raylets of the Ray started with ``--temp-dir=temp_dir``,
    oldest first: the head's, then each node that joined it."""
    import psutil

    found = []
    for proc in psutil.process_iter(["name", "cmdline", "create_time"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        node = re.search(r"--node_id=(\w+)", cmdline)
        if proc.info["name"] == "raylet" and temp_dir in cmdline and node:
            found.append((proc.info["create_time"], proc.pid, node.group(1)))
    return [(pid, node) for _, pid, node in sorted(found)]


# How long a command or a condition may take before the test calls it a hang. Not a
# speed goal: a loaded machine takes several times as long as a quiet one, and still
# passes; only a command that will never end meets it.
HANG_S = 900.0


def finish_output(proc: subprocess.Popen, what: str, ceiling: float = HANG_S) -> tuple[str, str]:
    """``proc``'s stdout and stderr once it has exited; a process still running after
    ``ceiling`` seconds is a hang: it is killed and the failure shows its last output."""
    try:
        out, err = proc.communicate(timeout=ceiling)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        tail = f"{out or ''}\n{err or ''}"[-4000:]
        raise AssertionError(
            f"{what}: still running after {ceiling:.0f} s; it printed:\n{tail}"
        ) from None
    return out or "", err or ""


def wait_until(
    condition: Callable[[], Any],
    what: str,
    seen: Callable[[], Any] = lambda: "-",
    ceiling: float = HANG_S,
    every: float = 0.5,
) -> Any:
    """Until ``condition()`` is true (returns it). After ``ceiling`` seconds the failure
    names what was awaited and what ``seen()`` says there was instead."""
    deadline = time.monotonic() + ceiling
    while not (got := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {ceiling:.0f} s for {what}; saw: {seen()}")
        time.sleep(every)
    return got


class CountingProxy:
    """A TCP proxy on 127.0.0.1 in front of ``upstream`` (``http://host:port``) that counts
    the bytes the server sends back: what a client read, measured outside it."""

    def __init__(self, upstream: str):
        import socket
        import threading

        host, port = upstream.removeprefix("http://").rstrip("/").split(":")
        self.upstream = (host, int(port))
        self.served = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(self.upstream)
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, src: Any, dst: Any, count: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
                if count:
                    with self._lock:
                        self.served += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(2)

    def close(self) -> None:
        self._listener.close()
