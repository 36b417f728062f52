"""``gpulock.acquire_async``: the same line, waited for on an asyncio event loop.

::

    async with gpulock.acquire_async(gpu=0, need="6GiB", timeout=600, name="chat") as lease:
        ...  # the GPU is yours

The ticket, the queue's rules and every decision are those of ``acquire``: one ``Waiter``
(``gpulock.lock.waiter``) takes each step; only the sleep between steps differs.  Instead of
blocking in ``poll()``, the waiter's descriptors (the FIFOs it watches, its own doorbell) are
registered on the event loop with ``add_reader``, so the kernel's ``POLLERR`` on a watched claim
wakes the task as it wakes a blocking waiter.  (A write end of a FIFO never reads: the selector
reports its error as readable, which is all the waiter needs.)  No thread per waiter, no
polling.

Cancelling the task (a client that hung up, ``asyncio.timeout``) leaves the line at once: the
ticket and its FIFO are removed and the successor wakes, exactly as on a timeout.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Generator, Sequence
from types import TracebackType
from typing import Any

from gpulock.core.config import Config
from gpulock.lock.gpuset import GpuArg, Prefer
from gpulock.lock.lease import Lease, enqueue
from gpulock.lock.queued import Queued
from gpulock.lock.room import Room, require


class _LoopPoller:
    """What the Waiter registers its descriptors with, backed by the running event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.fds: set[int] = set()
        self.ready: set[int] = set()  # the descriptors that woke us since the last look
        self.woke = asyncio.Event()

    def _ready(self, fd: int) -> None:
        self.ready.add(fd)
        self.woke.set()

    def register(self, fd: int, _mask: int = 0, /) -> None:
        self.loop.add_reader(fd, self._ready, fd)
        self.fds.add(fd)

    def unregister(self, fd: int, /) -> None:
        self.loop.remove_reader(fd)
        self.fds.discard(fd)
        self.ready.discard(fd)

    def close(self) -> None:
        for fd in list(self.fds):
            self.unregister(fd)


async def _wait(got: Queued) -> Lease:
    poller = _LoopPoller(asyncio.get_running_loop())
    waiter = got.waiter(poller)
    try:
        while (wake := waiter.step()) is not None:
            if not poller.ready:
                poller.woke.clear()
                try:
                    async with asyncio.timeout(max(0.0, wake - time.monotonic())):
                        await poller.woke.wait()
                except TimeoutError:
                    pass
            ready, poller.ready = sorted(poller.ready), set()
            waiter.woken(ready)
        # Asking other processes' idle models to leave may take seconds: not on the loop.
        await asyncio.to_thread(waiter._make_room)
        waiter._grant()
    except BaseException:
        waiter.close()
        poller.close()
        raise
    waiter.close(granted=True)
    poller.close()
    return Lease(got.settings, waiter.granted_spots(), time.monotonic() - got.start)


class AsyncAcquire:
    """``await acquire_async(...)`` gives the Lease; ``async with`` also releases it."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._args = args
        self._kwargs = kwargs
        self._lease: Lease | None = None

    async def _acquire(self) -> Lease:
        got = enqueue(*self._args, nested=False, **self._kwargs)
        if isinstance(got, Lease):
            return got
        try:
            return await _wait(got)
        except BaseException as e:  # CancelledError included: leave the line at once
            got.leave(e)
            raise

    def __await__(self) -> Generator[Any, None, Lease]:
        return self._acquire().__await__()

    async def __aenter__(self) -> Lease:
        self._lease = await self._acquire()
        return self._lease

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._lease is not None:
            self._lease.release()


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
    room: Room,
) -> AsyncAcquire:
    """``acquire`` for asyncio: ``async with acquire_async(...) as lease`` or ``await``.

    The lock's own entry point (``room``: see ``gpulock.lock.room``); users call
    ``gpulock.acquire_async``, which passes the residents' room.

    Arguments as ``gpulock.acquire``.  Each call takes its own ticket (tasks of one event loop
    are not nested calls, so there is no re-entrancy by thread); a lease inherited from
    ``gpulock run`` satisfies it at once, as it does ``acquire``.  Cancellation leaves the
    queue cleanly; LockTimeout at ``timeout``, having left the queue.
    """
    kwargs: dict[str, Any] = {
        "gpus": gpus,
        "prefer": prefer,
        "config": config,
        "state_dir": state_dir,
        "command": command,
        "prefetch": prefetch,
        "room": require(room),
    }
    return AsyncAcquire((gpu, need, timeout, name, lease), kwargs)
