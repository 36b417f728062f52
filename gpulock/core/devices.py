"""What GPUs this machine has, how big they are and who uses them: simulated or NVML.

One interface above two probes, so the code that uses it (the lock's VRAM sharing, status, the
governor) is the same on a laptop without a GPU and on a workstation with one:

* ``GPULOCK_SIMULATE=24GiB`` (or ``24GiB,12GiB`` for two GPUs; the config key ``simulate``
  likewise, the variable wins) declares simulated GPUs.  Their use is whatever the caller says
  it is (``probe(..., used_by=...)``: the residents' declared bytes plus the holders' needs).
* Otherwise NVML through ``nvidia-ml-py``, imported lazily and initialised once.  No package or
  no driver is a state ("no NVIDIA driver: ..."), never a crash, and never a fake 0: values
  nobody measured are ``None``.  Every NVML call goes through ``_nvml()``, the one place that
  turns a driver error into "not available".

GPUs are numbered by NVML index, the physical order the driver reports, whatever
``CUDA_VISIBLE_DEVICES`` says: gpulock arbitrates the machine's GPUs, not one process's view
of them.  ``torch_memory`` is the exception, as it asks torch about this process's own device.

``pynvml`` and ``torch`` are imported inside the functions that need them, so importing this
module (which every cron job does, through the lock) costs neither.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any, TypeVar

from gpulock.core.config import Config
from gpulock.core.errors import ConfigError, NoSuchGpu
from gpulock.core.units import gpu_size_mistake, parse_size

SIMULATE_ENV = "GPULOCK_SIMULATE"
# One folder per GPU the NVIDIA driver drives: a count without importing pynvml, which
# `gpulock run` must not pay for (see known_gpus).
DRIVER_GPUS = "/proc/driver/nvidia/gpus"

NO_PACKAGE = "no NVIDIA driver information: nvidia-ml-py is not installed"

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """A process with a context on a GPU, as NVML lists it."""

    pid: int  # as NVML sees it: the host's pid, also from inside a container
    used_bytes: int | None  # None where NVML cannot tell (WDDM, some MIG and vGPU setups)
    kind: str  # "compute" | "graphics"


@dataclass(frozen=True, slots=True)
class Device:
    index: int  # NVML index (physical order), not a CUDA_VISIBLE_DEVICES position
    name: str
    source: str  # "simulated" | "nvml"
    total_bytes: int | None
    used_bytes: int | None = None  # NVML v2: allocated, without what the driver reserves
    free_bytes: int | None = None
    uuid: str | None = None  # "GPU-..." for NVML devices; None for simulated ones
    util_gpu_pct: int | None = None  # share of the last sample period a kernel ran
    util_mem_pct: int | None = None  # share of it the memory was read or written
    # NVML's listing; empty both when nobody uses the GPU and when it could not be listed, so
    # ask ``process_used_bytes``, which says None rather than guess.
    processes: tuple[GpuProcess, ...] = ()
    # Memory the driver and firmware keep for themselves (NVML v2); None where only v1 answers
    # (then ``used_bytes`` includes it) and for simulated GPUs.
    reserved_bytes: int | None = None


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


@dataclass(frozen=True, slots=True)
class TorchMemory:
    """This process's torch caching allocator on one CUDA device."""

    allocated_bytes: int  # held by live tensors
    reserved_bytes: int  # held by the allocator from the driver (allocated + cached)
    fragmentation_bytes: int  # reserved - allocated: what empty_cache() could give back


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
        mistake = gpu_size_mistake(p, size)
        if mistake is not None:
            raise ConfigError(mistake[0], key=key, hint=mistake[1])
        sizes.append(size)
    return tuple(sizes)


def simulated_sizes(
    config: Config | None, environ: Mapping[str, str] | None = None
) -> tuple[int, ...] | None:
    """The simulated GPUs' sizes (``$GPULOCK_SIMULATE`` first, then the config), or None."""
    env = os.environ if environ is None else environ
    spec = env.get(SIMULATE_ENV)
    if spec:
        return parse_simulate(spec)
    if config is not None and config.simulate_bytes:
        return tuple(config.simulate_bytes)
    return None


def probe(
    config: Config | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    used_by: Callable[[int], int] | None = None,
) -> DeviceReport:
    """The GPUs this process should arbitrate, simulated or real; never raises for NVML.

    Simulated GPUs use ``used_by(index)`` bytes when it is given, else an unknown amount.  Real
    GPUs are measured, so ``used_by`` is ignored for them.  A bad ``GPULOCK_SIMULATE`` raises
    ``ConfigError``.
    """
    sizes = simulated_sizes(config, environ)
    if sizes is not None:
        return DeviceReport(
            tuple(_simulated(i, s, used_by) for i, s in enumerate(sizes)), "simulated"
        )
    return _nvml_report()


