"""Two tiny agents that ``tests/test_fleet.py`` runs through the real runtime, from a fleet.

Named to the runtime with ``--module tests/fleet_agents.py`` (the fleet file's ``module:``).
"""

from __future__ import annotations

import os
import time

import gpulock
from gpulock.agents import Context, agent


@agent("fleet-probe", timeout="1m", description="append one line per run to its first input")
def probe(ctx: Context) -> None:
    # Same layout as the test's recorder lines, plus the timeout the runtime was given.
    line = f"start {ctx.name} {os.getpid()} {os.getpgid(0)} {time.time():.6f} {ctx.timeout_s}\n"
    fd = os.open(ctx.inputs[0], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


@agent("fleet-busy", description="always finds the GPU taken: the runtime makes that exit 75")
def busy(ctx: Context) -> None:
    raise gpulock.LockTimeout(gpu=0, waited_s=0.1, holder_pid=1, holder_name="someone")
