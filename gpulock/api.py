"""The public face: ``acquire``, ``locked`` and ``acquire_async``, as ``gpulock`` exports them.

They are the lock's own entry points (``gpulock.lock.lease``, ``gpulock.lock.aiolock``) with
the residents' room-maker handed in, so that idle models of other processes leave before a
grant (``gpulock.residents.room``).  Packages built on gpulock take the line here.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from gpulock.lock import lease as _lease
from gpulock.lock.gpuset import GpuArg, Prefer
from gpulock.lock.lease import Lease
from gpulock.residents.room import ROOM

if TYPE_CHECKING:
    from gpulock.core.config import Config
    from gpulock.lock.aiolock import AsyncAcquire

__all__ = ["Lease", "acquire", "acquire_async", "locked"]

P = ParamSpec("P")
R = TypeVar("R")


def acquire(
    gpu: GpuArg = None,
    need: int | str | None = None,
    timeout: float | str | None = None,
    name: str | None = None,
    lease: float | str | None = None,
    *,
    gpus: int | None = None,
    config: Config | str | None = None,
    state_dir: str | os.PathLike[str] | None = None,
    command: Sequence[str] | None = None,
    prefetch: Sequence[str | os.PathLike[str]] | None = None,
    prefer: Prefer = None,
) -> Lease:
    """Wait in line for a GPU and return the granted Lease (also a context manager).

    gpu: an index, a set (``[0, 2]`` or ``"0,2"``) or ``"any"``: the ticket is granted on
    whichever GPU of the set can take it first (default: the config's ``default_gpu``, else
    0); ``lease.gpu`` says which, ``lease.gpus`` all it holds.  gpus: how many GPUs at once,
    all or nothing (``gpus=2``; without ``gpu``, from every GPU).  need: VRAM this holder will
    use (on each GPU), e.g. ``"6GiB"``; None means the whole GPU, exclusively.  timeout:
    seconds (or ``"5m"``) to wait before giving up with LockTimeout, having left the queue;
    None waits for ever, 0 tries once.  name: shown in ``gpulock status`` (default: the
    program's name).  lease: the longest the holder may go without ``heartbeat()`` before it
    counts as hung.  prefetch: files the holder will load (a model's GGUF...): read into the
    page cache while the ticket waits among the first ``prefetch.ahead`` (see
    ``gpulock.lock.prefetch``); among GPUs free at once, one where such a model is resident is
    taken first.  prefer: GPUs (or GPU -> why) where the job is warm, taken first likewise.
    Before the grant, idle models of other processes leave: enough for ``need``, or all that
    are idle and unpinned for an exclusive holder.
    """
    return _lease.acquire(
        gpu,
        need,
        timeout,
        name,
        lease,
        gpus=gpus,
        config=config,
        state_dir=state_dir,
        command=command,
        prefetch=prefetch,
        prefer=prefer,
        room=ROOM,
    )


def locked(
    gpu: GpuArg = None,
    need: int | str | None = None,
    timeout: float | str | None = None,
    name: str | None = None,
    lease: float | str | None = None,
    **kwargs: Any,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorator form of ``acquire``: the function runs holding the GPU.

    ::

        @gpulock.locked(gpu=0, need="6GiB", timeout=600)
        def render(batch): ...
    """

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def wrapper(*args: P.args, **kw: P.kwargs) -> R:
            label = name or getattr(fn, "__qualname__", None) or "function"
            with acquire(gpu, need, timeout, label, lease, **kwargs):
                return fn(*args, **kw)

        return wrapper

    return decorate


def acquire_async(
    gpu: GpuArg = None,
    need: int | str | None = None,
    timeout: float | str | None = None,
    name: str | None = None,
    lease: float | str | None = None,
    *,
    gpus: int | None = None,
    config: Config | str | None = None,
    state_dir: str | None = None,
    command: Sequence[str] | None = None,
    prefetch: Sequence[str] | None = None,
    prefer: Prefer = None,
) -> AsyncAcquire:
    """``acquire`` for asyncio: ``async with acquire_async(...) as lease`` or ``await``.

    Arguments as ``acquire``.  Each call takes its own ticket (tasks of one event loop are not
    nested calls, so there is no re-entrancy by thread); a lease inherited from ``gpulock run``
    satisfies it at once.  Cancellation leaves the queue cleanly; LockTimeout at ``timeout``,
    having left the queue.  asyncio is imported on the first call, not by ``import gpulock``.
    """
    from gpulock.lock import aiolock

    return aiolock.acquire_async(
        gpu,
        need,
        timeout,
        name,
        lease,
        gpus=gpus,
        prefer=prefer,
        config=config,
        state_dir=state_dir,
        command=command,
        prefetch=prefetch,
        room=ROOM,
    )
