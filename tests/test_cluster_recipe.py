"""docs/cluster.md's "Try it on one machine", run as written: its three shell blocks, in bash,
with only the ports (free ones) and the home folder (this test's) changed."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from procs import wait_until
from redis_server import need_redis
from router_servers import free_port

REPO = Path(__file__).resolve().parent.parent
WAIT_S = 90.0


def recipe() -> list[str]:
    text = (REPO / "docs" / "cluster.md").read_text()
    section = text.split("## Try it on one machine", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sh\n(.*?)```", section, re.S)


def test_the_one_machine_recipe_runs_as_written(tmp_path: Path) -> None:
    need_redis()
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    blocks = recipe()
    assert len(blocks) == 3, blocks
    ports = {"6390": str(free_port()), "11501": str(free_port()), "11502": str(free_port())}
    for old, new in ports.items():
        blocks = [b.replace(old, new) for b in blocks]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULOCK_")}
    env.update(
        HOME=str(tmp_path),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=str(REPO),
    )

    def bash(block: str, **kw: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "-eu", "-c", block],
            env=env, capture_output=True, text=True, timeout=WAIT_S, **kw,  # type: ignore[call-overload]
        )  # fmt: skip

    hosts = look = None
    try:
        made = bash(blocks[0])
        assert made.returncode == 0, made.stderr
        assert (tmp_path / "gpulock-try" / "a.yaml").is_file()
        log = (tmp_path / "hosts.log").open("wb")
        hosts = subprocess.Popen(
            ["bash", "-eu", "-c", blocks[1] + "wait\n"],
            env=env, stdout=log, stderr=log, start_new_session=True,
        )  # fmt: skip

        def up(port: str) -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    return bool(r.status == 200 and b'"hosts":2' in r.read())
            except OSError:
                return False

        wait_until(
            lambda: up(ports["11501"]) and up(ports["11502"]),
            WAIT_S,
            lambda: (
                "both hosts up, each seeing the other\n"
                + (tmp_path / "hosts.log").read_text(errors="replace")
            ),
        )
        # To files, not pipes: the `gpulock run ... &` it leaves holding would keep a pipe open.
        seen, errs = (tmp_path / "look.out").open("wb"), (tmp_path / "look.err").open("wb")
        look = subprocess.Popen(
            ["bash", "-eu", "-c", blocks[2]],
            env=env, stdout=seen, stderr=errs, start_new_session=True,
        )  # fmt: skip
        assert look.wait(WAIT_S) == 0, (tmp_path / "look.err").read_text()
        out = (tmp_path / "look.out").read_text()
        assert "a (this host)" in out and "\nb " in out, out
        assert "on b: starts in" in out, out
        assert re.search(r"(?im)^x-gpulock-host: b\s*$", out), out
    finally:
        for p in (look, hosts):
            if p is not None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(30)
        subprocess.run(
            ["redis-cli", "-p", ports["6390"], "shutdown", "nosave"],
            capture_output=True, timeout=30,
        )  # fmt: skip
