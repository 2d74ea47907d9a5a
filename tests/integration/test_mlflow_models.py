"""MLflow as its users use it, against a real MLflow server whose artifact store is the S3
server: a run logs its model, its config and its data; the registered model trains again
from ``models:/NAME/1``; a mixture of experts saved as ``save_pretrained`` writes it (the
zoo's Mixtral), fine-tuned under ZeRO-3, logs a folder that ``from_pretrained`` loads
after ``mlflow.artifacts.download_artifacts``: its experts written back in the layout
transformers reads."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import finish_output
from tests.integration.test_train import OURS, cli_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]
QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
REGISTERED = "digits-registered"


def raylift(folder: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "raylift.cli", *args],
        cwd=folder, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def finish(proc: subprocess.Popen, what: str) -> str:
    out, _ = finish_output(proc, what)
    assert proc.returncode == 0, f"{what}:\n{out[-4000:]}"
    assert not [x for x in out.splitlines() if not x.startswith(OURS)], out
    return str(out)


@pytest.fixture(scope="module")
def consoles(
    ray_cluster: str, mlflow_server: str, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, str]:
    """Three runs, one after the other (each fills the two cores): the zoo's Mixtral under
    ZeRO-3, the quickstart registered, then a run that starts from the registered
    version."""
    from tests.zoo import save_zoo, zoo_config

    folder = tmp_path_factory.mktemp("mlflow-models")
    common = [
        f"tracking.uri={mlflow_server}", "precision=32", f"storage=s3://runs/{folder.name}",
        "train.early_stopping=null", "checkpoint.every_n_steps=null",
    ]  # fmt: skip
    moe = save_zoo(folder / "zoo", ["mixtral"])["mixtral"]
    cfg = zoo_config(moe, {"name": "deepspeed", "zero_stage": 3}, lora=False)
    cfg["scaling"] = {"num_workers": 2, "cpus_per_worker": 0.5}
    (folder / "moe.yaml").write_text(yaml.safe_dump(cfg))
    hf = raylift(folder, "train", "moe.yaml", "name=moe-zero3", *common)
    out = {"hf": finish(hf, "Mixtral under ZeRO-3")}
    first = raylift(
        folder, "train", str(QUICKSTART), "name=registered", "train.max_steps=12",
        f"tracking.register_as={REGISTERED}", *common,
    )  # fmt: skip
    out["registered"] = finish(first, "the registered run")
    again = raylift(
        folder,
        "train",
        str(QUICKSTART),
        "name=finetuned",
        "train.max_steps=3",
        f"model.weights=models:/{REGISTERED}/1",
        "tracking.log_model=none",
        *common,
    )  # fmt: skip
    out["finetuned"] = finish(again, "the run from the registry")
    return out


def run_of(client, name: str):  # type: ignore[no-untyped-def]
    exp = client.get_experiment_by_name("raylift")
    (run,) = client.search_runs([exp.experiment_id], f"tags.`mlflow.runName` = '{name}'")
    return run


def logged_id(console: str) -> str:
    found = re.search(r"raylift: model logged to MLflow as models:/(\S+) ", console)
    assert found, console
    return found.group(1)


def test_the_model_config_data_and_system_metrics_are_in_the_run(
    consoles: dict[str, str], mlflow_server: str
) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server)
    run = run_of(client, "registered")
    model_id = logged_id(consoles["registered"])
    assert f"registered as models:/{REGISTERED}/1" in consoles["registered"]
    model = client.get_logged_model(model_id)
    assert model.source_run_id == run.info.run_id and model.name == "model"
    assert str(model.status) in ("READY", "LoggedModelStatus.READY"), model.status
    files = {f.path for f in client.list_logged_model_artifacts(model_id)}
    assert {"model.safetensors", "config.yaml", "raylift-model.json"} <= files, files
    version = client.get_model_version(REGISTERED, "1")
    assert version.source == f"models:/{model_id}" and version.run_id == run.info.run_id
    # The artifacts are in the S3 server, under the server's artifact destination.
    import boto3

    keys = [o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket="runs")["Contents"]]
    weights = f"{model_id}/artifacts/model.safetensors"
    assert any(k.startswith("mlflow-artifacts/") and k.endswith(weights) for k in keys), keys
    assert "config.yaml" in {f.path for f in client.list_artifacts(run.info.run_id)}
    datasets = {d.dataset.source_type: d.dataset for d in run.inputs.dataset_inputs}
    shards = datasets["s3"]  # the shards in the run's storage, digested by their fingerprint
    assert json.loads(shards.profile)["rows"] == {"train": 1438, "val": 359}
    assert json.loads(shards.source)["uri"].startswith("s3://runs/") and len(shards.digest) == 36
    assert json.loads(datasets["local"].source)["uri"].endswith("digits.csv.gz")  # the raw data
    cpu = client.get_metric_history(run.info.run_id, "system/cpu_utilization_percentage")
    memory = client.get_metric_history(run.info.run_id, "system/system_memory_usage_megabytes")
    assert cpu and memory and all(m.value > 0 for m in memory)


def test_a_registered_model_trains_again_from_its_weights(
    consoles: dict[str, str], mlflow_server: str
) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server)
    first, again = run_of(client, "registered"), run_of(client, "finetuned")
    final = max(client.get_metric_history(first.info.run_id, "val_loss"), key=lambda m: m.step)
    start = [m for m in client.get_metric_history(again.info.run_id, "val_loss") if m.step == 0]
    assert final.step == 12 and start, (final, start)
    assert math.isclose(start[0].value, final.value, rel_tol=1e-6), (start[0].value, final.value)
    print(f"val_loss: the registered run's final {final.value!r}, from it {start[0].value!r}")
    console = consoles["finetuned"]
    assert f"raylift: model.weights models:/{REGISTERED}/1 -> s3://runs/" in console, console
    assert "model logged" not in console  # tracking.log_model: none
    assert not client.search_logged_models(
        experiment_ids=[again.info.experiment_id],
        filter_string=f"source_run_id = '{again.info.run_id}'",
    )


def test_a_mixture_of_experts_trained_under_zero3_loads_with_from_pretrained(
    consoles: dict[str, str], mlflow_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlflow.artifacts
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tests.zoo import STEPS

    client = MlflowClient(tracking_uri=mlflow_server)
    run = run_of(client, "moe-zero3")
    assert ", hf, " in consoles["hf"], consoles["hf"]  # logged as a Hugging Face folder
    # As a user points MLflow at the server (runs:/ resolves through the process's URI).
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    local = mlflow.artifacts.download_artifacts(
        f"runs:/{run.info.run_id}/model", dst_path=str(tmp_path)
    )
    model, info = AutoModelForCausalLM.from_pretrained(local, output_loading_info=True)
    # Every tensor the model has came from the folder, and every one there went somewhere
    # (a key transformers does not know would be left out of the model, silently).
    assert not any(info.values()), info
    saved = load_file(str(Path(local) / "model.safetensors"))
    # The experts as the zoo's folder had them, one tensor each: what from_pretrained fuses.
    assert any(".block_sparse_moe.experts.0.w1." in k for k in saved), sorted(saved)[:20]
    # The weights the run ended with: the export of its newest checkpoint, in storage.
    from raylift.cli import main

    ckpt = re.search(r"raylift: checkpoint (\S+)/checkpoint-step", consoles["hf"])
    assert ckpt, consoles["hf"]
    exported = tmp_path / "exported"
    assert main(["export", ckpt.group(1), "--format", "hf", "--out", str(exported)]) == 0
    final = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True).eval()
    tokens = torch.randint(4, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = model.eval()(input_ids=tokens).logits, final(input_ids=tokens).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    note = json.loads((Path(local) / "raylift-model.json").read_text())
    assert note["format"] == "hf" and note["step"] == STEPS and note["task"] == "hf-causal-lm"
