"""``raylift doctor`` on runs built to have one bottleneck each, on the session's local Ray.

For each case the doctor must name the intended bottleneck, and the run with its
first suggestion applied must be faster (``samples_per_s`` of the measured window).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raylift.cli import main as cli_main
from raylift.config import load_config
from raylift.doctor import PREFIX, DoctorResult, run_doctor

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"
STEPS = 40  # per window: 3 x 40 steps, a few seconds of training after Ray's start-up

CASES = {
    # The plain quickstart: small CNN, batch 32 -- fixed per-step costs weigh.
    "plain": ([], "compute-bound"),
    # Logging (a host sync, two collectives and an MLflow write) after every step.
    "sync": (["train.log_every_n_steps=1"], "host-sync-bound"),
    # A 15 ms host transform per batch and no prefetching: the step waits for it.
    "input": (
        ["task=tests.bottlenecks:SlowInputDigits", "data.prefetch_batches=0"],
        "input-bound",
    ),
}


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One storage (and so one set of prepared shards per task) for every case."""
    return tmp_path_factory.mktemp("doctor")


def overrides(home: Path, extra: list[str]) -> list[str]:
    return [f"storage={home / 'runs'}", f"tracking.uri=sqlite:///{home / 'mlflow.db'}", *extra]


def doctor(home: Path, extra: list[str]) -> DoctorResult:
    return run_doctor(load_config(QUICKSTART, overrides(home, extra)), steps=STEPS)


def check_outputs(home: Path, verdict: dict) -> None:
    """Trace, chart and verdict in the run folder and in MLflow; the metrics in MLflow."""
    import matplotlib.image
    from mlflow.tracking import MlflowClient

    folder = verdict["folder"]
    trace = json.loads((folder / "trace-rank0.json").read_text())
    assert trace["traceEvents"], "empty Chrome trace"
    image = matplotlib.image.imread(folder / "breakdown.png")
    assert image.shape[0] > 300 and image.shape[1] > 800
    client = MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
    exp = client.get_experiment_by_name("raylift")
    (run,) = client.search_runs([exp.experiment_id], f"tags.mlflow.runName = '{verdict['name']}'")
    logged = {a.path for a in client.list_artifacts(run.info.run_id, "doctor")}
    assert logged == {"doctor/trace-rank0.json", "doctor/breakdown.png", "doctor/verdict.json"}
    assert run.data.tags["raylift.doctor.verdict"] == verdict["verdict"]
    for key in (
        "step_forward_frac",
        "step_backward_frac",
        "step_optimizer_frac",
        "step_sync_frac",
        "data_wait_frac",
        "samples_per_s",
        "mfu",
        "mem_rss_bytes",
        "step_time_s",
    ):
        assert key in run.data.metrics, key


def doctor_command(home: Path, extra: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    """``raylift doctor``, as a user runs it; returns the verdict.json it wrote."""
    code = cli_main(["doctor", str(QUICKSTART), "--steps", str(STEPS), *overrides(home, extra)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "verdict: " in out and "what to change, by expected gain:" in out
    folder = Path(out.split("trace, chart and verdict in ")[1].split(" and MLflow run ")[0])
    return json.loads((folder / "verdict.json").read_text()) | {"folder": folder}


@pytest.mark.parametrize("case", list(CASES))
def test_doctor_names_the_bottleneck_and_its_first_fix_is_faster(
    ray_cluster: str, home: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    extra, intended = CASES[case]
    before = doctor_command(home, extra, capsys)
    print(f"{case}: {before['verdict']}; " + "; ".join(before["evidence"]))
    assert before["verdict"] == intended, before["evidence"]
    first = before["suggestions"][0]
    assert first["key"] != "code", f"the first suggestion must be a config change: {first}"
    check_outputs(home, before)
    change = f"{first['key']}={first['value']}"
    after = doctor(home, [*extra, change])
    rate = (before["metrics"][PREFIX + "samples_per_s"], after.metrics[PREFIX + "samples_per_s"])
    with capsys.disabled():
        print(
            f"\n{case}: {before['verdict']}, first fix {change}: {rate[0]:,.0f} -> "
            f"{rate[1]:,.0f} samples/s ({rate[1] / rate[0]:.2f}x, expected ~{first['gain']:.2f}x)"
        )
    assert rate[1] > 1.1 * rate[0], (first, rate)
