"""A failed run in one message: what failed, on which rank, and where its log is. Ray
groups ranks that fail alike (``[Rank 0,1 Error Snippet]``): the traceback is shown once,
naming every rank, and ranks that fail differently each show theirs."""

from __future__ import annotations

import errno
import re
from collections.abc import Sequence
from typing import Any

from raylift.core.config import Config, ConfigError
from raylift.core.errors import RefusedPickle
from raylift.core.storage import StorageError
from raylift.run.check import worker_resources
from raylift.run.faults import Crash, cause, died, primary


def nonfinite_message(cfg: Config, metrics: dict[str, float], ckpt: str | None) -> str:
    return (
        f"training run {cfg.name!r} stopped: the loss became inf/NaN at step "
        f"{int(metrics['nonfinite_step'])} (train.on_nan: stop); the last good checkpoint is "
        f"{ckpt or 'none'}. Lower optim.lr, set train.grad_clip, use precision bf16-mixed "
        "instead of 16-mixed, or set train.on_nan=skip to step over bad batches"
    )


def caused_by(exc: BaseException, name: str) -> bool:
    """Whether an exception named ``name`` is in ``exc``'s chain, or is the controller
    failure Ray Train's ``ControllerError`` wraps."""
    seen: BaseException | None = exc
    while seen is not None:
        inner = getattr(seen, "controller_failure", None)
        if name in (type(seen).__name__, type(inner).__name__):
            return True
        seen = seen.__cause__
    return False


def placement_message(cfg: Config) -> str:
    """What the run waited for, what the cluster has, and what holds the rest."""
    import ray

    want = worker_resources(cfg)
    n = cfg.scaling.min_workers
    total, free = ray.cluster_resources(), ray.available_resources()
    needed = ", ".join(f"{k} {v * n:g}" for k, v in want.items())
    has = ", ".join(f"{k} {total.get(k, 0):g} ({free.get(k, 0):g} free)" for k in want)
    held = [
        f"    placement group {pg.get('name') or pid[:8]}: "
        + ", ".join(f"{k} {v:g}" for k, v in _bundle_sum(pg).items() if k in want)
        for pid, pg in ray.util.placement_group_table().items()
        if pg.get("state") == "CREATED"
    ]
    return (
        f"training run {cfg.name!r} failed: its {n} worker(s) of {want} could not be placed "
        f"within scaling.placement_timeout_s={cfg.scaling.placement_timeout_s:g} s.\n"
        f"  it needs {needed}; the cluster has {has}.\n"
        + ("  held by:\n" + "\n".join(held) + "\n" if held else "")
        + "  lower scaling.num_workers or scaling.cpus_per_worker, stop what holds the "
        "resources, add nodes, or raise scaling.placement_timeout_s for a slow autoscaler"
    )


