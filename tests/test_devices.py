"""Device probes without a GPU: simulated GPUs, the NVML chokepoint, lazy imports.

The NVML tests drive ``_nvml_report``/``_nvml_init`` with a small stand-in module passed as an
argument (this machine cannot have an NVIDIA GPU); nothing is patched in ``sys.modules`` here.
What needs a real GPU is in test_devices_gpu.py.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from gpulock.core import devices
from gpulock.core.config import parse_config
from gpulock.core.devices import Device, DeviceReport, GpuProcess
from gpulock.core.errors import ConfigError

GIB = 1024**3
MIB = 1024**2
NO_SIM: dict[str, str] = {}  # an environ without GPULOCK_SIMULATE


def in_fresh_python(code: str) -> str:
    """Run ``code`` in a new interpreter (same venv) and return its stdout."""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


# --- simulated GPUs --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "sizes"),
    [
        ("24GiB", (24 * GIB,)),
        ("24GiB,12GiB", (24 * GIB, 12 * GIB)),
        (" 8GiB , 512MiB ", (8 * GIB, 512 * MIB)),
    ],
)
def test_parse_simulate(spec: str, sizes: tuple[int, ...]) -> None:
    assert devices.parse_simulate(spec) == sizes


@pytest.mark.parametrize("spec", ["", "24GiB,", ",12GiB", "lots", "0", "24GiB,0GiB", "-1GiB"])
def test_bad_simulate_spec_names_the_variable(spec: str) -> None:
    with pytest.raises(ConfigError) as caught:
        devices.parse_simulate(spec)
    assert caught.value.key == devices.SIMULATE_ENV
    assert "GPULOCK_SIMULATE" in str(caught.value)


@pytest.mark.parametrize(("spec", "guess"), [("24", "24GiB"), ("24GiB,12", "12GiB")])
def test_a_simulated_gpu_under_64_mib_in_the_variable_is_refused(spec: str, guess: str) -> None:
    with pytest.raises(ConfigError, match="too small to simulate") as caught:
        devices.parse_simulate(spec)
    assert caught.value.key == devices.SIMULATE_ENV
    assert caught.value.hint == f"did you mean {guess}?"


def test_bad_simulate_variable_raises_from_probe() -> None:
    with pytest.raises(ConfigError, match="GPULOCK_SIMULATE"):
        devices.probe(None, {devices.SIMULATE_ENV: "twelve"})


def test_one_simulated_gpu_without_used_by_has_unknown_use() -> None:
    report = devices.probe(None, {devices.SIMULATE_ENV: "24GiB"})
    assert report == DeviceReport(
        (Device(0, "simulated GPU 0", "simulated", 24 * GIB, None, None),), "simulated"
    )
    dev = report.devices[0]
    assert (dev.uuid, dev.util_gpu_pct, dev.util_mem_pct, dev.processes) == (None, None, None, ())


def test_two_simulated_gpus_use_what_used_by_says() -> None:
    asked: list[int] = []

    def used_by(gpu: int) -> int:
        asked.append(gpu)
        return {0: 6 * GIB, 1: 0}[gpu]

    report = devices.probe(None, {devices.SIMULATE_ENV: "24GiB,12GiB"}, used_by=used_by)
    assert report.source == "simulated" and report.problem is None
    assert asked == [0, 1]
    gpu0, gpu1 = report.devices
    assert (gpu0.total_bytes, gpu0.used_bytes, gpu0.free_bytes) == (24 * GIB, 6 * GIB, 18 * GIB)
    assert (gpu1.total_bytes, gpu1.used_bytes, gpu1.free_bytes) == (12 * GIB, 0, 12 * GIB)
    assert report.get(1) is gpu1 and report.get(2) is None


def test_over_declared_simulated_gpu_shows_no_free_memory_not_negative() -> None:
    report = devices.probe(None, {devices.SIMULATE_ENV: "8GiB"}, used_by=lambda _gpu: 10 * GIB)
    assert report.devices[0].used_bytes == 10 * GIB
    assert report.devices[0].free_bytes == 0


def test_config_simulate_is_used_and_the_variable_wins() -> None:
    cfg = parse_config("simulate: 12GiB\n", "x.yaml")
    assert devices.simulated_sizes(cfg, NO_SIM) == (12 * GIB,)
    assert devices.total_bytes(0, cfg, NO_SIM) == 12 * GIB
    env = {devices.SIMULATE_ENV: "24GiB,16GiB"}
    assert devices.simulated_sizes(cfg, env) == (24 * GIB, 16 * GIB)
    assert [d.total_bytes for d in devices.probe(cfg, env).devices] == [24 * GIB, 16 * GIB]
    assert devices.total_bytes(1, cfg, env) == 16 * GIB
    assert devices.total_bytes(2, cfg, env) is None


def test_simulated_processes_are_unknown() -> None:
    report = devices.probe(None, {devices.SIMULATE_ENV: "24GiB"}, used_by=lambda _gpu: GIB)
    assert devices.process_used_bytes(report, 0, 4711) is None


# --- this machine: no NVIDIA driver ----------------------------------------------------------

needs_no_nvml = pytest.mark.skipif(devices.nvml_available(), reason="this machine has NVML GPUs")


@needs_no_nvml
def test_probe_without_driver_is_a_problem_not_a_crash() -> None:
    report = devices.probe(None, NO_SIM)
    assert report.devices == () and report.source is None
    assert report.problem is not None
    assert "nvidia-ml-py" in report.problem or "no NVIDIA driver" in report.problem
    assert devices.total_bytes(0, None, NO_SIM) is None
    assert devices.process_used_bytes(report, 0, 1) is None
    assert devices.nvml_available() is False


@needs_no_nvml
def test_torch_memory_is_none_without_cuda() -> None:
    assert devices.torch_memory(0) is None


def test_without_the_package_the_problem_names_the_extra() -> None:
    # A fresh interpreter where `import pynvml` fails, whether or not it is installed here.
    out = in_fresh_python(
        "import sys; sys.modules['pynvml'] = None\n"
        "from gpulock.core import devices\n"
        "print(devices.probe(None, {}).problem)\n"
        "print(devices.nvml_available())\n"
    )
    problem, available = out.splitlines()
    assert problem.startswith("no NVIDIA driver information: nvidia-ml-py is not installed ("), out
    assert "install" in problem and "[nvml]'" in problem, out  # the form for this install
    assert available == "False"


def test_without_torch_torch_memory_is_none() -> None:
    out = in_fresh_python(
        "import sys; sys.modules['torch'] = None\n"
        "from gpulock.core import devices\n"
        "print(devices.torch_memory(0))\n"
    )
    assert out == "None"


def test_importing_devices_imports_neither_pynvml_nor_torch() -> None:
    out = in_fresh_python(
        "import sys, gpulock.core.devices\n"
        "print(sorted(m for m in ('pynvml', 'torch') if m in sys.modules))\n"
    )
    assert out == "[]"


# --- the NVML chokepoint, with a stand-in module ---------------------------------------------


class FakeNVMLError(Exception):
    """Like pynvml's errors: the class says what, str() says it for humans."""


