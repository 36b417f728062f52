"""On a real NVIDIA GPU: a SIGKILLed holder's successor starts once NVML no longer lists it.

Skipped, with the reason, where NVML shows no GPU or torch has no CUDA.  The holder allocates
1 GiB with torch under ``gpulock run`` and is SIGKILLed with its whole group; the successor's
command asks NVML, as its first act, whether the dead pids are still listed.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest
from cli_helpers import Cli, wait_until

from gpulock.core import devices

_REPORT = devices.probe(None, {})

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not _REPORT.devices,
        reason=f"no NVIDIA GPU visible to NVML: {_REPORT.problem or 'NVML lists none'}",
    ),
]

ALLOCATE_PY = """\
import sys, torch
block = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
open(sys.argv[1], "w").close()
sys.stdin.read()
"""

CHECK_PY = """\
import json, sys
from gpulock.core import devices
dead = {int(p) for p in sys.argv[2:]}
listed = devices.gpu_pids(0) or frozenset()
with open(sys.argv[1], "w") as f:
    json.dump(sorted(dead & listed), f)
"""


def test_successor_starts_after_nvml_lets_go_of_the_dead_holder(cli: Cli) -> None:
    try:
        import torch
    except ImportError:
        pytest.skip("torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    alloc = cli.script("allocate.py", ALLOCATE_PY)
    check = cli.script("check.py", CHECK_PY)
    ready, out = cli.root / "holder.ready", cli.root / "check.json"
    holder = cli.start_run("holder", "--gpu", "0", cmd=[sys.executable, str(alloc), str(ready)])
    cli.wait_ready(holder, ready)
    child_pid = wait_until(
        lambda: (cli.entry("holder") or {}).get("child_pid"), "the holder's child_pid"
    )
    if child_pid not in (devices.gpu_pids(0) or ()):
        pytest.skip("NVML does not list the holder's pid (another pid namespace?)")
    successor = cli.start_run(
        "successor", "--gpu", "0", "--timeout", "120",
        cmd=[sys.executable, str(check), str(out), str(holder.pid), str(child_pid)],
    )  # fmt: skip
    cli.wait_event("wait", name="successor")
    os.killpg(holder.pid, signal.SIGKILL)
    assert successor.wait(120) == 0, successor.output()
    assert json.loads(out.read_text()) == [], "the successor started while NVML listed the dead"
    assert not cli.events("exit-wait-timeout"), cli.describe()
