"""Files that someone else can write, made hostile as an attacker makes them.

A payload is a pickled call that would run code (``exec``, ``eval``, ``os.system``,
``torch.hub.load``, ``torch.utils.cpp_extension.load_inline``, numpy's ``runstring``, a
module import); each, if it ever ran, writes a marker file. They are planted in real
checkpoints of every strategy (the engine's files, DCP's ``.metadata`` and items, the
loop state, the RNG files), each checkpoint's seal recomputed with raylift's own
``_listed`` so that every checksum passes, and every command that opens the folder is
tried: ``raylift verify``, ``raylift export``, a resume on two ranks, a resume from a
memory snapshot. Each refuses with one line naming the file and the global; no marker
is ever written, and no file of the run is changed. A sweep's state and a model folder
are tried the same way (tests/integration/test_hostile_runs.py: the CLI end to end).
"""

from __future__ import annotations

import io
import json
import pickle
import shutil
import sys
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from raylift.core.errors import RefusedPickle
from raylift.tensors.checkpoints import verify_checkpoint
from raylift.tensors.lazytorch import load_lazy
from raylift.tensors.pickles import CHECKPOINT, check, check_torch_file, load_pickle, load_torch
from tests.helpers import make_config, run_ranks, train_keep_checkpoints
from tests.hostile import (
    BY_NAME,
    PAYLOAD_NAMES,
    PAYLOADS,
    Payload,
    armed,
    digests,
    markers,
    marks_in,
    plant,
)


@pytest.fixture
def marks(tmp_path: Path) -> Iterator[Path]:
    with marks_in(tmp_path) as folder:
        yield folder


# ---------------------------------------------------------------- the payloads are real


@pytest.mark.parametrize("name", [p.name for p in PAYLOADS if p.runnable])
def test_each_payload_runs_its_code_when_unpickled_plainly(tmp_path: Path, name: str) -> None:
    """What ``pickle.load`` (or ``torch.load(weights_only=False)``) of a planted file did:
    the payload runs. (load_inline's is not run here: it compiles C++ for a minute.)"""
    folder = tmp_path / "marks"
    folder.mkdir()
    sys.path.insert(0, str(folder))
    try:
        pickle.loads(pickle.dumps(armed(BY_NAME[name], folder), protocol=2))
    finally:
        sys.path.remove(str(folder))
        for module in folder.glob("planted_*.py"):
            sys.modules.pop(module.stem, None)
    assert markers(folder) == [f"marker-{name}"]


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
@pytest.mark.parametrize("name", PAYLOAD_NAMES)
def test_every_payload_is_refused_in_every_pickle_protocol(
    marks: Path, name: str, protocol: int
) -> None:
    payload = BY_NAME[name]
    data = pickle.dumps({"weights": [1.0], "x": armed(payload, marks)}, protocol=protocol)
    with pytest.raises(RefusedPickle) as refused:
        check(data, "s3://b/runs/x/f.pt")
    assert str(refused.value).startswith(
        f"refusing to open s3://b/runs/x/f.pt: its pickle calls {payload.first}, which no "
        "checkpoint holds; nothing of it was run"
    )
    with pytest.raises(RefusedPickle):
        load_pickle(data, "f")
    saved = io.BytesIO()
    torch.save({"w": torch.ones(2), "x": armed(payload, marks)}, saved)
    for load in (load_torch, load_lazy):
        with pytest.raises(RefusedPickle, match=f"f.pt: its pickle calls {payload.first},"):
            load(io.BytesIO(saved.getvalue()), "f.pt")


def test_the_list_is_pairs_of_objects_that_exist_and_loads_what_torch_saves() -> None:
    """Every entry names one object (a module and a name in it: no prefix admits a
    package), and a file of every dtype raylift exports loads under the list."""
    import deepspeed  # noqa: F401  (its entries resolve only once it is there)

    from raylift.tensors.pickles import _resolve
    from raylift.tensors.streaming import CODES

    for module, name in sorted(CHECKPOINT):
        assert "." not in name and not name.endswith("*"), (module, name)
        assert _resolve(module, name) is not None, (module, name)
    for dtype in CODES:
        saved = io.BytesIO()
        torch.save({"t": torch.zeros(3, dtype=dtype)}, saved)
        saved.seek(0)
        assert load_torch(saved, "t.pt")["t"].dtype == dtype
        assert load_lazy(io.BytesIO(saved.getvalue()), "t.pt")["t"].load().dtype == dtype