class NotSupported(FakeNVMLError):
    def __str__(self) -> str:
        return "Not Supported"


class FunctionNotFound(FakeNVMLError):
    def __str__(self) -> str:
        return "Function Not Found"


def fails_with(exc: Exception) -> Callable[..., Any]:
    def call(*_args: Any) -> Any:
        raise exc

    return call


def proc(pid: int, used: int | None) -> SimpleNamespace:
    return SimpleNamespace(pid=pid, usedGpuMemory=used, gpuInstanceId=0, computeInstanceId=0)


def fake_nvml(**overrides: Any) -> SimpleNamespace:
    """Two GPUs as an initialised pynvml would show them; ``overrides`` break parts of it.

    GPU 0: everything known, pid 100 computing (2 GiB), pid 200 drawing (unknown amount, as
    nvidia-ml-py reports it), pid 300 both computing and drawing.  GPU 1: an older driver (no
    _v3 listers), no utilisation counters, NVML_VALUE_NOT_AVAILABLE passed through raw.
    """
    handles = ["h0", "h1"]
    names = {"h0": b"NVIDIA Fake 24GB", "h1": "NVIDIA Fake 12GB"}
    mem = {
        "h0": SimpleNamespace(total=24 * GIB, used=5 * GIB, free=19 * GIB),
        "h1": SimpleNamespace(total=12 * GIB, used=0, free=12 * GIB),
    }

    def util(h: str) -> SimpleNamespace:
        if h == "h1":
            raise NotSupported()
        return SimpleNamespace(gpu=37, memory=12)

    def compute_v3(h: str) -> list[SimpleNamespace]:
        if h == "h1":
            raise FunctionNotFound()
        return [proc(100, 2 * GIB), proc(300, GIB)]

    def graphics_v3(h: str) -> list[SimpleNamespace]:
        if h == "h1":
            raise FunctionNotFound()
        return [proc(200, None), proc(300, GIB)]

    nv = SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetCount=lambda: len(handles),
        nvmlDeviceGetHandleByIndex=lambda i: handles[i],
        nvmlDeviceGetName=lambda h: names[h],
        nvmlDeviceGetUUID=lambda h: f"GPU-{h}-uuid",
        nvmlDeviceGetMemoryInfo=lambda h: mem[h],
        nvmlDeviceGetUtilizationRates=util,
        nvmlDeviceGetComputeRunningProcesses_v3=compute_v3,
        nvmlDeviceGetComputeRunningProcesses_v2=lambda h: [proc(400, 2**64 - 1)],
        nvmlDeviceGetGraphicsRunningProcesses_v3=graphics_v3,
        nvmlDeviceGetGraphicsRunningProcesses_v2=lambda h: [],
    )
    for name, value in overrides.items():
        setattr(nv, name, value)
    return nv


