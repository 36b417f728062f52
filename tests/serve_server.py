"""A real ``gpulock serve`` for the tests: a child process on a free port of 127.0.0.1.

``GatewayProc.start()`` returns once ``/health`` answers (with a deadline); ``stop()`` kills
its process group.  ``request()`` is a raw ``http.client`` call for the shapes the official
clients hide (status, headers, the exact body).
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from procs import wait_until
from router_servers import free_port, kill_group, log_tail

START_S = 60.0  # "it starts", on a busy 2-core machine with other hosts starting too


def clean_env() -> dict[str, str]:
    """This process's environment less its ``GPULOCK_*`` variables: for a child that is a host
    of its own (its own config and state folder, none of the test's)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("GPULOCK_")}


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class GatewayProc:
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    args: tuple[str, ...] = ()
    port: int = 0  # given: the port its config names, kept; 0: a free one picked at start
    proc: subprocess.Popen[bytes] | None = None
    isolated: bool = False  # the child gets none of this process's GPULOCK_* (clean_env)
    _named_port: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self._named_port = self.port != 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Self:
        for _attempt in range(1 if self._named_port else 3):  # a taken free port: another
            if not self._named_port:
                self.port = free_port()
            argv = [sys.executable, "-m", "gpulock", "serve"]
            argv += ["--listen", f"127.0.0.1:{self.port}", *self.args]
            with open(self.log, "ab") as log:
                self.proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    env={**(clean_env() if self.isolated else os.environ), **self.env},
                    start_new_session=True,
                )
            proc = self.proc

            def up(proc: subprocess.Popen[bytes] = proc) -> str:
                if proc.poll() is not None:
                    return "exited"
                try:
                    r = self.request("GET", "/health", headers=self.auth())
                except OSError:
                    return ""
                return "up" if r.status in (200, 401) else ""

            if wait_until(up, START_S, lambda: f"gpulock serve\n{self.output()}") == "up":
                return self
        raise AssertionError(f"gpulock serve would not start\n{self.output()}")

    def auth(self) -> dict[str, str]:
        return {}

    def output(self) -> str:
        return log_tail(self.log, 6000)

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
        *,
        raw: bytes | None = None,
        timeout: float = 60.0,
    ) -> Reply:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
            hdrs = {"Content-Type": "application/json", **(headers or {})}
            conn.request(method, path, body=data, headers=hdrs)
            r = conn.getresponse()
            return Reply(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
        finally:
            conn.close()

    def stop(self) -> None:
        kill_group(self.proc)


def stand_in_gateway(root: Path, base_url: str, serve: str = "") -> GatewayProc:
    """A (not yet started) gateway whose one route ``chat`` goes to an OpenAI-style upstream
    at ``base_url``; ``serve`` is an optional flow-style ``serve:`` section like
    ``{read_timeout: 2s}``."""
    config = root / "gpulock.yaml"
    config.write_text(
        "simulate: 24GiB\n" + (f"serve: {serve}\n" if serve else "") + "routes:\n  chat:\n"
        f"    - {{tier: cloud, backend: openai, model: m, base_url: {base_url},\n"
        "       api_key_env: UPSTREAM_KEY, max_tokens: 8, name: stand-in}\n"
    )
    env = {
        "GPULOCK_CONFIG": str(config),
        "GPULOCK_STATE_DIR": str(root / "state"),
        "UPSTREAM_KEY": "k",
    }
    return GatewayProc(root / "serve.log", env=env)
