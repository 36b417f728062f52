"""When ``gpulock serve`` writes the events it gathers: at once when idle, in batches when busy.

Each request writes two events (``call`` and ``gateway-request``), and an open, a write and a
close per event was a large part of the gateway's CPU under load.  While the server runs, its
events go to a ``gpulock.core.events.Batch``.  With one request in flight (or none) an event is
written at once, as before: a client that reads the event log after its answer finds the
answer's events.  With several, it waits at most ``every_s`` and is written in one
``write()`` with theirs, or when the last request in flight ends, before that response is sent.
An event from a thread (the cluster's heartbeat, a fallback run off the loop) is written
within ``every_s``.  ``close()`` writes what is left, when the server stops.

``on_idle`` is called when the last request in flight ends (before its response is sent):
serve gives back there what its accounting holds ahead (``gpulock.router.books``).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from gpulock.core import events
from gpulock.core.settings import Settings


class WriteBehind:
    def __init__(
        self,
        settings: Settings,
        *,
        every_s: float = 0.02,
        on_idle: Callable[[], None] | None = None,
    ) -> None:
        self.every_s = every_s
        self.on_idle = on_idle
        self.batch = events.Batch(
            settings.state_dir,
            max_bytes=settings.config.events_max_bytes,
            mode=settings.file_mode,
            on_add=self._added,
        )
        self.active = 0  # requests in flight (a stream until its end)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """Gather from now on (called on the server's event loop, when it starts)."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        events.batch(self.batch)

    def begin(self) -> None:
        self.active += 1

    def end(self) -> None:
        self.active = max(0, self.active - 1)
        if self.active == 0:
            if self.on_idle is not None:
                self.on_idle()
            self.flush()

    def _added(self, _batch: events.Batch) -> None:
        loop = self._loop
        if loop is None:
            return
        if threading.get_ident() != self._loop_thread:
            loop.call_soon_threadsafe(self._arm)
        elif self.active <= 1:
            self.batch.flush()  # one request at a time: nothing to gather it with
        else:
            self._arm()

    def _arm(self) -> None:
        if self._timer is None and self._loop is not None:
            self._timer = self._loop.call_later(self.every_s, self.flush)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.batch.flush()

    def close(self) -> None:
        """Write what is left and emit at once again."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        events.unbatch(self.batch)
        self._loop = None
