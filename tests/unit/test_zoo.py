"""Every model a user brings: the zoo of real architectures (tests/zoo.py), each saved as
``save_pretrained`` writes it, under every strategy, fully fine-tuned and with LoRA.

One pair of gloo ranks per strategy loops over the architectures (a Ray start per case
would take half an hour here): each run loads the folder's own weights (transformers'
renamed and fused keys included), trains fp32 steps that must follow DDP's curve,
checkpoints half-way, and is restored on one rank to continue DDP's curve. The driver
then exports each run (``--format hf``, or ``peft`` for LoRA) and loads it back with
transformers or PEFT, with the trained model's logits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

pytest.importorskip("transformers")
pytest.importorskip("peft")

from raylift.cli import main
from tests.helpers import run_ranks
from tests.unit.test_init import ZERO3
from tests.zoo import MOE, RESUME_AT, STEPS, ZOO, probe, save_zoo, zoo_config, zoo_resume, zoo_train

pytestmark = pytest.mark.slow

STRATEGIES = {
    "fsdp": {"name": "fsdp"},
    "zero3": {"name": "deepspeed", "zero_stage": 3, "config": ZERO3},
    "zero2": {"name": "deepspeed", "zero_stage": 2},
    "fairscale": {"name": "fairscale"},
}
# Where a strategy runs which half of the matrix: ZeRO-2 and fairscale shard only the
# optimizer's state, so the full fine-tune is what they add; LoRA is shown under the
# strategies that shard the frozen base.
MODES = {"ddp": (False, True), "fsdp": (False, True), "zero3": (False, True),
         "zero2": (False,), "fairscale": (False,)}  # fmt: skip
# Relative, fp32: every architecture holds it, trained and resumed on fewer ranks under
# every strategy (no exception was needed).
TOLERANCE = 1e-5


def run_name(arch: str, lora: bool) -> str:
    return f"{arch}-lora" if lora else arch


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return save_zoo(tmp_path_factory.mktemp("zoo"))


def matrix(zoo: dict[str, Path], strategy: dict[str, Any], modes: tuple[bool, ...]) -> dict:
    return {
        run_name(arch, lora): zoo_config(folder, strategy, lora)
        for arch, folder in zoo.items()
        for lora in modes
    }


@pytest.fixture(scope="module")
def ddp(zoo: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """DDP's curves and logits, the reference every strategy follows."""
    root = tmp_path_factory.mktemp("ddp")
    runs = matrix(zoo, {"name": "ddp"}, MODES["ddp"])
    run_ranks(2, root, zoo_train, runs, str(root))
    return {"root": root, "runs": runs, **torch.load(root / "train.pt", weights_only=True)}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_architecture_follows_ddp_resumes_and_exports(
    name: str, zoo: dict[str, Path], ddp: dict[str, Any], tmp_path: Path
) -> None:
    runs = matrix(zoo, STRATEGIES[name], MODES[name])
    run_ranks(2, tmp_path, zoo_train, runs, str(tmp_path))
    trained = torch.load(tmp_path / "train.pt", weights_only=True)
    run_ranks(1, tmp_path, zoo_resume, runs, str(tmp_path))
    resumed = torch.load(tmp_path / "resume-1.pt", weights_only=True)
    table = []
    for run, cfg in runs.items():
        ref = ddp[run]["loss"]
        assert sorted(ref) == list(range(1, STEPS + 1)), run
        curve = trained[run]["loss"]
        worst = max(abs(curve[s] - v) / abs(v) for s, v in ref.items())
        assert worst <= TOLERANCE, (name, run, curve, ref)
        # 2 -> 1 ranks from the half-way checkpoint: the rest of the same curve.
        after = resumed[run]["loss"]
        assert sorted(after) == list(range(RESUME_AT + 1, STEPS + 1)), run
        resume_worst = max(abs(after[s] - ref[s]) / abs(ref[s]) for s in after)
        assert resume_worst <= TOLERANCE, (name, run, after, ref)
        exported = export_and_reload(run, cfg, tmp_path, trained[run]["logits"])
        table.append(f"{name} {run}: curve {worst:.1e} resume {resume_worst:.1e} {exported}")
    print("\n".join(table))


def test_ddp_curves_learn_and_every_architecture_exports(ddp: dict[str, Any]) -> None:
    root: Path = ddp["root"]
    for run, cfg in ddp["runs"].items():
        curve = ddp[run]["loss"]
        if "adapter" not in cfg["model"] or not cfg["model"]["adapter"]["type"]:
            assert min(curve.values()) < curve[1], (run, curve)  # it learns (LoRA: slower)
        export_and_reload(run, cfg, root, ddp[run]["logits"])


def test_the_zoo_is_as_transformers_saves_it(zoo: dict[str, Path]) -> None:
    """The folders hold what users download: the MoE models' experts one tensor each and
    GPT-NeoX's head as ``embed_out`` (which the model calls otherwise), a pad token."""
    from safetensors import safe_open

    def keys(arch: str) -> list[str]:
        with safe_open(str(zoo[arch] / "model.safetensors"), framework="pt") as f:
            return list(f.keys())

    assert any(".block_sparse_moe.experts.0.w1." in k for k in keys("mixtral"))
    assert any(".mlp.experts.0.gate_proj." in k for k in keys("qwen3-moe"))
    assert "embed_out.weight" in keys("gpt-neox")
    assert json.loads((zoo["llama-pad"] / "config.json").read_text())["pad_token_id"] == 3
    assert set(MOE) <= set(ZOO)


def export_and_reload(run: str, cfg: dict, root: Path, logits: torch.Tensor) -> str:
    """``raylift export`` of the run (``hf``; ``peft`` too for LoRA), loaded back by
    transformers (and PEFT) with the trained model's logits."""
    from transformers import AutoModelForCausalLM

    config = root / f"{run}.yaml"
    config.write_text(yaml.safe_dump(cfg))
    args = ["export", str(root / run), "--config", str(config)]
    out = root / f"{run}-hf"
    assert main([*args, "--format", "hf", "--out", str(out)]) == 0, run
    tokens = probe(logits.shape[-1])
    merged = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    with torch.no_grad():
        got = merged(input_ids=tokens).logits.float()
    torch.testing.assert_close(got, logits, rtol=1e-4, atol=1e-4, msg=run)
    if "adapter" not in (cfg.get("model") or {}) or not cfg["model"]["adapter"].get("type"):
        return "hf ok"
    from peft import PeftModel

    adapters = root / f"{run}-peft"
    assert main([*args, "--format", "peft", "--out", str(adapters)]) == 0, run
    base = AutoModelForCausalLM.from_pretrained(cfg["task_args"]["model"], local_files_only=True)
    peft = PeftModel.from_pretrained(base, str(adapters)).eval()
    with torch.no_grad():
        got = peft(input_ids=tokens).logits.float()
    torch.testing.assert_close(got, logits, rtol=1e-4, atol=1e-4, msg=run)
    return "hf+peft ok"
