"""The line: HTTP requests for GPU models wait in the same per-GPU FIFO as ``gpulock run``.

A GPU-tier request takes a ticket (``need`` = the model's size, ``name`` = the caller's
``X-Gpulock-Agent``) through ``gpulock.acquire_async`` and holds it while its answer is made.
Requests for a model whose ticket is already granted may run under that ticket, up to the
model's ``parallel`` at once, so a busy model does not take one ticket per request:

* a request joins a granted ticket of its model while fewer than ``parallel`` requests run
  under it, or waits here for one of them to end;
* but once any other ticket waits in the GPU's queue behind that ticket, no request joins it
  any more: those that come (and those waiting here) take tickets of their own, behind the
  waiter.  A stream of requests therefore keeps a waiting cron job off the GPU no longer than
  the requests already running, and the cron job keeps the stream waiting no longer than its
  own hold: the queue's FIFO decides, as for everyone else;
* the ticket is released when its last request ends.

Waiting requests are counted; past ``max_queue`` a request is refused (``QueueFull``, HTTP 429).
A request whose task is cancelled (the client hung up) leaves at once: a waiter's ticket is
removed, a holder's slot freed, and the ticket released when it was the last.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from gpulock import Lease, acquire_async
from gpulock.core.errors import GpulockError, LockTimeout
from gpulock.core.settings import Settings


class QueueFull(GpulockError):
    """``serve.max_queue`` requests wait already."""


STOPPING = "gpulock serve is stopping"


class Stopping(GpulockError):
    """The server is stopping: a request waiting for its place is answered, not left hanging."""


@dataclass(frozen=True, slots=True)
class Slot:
    """What a request got: the GPU and ticket it runs under and how long it waited."""

    gpu: int
    ticket: int
    waited_s: float
    shared: bool  # joined a ticket another request took


@dataclass(eq=False)
class _Group:
    """One granted ticket and the requests running under it."""

    key: str
    lease: Lease
    parallel: int
    active: int = 1
    closed: bool = False  # takes no new requests (someone waits behind it)
    waiting: deque[asyncio.Future[bool]] = field(default_factory=deque)


class Line:
    """The requests of one ``gpulock serve`` in the GPUs' queues (see the module doc)."""

    def __init__(self, settings: Settings, max_queue: int) -> None:
        self.settings = settings
        self.max_queue = max_queue
        self.waiting = 0
        self._open: dict[str, _Group] = {}
        # Per GPU: this server's requests in the line (waiting or running), since when it has
        # had any, when the last one ended, and the time each adds (see ``request_s``).
        self._busy: dict[int, int] = {}
        self._busy_since: dict[int, float] = {}
        self._last_end: dict[int, float] = {}
        self._request_s: dict[int, float] = {}
        self.stopping = False
        self._waiters: set[asyncio.Task[object]] = set()

    def stop(self) -> None:
        """Take no more requests, and answer those waiting for a place (``Stopping``); those
        running keep theirs until they end."""
        self.stopping = True
        for t in list(self._waiters):
            t.cancel(STOPPING)

    @asynccontextmanager
    async def slot(
        self,
        key: str,
        *,
        gpu: int,
        need: int | None,
        parallel: int,
        name: str,
        timeout_s: float | None,
        command: Sequence[str] = (),
        gpus: Sequence[int] = (),
        prefer: Mapping[int, str] | None = None,
    ) -> AsyncIterator[Slot]:
        """Hold a place on ``gpu`` for one request to model ``key`` (see the module doc).

        ``gpus``: a set its ticket may be granted on instead (one line in front of them; the
        Slot says which it got), ``prefer`` where its model is loaded already; the counts of
        this server's requests stay under ``gpu``."""
        if self.stopping:
            raise Stopping("gpulock serve is stopping", hint="send it again to another server")
        if self.waiting >= self.max_queue:
            raise QueueFull(f"{self.waiting} requests wait already (serve.max_queue)")
        start = time.monotonic()
        self._began(gpu, start)
        served = False
        me = asyncio.current_task()
        try:
            self.waiting += 1
            if me is not None:
                self._waiters.add(me)
            try:
                group, shared = await self._enter(
                    key, gpu, need, parallel, name, timeout_s, command, tuple(gpus), prefer
                )
            except asyncio.CancelledError:
                if me is None or not self.stopping or me.cancelling() != 1:
                    raise
                me.uncancel()  # cancelled by stop() only: answered, the task goes on
                raise Stopping(
                    "gpulock serve is stopping", hint="send it again to another server"
                ) from None
            finally:
                self.waiting -= 1
                if me is not None:
                    self._waiters.discard(me)
            try:
                yield Slot(group.lease.gpu, group.lease.ticket, time.monotonic() - start, shared)
                served = True
            finally:
                self._leave(group)
        finally:
            self._ended(gpu, served)

    async def _enter(
        self,
        key: str,
        gpu: int,
        need: int | None,
        parallel: int,
        name: str,
        timeout_s: float | None,
        command: Sequence[str],
        gpus: tuple[int, ...] = (),
        prefer: Mapping[int, str] | None = None,
    ) -> tuple[_Group, bool]:
        begun = time.monotonic()
        deadline = None if timeout_s is None else begun + timeout_s
        while True:
            g = self._open.get(key)
            if g is None or g.closed or self._close_if_followed(g):
                break
            if g.active < g.parallel and not g.waiting:
                g.active += 1
                return g, True
            fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            g.waiting.append(fut)
            try:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                async with asyncio.timeout(left):
                    got = await asyncio.shield(fut)
            except TimeoutError:
                self._forget(g, fut)
                # As a ticket's wait would: the dispatcher falls back on LockTimeout.
                raise LockTimeout(gpu, time.monotonic() - begun) from None
            except BaseException:
                self._forget(g, fut)
                raise
            if got:
                return g, True
            # The ticket closed while we waited here: take one of our own (below).
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        lease = await acquire_async(
            list(gpus) if len(gpus) > 1 else gpu,
            need,
            left,
            name,
            config=self.settings.config,
            state_dir=str(self.settings.state_dir),
            command=(*command, *_tenant_call(key)),
            prefer=prefer or None,
        )
        g = _Group(key, lease, max(1, parallel))
        current = self._open.get(key)
        if current is None or current.closed:
            self._open[key] = g
        else:
            g.closed = True  # another ticket of this model is open already: this one serves one
        return g, False

    def _forget(self, g: _Group, fut: asyncio.Future[bool]) -> None:
        """A request waiting under ``g`` gives up (timeout, hang-up)."""
        if fut.done() and not fut.cancelled() and fut.result():
            self._leave(g)  # the slot was handed to us as we left: pass it on
        else:
            fut.cancel()
            if fut in g.waiting:
                g.waiting.remove(fut)

    def _leave(self, g: _Group) -> None:
        g.active -= 1
        if g.waiting and not g.closed:
            self._close_if_followed(g)
        while g.waiting and not g.closed and g.active < g.parallel:
            fut = g.waiting.popleft()
            if not fut.done():
                g.active += 1
                fut.set_result(True)
        if g.active > 0:
            return
        if self._open.get(g.key) is g:
            del self._open[g.key]
        self._release_waiters(g)
        g.lease.release()

    def _close_if_followed(self, g: _Group) -> bool:
        """Close ``g`` to new requests when another ticket waits behind it; True if closed."""
        if g.closed:
            return True
        if not g.lease.waiting_behind():
            return False
        g.closed = True
        if self._open.get(g.key) is g:
            del self._open[g.key]
        self._release_waiters(g)
        return True

    @staticmethod
    def _release_waiters(g: _Group) -> None:
        """Send the requests waiting under ``g`` to take tickets of their own, in order."""
        while g.waiting:
            fut = g.waiting.popleft()
            if not fut.done():
                fut.set_result(False)

    def busy(self, gpu: int) -> int:
        """This server's requests on ``gpu`` now, waiting or running: whether they wait in the
        GPU's queue for tickets of their own, under a shared ticket, or inside the model
        (llama.cpp runs one call at a time, though its tickets share the GPU's memory)."""
        return self._busy.get(gpu, 0)

    def request_s(self, gpu: int) -> float | None:
        """The time one more request adds on ``gpu`` (None before any ended): a moving average
        of the time between two ends while requests were in line, or of a request's whole time
        when it was alone.  It is the line's pace, whatever runs one call at a time (the GPU's
        queue, a shared ticket, the model itself) and however many run at once."""
        return self._request_s.get(gpu)

    def _began(self, gpu: int, now: float) -> None:
        n = self._busy.get(gpu, 0)
        if n == 0:
            self._busy_since[gpu] = now
        self._busy[gpu] = n + 1

    def _ended(self, gpu: int, served: bool) -> None:
        self._busy[gpu] -= 1
        if not served:
            return
        now = time.monotonic()
        took = now - max(self._last_end.get(gpu, 0.0), self._busy_since[gpu])
        self._last_end[gpu] = now
        old = self._request_s.get(gpu)
        self._request_s[gpu] = took if old is None else 0.7 * old + 0.3 * took

    def held(self) -> dict[str, int]:
        """Requests running per model now (for ``/api/ps``)."""
        return {k: g.active for k, g in self._open.items()}


def _tenant_call(key: str) -> tuple[str, ...]:
    """``(TENANT_CALL, "TENANT/MODEL")`` when ``key`` (the dispatcher's ``CID|GPU``) is a
    tenant model's (``gpulock.router.choose.cid``: ``tenant:TENANT/MODEL``), else nothing: making
    room for the ticket then never evicts the model the request is about to call (the tenant
    holds it already: evicted, it would be loaded again for the call, at every request)."""
    from gpulock.residents.eviction import TENANT_CALL

    cid = key.rpartition("|")[0] or key
    if not cid.startswith("tenant:"):
        return ()
    return (TENANT_CALL, cid.removeprefix("tenant:"))
