"""The bytes each rank sends in one training step, by collective, within its node and
across nodes: read from the collectives the process groups ran, not computed from the
model.

torch's Flight Recorder (on by default; ``TORCH_FR_BUFFER_SIZE`` entries, 2000 unless
set) keeps the last collectives of every process group: the operation, the group, the
sizes and dtypes of its tensors and when it was issued. One step's entries give what
the rank handed to each group. A group's bytes count as across nodes when its ranks are
on more than one node: what may take the slow links.

The bytes a rank sends are those of the bandwidth-optimal (ring) algorithm, as NCCL and
gloo run them for large messages: an all-reduce of S bytes on a group of g ranks sends
2(g-1)/g x S, an all-gather (g-1)/g x its output, a reduce-scatter (g-1)/g x its input.
gloo runs a reduce-scatter as an all-reduce (its entry says so), and is counted as one.

A dump of the recorder takes a fifth of a second here, so one step is measured per
start of the workers: its collectives are the same at every step of a layout.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from typing import Any

import torch

from raylift.core.storage import size_text

# The recorder's dtype names, in bytes.
WIDTHS = {
    "Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2,
    "Char": 1, "Byte": 1, "Bool": 1, "Float8_e4m3fn": 1, "Float8_e5m2": 1,
}  # fmt: skip
# The recorder's operation names (after "gloo:" or "nccl:"), by what they move.
ALL_REDUCE = ("all_reduce", "allreduce", "all_reduce_coalesced", "allreduce_coalesced")
GATHER = ("all_gather", "_allgather_base", "all_gather_into_tensor_coalesced",
          "allgather_coalesced", "allgather_into_tensor_coalesced")  # fmt: skip
SCATTER = ("reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced")
KINDS = {**dict.fromkeys(ALL_REDUCE, "all_reduce"), **dict.fromkeys(GATHER, "all_gather"),
         **dict.fromkeys(SCATTER, "reduce_scatter"), "broadcast": "broadcast",
         "send": "send", "alltoall_base": "all_to_all", "alltoall": "all_to_all"}  # fmt: skip


def nbytes(shapes: Sequence[Sequence[int]], dtypes: Sequence[str]) -> int:
    total = 0
    for shape, dtype in zip(shapes, dtypes, strict=False):
        total += int(torch.Size(shape).numel()) * WIDTHS.get(dtype, 4)
    return total


def sent(kind: str, group: int, inputs: int) -> float:
    """Bytes one rank sends for one collective on a group of ``group`` ranks."""
    if group <= 1:
        return 0.0
    share = (group - 1) / group
    if kind == "all_reduce":
        return 2 * share * inputs
    if kind == "all_gather":
        # Each rank sends its input to the g-1 others. Not read from the outputs: the
        # recorder gives the list form's (DTensor's gathers on gloo) as one rank's tensor.
        return (group - 1) * inputs
    if kind in ("reduce_scatter", "all_to_all", "broadcast"):
        return share * inputs
    return float(inputs) if kind == "send" else 0.0


@dataclasses.dataclass
class StepBytes:
    """What one rank sent in one step: by collective kind, within a node and across."""

    within: dict[str, float] = dataclasses.field(default_factory=dict)
    across: dict[str, float] = dataclasses.field(default_factory=dict)

    def add(self, kind: str, crosses: bool, value: float) -> None:
        side = self.across if crosses else self.within
        side[kind] = side.get(kind, 0.0) + value

    def metrics(self) -> dict[str, float]:
        out = {
            "wire/within_node_bytes_per_step": sum(self.within.values()),
            "wire/across_nodes_bytes_per_step": sum(self.across.values()),
        }
        for where, side in (("within_node", self.within), ("across_nodes", self.across)):
            out.update({f"wire/{where}/{kind}_bytes": v for kind, v in side.items()})
        return out


def entries_since(started_ns: int, ended_ns: int) -> list[dict[str, Any]]:
    """The recorder's entries of this rank issued between the two times (``time.time_ns``)."""
    from torch._C import _distributed_c10d as c10d

    # Untyped in torch's stubs; its JSON form, not its pickle (which unpickles anything).
    raw = c10d._dump_fr_trace_json(includeCollectives=True, onlyActive=False)  # type: ignore[attr-defined]
    dump = json.loads(raw)
    return [e for e in dump.get("entries", []) if started_ns <= e["time_created_ns"] <= ended_ns]


def group_ranks(name: str) -> list[int]:
    """The global ranks of the process group the recorder calls ``name``."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    return dist.get_process_group_ranks(_resolve_process_group(name))  # type: ignore[arg-type]


def measure(entries: list[dict[str, Any]], nodes: Sequence[str]) -> StepBytes:
    """The bytes of ``entries`` (one rank's, one step's), ranks on ``nodes`` (by rank)."""
    out = StepBytes()
    spans: dict[str, tuple[int, bool]] = {}
    for e in entries:
        op = e["profiling_name"].split(":", 1)[-1]
        kind = KINDS.get(op)
        if kind is None:  # a barrier, a receive: nothing this rank sends
            continue
        name = e["process_group"][0]
        if name not in spans:
            ranks = group_ranks(name)
            spans[name] = (len(ranks), len({nodes[r] for r in ranks}) > 1)
        size, crosses = spans[name]
        inputs = nbytes(e["input_sizes"], e["input_dtypes"])
        out.add(kind, crosses, sent(kind, size, inputs))
    return out


class WireMeter:
    """One step's bytes, measured once per start: ``begin()`` before the step,
    ``end()`` after it gives the metrics to log (``{}`` once done)."""

    def __init__(self, nodes: Sequence[str]):
        self.nodes = list(nodes)
        self.started: int | None = None
        self.done = len(self.nodes) < 2  # one worker sends nothing

    def begin(self) -> None:
        if not self.done:
            self.started = time.time_ns()

    def end(self) -> dict[str, float]:
        if self.done or self.started is None:
            return {}
        self.done = True
        return measure(entries_since(self.started, time.time_ns()), self.nodes).metrics()


def wire_line(metrics: dict[str, float]) -> str:
    """``wire: rank 0 sends a step 3.1 MiB within its node (all_gather 2.0 MiB, ...); ...``"""
    parts = []
    for where, words in (("within_node", "within its node"), ("across_nodes", "across nodes")):
        total = metrics[f"wire/{where}_bytes_per_step"]
        kinds = {
            k.rsplit("/", 1)[-1].removesuffix("_bytes"): v
            for k, v in metrics.items()
            if k.startswith(f"wire/{where}/") and v
        }
        detail = ", ".join(f"{kind} {size_text(int(v))}" for kind, v in kinds.items())
        parts.append(f"{size_text(int(total))} {words}" + (f" ({detail})" if detail else ""))
    return "wire: rank 0 sends a step " + "; ".join(parts)
