"""benchmarks/cpu_by_process.py: a process's CPU-seconds read from outside it, and the row
each of a run's processes is counted in (the launch benchmark's per-process table)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
from cpu_by_process import Sampler, Seen, row_of, spent, split  # noqa: E402

BURN = "import time\nend = time.process_time() + 0.4\nwhile time.process_time() < end: pass\n"


def test_a_child_s_cpu_is_counted_between_two_instants() -> None:
    with Sampler(every=0.05) as seen:
        started = time.time()
        child = subprocess.Popen([sys.executable, "-c", BURN + "time.sleep(0.3)"])
        child.wait()
        ended = time.time()
    rows = spent(seen, child.pid, started, ended)
    assert 0.35 <= rows["driver"] <= 1.5, rows  # the burn, and the interpreter's start
    before, after = split(seen, [child.pid], started, started, ended)
    assert before == 0.0 and after == rows["driver"]
    assert spent(seen, child.pid, ended, ended + 1) == {}  # nothing after its end


def test_each_process_is_counted_in_its_row() -> None:
    def one(title: str, parent: int = 1) -> Seen:
        return Seen(created=0.0, parent=parent, titles=[title], at=[1.0], cpu=[1.0])

    processes = {
        10: one("python -m raylift.cli train quickstart.yaml"),
        11: one("ray::TrainController.run"),
        12: Seen(
            0.0,
            1,
            [
                "python .../default_worker.py --x",
                "ray::IDLE    ",
                "ray::RayTrainWorker.run_train_fn",
            ],
            [1.0],
            [1.0],
        ),
        13: one("ray::Store"),
        14: one("/venv/lib/python3.11/site-packages/ray/core/src/ray/gcs/gcs_server --x"),
        15: one("/venv/bin/python .../ray/dashboard/agent.py --node-ip-address=..."),
        16: one("ray::IDLE"),
        17: one("some helper", parent=13),
    }
    rows = {pid: row_of(pid, processes, driver=10) for pid in processes}
    assert rows == {
        10: "driver",
        11: "Train controller",
        12: "worker 12",
        13: "actor or task Store",
        14: "Ray's GCS",
        15: "Ray's dashboard agent",
        16: "Ray's idle worker processes",
        17: "actor or task Store",  # a child without a title of its own: its parent's row
    }


def test_cpu_is_interpolated_between_samples_and_starts_at_zero() -> None:
    s = Seen(created=10.0, parent=1, titles=["x"], at=[11.0, 13.0], cpu=[1.0, 2.0])
    assert s.cpu_at(9.0) == 0.0
    assert s.cpu_at(10.5) == 0.5  # between its start (0 CPU-s) and the first sample
    assert s.cpu_at(12.0) == 1.5
    assert s.cpu_at(20.0) == 2.0  # ended: its last sample stands