def _simulated(index: int, size: int, used_by: Callable[[int], int] | None) -> Device:
    used = used_by(index) if used_by is not None else None
    # Declared bytes can add up to more than the GPU; a real GPU never shows less than 0 free.
    free = max(size - used, 0) if used is not None else None
    return Device(index, f"simulated GPU {index}", "simulated", size, used, free)


def known_gpus(
    config: Config | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    driver_dir: str = DRIVER_GPUS,
) -> tuple[tuple[int, ...], str] | None:
    """The GPU indices this machine has and where that came from; None when it cannot tell.

    Simulated GPUs are exact.  Real ones are counted in the driver's ``/proc`` folder (one
    entry per GPU), never through NVML: importing pynvml is what every ``gpulock run`` must
    not pay for.  Inside a container the driver may list GPUs the container cannot see, so
    the count can only be too high: a GPU refused here surely does not exist.  No driver
    folder (no NVIDIA driver, another vendor) is "cannot tell", never "no GPU".
    """
    sizes = simulated_sizes(config, environ)
    if sizes is not None:
        return tuple(range(len(sizes))), "simulated"
    try:
        count = len(os.listdir(driver_dir))
    except OSError:
        return None
    return (tuple(range(count)), "NVIDIA") if count else None


def check_gpu(
    gpu: int,
    config: Config | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    driver_dir: str = DRIVER_GPUS,
) -> None:
    """``NoSuchGpu`` (naming the GPUs there are) for an index this machine does not have."""
    known = known_gpus(config, environ, driver_dir=driver_dir)
    if known is not None and gpu not in known[0]:
        raise NoSuchGpu(gpu, *known)


def total_bytes(
    gpu: int, config: Config | None = None, environ: Mapping[str, str] | None = None
) -> int | None:
    dev = probe(config, environ).get(gpu)
    return dev.total_bytes if dev is not None else None


def process_used_bytes(report: DeviceReport, gpu: int, pid: int) -> int | None:
    """GPU memory ``pid`` uses on ``gpu`` per NVML, context included; None when unknown.

    A pid NVML does not list is unknown, not 0: NVML lists host pids, so from inside a
    container (another pid namespace) nobody's pid matches, and a failed listing is empty too.
    A process listed both as compute and graphics is counted once.
    """
    dev = report.get(gpu)
    if dev is None:
        return None
    known = [p.used_bytes for p in dev.processes if p.pid == pid and p.used_bytes is not None]
    return max(known) if known else None


def gpu_pids(gpu: int, config: Config | None = None) -> frozenset[int] | None:
    """The pids NVML lists on ``gpu`` now; None for simulated GPUs or without NVML."""
    if simulated_sizes(config) is not None:
        return None
    nv, _ = _nvml_module()
    if nv is None:
        return None
    h = _nvml(nv.nvmlDeviceGetHandleByIndex, gpu)
    if h is None:
        return None
    return frozenset(p.pid for p in _nvml_processes(nv, h))


def nvml_available() -> bool:
    """True when NVML is installed, initialised and reports at least one GPU."""
    nv, _ = _nvml_module()
    if nv is None:
        return False
    count = _nvml(nv.nvmlDeviceGetCount)
    return count is not None and int(count) > 0


def torch_memory(device_index: int) -> TorchMemory | None:
    """What torch's caching allocator holds in this process on CUDA device ``device_index``.

    ``device_index`` counts the devices this process sees (after ``CUDA_VISIBLE_DEVICES``),
    unlike the NVML indices elsewhere here.  None when torch is not installed, CUDA is not
    available or there is no such device.  CUDA is never initialised here: a process that has
    not used it holds nothing, which is 0 measured, not guessed.
    """
    try:
        import torch
    except (ImportError, OSError):  # OSError: a torch whose CUDA libraries fail to load
        return None
    try:
        if not torch.cuda.is_available() or not 0 <= device_index < torch.cuda.device_count():
            return None
        if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            return TorchMemory(0, 0, 0)
        allocated = int(torch.cuda.memory_allocated(device_index))
        reserved = int(torch.cuda.memory_reserved(device_index))
    except RuntimeError:  # a broken driver or a device that went away
        return None
    return TorchMemory(allocated, reserved, reserved - allocated)


# --- NVML: every call goes through _nvml(), which turns driver errors into "not available". ---

# NVML_VALUE_NOT_AVAILABLE as an unsigned long long; older nvidia-ml-py passes it through.
_NOT_AVAILABLE_U64 = 2**64 - 1

# Newest first: a driver older than the package lacks the newer symbols (FunctionNotFound, which
# the unversioned wrapper reports as NVMLLibraryMismatchError), so the next one is tried.
_PROCESS_LISTERS = (
    ("compute", "nvmlDeviceGetComputeRunningProcesses"),
    ("graphics", "nvmlDeviceGetGraphicsRunningProcesses"),
)
_VERSIONS = ("_v3", "_v2", "")


