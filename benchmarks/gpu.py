"""One call that measures a GPU machine: the GPU tests, GPT-2-small through Ray, LoRA
against a full fine-tune of a 1B Llama, checkpoints at GPU speed, ``raylift check``.

    python benchmarks/gpu.py            # a machine with CUDA GPUs: 9 minutes or less on one H200
    python benchmarks/gpu.py --smoke    # every part at toy sizes on this CPU, a few minutes

Each part runs in processes of its own, on a GPU under its own time budget (the machine's
minutes are few); a part that fails or runs out of time is reported with what it printed
last, and the next part still runs. ``--smoke`` sets no budget: it checks that every part
works, and a slow or loaded CPU only makes it longer:

1. ``tests``: ``pytest -m gpu``.
2. ``gpt2``: GPT-2-small (the gpt task: 12 layers, d_model 768, block 1024) through
   ``raylift train``, one worker per GPU, bf16-mixed, ``train.compile``: tokens/s, MFU
   against the GPU's bf16 dense peak (from its name), peak GPU memory, time to the first
   step; beside it the same model's step in ``benchmarks/overhead.py``'s hand-written loop
   (``--device cuda --compile``), and the ratio.
3. ``llama``: a Llama-3.2-1B-shaped model with random weights (hidden 2048, 16 layers, 32
   heads, 8 KV heads, vocab 128,256, block 2048), saved with ``save_pretrained``, trained
   with ``task: hf-causal-lm`` under fsdp, bf16-mixed: full fine-tune and LoRA, each
   with tokens/s and peak GPU memory, and ``raylift plan``'s prediction beside the peak.
4. ``checkpoints``: that model's full fine-tune saved with ``checkpoint.async`` true (the
   run of part 3) and false: the loop's stall, the save's total time, GB/s; then a resume:
   the GB/s read, and the bytes read against the checkpoint's size.
5. ``check``: ``raylift check`` on this machine, as printed (the GPU, CUDA, NCCL columns).
6. ``pipeline``: ``benchmarks/pipeline.py`` on the GPU, with what time is left.

The runs share one Ray (started here) and one MLflow store; their numbers are read back
from the MLflow runs (what rank 0 logged) and their console lines. Results:
``benchmarks/results/gpu-<device>.json``, rendered as the GPU row of the README's table.
``--smoke`` writes to a temporary folder instead, never to the results: a CPU's numbers
are not a GPU's. On the GPU machine, after ``bash ../shared/gpu/make_bundle.sh`` here and
``bash benchmarks/gpu_bundle.sh`` (MLflow's SQL store, which the bundle's skinny MLflow
lacks), there: ``bash .gpu-bundle/setup.sh && export PYTHONPATH=/tmp/site:$PWD/src
PATH=/tmp/site/bin:$PATH && python benchmarks/gpu.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))
from results import RESULTS, save  # noqa: E402

RAYLIFT = [sys.executable, "-m", "raylift.cli"]
GPT2 = [
    "task_args.n_layer=12",
    "task_args.n_head=12",
    "task_args.d_model=768",
    "task_args.block_size=1024",
    "task_args.max_bytes=6000000",
    "data.batch_size=16",
]
GPT_TOY = [
    "task_args.n_layer=2",
    "task_args.n_head=2",
    "task_args.d_model=64",
    "task_args.block_size=64",
    # Text for its 20 steps, and 1% of it held out: the run's final evaluation of 5% of
    # 400 KB was longer than its training here.
    "task_args.max_bytes=100000",
    "task_args.val_percent=1",
    "data.batch_size=8",
]
# Llama-3.2-1B's shape (its tied head too); the toy keeps the architecture, at a CPU's size.
LLAMA_1B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 2048,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
}
LLAMA_TOY = {
    **LLAMA_1B,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 128,
}
LORA = "model.adapter={type: lora, r: 16, alpha: 32, target_modules: all-linear}"
# Seconds each part may take. On one H200 (torch 2.11): the GPU tests took 29-34 s;
# raylift's GPT-2 run 90 s (40 s of it compiling), which left the hand-written loop too
# little of 140; the 1B Llama's full fine-tune was still training at 150. The pipeline
# has what is left of --total once the others are done.
BUDGETS = {"tests": 40, "gpt2": 170, "llama": 200, "checkpoints": 100, "check": 20, "pipeline": 0}
PIPELINE_TOY = ["--images", "90", "--source-size", "32", "--size", "16", "--epochs", "2",
                "--target", "0.0"]  # fmt: skip


class OutOfTime(Exception):
    pass


@dataclasses.dataclass
class Bench:
    """What every part shares: sizes, the Ray and MLflow store, the clock of its part."""

    smoke: bool
    tmp: Path
    env: dict[str, str]
    gpus: int
    deadline: float | None = None  # None: no budget (--smoke)
    log: list[str] = dataclasses.field(default_factory=list)  # the part's last output

    @property
    def store(self) -> str:
        return f"sqlite:///{self.tmp / 'mlflow.db'}"

    def left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def sh(self, cmd: list[str], cwd: Path | None = None, check: bool = True) -> str:
        """``cmd``'s output (stdout and stderr), within what is left of the part's budget."""
        left = self.left()
        if left is not None and left <= 0:
            raise OutOfTime("no time left for " + " ".join(cmd[:4]))
        proc = subprocess.Popen(
            cmd,
            cwd=cwd or self.tmp,
            env=self.env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=self.left())
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, _ = proc.communicate()
            self.log = out.splitlines()[-15:]
            raise OutOfTime(f"{' '.join(cmd[:4])}: out of time") from None
        self.log = out.splitlines()[-15:]
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:4])} exited {proc.returncode}")
        return str(out)

    def train(self, config: str, name: str, *overrides: str) -> dict[str, Any]:
        """``raylift train`` of ``config``; what its MLflow run holds, and its console."""
        more = [
            f"name={name}",
            f"tracking.uri={self.store}",
            f"storage={self.tmp / 'runs'}",
            "tracking.log_model=none",
            f"scaling.num_workers={max(self.gpus, 1)}",
            f"scaling.use_gpu={str(self.gpus > 0).lower()}",
            "train.early_stopping=null",
        ]
        out = self.sh([*RAYLIFT, "train", config, *more, *overrides])
        return {**run_metrics(self.store, name), "console": out}


def run_metrics(store: str, name: str) -> dict[str, Any]:
    """The newest MLflow run named ``name``: each metric's history, by step."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store)
    exp = client.get_experiment_by_name("raylift")
    run = client.search_runs(
        [exp.experiment_id], f"tags.mlflow.runName = '{name}'", order_by=["start_time DESC"]
    )[0]
    history = {k: client.get_metric_history(run.info.run_id, k) for k in run.data.metrics}
    return {"metrics": {k: {m.step: m.value for m in v} for k, v in history.items()}}


