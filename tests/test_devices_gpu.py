"""Device probes on a real NVIDIA GPU; skipped, with the reason, where NVML shows none.

The torch tests also need torch built with CUDA.  They allocate about 1 GiB on the first
device this process sees and look for this process in NVML's list on every GPU, since a CUDA
index need not be the NVML index.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from gpulock.core import devices

_REPORT = devices.probe(None, {})  # {}: a simulated GPU in the environment must not count

# A skipif mark rather than pytest.skip(allow_module_level=True): the tests are still collected,
# so `pytest -m gpu` on a machine without a GPU reports them skipped and exits 0, not 5.
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not _REPORT.devices,
        reason=f"no NVIDIA GPU visible to NVML: {_REPORT.problem or 'NVML lists none'}",
    ),
]

GIB = 1024**3


def test_every_gpu_reports_consistent_memory() -> None:
    report = devices.probe(None, {})
    assert report.source == "nvml" and report.problem is None
    assert devices.nvml_available()
    for dev in report.devices:
        assert dev.source == "nvml"
        assert dev.total_bytes is not None and dev.used_bytes is not None
        assert dev.free_bytes is not None
        assert dev.total_bytes > dev.used_bytes >= 0
        # NVML's used + free is total, up to what the driver reserves for itself.
        assert 0 <= dev.total_bytes - (dev.used_bytes + dev.free_bytes) <= dev.total_bytes // 10
        assert dev.uuid is not None and dev.uuid.startswith(("GPU-", "MIG-"))
        for pct in (dev.util_gpu_pct, dev.util_mem_pct):
            assert pct is None or 0 <= pct <= 100
        for p in dev.processes:
            assert p.pid > 0 and p.kind in ("compute", "graphics")
            assert p.used_bytes is None or p.used_bytes >= 0


def _cuda_torch() -> Any:
    try:
        import torch
    except ImportError:
        pytest.skip("torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    return torch


def _our_nvml_use() -> tuple[int, int] | None:
    """(NVML index, bytes) of this process's largest use of a GPU, or None when not listed."""
    report = devices.probe(None, {})
    pid = os.getpid()
    uses = [
        (used, d.index)
        for d in report.devices
        if (used := devices.process_used_bytes(report, d.index, pid)) is not None
    ]
    if not uses:
        return None
    used, index = max(uses)
    return index, used


def _skip_if_pid_namespace() -> None:
    # NVML lists host pids: in a container none of them is ours, and most are not visible.
    report = devices.probe(None, {})
    listed = {p.pid for d in report.devices for p in d.processes}
    if listed and not all(os.path.exists(f"/proc/{pid}") for pid in listed):
        pytest.skip("NVML lists pids from another pid namespace (a container?)")


def test_torch_allocation_shows_in_nvml_and_goes_after_empty_cache() -> None:
    torch = _cuda_torch()
    block = torch.empty(GIB, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    try:
        ours = _our_nvml_use()
        if ours is None:
            _skip_if_pid_namespace()
        assert ours is not None, "this process is not in NVML's process list"
        gpu, nvml_used = ours
        assert nvml_used >= GIB

        mem = devices.torch_memory(0)
        assert mem is not None
        assert mem.allocated_bytes >= GIB
        assert mem.reserved_bytes >= mem.allocated_bytes
        assert mem.fragmentation_bytes == mem.reserved_bytes - mem.allocated_bytes
        # NVML counts the CUDA context too, so it sees at least what torch reserved, and not
        # much more for a process that only allocated one tensor.
        assert mem.reserved_bytes <= nvml_used <= mem.reserved_bytes + 2 * GIB
    finally:
        del block
        torch.cuda.empty_cache()

    after = devices.torch_memory(0)
    assert after is not None and after.reserved_bytes < GIB
    deadline = time.monotonic() + 5.0
    while True:
        report = devices.probe(None, {})
        now = devices.process_used_bytes(report, gpu, os.getpid())
        if now is not None and now <= nvml_used - GIB // 2:  # most of the 1 GiB came back
            break
        assert time.monotonic() < deadline, f"NVML still shows {now} bytes, was {nvml_used}"
        time.sleep(0.1)


def test_torch_memory_without_a_device_is_none() -> None:
    torch = _cuda_torch()
    assert devices.torch_memory(torch.cuda.device_count()) is None
    assert devices.torch_memory(-1) is None
