"""What the suite leaves running: every process it starts carries a mark in its environment.

The controller sets ``MARK`` before anything starts; xdist's workers, the Rays they start
(raylets hand their environment to every worker), the servers and the commands the tests
run all inherit it, even once their parent is gone. At the end, a process that still
carries the suite's mark was left behind: the suite lists it, stops it and fails.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid

import psutil

MARK = "RAYLIFT_TEST_SUITE"


def mark_suite() -> str:
    """Mark this process's environment, so that every process started from now on carries
    it. A new mark each time: a suite started from inside another checks only its own."""
    os.environ[MARK] = uuid.uuid4().hex
    return os.environ[MARK]


def marked(value: str) -> list[psutil.Process]:
    """The live processes that carry ``value``, but this one, those it runs under, and its
    multiprocessing resource tracker (which ends with it: a run without xdist has one)."""
    from multiprocessing import resource_tracker

    me = psutil.Process()
    spared = {me.pid, *(p.pid for p in me.parents())}
    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    if tracker is not None:
        spared.add(tracker)
    found = []
    for proc in psutil.process_iter():
        if proc.pid in spared:
            continue
        with contextlib.suppress(psutil.Error):  # gone, a zombie, or not ours to read
            if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get(MARK) == value:
                found.append(proc)
    return found


def describe(proc: psutil.Process) -> str:
    try:
        cmd = " ".join(proc.cmdline())[:200]
        age = time.time() - proc.create_time()
        return f"pid {proc.pid} ({proc.name()}, up {age:.0f} s): {cmd}"
    except psutil.Error:
        return f"pid {proc.pid} (gone while listed)"


def left_behind(value: str, ceiling: float = 60.0) -> list[str]:
    """Waits until no process carries ``value`` (processes still ending get up to
    ``ceiling`` seconds: a hang, not a slow exit, outlasts it); then stops and describes
    those that are left."""
    deadline = time.monotonic() + ceiling
    while (alive := marked(value)) and time.monotonic() < deadline:
        time.sleep(0.5)
    described = [describe(p) for p in alive]
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    return described
