"""`raylift prep` of a chat file for hf-sft on the session's Ray: packed windows, bad rows
named by file and line, `--show` and `--show --json` printing what the loss sees, and a
file of mostly bad rows stopping prep."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raylift.cli import main as cli_main
from raylift.data.manifest import open_shards
from tests.chats import model_folder, write_chats

pytest.importorskip("transformers")
pytestmark = pytest.mark.integration


def sft_config(tmp_path: Path, data: Path) -> list[str]:
    (tmp_path / "sft.yaml").write_text(
        f"task: hf-sft\ntask_args: {{model: {tmp_path / 'model'}, data: {data}, "
        "block_size: 256}\ndata: {batch_size: 4}\n"
    )
    return [str(tmp_path / "sft.yaml"), f"data.shards={tmp_path / data.stem}"]


def test_prep_packs_a_chat_file_names_bad_rows_and_shows_what_the_loss_sees(
    ray_cluster: str, in_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tmp_path = in_tmp
    model_folder(tmp_path / "model")
    data = tmp_path / "chats.jsonl"
    write_chats(data, 300)
    long = {"messages": [{"role": "user", "content": "Say it."},
                         {"role": "assistant", "content": "sun moon " * 200}]}  # fmt: skip
    with data.open("a") as f:  # lines 301 and 302 bad, 303 longer than a window
        f.write('{"messages": [{"role": "user", "content": "Repeat: a b c"}]}\n{oops\n')
        f.write(json.dumps(long) + "\n")
    args = sft_config(tmp_path, data)
    assert cli_main(["prep", *args, "--show", "3"]) == 0
    out = capsys.readouterr().out
    print(out)  # for the record: what --show prints
    assert "raylift: hf-sft: task_args.format auto: messages (the first row's keys" in out, out
    assert "skipped 2 unreadable row(s)" in out, out
    assert "raylift: hf-sft: 1 example(s) longer than block_size 256 cut to it" in out, out
    assert f"{data}:301: no assistant turn" in out and f"{data}:302: " in out, out
    shown = out.split("--- ")[1:]  # each example after its "--- N of M tokens trained"
    assert len(shown) == 3, out
    for example in shown:  # the answer and its end of turn, nothing else, set apart
        words = example.split("Repeat: ")[1].split("<|im_end|>")[0]
        assert example.count("[[") == 1 and f"[[{words}<|im_end|>]]" in example, example
    manifest = open_shards(str(tmp_path / "chats"), None)
    assert 0 < manifest.rows("train") < 300 // 3  # several examples a window
    assert cli_main(["prep", *args, "--show", "2", "--json"]) == 0  # prepared: read back
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert len(lines) == 2
    for example in lines:
        pairs = zip(example["tokens"], example["trained"], strict=True)
        trained = "".join(token for token, on in pairs if on)
        assert trained.endswith("<|im_end|>") and "Repeat" not in trained, example
    # Val from files of its own: every one of their examples, none of the train file's.
    held = tmp_path / "held.jsonl"
    held.write_text("\n".join(data.read_text().splitlines()[:20]) + "\n")
    with_val = [f"{args[0]}", f"data.shards={tmp_path / 'with-val'}", f"task_args.val_data={held}"]
    assert cli_main(["prep", *with_val]) == 0
    from raylift.data.manifest import column_total, head

    val = open_shards(str(tmp_path / "with-val"), None)
    assert head(val, "val", 100)["examples"].sum() == 20
    assert column_total(val, "examples") == 20 + 301  # the file's good rows, 303 among them
    capsys.readouterr()
    # Most rows bad: prep stops, naming them, and writes nothing.
    bad = tmp_path / "bad.jsonl"
    rows = [f'{{"prompt": "x{i}", "completion": null}}' for i in range(8)]
    rows += data.read_text().splitlines()[:2]
    bad.write_text("\n".join(rows) + "\n")
    assert cli_main(["prep", *sft_config(tmp_path, bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:1: no 'completion'" in err and "max_bad_fraction" in err, err
    assert not (tmp_path / "bad").exists()


def test_prep_reads_a_chat_data_set_named_by_its_hub_id_at_one_commit(
    ray_cluster: str, in_tmp: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """``task_args.data: org/chats`` with ``split`` and ``val_split``: the card's files of
    each split, read through Ray Data from the Hub (a server on 127.0.0.1) at the commit
    the name had, and a split the card lacks refused in one line naming those it has."""
    from raylift.data.manifest import column_total, head
    from tests.chats import CARD, chat_parquet, triples
    from tests.hub_server import HubServer

    tmp_path = in_tmp
    model_folder(tmp_path / "model")
    train, held = triples()
    chats = {"train_sft-00000-of-00002": train[:60], "train_sft-00001-of-00002": train[60:120],
             "test_sft-00000-of-00001": held[:20]}  # fmt: skip
    files = chat_parquet(chats)
    with HubServer(tmp_path / "hub") as hub:
        hub.use(monkeypatch, tmp_path / "hf-home")
        commit = hub.add_repo("org/chats", {"README.md": CARD.encode(), **files},
                              repo_type="dataset")  # fmt: skip
        (tmp_path / "hub.yaml").write_text(
            f"task: hf-sft\ntask_args: {{model: {tmp_path / 'model'}, data: org/chats, "
            "split: train_sft, val_split: test_sft, block_size: 256}\ndata: {batch_size: 4}\n"
        )
        args = [str(tmp_path / "hub.yaml"), f"data.shards={tmp_path / 'hub-shards'}"]
        assert cli_main(["prep", *args, "--show", "1"]) == 0
        out = capsys.readouterr().out
        read = {r.revision for r in hub.requests if (r.file or "").endswith(".parquet")}
        assert cli_main(["prep", *args, "task_args.split=nope"]) == 2
        err = capsys.readouterr().err
    assert f"hf://datasets/org/chats@{commit}/data/train_sft-00000-of-00002.parquet" in out, out
    assert read == {commit}, read  # every read of the data at the one commit
    manifest = open_shards(str(tmp_path / "hub-shards"), None)
    assert head(manifest, "val", 100)["examples"].sum() == 20
    assert column_total(manifest, "examples") == 120 + 20
    said = err.strip().splitlines()[-1]
    assert said.endswith(
        "org/chats has no .parquet, .jsonl or .json files for split 'nope'; its card names "
        "the splits test_sft, train_sft; set task_args.split (and task_args.subset) to one "
        "it has"
    ), err