def test_an_archive_two_readers_would_read_differently_is_refused(marks: Path) -> None:
    """torch.load reads a zip only where the file starts with one, and reads its directory
    where the end record says; Python's zipfile finds a zip anywhere and shifts offsets.
    A file built to be checked one way and loaded the other is refused, and a file that is
    no archive at all is damage (the resume passes over it), not run."""
    hostile = pickle.dumps(armed(BY_NAME["exec"], marks), protocol=2)
    benign = io.BytesIO()
    torch.save({"w": torch.ones(2)}, benign)
    zipped = benign.getvalue()
    for built in (
        hostile + zipped,  # an old-format pickle for torch, a clean zip for zipfile
        b"PK\x03\x04" + b"\0" * 26 + zipped,  # the zip shifted behind a fake record
    ):
        with pytest.raises(RefusedPickle, match=r"which torch\.save never writes"):
            check_torch_file(io.BytesIO(built), "f.pt")
    twice = io.BytesIO()
    with zipfile.ZipFile(twice, "w") as z, pytest.warns(UserWarning, match="Duplicate"):
        z.writestr("archive/data.pkl", pickle.dumps({"w": 1}, protocol=2))
        z.writestr("archive/data.pkl", hostile)
    with pytest.raises(RefusedPickle, match="lists a member twice"):
        check_torch_file(twice, "f.pt")
    with pytest.raises(zipfile.BadZipFile):
        check_torch_file(io.BytesIO(zipped[: len(zipped) // 2]), "f.pt")


# ---------------------------------------------------------------- real checkpoints

ZERO3 = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
STRATEGIES = {
    "ddp": {"name": "ddp"},
    "fsdp": {"name": "fsdp"},
    "fairscale": {"name": "fairscale"},
    "zero2": {"name": "deepspeed", "zero_stage": 2},
    "zero3": {"name": "deepspeed", "zero_stage": 3, "config": ZERO3},
}
DCP_FILES = ["loop_state.pt", "rng-rank1.pt", "engine/.metadata", "bytes-item", "tensor-item"]
FILES = {
    "ddp": DCP_FILES,
    "fsdp": DCP_FILES,
    "fairscale": ["loop_state.pt", "rng-rank0.pt", "engine/consolidated.pt"],
    "zero2": [
        "loop_state.pt",
        "rng-rank1.pt",
        "engine/state/mp_rank_00_model_states.pt",
        "engine/state/zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "engine/state/zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ],
    "zero3": [
        "loop_state.pt",
        "rng-rank0.pt",
        "engine/state/zero_pp_rank_0_mp_rank_00_model_states.pt",
        "engine/state/zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ],
}
CASES = [(s, f) for s in STRATEGIES for f in FILES[s]]
NEWEST, OLDER = "checkpoint-step00000004", "checkpoint-step00000002"


def run_config(strategy: str) -> dict[str, Any]:
    return make_config(
        strategy=STRATEGIES[strategy],
        train={"max_steps": 4, "log_every_n_steps": 2},
        checkpoint={"every_n_steps": 2},
    ).to_dict()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Each strategy's run folder (checkpoints at steps 2 and 4), trained once for the
    module on two ranks, the first time a test asks for it."""
    made: dict[str, Path] = {}

    def run(strategy: str) -> Path:
        if strategy not in made:
            root = tmp_path_factory.mktemp(f"run-{strategy}")
            run_ranks(2, root, train_keep_checkpoints, run_config(strategy), str(root / "run"))
            made[strategy] = root / "run"
        return made[strategy]

    return run


def planted_run(runs: Callable[[str], Path], strategy: str, file: str, payload: Any,
                into: Path) -> tuple[Path, str]:  # fmt: skip
    """A copy of the strategy's run with ``payload`` planted in ``file`` of its newest
    checkpoint and the seal recomputed; the copy and the planted file's name."""
    run = into / "run"
    shutil.copytree(runs(strategy), run)
    name = plant(run / NEWEST, file, payload)
    return run, name


def refused_line(exc: BaseException, ckpt: Path, file: str, payload: Payload) -> None:
    said = str(exc)
    assert said.startswith(f"refusing to open {ckpt}/{file}"), said
    assert f": its pickle calls {payload.first}, which no checkpoint holds;" in said, said
    assert "\n" not in said


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "file"), CASES)
def test_verify_and_export_refuse_every_payload_in_every_file(
    runs: Callable[[str], Path], tmp_path: Path, marks: Path, strategy: str, file: str
) -> None:
    """Each payload planted in the file, the checksums recomputed: ``raylift verify`` and
    ``raylift export`` refuse the checkpoint naming the file and the global, the export
    falls back to no older checkpoint and writes nothing, and no file of the run changes."""
    from raylift.artifacts.export import export
    from raylift.cli import main as cli_main

    for payload in PAYLOADS:
        run, name = planted_run(
            runs, strategy, file, armed(payload, marks), tmp_path / payload.name
        )
        before = digests(run)
        with pytest.raises(RefusedPickle) as refused:
            verify_checkpoint(str(run / NEWEST))
        refused_line(refused.value, run / NEWEST, name, payload)
        verify_checkpoint(str(run / OLDER))  # the one before is intact, and left alone
        out = tmp_path / payload.name / "m.safetensors"
        with pytest.raises(RefusedPickle) as refused:
            export(str(run), out)
        refused_line(refused.value, run / NEWEST, name, payload)
        assert not out.exists()
        assert cli_main(["verify", str(run)]) == 2
        assert cli_main(["export", str(run), "--out", str(out)]) == 2
        assert digests(run) == before
        assert not markers(marks), (payload.name, markers(marks))


def resume_refused(rank: int, world: int, cfg_dict: dict, ckpt: str, out: str) -> None:
    """In a pool rank: resume from ``ckpt`` as a worker does; what happened, by rank."""
    from raylift.validation import config_from_dict
    from tests.helpers import LocalReporter, make_trainer

    trainer = make_trainer(config_from_dict(cfg_dict), rank, world, LocalReporter(Path(out)))
    try:
        trainer.restore(ckpt)
        said = "restored"
    except RefusedPickle as exc:
        said = f"refused: {exc}"
    except Exception as exc:  # reported to the test, which fails on it
        said = f"{type(exc).__name__}: {exc}"
    Path(f"{out}.{rank}").write_text(said)


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "file"), CASES)
def test_a_resume_refuses_the_planted_file_on_every_rank(
    runs: Callable[[str], Path], tmp_path: Path, marks: Path, strategy: str, file: str
) -> None:
    """Resumed on two ranks through the worker's restore: every rank refuses with the
    one line (the file is read by one rank or both; the verdict is collective), nothing
    runs and nothing is loaded from the checkpoint before it. One payload per file, in
    turn, so that every payload meets a resume."""
    payload = PAYLOADS[CASES.index((strategy, file)) % len(PAYLOADS)]
    run, name = planted_run(runs, strategy, file, armed(payload, marks), tmp_path)
    before = digests(run)
    out = tmp_path / "said"
    run_ranks(2, tmp_path, resume_refused, run_config(strategy), str(run / NEWEST), str(out))
    for rank in range(2):
        said = Path(f"{out}.{rank}").read_text()
        assert said.startswith("refused: "), said
        refused_line(RefusedPickle(said.removeprefix("refused: ")), run / NEWEST, name, payload)
    assert digests(run) == before