def _nvml(fn: Callable[..., T], *args: Any) -> T | None:
    """Call one NVML function; any error (not supported, no permission, GPU lost...) is None."""
    try:
        return fn(*args)
    except Exception:  # NVMLError_* and NVMLLibraryMismatchError share no base but Exception
        return None


@cache
def _nvml_module() -> tuple[Any, str | None]:
    """``(pynvml, None)`` once initialised, or ``(None, why not)``; tried once per process."""
    try:
        import pynvml
    except ImportError:
        from gpulock.core.extras import install_hint  # here: only when the package is missing

        return None, f"{NO_PACKAGE} ({install_hint('nvml')})"
    return _nvml_init(pynvml)


def _nvml_init(nv: Any) -> tuple[Any, str | None]:
    try:
        nv.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return None, f"no NVIDIA driver: {_nvml_error_text(e)}"
    return nv, None


def _nvml_error_text(e: BaseException) -> str:
    try:
        text = str(e)
    except Exception:  # NVMLError.__str__ asks the library, which may be what is broken
        text = ""
    return (text or e.__class__.__name__).replace("\n", " ")


def _nvml_report(nv: Any = None) -> DeviceReport:
    """Probe every GPU NVML knows; ``nv`` is an initialised pynvml (tests pass a stand-in)."""
    if nv is None:
        nv, problem = _nvml_module()
        if nv is None:
            return DeviceReport((), None, problem)
    try:
        count = int(nv.nvmlDeviceGetCount())
    except Exception as e:
        return DeviceReport((), None, f"NVML failed: {_nvml_error_text(e)}")
    return DeviceReport(tuple(_nvml_device(nv, i) for i in range(count)), "nvml")


def _nvml_device(nv: Any, index: int) -> Device:
    """One GPU, each value on its own, so one unsupported query hides nothing else."""
    h = _nvml(nv.nvmlDeviceGetHandleByIndex, index)
    if h is None:
        return Device(index, f"GPU {index}", "nvml", None)
    name = _text(_nvml(nv.nvmlDeviceGetName, h)) or f"GPU {index}"
    mem, reserved = _nvml_memory(nv, h)
    util = _nvml(nv.nvmlDeviceGetUtilizationRates, h)
    return Device(
        index,
        name,
        "nvml",
        total_bytes=_int(getattr(mem, "total", None)),
        used_bytes=_int(getattr(mem, "used", None)),
        free_bytes=_int(getattr(mem, "free", None)),
        uuid=_text(_nvml(nv.nvmlDeviceGetUUID, h)),
        util_gpu_pct=_pct(getattr(util, "gpu", None)),
        util_mem_pct=_pct(getattr(util, "memory", None)),
        processes=_nvml_processes(nv, h),
        reserved_bytes=reserved,
    )


def _nvml_memory(nv: Any, handle: Any) -> tuple[Any, int | None]:
    """(memory info, driver-reserved bytes): v2 where the package and driver have it, so that
    ``used`` is what processes allocated; else v1, whose ``used`` includes the reservation."""
    v2 = getattr(nv, "nvmlMemory_v2", None)
    if v2 is not None:
        mem = _nvml(lambda: nv.nvmlDeviceGetMemoryInfo(handle, version=v2))
        if mem is not None:  # None: an older driver (FunctionNotFound, version mismatch)
            return mem, _int(getattr(mem, "reserved", None))
    return _nvml(nv.nvmlDeviceGetMemoryInfo, handle), None


def _nvml_processes(nv: Any, handle: Any) -> tuple[GpuProcess, ...]:
    found: list[GpuProcess] = []
    for kind, base in _PROCESS_LISTERS:
        for raw in _nvml_list(nv, base, handle) or ():
            pid = _int(getattr(raw, "pid", None))
            if pid is not None:
                found.append(GpuProcess(pid, _int(getattr(raw, "usedGpuMemory", None)), kind))
    return tuple(found)


def _nvml_list(nv: Any, base: str, handle: Any) -> list[Any] | None:
    for suffix in _VERSIONS:
        fn = getattr(nv, base + suffix, None)
        if fn is None:
            continue
        procs = _nvml(fn, handle)
        if procs is not None:
            return list(procs)
    return None


def _int(value: Any) -> int | None:
    """An NVML number, or None for "not available" (absent, or all bits set)."""
    try:
        n = int(value)
    except (TypeError, ValueError):  # None, or something no driver should return
        return None
    return None if n < 0 or n >= _NOT_AVAILABLE_U64 else n


def _pct(value: Any) -> int | None:
    """A percentage; NVML_VALUE_NOT_AVAILABLE as an unsigned int (2**32 - 1) is None."""
    n = _int(value)
    return n if n is not None and n <= 100 else None


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
