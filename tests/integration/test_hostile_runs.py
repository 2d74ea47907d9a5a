"""Hostile files end to end, through the CLI on the session's Ray: a DeepSpeed run whose
newest checkpoint was planted as an attacker plants it (the seal recomputed): every
command refuses with one line naming the file and the global, exit 2, and the run's
other checkpoints stay as they were; a sweep whose saved state was: its resume never
unpickles it. No payload runs. The matrix of payloads x files x strategies x commands:
tests/unit/test_hostile.py."""

from __future__ import annotations

import binascii
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from raylift.cli import main as cli_main
from tests.hostile import BY_NAME, PAYLOADS, armed, digests, markers, marks_in, plant

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"
SWEEP = REPO / "configs" / "sweep-digits.yaml"
RUNSTRING = "numpy.testing._private.utils.runstring"


@pytest.fixture
def marks(tmp_path: Path) -> Iterator[Path]:
    with marks_in(tmp_path) as folder:
        yield folder


def test_a_planted_deepspeed_checkpoint_stops_verify_export_and_the_resume(
    ray_cluster: str, in_tmp: Path, marks: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """ZeRO-2, fp32, 4 steps of the quickstart; numpy's ``runstring`` (an exec) planted in
    each rank's optimizer file of the newest checkpoint, each rank's list recomputed.
    ``raylift verify`` and ``raylift export`` exit 2 naming the file and the global, and
    ``raylift train`` with the same name (a resume) too: it does not fall back to the
    checkpoint before, and changes nothing in the run's folder."""
    train = ["train", str(QUICKSTART), "name=hostile", "strategy.name=deepspeed",
             "strategy.zero_stage=2", "precision=32", "train.max_steps=4",
             "train.log_every_n_steps=2", "checkpoint.every_n_steps=2", "task_args.width=8",
             "tracking.log_model=none"]  # fmt: skip
    assert cli_main(train) == 0, capsys.readouterr().err
    run = in_tmp / "runs" / "hostile"
    newest = run / "checkpoint-step00000004"
    for part in sorted((newest / "engine" / "state").glob("*optim_states.pt")):
        plant(newest, str(part.relative_to(newest)), armed(BY_NAME["runstring"], marks))
    before = {c.name: digests(c) for c in run.glob("checkpoint-step*")}
    capsys.readouterr()

    assert cli_main(["verify", str(run)]) == 2
    out = capsys.readouterr()
    assert "checkpoint-step00000002: intact" in out.out
    assert f"checkpoint-step00000004: refusing to open {newest}/engine/state/" in out.out
    assert f"_optim_states.pt: its pickle calls {RUNSTRING}, which no checkpoint holds" in out.out

    assert cli_main(["export", str(run), "--out", str(in_tmp / "m.safetensors")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"raylift: refusing to open {newest}/engine/state/"), err
    assert f"its pickle calls {RUNSTRING}" in err[-1] and not (in_tmp / "m.safetensors").exists()

    assert cli_main(train) == 2
    err = capsys.readouterr().err.strip().splitlines()
    line = next(x for x in err if "refusing to open" in x)
    assert line.startswith(
        f"raylift: training run 'hostile' failed: refusing to open {newest}/engine/state/"
    ), err
    assert f"_optim_states.pt: its pickle calls {RUNSTRING}, which no checkpoint holds" in line
    assert {c.name: digests(c) for c in run.glob("checkpoint-step*")} == before
    assert not markers(marks)


# ---------------------------------------------------------------- a sweep's state


def sweep_args(tmp: Path) -> list[str]:
    raw = yaml.safe_load(SWEEP.read_text())
    raw["tune"].update(num_samples=1, max_concurrent=1)  # one trial: its files are Tune's all
    raw["train"].update(max_epochs=1, log_every_n_steps=20)
    path = tmp / "sweep.yaml"
    path.write_text(yaml.safe_dump(raw))
    return ["tune", str(path), "name=hostile-sweep", "task_args.width=8"]


def plant_sweep(folder: Path, payloads: Iterator[Any]) -> list[str]:
    """A payload planted in every pickle Tune saved for the sweep (and an ``error.pkl``
    in a trial's folder, which Tune's results read), as an attacker edits them; the
    files planted."""
    import ray.cloudpickle as cloudpickle

    planted = []
    for path in sorted(folder.glob("*")):
        if path.name == "tuner.pkl" or path.name.startswith("basic-variant-state-"):
            state = cloudpickle.loads(path.read_bytes())  # the sweep's own, just written
            state["planted"] = next(payloads)
            path.write_bytes(cloudpickle.dumps(state))
        elif path.name.startswith("experiment_state-"):
            state = json.loads(path.read_text())
            trial = json.loads(state["trial_data"][0][0])
            trial["results"] = binascii.hexlify(cloudpickle.dumps(next(payloads))).decode()
            state["trial_data"][0][0] = json.dumps(trial)
            path.write_text(json.dumps(state))
        elif path.is_dir():
            (path / "error.pkl").write_bytes(cloudpickle.dumps(next(payloads)))
        else:
            continue
        planted.append(path.name)
    return planted


def test_a_resumed_sweep_never_unpickles_what_tune_saved(
    ray_cluster: str, in_tmp: Path, marks: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real sweep, then a payload planted in each pickle Ray Tune saved for it (the
    tuner, the variant generator's state, a trial's fields in the experiment state, an
    ``error.pkl``): rerunning the sweep resumes it from raylift's own record (JSON), every
    trial found finished and its result reported again, and no payload runs."""
    args = sweep_args(in_tmp)
    assert cli_main(args) == 0, capsys.readouterr().err
    first = capsys.readouterr().out
    folder = in_tmp / "runs" / "hostile-sweep"
    payloads = iter([armed(p, marks) for p in PAYLOADS] * 4)
    planted = plant_sweep(folder, payloads)
    assert {"tuner.pkl"} < set(planted) and len(planted) >= 4, planted
    assert cli_main(args) == 0
    again = capsys.readouterr()
    assert "resuming" in again.out + again.err
    table = [line for line in first.splitlines() if re.match(r"[0-9a-f]{5}_\d{5} ", line)]
    assert len(table) == 1 and table == [
        line for line in again.out.splitlines() if re.match(r"[0-9a-f]{5}_\d{5} ", line)
    ], again.out
    assert not markers(marks)
