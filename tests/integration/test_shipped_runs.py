"""Every shipped config run to its very end as a user runs it (``raylift train``; the
sweep's ``raylift tune`` is in test_tune), a few steps each: trained, checkpointed, the
model logged to MLflow, and the logged model loaded back with the weights the run ended
with. Then a zoo case through the same command: a Llama with ``pad_token_id`` under
ZeRO-3 with LoRA (the zoo's mixture of experts under ZeRO-3 runs end to end in
test_mlflow_models, logged to an MLflow server)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import finish_output
from tests.integration.test_train import OURS, cli_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
# quickstart.yaml runs to its end in test_mlflow_models.py (logged, registered, and
# trained again from the registered model), and sweep-digits.yaml in test_tune.py (a trial
# that fails once, the sweep stopped and resumed, the best trial's model loaded back).
ELSEWHERE = ("quickstart.yaml", "sweep-digits.yaml")
CONFIGS = sorted(p for p in (REPO / "configs").glob("*.yaml") if p.name not in ELSEWHERE)
SHORT = ["train.max_steps=3", "train.early_stopping=null", "train.eval_every_n_steps=3"]
# What each config needs to be a few steps on this machine; nothing else is changed.
SMALL = {
    "gpt": ["task_args.max_bytes=150000", "task_args.block_size=32"],
    "images": ["data.batch_size=8"],  # and the image folder, below
    "digits": [],
}


def command(folder: Path, *args: str) -> str:
    """``raylift ARGS`` in ``folder`` on the session's Ray; its console, which must be
    raylift's lines only."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "raylift.cli", *args], cwd=folder, env=cli_env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    out, _ = finish_output(proc, " ".join(args[:2]))
    assert proc.returncode == 0, out[-4000:]
    assert not [x for x in out.splitlines() if not x.startswith(OURS)], out
    return str(out)


def logged_model(out: str, folder: Path, into: Path | None = None) -> Path:
    """The model the run logged, downloaded from the MLflow store in ``folder`` (where
    the command ran) into ``into``."""
    import mlflow
    from mlflow.tracking import MlflowClient

    found = re.search(r"raylift: model logged to MLflow as models:/(\S+) ", out)
    assert found, out
    # Found through this store's client: a models:/ URI resolves through the process-wide
    # tracking URI, which is another test's, or the working directory's default.
    client = MlflowClient(tracking_uri=f"sqlite:///{folder / 'mlflow.db'}")
    location = client.get_logged_model(found.group(1)).artifact_location
    dst = (into or folder) / "m"
    return Path(mlflow.artifacts.download_artifacts(artifact_uri=location, dst_path=str(dst)))


def loads_back(out: str, folder: Path, into: Path) -> dict[str, torch.Tensor]:
    """The model the command logged (its console names it), downloaded and loaded into the
    task's model that its logged config builds: every tensor, BatchNorm's counters too; a
    tied weight once, as safetensors keeps it. Returns the logged tensors."""
    import yaml
    from safetensors.torch import load_file

    from raylift.tasks import build_task

    logged_folder = logged_model(out, folder, into)
    logged = load_file(str(next(logged_folder.rglob("model.safetensors"))))
    cfg = yaml.safe_load(next(logged_folder.rglob("config.yaml")).read_text())
    model = build_task(cfg["task"], cfg["task_args"]).build_model()
    missing, unexpected = model.load_state_dict(logged, strict=False)
    assert not unexpected, unexpected
    params = dict(model.named_parameters(remove_duplicate=False))
    for name in missing:
        assert any(params[name] is params[n] for n in logged if n in params), name
    return logged


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder the shipped configs all run in, as a user's project is: the runs share
    ``./runs`` and ``mlflow.db``, and the GPT configs the shards the first one prepared
    (each run's own data check still reads them)."""
    return tmp_path_factory.mktemp("project")


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.corpora import write_image_folder

    return write_image_folder(tmp_path_factory.mktemp("images") / "shapes", per_class=24, size=24)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_the_shipped_config_runs_to_its_end(
    ray_cluster: str, path: Path, images: Path, project: Path, tmp_path: Path
) -> None:
    import yaml

    from raylift.artifacts.export import consolidated_state_dict

    raw = yaml.safe_load(path.read_text())
    more = [*SHORT, *SMALL.get(raw["task"], []), "scaling.cpus_per_worker=0.5"]
    if raw["task"] == "images":
        more.append(f"task_args.root={images}")
    out = command(project, "train", str(path), *more)
    logged = loads_back(out, project, tmp_path)
    ckpt = re.search(r"raylift: checkpoint (\S+)", out)
    assert ckpt, out  # the run names its final checkpoint: the logged model is its weights
    final = consolidated_state_dict(ckpt.group(1))
    for name, tensor in logged.items():
        torch.testing.assert_close(tensor.float(), final[name].float(), msg=name)


def test_a_llama_with_a_pad_token_trains_under_zero3_with_lora_logs_and_loads_back(
    ray_cluster: str, tmp_path: Path
) -> None:
    """Llama's pad row (its init indexes a row ZeRO-3 has partitioned), with LoRA."""
    import yaml
    from transformers import AutoModelForCausalLM

    from tests.zoo import save_zoo, zoo_config

    arch = "llama-pad"
    folder = save_zoo(tmp_path / "zoo", [arch])[arch]
    zero3 = {"name": "deepspeed", "zero_stage": 3}
    cfg = zoo_config(folder, zero3, lora=True)
    cfg.update(name=arch, storage=str(tmp_path / "runs"))
    cfg["scaling"] = {"num_workers": 2, "cpus_per_worker": 0.5}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    out = command(tmp_path, "train", "run.yaml", "checkpoint.every_n_steps=null")
    logged = logged_model(out, tmp_path)
    from peft import PeftModel  # the adapters alone, on the folder's base

    base = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    model = PeftModel.from_pretrained(base, str(next(logged.rglob("adapter_config.json")).parent))
    # The same weights as the run's own export of its final checkpoint, merged.
    from raylift.cli import main

    merged = tmp_path / "merged"
    assert (
        main(["export", str(tmp_path / "runs" / arch), "--format", "hf", "--out", str(merged)]) == 0
    )
    exported = AutoModelForCausalLM.from_pretrained(merged, local_files_only=True).eval()
    tokens = torch.randint(4, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = model.eval()(input_ids=tokens).logits, exported(input_ids=tokens).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