def test_nvml_report_reads_every_value() -> None:
    report = devices._nvml_report(nv=fake_nvml())
    assert report.source == "nvml" and report.problem is None
    gpu0, gpu1 = report.devices
    assert gpu0 == Device(
        0,
        "NVIDIA Fake 24GB",
        "nvml",
        24 * GIB,
        5 * GIB,
        19 * GIB,
        uuid="GPU-h0-uuid",
        util_gpu_pct=37,
        util_mem_pct=12,
        processes=(
            GpuProcess(100, 2 * GIB, "compute"),
            GpuProcess(300, GIB, "compute"),
            GpuProcess(200, None, "graphics"),
            GpuProcess(300, GIB, "graphics"),
        ),
    )
    # Unsupported utilisation is unknown, not 0; the _v3 listers' absence falls back to _v2.
    assert (gpu1.name, gpu1.total_bytes, gpu1.used_bytes, gpu1.free_bytes) == (
        "NVIDIA Fake 12GB",
        12 * GIB,
        0,
        12 * GIB,
    )
    assert (gpu1.util_gpu_pct, gpu1.util_mem_pct) == (None, None)
    assert gpu1.processes == (GpuProcess(400, None, "compute"),)


def test_process_used_bytes() -> None:
    report = devices._nvml_report(nv=fake_nvml())
    assert devices.process_used_bytes(report, 0, 100) == 2 * GIB
    assert devices.process_used_bytes(report, 0, 300) == GIB  # listed twice, counted once
    assert devices.process_used_bytes(report, 0, 200) is None  # NVML could not tell
    assert devices.process_used_bytes(report, 1, 400) is None  # NVML_VALUE_NOT_AVAILABLE
    assert devices.process_used_bytes(report, 0, 999) is None  # not listed: unknown, not 0
    assert devices.process_used_bytes(report, 5, 100) is None  # no such GPU


def test_every_failing_query_is_none_and_hides_nothing_else() -> None:
    broken = fails_with(NotSupported())
    nv = fake_nvml(
        nvmlDeviceGetName=broken,
        nvmlDeviceGetUUID=broken,
        nvmlDeviceGetMemoryInfo=broken,
        nvmlDeviceGetComputeRunningProcesses_v3=broken,
        nvmlDeviceGetComputeRunningProcesses_v2=broken,
    )
    gpu0, gpu1 = devices._nvml_report(nv=nv).devices
    assert gpu0 == Device(
        0,
        "GPU 0",
        "nvml",
        None,
        None,
        None,
        uuid=None,
        util_gpu_pct=37,
        util_mem_pct=12,
        processes=(GpuProcess(200, None, "graphics"), GpuProcess(300, GIB, "graphics")),
    )
    assert gpu1.index == 1 and gpu1.total_bytes is None


def test_a_lost_gpu_does_not_hide_the_others() -> None:
    def handle(i: int) -> str:
        if i == 0:
            raise FakeNVMLError("GPU is lost")
        return "h1"

    gpu0, gpu1 = devices._nvml_report(nv=fake_nvml(nvmlDeviceGetHandleByIndex=handle)).devices
    assert gpu0 == Device(0, "GPU 0", "nvml", None)
    assert gpu1.total_bytes == 12 * GIB


def test_not_available_utilisation_is_none() -> None:
    raw = SimpleNamespace(gpu=2**32 - 1, memory=2**32 - 1)  # NVML_VALUE_NOT_AVAILABLE, uint
    gpu0 = devices._nvml_report(nv=fake_nvml(nvmlDeviceGetUtilizationRates=lambda h: raw))
    assert (gpu0.devices[0].util_gpu_pct, gpu0.devices[0].util_mem_pct) == (None, None)


