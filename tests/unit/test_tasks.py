from __future__ import annotations

import math
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from raylift.tasks import build_task, resolve_task, task_problems
from raylift.tasks.gpt import GPTTask, corpus_files


def test_digits_stays_uint8_until_the_device() -> None:
    task = build_task("digits", {})
    src = task.sources()
    assert len(src["train"]["label"]) + len(src["val"]["label"]) == 1797
    out = task.preprocess({k: v[:16] for k, v in src["train"].items()})
    assert out["image"].dtype == np.uint8 and out["image"].max() <= 255
    batch = task.finish({k: torch.from_numpy(v) for k, v in out.items()}, torch.float32)
    assert batch["image"].shape == (16, 1, 8, 8) and batch["image"].dtype == torch.float32
    assert abs(float(batch["image"].mean())) < 1.0
    model = task.build_model()
    with torch.no_grad():
        sums = task.eval_sums(model, batch)
    metrics = task.summarize({k: float(v) for k, v in sums.items()})
    assert 0 <= metrics["val_acc"] <= 1 and metrics["val_loss"] > 0


def test_gpt_split_is_by_file_and_deterministic(tmp_path: Path) -> None:
    for i in range(40):
        (tmp_path / f"m{i}.py").write_text(f"x = {i}\n" * 50)
    a = GPTTask(corpus=str(tmp_path), block_size=16, max_bytes=None, val_percent=20).sources()
    b = GPTTask(corpus=str(tmp_path), block_size=16, max_bytes=None, val_percent=20).sources()
    assert list(a["val"]["path"]) == list(b["val"]["path"])
    assert not set(a["train"]["path"]) & set(a["val"]["path"])
    assert len(a["train"]["path"]) + len(a["val"]["path"]) == 40


def test_gpt_windows_cover_every_byte_once_as_a_target(tmp_path: Path) -> None:
    text = bytes(range(256)) * 3
    (tmp_path / "a.py").write_bytes(text)
    task = GPTTask(corpus=str(tmp_path), block_size=32)
    tokens = task.preprocess({"path": np.array([str(tmp_path / "a.py")])})["tokens"]
    assert tokens.dtype == np.uint8 and tokens.shape[1] == 33
    targets = tokens[:, 1:].reshape(-1)
    assert bytes(targets) == text[1 : 1 + len(targets)]


def test_gpt_loss_starts_near_uniform() -> None:
    task = GPTTask(block_size=32, n_layer=1, d_model=32, n_head=2)
    model = task.build_model()
    tokens = torch.randint(0, 256, (4, 33), dtype=torch.uint8)
    batch = task.finish({"tokens": tokens}, torch.float32)
    with torch.no_grad():
        sums = task.eval_sums(model, batch)
    bpb = task.summarize({k: float(v) for k, v in sums.items()})["val_bpb"]
    assert abs(bpb - 8.0) < 0.5  # ln(256)/ln(2) bits: an untrained model knows nothing
    assert math.isfinite(float(task.loss(model, batch).detach()))


