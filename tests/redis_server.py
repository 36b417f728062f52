"""A real ``redis-server`` for the cluster tests: 127.0.0.1, a free port, no persistence.

``RedisServer(folder).start()`` returns once it answers PING; ``stop()`` kills it (SIGKILL: a
crash, and with no persistence it comes back empty), ``freeze()``/``thaw()`` SIGSTOP and
SIGCONT it (connections accepted, nothing answered).  Tests that need it call ``need_redis()``,
which skips with the reason when Debian's ``redis-server`` is not installed.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, Self

import pytest
from procs import wait_until
from router_servers import free_port, log_tail

HANG_BOUND_S = 60.0  # "does not hang": a deadline against a hang, not a speed (the test's
# message check names the short timeout that ended the wait)
REDIS_MISSING = (
    "redis-server not found: it comes with Debian's 'redis-server' package, which 'make test' "
    "installs when it runs as root"
)


def need_redis() -> str:
    path = shutil.which("redis-server")
    if path is None:
        pytest.skip(REDIS_MISSING)
    return path


@dataclass
class RedisServer:
    folder: Path
    password: str | None = None
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log(self) -> Path:
        return self.folder / f"redis-{self.port}.log"

    def argv(self, exe: str) -> list[str]:
        argv = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        argv += ["--appendonly", "no", "--dir", str(self.folder), "--protected-mode", "no"]
        if self.password:
            argv += ["--requirepass", self.password]
        return argv

    def start(self, *, same_port: bool = False) -> Self:
        exe = need_redis()
        self.folder.mkdir(parents=True, exist_ok=True)
        if not same_port or not self.port:
            self.port = free_port()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv(exe),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        proc = self.proc

        def ready() -> str:
            if proc.poll() is not None:
                return "exited"
            return "up" if self._answers() else ""

        state = wait_until(ready, 20.0, lambda: f"redis-server {self.port}\n{log_tail(self.log)}")
        if state != "up":
            self.proc = None
            self.exited(log_tail(self.log))
        return self

    def exited(self, log: str) -> NoReturn:
        """It exited instead of answering; ``log`` is the end of its log."""
        raise AssertionError(f"redis-server exited:\n{log}")

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                reply = s.recv(64)
        except OSError:
            return False
        return reply.startswith((b"+PONG", b"-NOAUTH"))

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.kill(self.proc.pid, signal.SIGCONT)  # a frozen one must be able to die
            os.kill(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self.proc = None

    def freeze(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)