def test_unversioned_lister_is_the_last_resort() -> None:
    gone = fails_with(FunctionNotFound())
    nv = fake_nvml(
        nvmlDeviceGetComputeRunningProcesses_v3=gone,
        nvmlDeviceGetComputeRunningProcesses_v2=gone,
        nvmlDeviceGetComputeRunningProcesses=lambda h: [proc(7, MIB)],
        nvmlDeviceGetGraphicsRunningProcesses_v3=gone,
        nvmlDeviceGetGraphicsRunningProcesses_v2=gone,
    )
    gpu0 = devices._nvml_report(nv=nv).devices[0]
    assert gpu0.processes == (GpuProcess(7, MIB, "compute"),)


def test_count_failure_is_a_problem() -> None:
    report = devices._nvml_report(nv=fake_nvml(nvmlDeviceGetCount=fails_with(NotSupported())))
    assert report == DeviceReport((), None, "NVML failed: Not Supported")


def test_init_failure_is_a_no_driver_problem() -> None:
    class DriverNotLoaded(FakeNVMLError):
        def __str__(self) -> str:
            return "Driver Not Loaded"

    nv, problem = devices._nvml_init(fake_nvml(nvmlInit=fails_with(DriverNotLoaded())))
    assert nv is None
    assert problem == "no NVIDIA driver: Driver Not Loaded"


def test_an_error_whose_text_fails_still_reads() -> None:
    class Unprintable(FakeNVMLError):
        def __str__(self) -> str:
            raise FakeNVMLError("nvmlErrorString failed too")

    _, problem = devices._nvml_init(fake_nvml(nvmlInit=fails_with(Unprintable())))
    assert problem == "no NVIDIA driver: Unprintable"


def test_init_success_returns_the_module() -> None:
    nv = fake_nvml()
    assert devices._nvml_init(nv) == (nv, None)


def test_chokepoint_passes_values_and_turns_errors_into_none() -> None:
    assert devices._nvml(lambda a, b: a + b, 2, 3) == 5
    assert devices._nvml(lambda: 0) == 0  # a measured 0 stays 0
    assert devices._nvml(fails_with(NotSupported())) is None


# nvidia-ml-py 12.535+ (the API followed here: nvmlDeviceGetMemoryInfo(handle, version=None);
# with version=nvmlMemory_v2 it calls nvmlDeviceGetMemoryInfo_v2 and returns a struct with
# version, total, reserved, free, used, where used no longer includes reserved).
NVML_MEMORY_V2 = 0x02000028


def memory_v2(driver_has_v2: bool) -> Callable[..., Any]:
    def get(h: str, version: int | None = None) -> SimpleNamespace:
        if version is None:  # v1: used = total - free, the driver's reservation included
            return SimpleNamespace(total=24 * GIB, used=5 * GIB, free=19 * GIB)
        if not driver_has_v2:
            raise FunctionNotFound()
        assert version == NVML_MEMORY_V2
        return SimpleNamespace(
            version=version, total=24 * GIB, reserved=512 * MIB, free=19 * GIB,
            used=5 * GIB - 512 * MIB,
        )  # fmt: skip

    return get


def test_nvml_v2_memory_leaves_the_driver_reservation_out_of_used() -> None:
    nv = fake_nvml(nvmlMemory_v2=NVML_MEMORY_V2, nvmlDeviceGetMemoryInfo=memory_v2(True))
    gpu0 = devices._nvml_report(nv=nv).devices[0]
    assert (gpu0.total_bytes, gpu0.used_bytes, gpu0.free_bytes) == (24 * GIB, 4.5 * GIB, 19 * GIB)
    assert gpu0.reserved_bytes == 512 * MIB


def test_nvml_memory_falls_back_to_v1_where_the_driver_lacks_v2() -> None:
    nv = fake_nvml(nvmlMemory_v2=NVML_MEMORY_V2, nvmlDeviceGetMemoryInfo=memory_v2(False))
    gpu0 = devices._nvml_report(nv=nv).devices[0]
    assert (gpu0.used_bytes, gpu0.free_bytes, gpu0.reserved_bytes) == (5 * GIB, 19 * GIB, None)
    old_package = devices._nvml_report(nv=fake_nvml()).devices[0]  # no nvmlMemory_v2 at all
    assert (old_package.used_bytes, old_package.reserved_bytes) == (5 * GIB, None)