@pytest.mark.slow
@pytest.mark.parametrize("file", ["rng-rank1.pt", "engine/state/mp_rank_00_model_states.pt"])
def test_a_memory_snapshot_is_refused_as_storage_is(
    runs: Callable[[str], Path], tmp_path: Path, marks: Path, file: str
) -> None:
    """A snapshot's parts, held by a keeper as bytes and fetched into a scratch folder,
    restore through the same reader: a planted part is refused on every rank (the
    restart does not fall back to storage in silence)."""
    from raylift.run.snapshots import Keeper

    payload = BY_NAME["runstring"]
    run, name = planted_run(runs, "zero2", file, armed(payload, marks), tmp_path / "src")
    keeper, ckpt = Keeper(keep=2), run / NEWEST
    for rank in range(2):
        part = json.loads((ckpt / f"complete-rank{rank}.json").read_text())
        files = {n: (ckpt / n).read_bytes() for n in [*part, f"complete-rank{rank}.json"]}
        keeper.hold(4, rank, 2, "node-a", files)
    fetched = tmp_path / "snapshot"
    for rank in range(2):  # as Snapshots.fetch writes every rank's part
        for n, data in keeper.give(4, rank).items():
            (fetched / n).parent.mkdir(parents=True, exist_ok=True)
            (fetched / n).write_bytes(data)
    out = tmp_path / "said"
    run_ranks(2, tmp_path, resume_refused, run_config("zero2"), str(fetched), str(out))
    for rank in range(2):
        said = Path(f"{out}.{rank}").read_text()
        assert said.startswith("refused: "), said
        refused_line(RefusedPickle(said.removeprefix("refused: ")), fetched, name, payload)


# ---------------------------------------------------------------- model.weights


def test_a_weights_folder_is_read_as_safetensors_only(tmp_path: Path, marks: Path) -> None:
    """``model.weights`` (a folder, or a logged model fetched from MLflow into one) is
    read as safetensors: a hostile ``pytorch_model.bin`` beside the weights is never
    opened, one alone is refused, and an index that maps the weights into it is refused
    when its header is read. No payload runs."""
    from safetensors.torch import save_file

    from raylift.tasks import build_task
    from raylift.tensors.preflight import check_for_config
    from raylift.tensors.weights import WeightsError, weight_files

    cfg = make_config()
    task = build_task(cfg.task, cfg.task_args)
    weights = {k: v.contiguous() for k, v in task.build_model().state_dict().items()}
    for payload in PAYLOADS:
        folder = tmp_path / payload.name
        folder.mkdir()
        torch.save({"planted": armed(payload, marks)}, folder / "pytorch_model.bin")
        with pytest.raises(WeightsError, match=r"neither a \.safetensors file nor a folder"):
            check_for_config(cfg, task, str(folder))
        index = {"metadata": {}, "weight_map": {k: "pytorch_model.bin" for k in weights}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(WeightsError, match=r"pytorch_model\.bin"):
            check_for_config(cfg, task, str(folder))
        (folder / "model.safetensors.index.json").unlink()
        save_file(weights, str(folder / "model.safetensors"))
        check_for_config(cfg, task, str(folder))  # the safetensors alone
        assert set(weight_files(str(folder)).values()) == {str(folder / "model.safetensors")}
    assert not markers(marks)
