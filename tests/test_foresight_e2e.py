"""End to end: a fleet of real processes on a simulated GPU that holds two of three models.

A host process keeps the models resident (``tests/fleet_host.py``); each agent run is a real
``gpulock run --need`` whose command asks the host for its model; the runs queue up in the
GPU's line behind a gate, in the order A B C A B C...  The line is what foresight reads (the
waiters' models, in line order), so with ``foresight`` the room made for each run evicts the
model needed last, and loads come close to Belady's optimum; with ``lru`` every use after the
first two is a reload (LRU's worst case, a cycle one longer than the cache).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import GPULOCK, REPO, Cli
from procs import wait_until

from gpulock.replay_sim import Arrival, simulate

GiB = 1024**3
ORDER = "ABC" * 4
JOB = (
    "import socket, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); "
    "s.sendall((sys.argv[2] + ' ' + sys.argv[3] + chr(10)).encode()); "
    "assert s.makefile().readline() == 'ok' + chr(10)"
)
GATE = (
    "import os, sys, time; open(sys.argv[1], 'w').close()\n"
    "while not os.path.exists(sys.argv[2]): time.sleep(0.02)"
)


def loads_with(cli: Cli, tmp_path: Path, policy: str) -> int:
    config = tmp_path / f"{policy}.yaml"
    config.write_text(f"eviction:\n  policy: {policy}\n")
    cli.simulate = "20GiB"  # two 8 GiB models fit, not three
    env = cli.env(PYTHONPATH=str(REPO), GPULOCK_CONFIG=str(config))
    sock = tmp_path / f"{policy}.sock"
    host = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "fleet_host.py"), str(sock), "8GiB"],
        env=env, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    procs: list[subprocess.Popen[bytes]] = []
    try:
        assert host.stdout is not None and host.stdout.readline() == "ready\n"
        held, release = tmp_path / f"{policy}.held", tmp_path / f"{policy}.release"
        gate = [*GPULOCK, "run", "--name", "gate", "--", sys.executable, "-c", GATE]
        procs.append(subprocess.Popen([*gate, str(held), str(release)], env=env))
        wait_until(held.exists, 30.0, "the gate to hold the GPU")
        queue = cli.state / "gpu0"
        for i, model in enumerate(ORDER):
            run = [
                *GPULOCK,
                "run",
                "--need",
                "10GiB",
                "--timeout",
                "120",
                "--name",
                f"agent-{model}",
            ]
            job = [sys.executable, "-c", JOB, str(sock), model, f"agent-{model}"]
            procs.append(subprocess.Popen([*run, "--", *job], env=env))
            wait_until(lambda n=i + 2: len(list(queue.glob("*.ticket"))) >= n, 30.0, "a ticket")
        release.touch()
        codes = [p.wait(timeout=120) for p in procs]
        assert codes == [0] * len(procs)
    finally:
        for p in [*procs, host]:
            if p.poll() is None:
                p.kill()
                p.wait()
    loads = [e for e in cli.events("resident") if e.get("name") in set(ORDER)]
    for e in cli.events("evict"):
        assert e["policy"] == policy
    cli.state.joinpath("events.jsonl").rename(tmp_path / f"{policy}.events.jsonl")
    return len(loads)


@pytest.mark.slow
def test_foresight_loads_about_as_few_as_belady_and_fewer_than_lru(
    cli: Cli, tmp_path: Path
) -> None:
    trace = [Arrival(i * 10.0, f"agent-{m}", m, 8 * GiB, 1.0, 8 * GiB) for i, m in enumerate(ORDER)]
    belady = simulate([Arrival(0, "gate", "", 0, 1.0, None), *trace], 20 * GiB, "belady").loads
    foresight = loads_with(cli, tmp_path, "foresight")
    lru = loads_with(cli, tmp_path, "lru")
    assert foresight <= belady + 1, (foresight, belady, lru)
    assert foresight < lru, (foresight, belady, lru)