def steady(run: dict[str, Any], key: str) -> float:
    """A rate after the first logging interval (which holds compilation and warm-up)."""
    values = [v for _, v in sorted(run["metrics"].get(key, {}).items())]
    later = values[1:] or values
    return sorted(later)[len(later) // 2] if later else float("nan")


def peak_memory(run: dict[str, Any]) -> tuple[float, str]:
    """The run's peak memory in GiB: the GPU's allocator peak, or the host's RSS on a CPU."""
    for key, what in (("cuda_peak_allocated_bytes", "GPU"), ("mem_rss_bytes", "host RSS")):
        if run["metrics"].get(key):
            return max(run["metrics"][key].values()) / 2**30, what
    return float("nan"), "none"


# ------------------------------------------------------------------ the parts


def part_tests(b: Bench) -> dict[str, Any]:
    out = b.sh(
        [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "gpu",
            "-n",
            "0",
            "-p",
            "no:cacheprovider",
            "-q",
            "--no-header",
            "tests",
        ],
        cwd=REPO,
        check=False,
    )
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", out)}
    if counts.get("failed") or counts.get("error"):
        raise RuntimeError(f"GPU tests: {counts}")
    return counts


def part_gpt2(b: Bench) -> dict[str, Any]:
    sizes = GPT_TOY if b.smoke else GPT2
    steps = 20 if b.smoke else 60
    run = b.train(
        str(REPO / "configs" / "gpt-tiny.yaml"),
        "gpu-gpt2",
        *sizes,
        "precision=bf16-mixed",
        f"train.compile={str(not b.smoke).lower()}",
        f"train.max_steps={steps}",
        "train.log_every_n_steps=10",
        "train.eval_every_n_steps=null",
        "checkpoint.every_n_steps=null",
    )
    step_s = steady(run, "step_time_s")
    try:
        hand = hand_written_step(b)
    except OutOfTime:  # raylift's numbers stand; the baseline is reported as missing
        hand = float("nan")
    mem, where = peak_memory(run)
    return {
        "tokens_per_s": steady(run, "tokens_per_s"),
        "mfu": steady(run, "mfu"),
        f"peak_{where.replace(' ', '_').lower()}_gib": mem,
        "first_step_s": next(iter(run["metrics"].get("startup/total_s", {}).values()), None),
        "step_ms": step_s * 1e3,
        "hand_written_step_ms": hand * 1e3,
        "ratio_to_hand_written": step_s / hand,
    }


def hand_written_step(b: Bench) -> float:
    """``benchmarks/overhead.py``'s hand-written loop, the same model on one device."""
    if b.smoke:  # the raylift run's toy sizes and precision (overhead.py's CPU default is fp32)
        device = ["--device", "cpu", "--steps", "20", "--repeats", "1", *GPT_TOY]
        device.append("precision=bf16-mixed")
    else:  # overhead.py's GPU size is GPT-2-small's, bf16-mixed
        device = ["--device", "cuda", "--compile", "--steps", "40", "--repeats", "1"]
    script = str(REPO / "benchmarks" / "overhead.py")
    out = b.sh([sys.executable, script, *device, "--no-save"], cwd=REPO)
    found = re.search(r"hand-written ([\d.]+) ms \(MFU", out)
    if not found:
        raise RuntimeError("overhead.py printed no hand-written step time")
    return float(found.group(1)) / 1e3


def save_llama(b: Bench) -> Path:
    """The 1B Llama (or its toy) with random weights, as ``save_pretrained`` writes it,
    beside a small BPE tokenizer (tests/zoo.py's: ids below its 300 are in any vocab)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.zoo import zoo_tokenizer

    folder = b.tmp / "llama"
    if (folder / "config.json").is_file():
        return folder
    config = LlamaConfig(**(LLAMA_TOY if b.smoke else LLAMA_1B), bos_token_id=2, eos_token_id=1)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # a 1B init is minutes on a CPU
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    zoo_tokenizer().save_pretrained(folder)
    return folder


def llama_config(b: Bench) -> Path:
    folder = save_llama(b)
    block = 64 if b.smoke else 2048
    cfg = {
        "task": "hf-causal-lm",
        "task_args": {
            "model": str(folder),
            "block_size": block,
            # The toy's text for its 12 steps, 1% held out (its evaluations, not training,
            # were most of a toy run); the real size holds out the task's default.
            "max_bytes": 60_000 if b.smoke else 3_000_000,
            **({"val_percent": 1} if b.smoke else {}),
        },
        "data": {"batch_size": 2},
        "strategy": {"name": "fsdp"},
        "precision": "bf16-mixed",
        "optim": {"name": "adamw", "lr": 1e-4, "warmup_steps": 2},
        "train": {
            "max_steps": 10,
            "log_every_n_steps": 2,
            "grad_clip": 1.0,
            "eval_every_n_steps": None,
        },
        "checkpoint": {"every_n_steps": 5, "keep": 1},
    }
    import yaml

    path = b.tmp / "llama.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def planned_peak(b: Bench, config: Path, *overrides: str) -> float:
    """``raylift plan``'s total for the strategy the run uses (fsdp), in GiB."""
    gib = 80 if not b.smoke else 16
    out = b.sh(
        [
            *RAYLIFT,
            "plan",
            str(config),
            "--gpus",
            str(max(b.gpus, 1)),
            "--gpu-mem",
            str(gib),
            *overrides,
        ]
    )
    row = re.search(r"^fsdp\s+(.*)$", out, re.MULTILINE)
    if not row:
        raise RuntimeError("raylift plan printed no fsdp row")
    return float(row.group(1).split()[-2]) / 1024  # MiB, the column before "fits"


def part_llama(b: Bench) -> dict[str, Any]:
    config = llama_config(b)
    out: dict[str, Any] = {}
    for mode, more in (("full", []), ("lora", [LORA])):
        run = b.train(str(config), f"gpu-llama-{mode}", *more)
        mem, where = peak_memory(run)
        out[mode] = {
            "tokens_per_s": steady(run, "tokens_per_s"),
            "peak_gib": mem,
            "peak_of": where,
            "planned_gib": planned_peak(b, config, *more),
        }
        if mode == "full":
            out["full"]["async_save"] = saves(run)
    return out


def saves(run: dict[str, Any]) -> dict[str, float]:
    """The first save's numbers (mid-run, while training goes on): the loop's stall, the
    save's total, its GB/s."""
    m = run["metrics"]
    if not m.get("checkpoint_save_s"):
        raise RuntimeError("the run logged no checkpoint")
    step = min(m["checkpoint_save_s"])
    total, size = m["checkpoint_save_s"][step], m["checkpoint_bytes"][step]
    return {
        "step": step,
        "stall_s": m["checkpoint_blocked_s"][step],
        "save_s": total,
        "gib": size / 2**30,
        "gb_per_s": size / total / 1e9,
    }


RESTORE = re.compile(
    r"restore read ([\d,.]+) MiB of the checkpoint's ([\d,.]+) MiB in ([\d.]+) s \(([\d.e+-]+) GB/s"
)


def part_checkpoints(b: Bench) -> dict[str, Any]:
    config = llama_config(b)
    # One save, at the run's end: the same blocking save as a mid-run one, and one copy of
    # the model's 15 GB of states on the machine's disk beside part 3's.
    run = b.train(str(config), "gpu-llama-sync", "checkpoint.async=false", "train.max_steps=5")
    shutil.rmtree(b.tmp / "runs" / "gpu-llama-sync", ignore_errors=True)
    out = {"sync_save": saves(run)}
    # The async run of part 3 trained on: its newest checkpoint read back, 2 steps more.
    resumed = b.train(str(config), "gpu-llama-full", "train.max_steps=12")
    found = RESTORE.search(resumed["console"])
    if not found:
        raise RuntimeError("the resumed run printed no restore line")
    read, size, seconds, gbps = (float(x.replace(",", "")) for x in found.groups())
    out["resume"] = {"read_mib": read, "checkpoint_mib": size, "seconds": seconds, "gb_per_s": gbps}
    return out


def part_check(b: Bench) -> dict[str, Any]:
    out = b.sh(
        [
            *RAYLIFT,
            "check",
            str(REPO / "configs" / "gpt-tiny.yaml"),
            f"scaling.num_workers={max(b.gpus, 1)}",
            f"scaling.use_gpu={str(b.gpus > 0).lower()}",
            f"storage={b.tmp / 'runs'}",
            f"tracking.uri={b.store}",
        ],
        check=False,
    )
    table = [line for line in out.splitlines() if line.strip()]
    return {"printed": table[-12:]}


def part_pipeline(b: Bench) -> dict[str, Any]:
    toy = PIPELINE_TOY if b.smoke else []
    script = str(REPO / "benchmarks" / "pipeline.py")
    out = b.sh([sys.executable, script, *toy, "--no-save"], cwd=REPO)
    return {"printed": [line for line in out.splitlines() if line.strip()][-8:]}


PARTS: dict[str, Callable[[Bench], dict[str, Any]]] = {
    "tests": part_tests,
    "gpt2": part_gpt2,
    "llama": part_llama,
    "checkpoints": part_checkpoints,
    "check": part_check,
    "pipeline": part_pipeline,
}


def run_part(b: Bench, name: str, left: float) -> dict[str, Any]:
    """One part within its budget (``left``: the whole call's seconds left, for the part
    without a budget of its own): its numbers, or how it failed and what it said last."""
    budget = None if b.smoke else BUDGETS[name] or max(0, int(left))
    started = time.monotonic()
    b.deadline, b.log = None if budget is None else started + budget, []
    try:
        result: dict[str, Any] = {"status": "ok", **PARTS[name](b)}
    except OutOfTime as exc:
        result = {"status": "out of time", "error": str(exc), "last_lines": b.log}
    except Exception as exc:  # a part's failure is reported; the next part runs
        result = {"status": "failed", "error": f"{type(exc).__name__}: {exc}", "last_lines": b.log}
    result["seconds"] = round(time.monotonic() - started, 1)
    result["budget_s"] = budget
    of = "" if budget is None else f" (budget {budget} s)"
    print(f"gpu.py: {name}: {result['status']} in {result['seconds']:.0f} s{of}", flush=True)
    if result["status"] != "ok":
        print("  " + result["error"], *("  | " + x for x in result["last_lines"]), sep="\n")
    return result


def start_ray(b: Bench) -> Any:
    """One Ray for every run (each run joins it, as on a cluster, with its token)."""
    import ray

    ctx = ray.init(
        address="local",
        num_gpus=b.gpus,
        include_dashboard=False,
        _temp_dir=str(b.tmp / "ray"),
        logging_level="WARNING",
    )
    b.env.update(RAY_ADDRESS=ctx.address_info["gcs_address"], RAY_AUTH_MODE="token")
    return ray


def device() -> tuple[int, str]:
    import torch

    if not torch.cuda.is_available():
        return 0, "cpu"
    return torch.cuda.device_count(), torch.cuda.get_device_name(0)


def facts() -> dict[str, Any]:
    """Torch, CUDA, NCCL (as ``raylift check`` reads them) and the driver's version."""
    import torch

    from raylift.run.check import gpu_facts

    cuda, nccl, _ = gpu_facts()
    out: dict[str, Any] = {"torch": torch.__version__, "cuda": cuda, "nccl": nccl}
    smi = shutil.which("nvidia-smi")
    if smi and torch.cuda.is_available():
        query = [smi, "--query-gpu=driver_version", "--format=csv,noheader"]
        out["driver"] = subprocess.run(query, capture_output=True, text=True).stdout.strip()
    return out


def rows(results: dict[str, Any]) -> list[list[str]]:
    """The results page's rows: each part, its status, its time, its main numbers."""

    def short(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:,.3g}"
        if isinstance(value, dict):
            return "; ".join(f"{k} {short(v)}" for k, v in value.items())
        return str(value)

    out = []
    for name, r in results.items():
        hidden = ("status", "seconds", "budget_s", "printed", "last_lines")
        shown = {k: v for k, v in r.items() if k not in hidden}
        if "printed" in r:
            shown["output"] = "below"
        spent = f"{r['seconds']:.0f} / {r['budget_s'] or '-'}"
        out.append([name, r["status"], spent, short(shown)])
    return out


def printed(results: dict[str, Any]) -> list[dict[str, Any]]:
    """What the parts that print a table printed, each as a table of its lines."""
    return [
        {"title": f"`{name}`, as printed", "columns": ["line"],
         "rows": [[f"`{line}`"] for line in r["printed"]]}
        for name, r in results.items()
        if r.get("printed")
    ]  # fmt: skip


def summary(results: dict[str, Any]) -> dict[str, str]:
    gpt = results.get("gpt2", {})
    if gpt.get("status") != "ok":
        return {
            "what": "GPT-2-small through raylift train",
            "raylift": gpt.get("status", "-"),
            "baseline": "-",
            "ratio": "-",
        }
    return {
        "what": "GPT-2-small through raylift train, bf16, compiled: step time, MFU",
        "raylift": f"{gpt['step_ms']:.1f} ms/step, {gpt['tokens_per_s']:,.0f} tok/s, "
        f"MFU {gpt['mfu']:.1%}",
        "baseline": f"{gpt['hand_written_step_ms']:.1f} ms/step (hand-written loop)"
        if gpt["hand_written_step_ms"] == gpt["hand_written_step_ms"]
        else "hand-written loop: out of time",
        "ratio": f"{gpt['ratio_to_hand_written']:.3f}",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="toy sizes on a CPU; saves nothing")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated, in order")
    parser.add_argument("--out", type=Path, help="the JSON file (default: benchmarks/results)")
    parser.add_argument("--total", type=float, default=540, help="seconds for the whole call")
    opts = parser.parse_args()
    began = time.monotonic()
    gpus, name = device()
    if not gpus and not opts.smoke:
        parser.error("no CUDA GPU here: run with --smoke to try every part on this CPU")
    tmp = Path(tempfile.mkdtemp(prefix="raylift-gpu-"))
    bench = Bench(opts.smoke, tmp, {**os.environ, "PYTHONUNBUFFERED": "1"}, gpus)
    ray = start_ray(bench)
    results: dict[str, Any] = {}
    try:
        for part in opts.parts.split(","):
            results[part] = run_part(bench, part, opts.total - (time.monotonic() - began))
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    return report(results, name, opts)


def report(results: dict[str, Any], name: str, opts: argparse.Namespace) -> int:
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    default = Path(tempfile.gettempdir()) if opts.smoke else RESULTS
    out = opts.out or default / f"gpu-{'smoke' if opts.smoke else slug}.json"
    size = "toy sizes on a CPU (--smoke)" if opts.smoke else f"on {name}"
    saved = save(
        out.name,
        f"one call on a GPU machine, {size}",
        ["part", "status", "s / budget", "numbers"],
        rows(results),
        summary(results),
        notes=", ".join(f"{k} {v}" for k, v in facts().items()),
        tables=printed(results),
        folder=out.parent,
    )
    data = json.loads(saved.read_text())
    data["parts"] = results
    saved.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return 0 if all(r["status"] == "ok" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
