"""Reading one tensor out of a checkpoint's ``torch.save`` file: its own bytes alone,
checked as they arrive."""

from __future__ import annotations

from pathlib import Path
from typing import IO, cast

import pytest
import torch

from raylift.core.errors import RefusedPickle
from raylift.tensors.checkpoints import (
    FORMAT,
    LOOP_FILE,
    CheckpointError,
    CheckpointReader,
    seal_checkpoint,
)
from raylift.tensors.lazytorch import concat_range, load_lazy

MIB = 2**20


def saved_checkpoint(folder: Path, state: dict) -> None:
    """A one-rank checkpoint folder holding ``state`` as ``engine/state.pt``, sealed as a
    save seals it (sizes and block checksums recorded)."""
    (folder / "engine").mkdir(parents=True)
    torch.save(state, folder / "engine" / "state.pt")
    torch.save({"format": FORMAT, "world_size": 1, "step": 1}, folder / LOOP_FILE)
    (folder / "complete-rank0.json").write_text(seal_checkpoint(folder, {}))


def test_one_tensor_of_a_torch_save_file_is_read_alone_and_checked(tmp_path: Path) -> None:
    """A file holding weights and two moments of 3 MiB each (DeepSpeed's optimizer file):
    reading the weights fetches their 3 MiB and the zip's small records, not the moments;
    a flipped byte in the moments goes unread, one in the weights stops the read."""
    weights, m1, m2 = (torch.randn(3 * MIB // 4) for _ in range(3))
    state = {"optimizer_state_dict": {"fp32": [weights], "state": {0: {"m1": m1, "m2": m2}}}}
    saved_checkpoint(tmp_path, state)
    reader = CheckpointReader(str(tmp_path))
    lazy = load_lazy(cast(IO[bytes], reader.open("engine/state.pt")))
    flat = lazy["optimizer_state_dict"]["fp32"][0]
    assert flat.shape == weights.shape and flat.dtype == torch.float32
    assert torch.equal(flat.load(), weights)
    assert weights.nbytes <= reader.read < weights.nbytes + 64 * 1024, reader.read
    # Parts of it, across two tensors laid end to end.
    moments = lazy["optimizer_state_dict"]["state"][0]
    both = concat_range([moments["m1"], moments["m2"]], m1.numel() - 5, 10)
    assert torch.equal(both, torch.cat([m1[-5:], m2[:5]]))

    path = tmp_path / "engine" / "state.pt"
    data = bytearray(path.read_bytes())
    at = data.find(m2[100:108].numpy().tobytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    again = load_lazy(cast(IO[bytes], CheckpointReader(str(tmp_path)).open("engine/state.pt")))
    assert torch.equal(again["optimizer_state_dict"]["fp32"][0].load(), weights)
    at = data.find(weights[100:108].numpy().tobytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    again = load_lazy(cast(IO[bytes], CheckpointReader(str(tmp_path)).open("engine/state.pt")))
    with pytest.raises(CheckpointError, match=r"corrupt: engine/state.pt bytes \d+-\d+"):
        again["optimizer_state_dict"]["fp32"][0].load()


class Payload:
    """Something a checkpoint never holds: unpickling it would run code of its choosing."""

    def __reduce__(self) -> tuple:
        return (print, ("ran",))


def test_a_torch_save_file_that_would_call_a_function_is_refused(tmp_path: Path) -> None:
    saved_checkpoint(tmp_path, {"module": {"w": torch.ones(2)}, "x": Payload()})
    with (
        CheckpointReader(str(tmp_path)).open("engine/state.pt") as f,
        pytest.raises(RefusedPickle, match=r"engine/state.pt: its pickle calls builtins.print, wh"),
    ):
        load_lazy(cast(IO[bytes], f))
