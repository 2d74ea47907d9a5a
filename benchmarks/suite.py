"""The test suite as CI and a new contributor run it: a fresh clone of the current commit,
``bash .ci/run`` (a new virtual environment, everything installed, the caches empty),
timed as a whole and as its pytest run, with pytest's count and its slowest tests. The
README's line on the suite's length is rendered from this file's result.

    python benchmarks/suite.py                 # --slowest 20
    python benchmarks/suite.py --quick         # the quick lane (-m "not slow") instead
    python benchmarks/suite.py --log OUT --commit C --seconds S --exit E   # a run made by hand
    ... --ci-seconds S --ci-commit C    # beside it, CI's time for the last commit it ran

CI's machines are slower than some of this kind: its time is kept beside the run's, as
the measure of the 30-minute goal on the slower machines.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import save

REPO = Path(__file__).resolve().parents[1]
COUNTS = re.compile(r"=+ (?P<counts>(?:\d+ \w+(?:, )?)+) in (?P<seconds>[\d.]+)s")
DURATION = re.compile(r"^(?P<s>[\d.]+)s (?P<phase>call|setup|teardown)\s+(?P<test>\S+)", re.M)


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {seconds % 60:.0f} s"


def clone(into: Path) -> str:
    """A clone of this checkout's HEAD into ``into``; its commit."""
    subprocess.run(["git", "clone", "-q", str(REPO), str(into)], check=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=into, check=True,
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    return head


def run(folder: Path, quick: bool) -> tuple[float, str, int]:
    """``bash .ci/run`` in ``folder`` (its pytest with ``-m "not slow"`` where ``quick``):
    seconds, output, exit code."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "RAY_ADDRESS")}
    env["RAYLIFT_TEST_CACHE"] = tempfile.mkdtemp(prefix="raylift-suite-cache-")
    # Every phase's time, not only the slowest, and the worker each test ran on (-v): the
    # lanes' totals come from them.
    env["PYTEST_ADDOPTS"] = ('-m "not slow" ' if quick else "") + "--durations=0 -v"
    started = time.perf_counter()
    done = subprocess.run(["bash", ".ci/run"], cwd=folder, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)  # fmt: skip
    return time.perf_counter() - started, done.stdout, done.returncode


def counted(output: str) -> tuple[dict[str, int], float]:
    """pytest's closing count (``{"passed": 519, "skipped": 9}``) and its seconds."""
    found = list(COUNTS.finditer(output))
    if not found:
        raise SystemExit("no pytest summary in the output:\n" + output[-3000:])
    last = found[-1]
    counts = {w: int(n) for n, w in re.findall(r"(\d+) (\w+)", last["counts"])}
    return counts, float(last["seconds"])


def slowest(output: str, n: int) -> list[list[str]]:
    """The ``n`` slowest test phases pytest listed (``--durations``)."""
    rows = [(float(m["s"]), m["phase"], m["test"]) for m in DURATION.finditer(output)]
    return [[f"{s:.1f} s", phase, test] for s, phase, test in sorted(rows, reverse=True)[:n]]


RAN_ON = re.compile(r"^\[(?P<worker>gw\d+)\] \[ *\d+%\] \w+ (?P<test>\S+)", re.M)


def own_ray_files() -> tuple[str, ...]:
    """The scenarios that start Rays of their own, the Ray lane's last: tests/conftest.py's
    ``OWN_RAY``, read from its source (importing the conftest would import torch)."""
    tree = ast.parse((REPO / "tests" / "conftest.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "OWN_RAY" for t in node.targets
        ):
            return tuple(ast.literal_eval(node.value))
    raise SystemExit("tests/conftest.py defines no OWN_RAY: the lanes cannot be told apart")


OWN_RAY = own_ray_files()


def lanes(output: str) -> list[list[str]]:
    """The seconds of test phases on each of the two workers (as ``-v`` names them, else
    by the group in the test's id): the one that ran the tests on Ray (in order: the
    suite's longest path), the scenarios with Rays of their own among them, and the other."""
    worker = {m["test"]: m["worker"] for m in RAN_ON.finditer(output)}
    ray = {w for t, w in worker.items() if t.endswith("@ray")}
    totals = {"on Ray (one worker, in order)": 0.0,
              "of it, the scenarios with Rays of their own (last)": 0.0,
              "the rest (the other worker)": 0.0}  # fmt: skip
    for m in DURATION.finditer(output):
        test, s = m["test"], float(m["s"])
        on_ray = worker[test] in ray if test in worker else test.endswith("@ray")
        totals["on Ray (one worker, in order)" if on_ray else "the rest (the other worker)"] += s
        if test.split("::")[0].rpartition("/")[2] in OWN_RAY:
            totals["of it, the scenarios with Rays of their own (last)"] += s
    return [[lane, minutes(s)] for lane, s in totals.items()]


def ci_row(seconds: float | None, commit: str | None) -> list[list[str]]:
    """CI's time for its last run of the suite (install included), where given."""
    if seconds is None:
        return []
    return [["in CI", f"{minutes(seconds)} with the install, at {commit}"]]


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--slowest", type=int, default=20)
    args.add_argument("--quick", action="store_true", help='only -m "not slow"')
    args.add_argument(
        "--log", type=Path,
        help="render a run made by hand instead (a fresh clone's bash .ci/run with "
        "PYTEST_ADDOPTS=--durations=0, its whole output); with --commit, --seconds, --exit",
    )  # fmt: skip
    args.add_argument("--commit", help="with --log: the clone's commit")
    args.add_argument("--seconds", type=float, help="with --log: bash .ci/run's seconds")
    args.add_argument("--exit", type=int, help="with --log: bash .ci/run's exit code")
    args.add_argument("--ci-seconds", type=float, help="CI's seconds for --ci-commit")
    args.add_argument("--ci-commit", help="the last commit CI ran the suite on")
    opts = args.parse_args()
    if (opts.ci_seconds is None) != (opts.ci_commit is None):
        raise SystemExit("--ci-seconds and --ci-commit go together")
    if opts.log:
        if None in (opts.commit, opts.seconds, opts.exit):
            raise SystemExit("--log needs --commit, --seconds and --exit")
        commit, seconds, code = opts.commit, opts.seconds, opts.exit
        output = opts.log.read_text()
    else:
        with tempfile.TemporaryDirectory(prefix="raylift-suite-") as tmp:
            commit = clone(Path(tmp) / "raylift")
            seconds, output, code = run(Path(tmp) / "raylift", opts.quick)
        log = Path(tempfile.gettempdir()) / f"raylift-suite-{'quick' if opts.quick else 'full'}.log"
        log.write_text(output)  # whole: a failure's traceback is far above the summary
        print(f"the whole output: {log}")
    counts, pytest_s = counted(output)
    print(output[-6000:])
    lane = "the quick lane" if opts.quick else "the whole suite"
    summary = ", ".join(f"{n} {w}" for w, n in counts.items())
    save(
        __file__,
        f"{lane} from a fresh clone of {commit}: bash .ci/run, caches empty",
        ["measure", "value"],
        [
            ["commit", commit],
            ["exit", str(code)],
            ["tests", summary],
            ["pytest", minutes(pytest_s)],
            ["with the install", minutes(seconds)],
            *ci_row(opts.ci_seconds, opts.ci_commit),
        ],
        {
            "what": f"{lane}, a fresh clone's bash .ci/run, caches empty",
            "raylift": f"{summary} in {minutes(pytest_s)}",
            "baseline": "-",
            "ratio": "-",
        },
        tables=[
            {
                "title": f"the {opts.slowest} slowest test phases",
                "columns": ["seconds", "phase", "test"],
                "rows": slowest(output, opts.slowest),
            },
            {
                "title": "the test phases' seconds by lane (of two workers)",
                "columns": ["lane", "seconds"],
                "rows": lanes(output),
            },
        ],
        variant="quick" if opts.quick else None,
    )
    if code != 0:
        raise SystemExit(f"bash .ci/run exited {code}")


if __name__ == "__main__":
    main()
