"""gpulock: a fair, crash-safe line in front of each GPU for fleets of small AI agents.

::

    import gpulock

    with gpulock.acquire(gpu=0, need="6GiB", timeout=600, name="digest") as lease:
        ...  # the GPU is yours; CUDA_VISIBLE_DEVICES-style index: lease.gpu

Importing this package stays light (no torch, pynvml, llama_cpp, openai or apscheduler): cron
jobs import it every minute.
"""

from __future__ import annotations

from gpulock.errors import (
    ConfigError,
    GpulockError,
    LockError,
    LockTimeout,
    NeedTooLarge,
    NotPermitted,
    StateDirError,
)
from gpulock.lock import Lease, acquire, locked

__all__ = [
    "ConfigError",
    "GpulockError",
    "Lease",
    "LockError",
    "LockTimeout",
    "NeedTooLarge",
    "NotPermitted",
    "StateDirError",
    "acquire",
    "locked",
]
__version__ = "0.1.0"
