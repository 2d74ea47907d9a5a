"""``raylift doctor`` on runs built to have one bottleneck each, on the session's local Ray.

For each case the doctor must name the intended bottleneck and put a config change
first. Whether that change makes the run faster is a speed claim, measured by
``benchmarks/doctor.py`` rather than asserted here (a loaded machine would flip it).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from raylift.cli import main as cli_main
from raylift.core import storage
from tests.bottlenecks import CASES

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"
STEPS = 40  # per window: 3 x 40 steps, a few seconds of training after Ray's start-up


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One storage (and so one set of prepared shards per task) for every case."""
    return tmp_path_factory.mktemp("doctor")


def overrides(home: Path, extra: list[str], where: str | None = None) -> list[str]:
    runs = where or home / "runs"
    return [f"storage={runs}", f"tracking.uri=sqlite:///{home / 'mlflow.db'}", *extra]


def check_outputs(home: Path, verdict: dict) -> None:
    """Trace, chart and verdict in the run folder and in MLflow; the metrics in MLflow."""
    import matplotlib.image
    from mlflow.tracking import MlflowClient

    folder = verdict["folder"]  # local, or in the object store
    trace = json.loads(storage.read_text(storage.join(folder, "trace-rank0.json")) or "{}")
    assert trace["traceEvents"], "empty Chrome trace"
    png = storage.read_bytes(storage.join(folder, "breakdown.png")) or b""
    image = matplotlib.image.imread(io.BytesIO(png), format="png")
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


def doctor_command(
    home: Path, extra: list[str], capsys: pytest.CaptureFixture[str], where: str | None = None
) -> dict:
    """``raylift doctor``, as a user runs it; returns the verdict.json it wrote."""
    args = overrides(home, extra, where)
    code = cli_main(["doctor", str(QUICKSTART), "--steps", str(STEPS), *args])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "verdict: " in out and "what to change, by expected gain:" in out
    folder = out.split("trace, chart and verdict in ")[1].split(" and MLflow run ")[0]
    if where:
        assert folder.startswith(where), folder
    return json.loads(storage.read_text(storage.join(folder, "verdict.json")) or "{}") | {
        "folder": folder
    }


@pytest.mark.parametrize("case", list(CASES))
def test_doctor_names_the_bottleneck_and_a_config_change_first(
    ray_cluster: str,
    home: Path,
    case: str,
    capsys: pytest.CaptureFixture[str],
    request: pytest.FixtureRequest,
) -> None:
    """The last case's run is on the S3 server: its trace, chart and verdict go there."""
    extra, intended = CASES[case]
    where = None
    if case == list(CASES)[-1]:
        request.getfixturevalue("s3_server")
        where = f"s3://runs/{home.name}"
    verdict = doctor_command(home, extra, capsys, where)
    assert verdict["verdict"] == intended, verdict["evidence"]
    first = verdict["suggestions"][0]
    assert first["key"] != "code", f"the first suggestion must be a config change: {first}"
    assert first["gain"] > 1.0, first
    check_outputs(home, verdict)