def _bundle_sum(pg: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for bundle in pg.get("bundles", {}).values():
        for k, v in bundle.items():
            out[k] = out.get(k, 0.0) + v
    return out


def failure_message(exc: BaseException, cfg: Config, tracking: Any = None) -> str:
    group = _worker_group_error(exc)
    if group is not None:  # which ranks, and their tracebacks: printed here, once
        root, what, trace = _group_failure(group, tracking)
        head = f"training run {cfg.name!r} failed: {what}"
    else:
        root = exc
        while root.__cause__ is not None:
            root = root.__cause__
        text = str(root).strip().splitlines()
        trace, head = "", f"training run {cfg.name!r} failed: {text[-1] if text else root!r}"
    if (refused := root_of(exc, StorageError)) is not None:
        return f"training run {cfg.name!r} failed: {refused}"
    if (hostile := root_of(exc, RefusedPickle)) is not None:  # a planted file: said alone
        return f"training run {cfg.name!r} failed: {hostile}"
    if isinstance(wrong := root_of(exc, ConfigError), ConfigError):  # found by the workers
        return f"training run {cfg.name!r} failed: {'; '.join(wrong.problems)}"
    if "No space left on device" in str(root) or getattr(root, "errno", None) == errno.ENOSPC:
        return (
            f"training run {cfg.name!r} failed: the disk under storage {cfg.storage!r} is full "
            f"({str(root).strip().splitlines()[-1]})\n  free space there or set storage "
            "elsewhere, then rerun the same command: it resumes from the newest complete "
            "checkpoint, skipping the cut-off one"
        )
    return (
        f"{head}\n"
        + (f"{trace}\n" if trace else "")
        + "  fix the cause and rerun the same command to resume from the latest checkpoint"
    )


def root_of(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    """A ``kind`` in ``exc``'s chain, or kept by Ray Train's wrapper of a worker's error."""
    group = _worker_group_error(exc)
    if group is not None:
        _, failed = primary(dict(group.worker_failures))
        exc = getattr(failed, "_base_exc", failed)
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, kind):
            return seen
        seen = seen.__cause__
    return None


def _worker_group_error(exc: BaseException) -> Any:
    """Ray Train's WorkerGroupError (rank -> exception) anywhere in ``exc``'s chain."""
    seen: BaseException | None = exc
    while seen is not None:
        if getattr(seen, "worker_failures", None):
            return seen
        seen = seen.__cause__
    return None


def _snippets(group: Any) -> list[tuple[list[int], str]]:
    """(ranks, traceback) for each distinct error Ray Train kept a traceback of: the
    ranks' exceptions come back to the driver without theirs."""
    parts = _SNIPPET.split(str(group))  # Ray's line, then each snippet's ranks and text
    return [(_ranks(r), t.strip()) for r, t in zip(parts[1::2], parts[2::2], strict=True)]


def _ranks(text: str) -> list[int]:
    """``0,1`` (Ray's), or ``0-3,5``: ranges, should a later Ray write them."""
    out: list[int] = []
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        out.extend(range(int(low), int(high or low) + 1))
    return out


def _label(ranks: Sequence[int]) -> str:
    """``rank 3``, ``ranks 0,1``, or ``ranks 0-63``: a run's many ranks in a line."""
    spans: list[list[int]] = []
    for r in sorted(set(ranks)):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    parts = [f"{a}" if a == b else f"{a},{b}" if b == a + 1 else f"{a}-{b}" for a, b in spans]
    return ("rank " if len(set(ranks)) == 1 else "ranks ") + ",".join(parts)


def _group_failure(group: Any, tracking: Any) -> tuple[BaseException, str, str]:
    """(the first failed rank's exception, which ranks failed and how, their tracebacks)."""
    rank, failed = primary(dict(group.worker_failures))
    what, node = cause(failed)
    where = f" on node {node}" if node else ""
    if died(failed):
        # A dead process has no traceback of its own (the controller showed the end of its
        # stderr), and the other ranks' errors are what its death did to them.
        crash = Crash.find(failed, tracking, rank)
        return failed, f"worker rank {rank}{where}: {crash.how() if crash else what}", ""
    snippets = _snippets(group)
    if len(snippets) == 1:  # every failed rank alike: all named, the traceback once
        ranks, trace = snippets[0]
        return failed, f"worker {_label(ranks)}{where}: {what}", trace
    head = f"worker rank {rank}{where}: {what}"
    if not snippets:  # a message Ray no longer writes as it did: the line alone
        return failed, head, ""
    everyone = [r for ranks, _ in snippets for r in ranks]
    head += f"; {_label(everyone)} failed, with {len(snippets)} different errors"
    return failed, head, "\n".join(f"[{_label(ranks)}]\n{trace}" for ranks, trace in snippets)


# Ray Train's message: one line of its own, then a snippet per group of ranks whose errors
# read alike but for numbers, headed "[Rank 0,1 Error Snippet]:" (its poll.py).
_SNIPPET = re.compile(r"^\[Ranks? ([\d, -]+) Error Snippet\]:\n", re.MULTILINE)
