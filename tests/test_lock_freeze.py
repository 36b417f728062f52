"""The lock honours a live governor's freeze, and only a live, fresh one.

The governor's side of the protocol is two things in the state folder: governor.json (written
atomically) and the claim governor.fifo held open for its life.  The test process plays that
part; the waiters are real processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from procs import wait_until

from gpulock.core import claim, level
from gpulock.core.settings import load
from gpulock.lock.queuedir import QueueDir

WAITER = (
    "import gpulock, sys, time; t = time.monotonic(); "
    "l = gpulock.acquire(timeout=float(sys.argv[1])); "
    "print(round(time.monotonic() - t, 3), flush=True)"
)


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    s = tmp_path / "state"
    monkeypatch.setenv("GPULOCK_STATE_DIR", str(s))
    return s


class StandInGovernor:
    """Holds the governor's claim, as a running governor does, until it dies."""

    def __init__(self, state: Path) -> None:
        self.settings = load(None, state)
        self.fd: int | None = claim.create(level.claim_path(self.settings), 0o600)

    def die(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # the kernel drops the claim, as when a governor exits
            self.fd = None


@pytest.fixture
def governor(state: Path) -> Iterator[StandInGovernor]:
    g = StandInGovernor(state)
    try:
        yield g
    finally:
        g.die()


def publish(state: Path, lvl: str, *, updated: float | None = None, interval: float = 60) -> None:
    now = time.time()
    level.write(
        load(None, state),
        level.Published(lvl, now, now if updated is None else updated, interval, os.getpid()),
    )


def waiter(timeout: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", WAITER, str(timeout)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def queued(state: Path) -> bool:
    return bool(QueueDir(load(None, state), 0, create=False).seqs())


def test_freeze_holds_new_admissions_until_the_governor_unfreezes_and_rings(
    state: Path, governor: StandInGovernor
) -> None:
    publish(state, "freeze")
    p = waiter(20)
    wait_until(lambda: queued(state), 10, "the waiter's ticket")
    assert p.poll() is None  # frozen: not granted although nobody holds the GPU
    publish(state, "normal")
    assert QueueDir(governor.settings, 0).ring_head() is not None  # as the governor does
    _out, err = p.communicate(timeout=10)
    assert p.returncode == 0, err


def test_a_dead_governors_freeze_does_not_count(state: Path, governor: StandInGovernor) -> None:
    settings = governor.settings
    publish(state, "freeze")
    p = waiter(20)
    wait_until(lambda: queued(state), 10, "the waiter's ticket")
    governor.die()  # the kernel drops its claim, the waiter wakes
    _out, err = p.communicate(timeout=30)
    assert p.returncode == 0, err  # granted well inside its 20 s, though the word is fresh
    assert level.read(settings) is None and level.current(settings) == "normal"


def test_a_stale_freeze_does_not_count(state: Path, governor: StandInGovernor) -> None:
    publish(state, "freeze", updated=time.time() - 3600, interval=60)  # a hung governor
    p = waiter(5)
    _out, err = p.communicate(timeout=10)
    assert p.returncode == 0, err


def test_frozen_waiter_times_out_cleanly(state: Path, governor: StandInGovernor) -> None:
    publish(state, "freeze")
    p = waiter(0.3)
    _out, err = p.communicate(timeout=10)
    assert p.returncode != 0 and "LockTimeout" in err
    assert not queued(state)  # it left the queue


def test_governor_level_reads_the_live_word_only(state: Path) -> None:
    import gpulock

    assert gpulock.governor_level() == "normal"  # no governor ever ran
    governor = StandInGovernor(state)
    publish(state, "reduce")
    assert gpulock.governor_level() == "reduce"
    governor.die()  # the governor is gone: its word no longer counts
    assert gpulock.governor_level() == "normal"
