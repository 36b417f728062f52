"""gpulock: a fair, crash-safe line in front of each GPU for fleets of small AI agents.

::

    import gpulock

    with gpulock.acquire(gpu=0, need="6GiB", timeout=600, name="digest") as lease:
        ...  # the GPU is yours; CUDA_VISIBLE_DEVICES-style index: lease.gpu

Importing this package stays light (no torch, pynvml, llama_cpp, openai or apscheduler): cron
jobs import it every minute.
"""

from __future__ import annotations

from gpulock.api import Lease, acquire, acquire_async, locked
from gpulock.core.errors import (
    ConfigError,
    GpulockError,
    LockError,
    LockTimeout,
    NeedTooLarge,
    NoSuchGpu,
    NotPermitted,
    StateDirError,
)

__all__ = [
    "AdmissionRefused",
    "ConfigError",
    "GpulockError",
    "Lease",
    "LockError",
    "LockTimeout",
    "NeedTooLarge",
    "NoSuchGpu",
    "NotPermitted",
    "Resident",
    "StateDirError",
    "acquire",
    "acquire_async",
    "adapters",
    "admit",
    "evict",
    "governor_level",
    "locked",
    "resident",
]
__version__ = "0.1.0"

# Resident models need sockets and threads; load them only when first used, so the cron job
# that only takes the lock does not pay for them.
_LAZY = {
    "resident": ("gpulock.residents.owner", "resident"),
    "admit": ("gpulock.residents.eviction", "admit"),
    "evict": ("gpulock.residents.eviction", "evict_named"),
    "Resident": ("gpulock.residents.owner", "Resident"),
    "AdmissionRefused": ("gpulock.residents.eviction", "AdmissionRefused"),
    "adapters": ("gpulock.residents.adapters", None),
    "governor_level": ("gpulock.core.level", "governor_level"),
}


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module 'gpulock' has no attribute {name!r}")
    import importlib

    module, attr = _LAZY[name]
    mod = importlib.import_module(module)
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value
    return value
