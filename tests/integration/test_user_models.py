"""A user's own model from a folder outside the repository, trained with ``raylift train``
under FSDP on the session's Ray: it learns, every console line is raylift's, its start-up
phases add up, and the run exports to a ``from_pretrained`` folder without its config."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import finish_output
from tests.integration.test_train import OURS, STARTUP_KEYS, cli_env

pytest.importorskip("transformers")
pytestmark = [pytest.mark.integration, pytest.mark.slow]

USER_FILE = Path(__file__).resolve().parents[1] / "user_models.py"
CONFIG = """
    task: mymodels:{task}
    data: {{batch_size: 8}}
    scaling: {{num_workers: 2, cpus_per_worker: 0.5}}
    precision: "32"
    optim: {{name: adamw, lr: 3.0e-3, weight_decay: 0.1, betas: [0.9, 0.95], warmup_steps: 5}}
    train: {{max_steps: 30, log_every_n_steps: 1, grad_clip: 1.0, seed: 0}}
    checkpoint: {{every_n_steps: 30, keep: 1}}
    storage: ./runs
"""
# Runs, name -> strategy overrides: one, as a run through Ray costs the two cores most of
# a minute. The curves are the unit tests': tests/unit/test_user_models.py holds both
# models (Llama, NormLM) to DDP's curve under every strategy, and shows NormLM's
# constructor-kept parameters; ZeRO-3's console under Ray is its shipped config's and the
# llama's with a pad token (test_shipped_runs.py), fairscale's too, ZeRO-2's the killed
# run's (test_train.py).
RUNS = {"llama-fsdp": ["strategy.name=fsdp"]}


def raylift(folder: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "raylift.cli", *args],
        cwd=folder, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def finish(proc: subprocess.Popen, name: str) -> list[str]:
    out, err = finish_output(proc, name)
    assert proc.returncode == 0, f"{name}:\n{out[-3000:]}\n{err[-3000:]}"
    return (out + err).splitlines()


@pytest.fixture(scope="module")
def user_runs(ray_cluster: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """Each run's console lines, and when each was started."""
    folder = tmp_path_factory.mktemp("user")  # under /tmp: outside the repository
    shutil.copy(USER_FILE, folder / "mymodels.py")
    (folder / "LlamaLM.yaml").write_text(textwrap.dedent(CONFIG.format(task="LlamaLM")))
    consoles: dict[str, list[str]] = {}
    started: dict[str, float] = {}
    for name, overrides in RUNS.items():
        started[name] = time.time()
        proc = raylift(folder, "train", "LlamaLM.yaml", f"name={name}", *overrides)
        consoles[name] = finish(proc, name)
    return folder, consoles, started


def mlflow_run(folder: Path, name: str) -> tuple:  # type: ignore[type-arg]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{folder / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("raylift").experiment_id
    (run,) = client.search_runs([experiment], f"tags.mlflow.runName = '{name}'")
    return client, run


def curve(folder: Path, name: str) -> dict[int, float]:
    client, run = mlflow_run(folder, name)
    return {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train_loss")}


def test_fsdp_trains_a_users_llama(user_runs: tuple) -> None:
    folder, _, _ = user_runs
    got = curve(folder, "llama-fsdp")
    assert sorted(got) == list(range(1, 31)) and got[30] < 0.8 * got[1]


def test_every_console_line_is_raylifts(user_runs: tuple) -> None:
    _, consoles, _ = user_runs
    for name, lines in consoles.items():
        foreign = [line for line in lines if not line.startswith(OURS)]
        assert not foreign, (name, foreign)
        # How the initial weights were made, said once: sharded builds and what they held.
        (init,) = [line for line in lines if line.startswith("raylift: initial weights:")]
        if name == "llama-fsdp":
            assert "meta device" in init and "by the model's _init_weights" in init, init
            assert "held on the host while building" in init, init


def test_the_run_exports_to_a_from_pretrained_folder_without_its_config(
    user_runs: tuple,
) -> None:
    from transformers import AutoModelForCausalLM

    from raylift.artifacts.export import consolidated_state_dict

    folder, _, _ = user_runs
    run = folder / "runs" / "llama-fsdp"
    assert (run / "config.yaml").is_file()
    proc = raylift(folder, "export", "runs/llama-fsdp", "--format", "hf", "--out", "hf")
    lines = finish(proc, "export")
    # The checkpoint by its absolute path: the newest intact one the folder listed.
    (line,) = lines
    assert re.fullmatch(rf"raylift: wrote 20 tensors \(fp32\) from {re.escape(str(run.resolve()))}"
                        r"/checkpoint-step00000030 to hf", line), line  # fmt: skip
    loaded = AutoModelForCausalLM.from_pretrained(folder / "hf", local_files_only=True).eval()
    sys.path.insert(0, str(folder))
    try:
        from mymodels import LlamaLM  # the user's file, as the run imported it
    finally:
        sys.path.remove(str(folder))
    ours = LlamaLM().build_model().eval()
    ours.load_state_dict(consolidated_state_dict(run), strict=False)  # the tied head once
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(input_ids=tokens).logits, ours(input_ids=tokens).logits, rtol=0, atol=0
        )


def test_the_startup_phases_add_up_to_the_time_to_the_first_step(user_runs: tuple) -> None:
    """Measured from the command's start (its data prepared in the run)."""
    folder, consoles, started = user_runs
    run_id = re.search(r"MLflow run (\w+)", "\n".join(consoles["llama-fsdp"])).group(1)  # type: ignore[union-attr]
    client, run = mlflow_run(folder, "llama-fsdp")
    assert run.info.run_id == run_id
    (first,) = client.get_metric_history(run_id, "model_state_bytes_per_rank")
    measured = first.timestamp / 1000 - started["llama-fsdp"]
    phases = sum(v for k, v in run.data.metrics.items() if k in STARTUP_KEYS)
    assert phases == pytest.approx(measured, rel=0.10), run.data.metrics
    assert phases == pytest.approx(run.data.metrics["startup/total_s"], rel=1e-6)
