"""Hostile files as an attacker makes them: payloads (pickled calls that would run code,
each writing a marker file if it ran) and their planting in a real checkpoint, its seal
recomputed with raylift's own code (tests/unit/test_hostile.py,
tests/integration/test_hostile_runs.py)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import hashlib
import importlib
import io
import json
import os
import pickle
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy.testing._private.utils as np_utils
import torch
import torch.utils.cpp_extension

from raylift.tensors.checkpoints import _listed


class Call:
    """Pickles as a call of ``fn(*args)``: what unpickling it does."""

    def __init__(self, fn: Callable[..., Any], *args: Any):
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple:
        return self.fn, self.args


HUBCONF = "open({marker!r}, 'w').write('torch.hub.load')\ndef entry():\n    return None\n"
CPP = """#include <cstdio>
static int planted = [] {{ FILE* f = std::fopen("{marker}", "w"); std::fputs("cpp", f);
                          std::fclose(f); return 0; }}();"""
MODULE = "open({marker!r}, 'w').write('imported')\n"


@dataclasses.dataclass(frozen=True)
class Payload:
    name: str
    make: Callable[[Path], Any]  # marker file -> the object to pickle
    first: str  # the first global its pickle names: the one a refusal names
    runnable: bool = True  # run plainly in a test (load_inline would compile for a minute)


def _code(marker: Path) -> str:
    return f"open({str(marker)!r}, 'w').write('ran')"


def _hub(marker: Path) -> Any:
    repo = marker.parent / f"{marker.name}-hub"
    repo.mkdir(exist_ok=True)
    (repo / "hubconf.py").write_text(HUBCONF.format(marker=str(marker)))
    return Call(functools.partial(torch.hub.load, source="local"), str(repo), "entry")


def _module(marker: Path, how: Callable[[str], Any]) -> Any:
    name = f"planted_{marker.name.replace('.', '_').replace('-', '_')}"
    (marker.parent / f"{name}.py").write_text(MODULE.format(marker=str(marker)))
    return Call(how, name)


PAYLOADS = [
    Payload("exec", lambda m: Call(exec, _code(m)), "builtins.exec"),
    Payload("eval", lambda m: Call(eval, _code(m)), "builtins.eval"),
    Payload("os.system", lambda m: Call(os.system, f"touch '{m}'"), f"{os.name}.system"),
    Payload("torch.hub.load", _hub, "functools.partial"),
    Payload(
        "load_inline",
        lambda m: Call(torch.utils.cpp_extension.load_inline, "planted", CPP.format(marker=m)),
        "torch.utils.cpp_extension.load_inline",
        runnable=False,
    ),
    Payload(
        "runstring",
        lambda m: Call(np_utils.runstring, _code(m), {}),
        "numpy.testing._private.utils.runstring",
    ),
    Payload(
        "import_module",
        lambda m: _module(m, importlib.import_module),
        "importlib.import_module",
    ),
    Payload("__import__", lambda m: _module(m, __import__), "builtins.__import__"),
]
BY_NAME = {p.name: p for p in PAYLOADS}
PAYLOAD_NAMES = [p.name for p in PAYLOADS]


@contextlib.contextmanager
def marks_in(tmp_path: Path) -> Iterator[Path]:
    """Where the payloads' markers go (and their modules: on ``sys.path``, so that an
    import payload that ran would find its module); empty of markers at the end."""
    folder = tmp_path / "marks"
    folder.mkdir()
    sys.path.insert(0, str(folder))
    try:
        yield folder
    finally:
        sys.path.remove(str(folder))
    assert not markers(folder), f"a payload ran: {markers(folder)}"


def markers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("marker-*") if p.is_file())


def armed(payload: Payload, marks: Path) -> Any:
    return payload.make(marks / f"marker-{payload.name}")


# ---------------------------------------------------------------- planting


def digests(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def plant(ckpt: Path, file: str, payload: Any) -> str:
    """``payload`` planted in the checkpoint's ``file`` (a name, or a DCP item: the first
    non-tensor one, or a weight), as an attacker edits it; then every rank's list of sizes
    and checksums recomputed with raylift's own code. The planted file's name."""
    meta_path = ckpt / "engine" / ".metadata"
    meta = pickle.loads(meta_path.read_bytes()) if meta_path.exists() else None  # clean
    if file.endswith("-item"):
        file = plant_item(ckpt, meta, file == "bytes-item", payload)
        meta = pickle.loads(meta_path.read_bytes())
    elif file.endswith(".metadata"):
        hostile = copy.copy(meta)
        hostile.planner_data = {"planted": payload}
        meta_path.write_bytes(pickle.dumps(hostile))
    else:
        obj = torch.load(ckpt / file, weights_only=False)  # the attacker's own tools
        obj["planted"] = payload
        torch.save(obj, ckpt / file)
    reseal(ckpt, meta)
    return file


def plant_item(ckpt: Path, meta: Any, non_tensor: bool, payload: Any) -> str:
    """The first non-tensor item of a DCP file (or a weight) rewritten with ``payload``
    beside its value, its file laid out again and the metadata's offsets moved with it."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    def kind(index: Any) -> bool:
        return isinstance(meta.state_dict_metadata[index.fqn], BytesStorageMetadata)

    chosen = next(
        i for i in sorted(meta.storage_data, key=lambda i: (meta.storage_data[i].relative_path,
                                                           meta.storage_data[i].offset))
        if kind(i) == non_tensor and (non_tensor or i.fqn.startswith("model."))
    )  # fmt: skip
    path = meta.storage_data[chosen].relative_path
    items = sorted((i for i, s in meta.storage_data.items() if s.relative_path == path),
                   key=lambda i: meta.storage_data[i].offset)  # fmt: skip
    data = (ckpt / "engine" / path).read_bytes()
    out, at = io.BytesIO(), 0
    for index in items:
        info = meta.storage_data[index]
        blob = data[info.offset : info.offset + info.length]
        if index == chosen:
            value = torch.load(io.BytesIO(blob), weights_only=False)
            planted = io.BytesIO()
            torch.save({"value": value, "planted": payload}, planted)
            blob = planted.getvalue()
        out.write(blob)
        meta.storage_data[index] = dataclasses.replace(info, offset=at, length=len(blob))
        at += len(blob)
    (ckpt / "engine" / path).write_bytes(out.getvalue())
    (ckpt / "engine" / ".metadata").write_bytes(pickle.dumps(meta))
    return f"engine/{path}"


def reseal(ckpt: Path, meta: Any) -> None:
    """Every rank's ``complete-rank<r>.json`` again, as raylift's save writes it."""
    items: dict[str, list[int]] = {}
    for info in meta.storage_data.values() if meta is not None else ():
        items.setdefault(f"engine/{info.relative_path}", []).append(info.offset)
    for done in ckpt.glob("complete-rank*.json"):
        listed = json.loads(done.read_text())
        for name in listed:
            listed[name] = _listed(ckpt / name, items.get(name))
        done.write_text(json.dumps(listed, indent=0))
