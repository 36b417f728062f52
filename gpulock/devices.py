"""What GPUs this machine has and how big they are: simulated (for tests, demos, dry runs) or NVML.

One interface above two probes, so the code that uses it (the lock's VRAM sharing, status, the
governor) is the same on a laptop without a GPU and on a workstation with one:

* ``GPULOCK_SIMULATE=24GiB`` (or ``24GiB,12GiB`` for two GPUs; the config key ``simulate``
  likewise, the variable wins) declares simulated GPUs.
* Otherwise NVML through ``nvidia-ml-py``, imported lazily and initialised once.  No package or
  no driver is a state ("no NVIDIA driver: ..."), never a crash, and never a fake 0: values
  nobody measured are ``None``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

from gpulock.config import Config
from gpulock.errors import ConfigError
from gpulock.units import parse_size

SIMULATE_ENV = "GPULOCK_SIMULATE"


@dataclass(frozen=True, slots=True)
class Device:
    index: int
    name: str
    source: str  # "simulated" | "nvml"
    total_bytes: int | None
    used_bytes: int | None = None
    free_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class DeviceReport:
    devices: tuple[Device, ...]
    source: str | None  # "simulated" | "nvml" | None when nothing could be probed
    problem: str | None = None  # why there is no device information, for humans

    def get(self, index: int) -> Device | None:
        for d in self.devices:
            if d.index == index:
                return d
        return None


def parse_simulate(spec: str | int, *, key: str = SIMULATE_ENV) -> tuple[int, ...]:
    """``"24GiB,12GiB"`` -> sizes in bytes, one per simulated GPU."""
    parts = [p.strip() for p in str(spec).split(",")]
    if not parts or not all(parts):
        raise ConfigError(f"expected sizes like 24GiB or 24GiB,12GiB, got {spec!r}", key=key)
    sizes = []
    for p in parts:
        try:
            size = parse_size(p)
        except ValueError as e:
            raise ConfigError(str(e), key=key) from None
        if size <= 0:
            raise ConfigError(f"a GPU needs a size above 0, got {p!r}", key=key)
        sizes.append(size)
    return tuple(sizes)


def simulated_sizes(
    config: Config | None, environ: Mapping[str, str] | None = None
) -> tuple[int, ...] | None:
    env = os.environ if environ is None else environ
    spec = env.get(SIMULATE_ENV)
    if spec:
        return parse_simulate(spec)
    if config is not None and config.simulate_bytes:
        return tuple(config.simulate_bytes)
    return None


def probe(config: Config | None = None, environ: Mapping[str, str] | None = None) -> DeviceReport:
    """The GPUs this process should arbitrate, simulated or real."""
    sizes = simulated_sizes(config, environ)
    if sizes is not None:
        devs = tuple(
            Device(index=i, name=f"simulated GPU {i}", source="simulated", total_bytes=s)
            for i, s in enumerate(sizes)
        )
        return DeviceReport(devs, "simulated")
    return _nvml_report()


def total_bytes(
    gpu: int, config: Config | None = None, environ: Mapping[str, str] | None = None
) -> int | None:
    dev = probe(config, environ).get(gpu)
    return dev.total_bytes if dev is not None else None


# --- NVML: every call goes through _nvml(), which turns driver errors into "not available". ---


@cache
def _nvml_module() -> tuple[Any, str | None]:
    try:
        import pynvml
    except ImportError:
        return None, (
            "no NVIDIA driver information: nvidia-ml-py is not installed "
            "(pip install 'gpulock[nvml]')"
        )
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return None, f"no NVIDIA driver: {_nvml_error_text(e)}"
    return pynvml, None


def _nvml_error_text(e: BaseException) -> str:
    text = str(e) or e.__class__.__name__
    return text.replace("\n", " ")


def _nvml_report() -> DeviceReport:
    nv, problem = _nvml_module()
    if nv is None:
        return DeviceReport((), None, problem)
    try:
        count = int(nv.nvmlDeviceGetCount())
    except Exception as e:
        return DeviceReport((), None, f"NVML failed: {_nvml_error_text(e)}")
    devs = []
    for i in range(count):
        name, total, used, free = f"GPU {i}", None, None, None
        try:
            h = nv.nvmlDeviceGetHandleByIndex(i)
            raw = nv.nvmlDeviceGetName(h)
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            total, used, free = int(mem.total), int(mem.used), int(mem.free)
        except Exception:  # one broken GPU must not hide the others
            pass
        devs.append(Device(i, name, "nvml", total, used, free))
    return DeviceReport(tuple(devs), "nvml")