def test_user_task_from_outside_the_repository(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "mytask.py").write_text(
        textwrap.dedent("""
        from raylift.tasks.digits import DigitsTask
        class Small(DigitsTask):
            def __init__(self, width: int = 4):
                super().__init__(width=width)
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_task("mytask:Small").__name__ == "Small"
    assert task_problems("mytask:Small", {"width": 2}) == []
    assert "takes no argument 'depth'" in task_problems("mytask:Small", {"depth": 2})[0]
    assert "has no class" in task_problems("mytask:Nope", {})[0]


def test_a_corpus_is_a_folder_a_glob_or_a_file(tmp_path: Path) -> None:
    from raylift.tasks.gpt import list_corpus

    for name in ("a.txt", "b.txt", "c.md", "sub/d.txt", ".hidden.txt"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(name)
    root, files = list_corpus(str(tmp_path))
    assert root == str(tmp_path) and [Path(f).name for f in files] == [
        "a.txt",
        "b.txt",
        "c.md",
        "d.txt",
    ]
    _, files = list_corpus(f"{tmp_path}/*.txt")
    assert [Path(f).name for f in files] == ["a.txt", "b.txt", "d.txt"]  # * crosses folders
    assert list_corpus(str(tmp_path / "c.md"))[1] == [str(tmp_path / "c.md")]


def test_text_files_are_documents_with_a_separator_between_them(tmp_path: Path) -> None:
    from raylift.tasks.gpt import SEP

    (tmp_path / "a.txt").write_bytes(b"x" * 40)
    (tmp_path / "b.txt").write_bytes(b"y" * 40)
    task = GPTTask(corpus=str(tmp_path), block_size=16)
    paths = np.array([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")])
    tokens = task.preprocess({"path": paths})["tokens"]
    joined = bytes(tokens[:, :-1].reshape(-1)) + bytes(tokens[-1:, -1])
    assert joined == (b"x" * 40 + SEP + b"y" * 40)[: len(joined)]
    assert (
        task.preprocess({"doc": np.array([b"x" * 40, b"y" * 40], dtype=object)})["tokens"].tolist()
        == tokens.tolist()
    )


def test_a_corpus_behind_a_uri_is_listed_and_read_through_its_filesystem(tmp_path: Path) -> None:
    # file:// takes the object-store path (pyarrow filesystem from the URI) without a network.
    for i in range(30):
        (tmp_path / f"doc{i}.txt").write_text(f"document {i}\n" * 20)
    task = GPTTask(corpus=f"file://{tmp_path}", block_size=16, max_bytes=None, val_percent=20)
    splits = task.sources()
    paths = [*splits["train"]["path"], *splits["val"]["path"]]
    assert len(paths) == 30 and all(p.startswith("file://") for p in paths)
    tokens = task.preprocess({"path": splits["val"]["path"][:2]})["tokens"]
    assert bytes(tokens[0][:9]) == b"document "


def test_jsonl_files_split_by_their_relative_path_when_both_sides_get_some(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import zlib

    monkeypatch.setattr(GPTTask, "_documents", lambda self, files: sorted(files))  # no Ray
    task = GPTTask(corpus=str(tmp_path), val_percent=30)
    names = [f"part-{i}.jsonl" for i in range(10)]
    out = task._row_sources(str(tmp_path), [str(tmp_path / n) for n in names])
    val = {Path(p).name for p in out["val"]}  # type: ignore[union-attr]
    assert val == {n for n in names if zlib.crc32(n.encode()) % 100 < 30} and val
    assert not val & {Path(p).name for p in out["train"]}  # type: ignore[union-attr]


def test_too_few_jsonl_files_give_one_row_split_whose_rows_are_preprocessed_per_split(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One file: both splits are one RowSplit (read once); each preprocess call packs a
    split's documents apart, so no train window holds val text, and marks its split."""
    from raylift.data.shards import _preprocess_by_split
    from raylift.data.sources import SPLIT_COLUMN, RowSplit, in_val

    monkeypatch.setattr(GPTTask, "_documents", lambda self, files: "docs")  # no Ray
    task = GPTTask(corpus=str(tmp_path), block_size=8, val_percent=30)
    out = task._row_sources(str(tmp_path), [str(tmp_path / "all.jsonl")])
    assert out["train"] is out["val"] and isinstance(out["train"], RowSplit)
    assert (out["train"].dataset, out["train"].key) == ("docs", "doc")
    docs = [f"document number {i} ".encode() * 3 for i in range(40)]
    val = {d for d in docs if in_val(d, 30)}
    assert 0 < len(val) < len(docs)
    rows = _preprocess_by_split(
        {"doc": np.array(docs, dtype=object)}, task.preprocess, key="doc", percent=30
    )
    train = [d for d in docs if d not in val]
    for split, text in (("val", b"".join(sorted(val))), ("train", b"".join(train))):
        windows = rows["tokens"][rows[SPLIT_COLUMN] == split]
        assert len(windows) > 0
        assert all(bytes(w[w != 0])[:8] in text for w in windows), split


def test_one_text_file_is_split_by_window_the_same_anywhere_within_max_bytes(
    tmp_path: Path,
) -> None:
    """Too few text files for both splits by path: one RowSplit of the files, whose windows
    go to val by a hash of the file's path under the corpus and their place, so a copy
    elsewhere splits the same; max_bytes plus val_percent of it are read."""
    from raylift.data.shards import _preprocess_by_split
    from raylift.data.sources import SPLIT_COLUMN, RowSplit, sample, val_outputs
    from tests.corpora import write_text_file

    text = write_text_file(tmp_path / "a" / "input.txt", 60).read_bytes()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "input.txt").write_bytes(text)
    block, percent, cap = 32, 10, 60_000
    split = {}
    for where in ("a", "b/input.txt"):  # a folder, or the file itself
        task = GPTTask(corpus=str(tmp_path / where), block_size=block, max_bytes=cap,
                       val_percent=percent)  # fmt: skip
        out = task.sources()
        both = out["train"]
        assert out["val"] is both and isinstance(both, RowSplit) and both.outputs == "window"
        assert list(both.dataset["file"]) == ["input.txt"] and "1 text file" in both.what
        assert len(task.preprocess(sample(both, 8))["tokens"]) > 0  # what plan.py does
        rows = _preprocess_by_split(
            both.dataset, task.preprocess, key=both.key, percent=percent, outputs=True,
            permute=True,
        )  # fmt: skip
        split[where] = {
            s: sorted(bytes(w) for w in rows["tokens"][rows[SPLIT_COLUMN] == s])
            for s in ("train", "val")
        }
    assert split["a"] == split["b/input.txt"]
    # Each window of the file's first cap + 10% bytes, in the split its place gives it.
    read = text[: cap + cap * percent // 100]
    n = (len(read) - 1) // block
    val = val_outputs("input.txt", n, percent)
    expected = {
        s: sorted(read[i * block : i * block + block + 1] for i in np.flatnonzero(mask))
        for s, mask in (("train", ~val), ("val", val))
    }
    assert split["a"] == expected
    assert 0.06 < len(expected["val"]) / n < 0.14 and n * block <= len(read)


def test_a_corpus_with_no_text_is_refused_naming_it(tmp_path: Path) -> None:
    from raylift.core.errors import SourceError

    with pytest.raises(SourceError, match="holds no files"):
        GPTTask(corpus=str(tmp_path)).sources()
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(SourceError, match=f"{tmp_path} holds no text"):
        GPTTask(corpus=str(tmp_path)).sources()


def test_shards_are_keyed_by_the_raw_data_not_just_the_task(tmp_path: Path) -> None:
    """An edited, added or removed corpus file or image changes the shards' task_fingerprint,
    so a run prepares its data again instead of training on stale shards."""
    import os

    from raylift.data.manifest import task_fingerprint
    from tests.corpora import write_image_folder
    from tests.helpers import make_config

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("one document\n")
    images = write_image_folder(tmp_path / "shapes", per_class=2, size=16)
    for task_name, args, root in (
        ("gpt", {"corpus": str(corpus)}, corpus),
        ("images", {"root": str(images), "image_size": 16}, images),
    ):
        cfg = make_config(task=task_name, task_args=args)

        def current() -> str:
            return task_fingerprint(cfg, build_task(cfg.task, cfg.task_args))  # noqa: B023

        first = current()
        assert current() == first  # nothing changed: the shards are reused
        victim = sorted(p for p in root.rglob("*") if p.is_file())[0]
        victim.write_bytes(victim.read_bytes() + b"\n")
        os.utime(victim, ns=(0, 10**18))  # rewritten: size and mtime
        edited = current()
        assert edited != first
        (
            victim.parent / "new.txt" if task_name == "gpt" else victim.parent / "new.png"
        ).write_bytes(victim.read_bytes())
        assert current() not in (first, edited)


def test_the_corpus_is_listed_once_for_its_version_and_its_sources(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import raylift.tasks.gpt as gpt

    for i in range(40):
        (tmp_path / f"doc{i}.txt").write_text(f"document {i}\n" * 20)
    calls = []
    real = gpt.corpus_infos
    monkeypatch.setattr(gpt, "corpus_infos", lambda spec: calls.append(spec) or real(spec))
    task = GPTTask(corpus=str(tmp_path), val_percent=20)
    task.data_version()
    sources = task.sources()
    assert len(calls) == 1 and task._listed is None  # not shipped with preprocess
    assert sum(len(s["path"]) for s in sources.values()) == 40


def test_prep_progress_counts_the_rows_of_finished_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows come from finished files' footers; a file still being written (no footer
    yet) counts its bytes but not yet its rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import raylift.data.shards as shards

    for split, n in (("train", 10), ("val", 5)):
        (tmp_path / split).mkdir()
        pq.write_table(pa.table({"x": list(range(n))}), tmp_path / split / "a.parquet")
    (tmp_path / "train" / "b.parquet").write_bytes(b"PAR1 half-written")
    said: list[str] = []
    monkeypatch.setattr(shards, "PROGRESS_EVERY_S", 0.05)
    with shards.Progress(str(tmp_path), "splits 'train' and 'val'", None, said.append, True):
        time.sleep(0.3)
    assert said and all(line.startswith("raylift: prep ") for line in said)
    assert "15 rows" in said[0] and "3 file(s)" in said[0] and "rows/s" in said[0]
    assert said[-1].startswith("raylift: prep wrote splits 'train' and 'val': 15 rows")
    only_train = shards.Progress(str(tmp_path / "train"), "split 'train'", None, said.append)
    assert only_train.written()[::2] == (2, 10)  # files, rows


def test_the_stdlib_corpus_is_every_py_file_outside_installed_packages(tmp_path: Path) -> None:
    for rel in ("a.py", "pkg/b.py", "pkg/deep/c.py", "site-packages/x/d.py",
                "pkg/dist-packages/e.py", "notes.txt", "dir.py/f.txt"):  # fmt: skip
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    (tmp_path / "pkg" / "link.py").symlink_to(tmp_path / "missing.py")  # dangling: no file
    assert corpus_files(tmp_path) == [tmp_path / p for p in ("a.py", "pkg/b.py", "pkg/deep/c.py")]
    # A root inside an installed package's folder is no corpus at all.
    assert corpus_files(tmp_path / "site-packages" / "x") == []
