"""Nothing gpulock starts can be shadowed by the folder it was started from.

Home is where users (and systemd user services) start things, and a folder there may be named
like a package: ``agents/`` (the docs once suggested ``~/agents/digest.py``), or ``gpulock/`` (a
checkout, a backup).  Every Python gpulock starts runs with ``-P``, so a fleet's scheduled run,
a pooled agent's workers and ``gpulock agent run`` all work from a folder holding junk
``agents/``, ``router/``, ``serve/`` and ``gpulock/`` packages that fail when imported.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
from cli_helpers import VENV_BIN, Cli, wait_until

from gpulock.core import children

GPULOCK = str(Path(VENV_BIN) / "gpulock")  # the console script, as a user's shell runs it

# A user's agent module, in a folder of its own (named like nothing gpulock imports).
AGENT_PY = """\
import os
from gpulock.agents import agent

@agent("hello")
def hello(ctx):
    with open({out!r}, "a") as f:
        f.write(f"hello {{os.getpid()}}\\n")

@agent("split", workers=2, need="8GiB", timeout="60s")
def split(ctx):
    for item in ctx.batch(range(6)):
        fd = os.open({out!r}, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, f"item {{item}}\\n".encode())
        os.close(fd)
"""


@pytest.fixture
def junk(tmp_path: Path) -> Path:
    folder = tmp_path / "home"
    for name in ("agents", "router", "serve", "gpulock"):
        (folder / name).mkdir(parents=True)
        (folder / name / "__init__.py").write_text(
            f"raise ImportError('junk {name}/ shadowed it')\n"
        )
    return folder


def _module(cli: Cli) -> tuple[Path, Path]:
    out = cli.root / "out.txt"
    module = cli.root / "mine" / "hello_jobs.py"
    module.parent.mkdir()
    module.write_text(AGENT_PY.format(out=str(out)))
    return module, out


def _lines(out: Path) -> list[str]:
    return out.read_text().splitlines() if out.exists() else []


def test_agent_run_and_a_pooled_agent_from_a_folder_of_junk_packages(cli: Cli, junk: Path) -> None:
    module, out = _module(cli)
    env = cli.env(GPULOCK_SIMULATE="24GiB")
    r = cli.run(
        "agent", "run", "hello", "--module", str(module), argv0=[GPULOCK], cwd=junk, env=env
    )
    assert r.code == 0, r.describe()
    assert [ln.split()[0] for ln in _lines(out)] == ["hello"]
    # A pooled agent as a fleet starts it (python -P -m gpulock.agents): its workers run the
    # same command line again, from the same folder.
    leader = children.python("-m", "gpulock.agents")
    r = cli.run("run", "split", "--module", str(module), argv0=leader, cwd=junk, env=env)
    assert r.code == 0, r.describe()
    items = sorted(ln for ln in _lines(out) if ln.startswith("item"))
    assert items == [f"item {i}" for i in range(6)], r.describe()
    workers = [e for e in cli.events("acquire") if "split" in str(e.get("name"))]
    assert workers, cli.describe()  # the batch ran in the pool's workers, under tickets


def test_a_fleets_scheduled_run_from_a_folder_of_junk_packages(cli: Cli, junk: Path) -> None:
    module, out = _module(cli)
    fleet = cli.root / "fleet.yaml"
    entry = {"name": "hello", "every": "1s", "module": str(module)}
    fleet.write_text(json.dumps({"agents": [entry]}) + "\n")
    env = cli.env(GPULOCK_SIMULATE="24GiB")
    proc = subprocess.Popen(
        [GPULOCK, "fleet", str(fleet), "--for", "120s"],
        cwd=junk,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        runs = wait_until(
            lambda: cli.events("fleet-run"),
            lambda: f"no fleet run ended; events: {cli.events()}",
            60,
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=60)[0].decode(errors="replace")
    assert runs[0].get("outcome") == "ok", (runs, output)
    assert _lines(out) and _lines(out)[0].startswith("hello"), output
