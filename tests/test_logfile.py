"""One rotation for every log: the event log, the agents' run logs and the fleet's output logs."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

from gpulock.core import logfile
from gpulock.core.errors import StateDirError


def test_append_rotates_past_max_bytes_keeping_one_generation(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    for i in range(50):
        logfile.append(log, b"%04d\n" % i, mode=0o600, max_bytes=100, lock_name=".x.lock")
    old = (tmp_path / "x.log.1").read_bytes()
    assert len(old) <= 105 and log.stat().st_size <= 100
    assert old.splitlines()[-1] < log.read_bytes().splitlines()[0]  # the order holds
    assert not (tmp_path / "x.log.2").exists()
    assert log.stat().st_mode & 0o777 == 0o600


def test_rotate_leaves_small_files_and_non_files_alone(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    assert not logfile.rotate(log, max_bytes=10, mode=0o600, lock_name=".l")  # no file
    log.write_bytes(b"12345")
    assert not logfile.rotate(log, max_bytes=10, mode=0o600, lock_name=".l")
    log.unlink()
    os.mkfifo(log)
    assert not logfile.rotate(log, max_bytes=0, mode=0o600, lock_name=".l")
    with pytest.raises(StateDirError):  # never hangs on a FIFO put in the log's place
        logfile.append(log, b"x\n", mode=0o600, max_bytes=10, lock_name=".l")


def test_a_planted_lock_symlink_is_refused_not_followed(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_bytes(b"x" * 20)
    outside = tmp_path / "outside"
    (tmp_path / ".l").symlink_to(outside)
    with pytest.raises(StateDirError):
        logfile.rotate(log, max_bytes=10, mode=0o600, lock_name=".l")
    assert not outside.exists() and log.exists()


def _writer(path: str, n: int) -> None:
    for i in range(n):
        logfile.append(Path(path), b"%06d\n" % i, mode=0o600, max_bytes=2000, lock_name=".w")


def test_writers_in_many_processes_lose_no_line_of_the_last_generation(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(log), 300)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    lines = log.read_bytes().splitlines() + (tmp_path / "w.log.1").read_bytes().splitlines()
    assert all(len(x) == 6 and x.isdigit() for x in lines)  # no torn or interleaved line


def test_all_three_logs_use_it() -> None:
    import inspect

    from gpulock.agents import fleetrun, logs
    from gpulock.core import events

    for module in (events, logs, fleetrun):
        src = inspect.getsource(module)
        assert "logfile." in src and "os.replace(" not in src, module.__name__
