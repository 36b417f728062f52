from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_helpers import Cli
from procs import World  # tests/ is on sys.path: pytest puts a conftest's folder there
from redis_server import RedisServer
from router_servers import FaultServer

# Variables that would make a test depend on the shell it was started from: a lease inherited
# from `gpulock run`, simulated GPUs, another config file, another state folder.
ISOLATED_ENV = ("GPULOCK_TICKET", "GPULOCK_SIMULATE", "GPULOCK_CONFIG", "GPULOCK_STATE_DIR")


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ISOLATED_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def world(isolated_env: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    """A private state folder and config file, for this process and the children it starts.

    Every child still running at the end (a failed test, a stopped or forked process) is
    killed with its whole process group, so no test can leave one behind or hang the next.
    """
    w = World(tmp_path)
    monkeypatch.setenv("GPULOCK_STATE_DIR", str(w.state))
    monkeypatch.setenv("GPULOCK_CONFIG", str(w.config))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    try:
        yield w
    finally:
        w.cleanup()


@pytest.fixture
def cli(tmp_path: Path) -> Iterator[Cli]:
    """Drives the real `gpulock` command in a private state folder; kills what it started."""
    c = Cli(tmp_path)
    try:
        yield c
    finally:
        c.cleanup()


@pytest.fixture
def ok_cloud() -> Iterator[FaultServer]:
    """An OpenAI-shaped server on 127.0.0.1 that answers every call (``FaultServer(mode="ok")``)."""
    f = FaultServer(mode="ok").start()
    try:
        yield f
    finally:
        f.stop()


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A real ``redis-server`` on a free port of 127.0.0.1, no persistence (skips without one)."""
    r = RedisServer(tmp_path / "redis").start()
    try:
        yield r
    finally:
        r.stop()
