"""Eviction on a real NVIDIA GPU: the registry asks, torch lets go, NVML shows it freed.

Skipped, with the reason, where NVML shows no GPU or torch has no CUDA.  The owner is a real
child process, so NVML's per-process number is the owner's alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from procs import wait_until

from gpulock.core import devices
from gpulock.core.settings import load
from gpulock.residents import eviction, registry

_REPORT = devices.probe(None, {})


def _torch_cuda() -> bool:
    try:
        import torch
    except (ImportError, OSError):
        return False
    return bool(torch.cuda.is_available())


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not _REPORT.devices,
        reason=f"no NVIDIA GPU visible to NVML: {_REPORT.problem or 'NVML lists none'}",
    ),
]

OWNER = textwrap.dedent(
    """
    import sys, time, torch, gpulock
    from gpulock.residents import adapters
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda:0")  # 1 GiB of "weights"
    holder = {"x": x}
    del x
    def unload():
        holder.pop("x", None)
        adapters.unload_torch(torch.nn.Module(), 0)  # gc + empty_cache: the blocks go back
    gpulock.resident("gpu-weights", gpu=0, bytes="1GiB", unload=unload)
    print("ready", flush=True)
    time.sleep(600)
    """
)


@pytest.mark.skipif(not _torch_cuda(), reason="torch with CUDA is not installed")
def test_eviction_frees_real_gpu_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = tmp_path / "state"
    monkeypatch.setenv("GPULOCK_STATE_DIR", str(state))
    env = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == "ready"

        def used() -> int | None:
            return devices.process_used_bytes(devices.probe(None, {}), 0, owner.pid)

        before = wait_until(used, 10, "NVML to list the owner")
        assert before >= 1 << 30
        [result] = eviction.evict_named("gpu-weights", state_dir=state)
        assert result.outcome == "freed", result
        assert result.freed_bytes is not None and result.freed_bytes >= (1 << 30) * 0.9
        after = used()
        assert after is not None and after <= before - (1 << 30) * 0.9
        assert not registry.Registry(load(None, state)).records()
    finally:
        owner.kill()
        owner.wait()
