"""A ticket in line, not yet granted: what ``acquire`` and ``acquire_async`` wait with.

``gpulock.lock.lease.enqueue`` takes the ticket (a copy in each line of its set) and returns a
``Queued``; the blocking ``acquire`` and the event loop's ``acquire_async`` each get its
``waiter()`` and sleep between its steps their own way.  A wait cut short leaves the line
through ``leave``, which wakes the successor and logs why the wait ended (a ``leave`` event
naming the signal, or the cancellation).
"""

from __future__ import annotations

import signal
import sys
import time
from dataclasses import dataclass

from gpulock.core.errors import LockTimeout
from gpulock.core.settings import Settings
from gpulock.lock import prefetch as prefetch_mod
from gpulock.lock.exitwait import Poller
from gpulock.lock.queuedir import Spot
from gpulock.lock.room import Room
from gpulock.lock.ticket import Ticket, event_fields
from gpulock.lock.waiter import Waiter


@dataclass(frozen=True, slots=True)
class Queued:
    """A ticket in line, not yet granted: what ``acquire`` and ``acquire_async`` wait with."""

    settings: Settings
    spots: tuple[Spot, ...]  # its copy in each line of its set (one for a pinned ticket)
    budgets: dict[int, int | None]  # each GPU's memory less the reserve, where a need asks
    deadline: float | None
    start: float
    room: Room  # makes room before the grant
    warm: prefetch_mod.Prefetch | None = None  # warms the job's files while it waits
    prefer: dict[int, str] | None = None  # GPU -> why the job is warm there (the caller's word)
    models: tuple[str, ...] = ()  # the files it will load (its prefetch), for placing it

    @property
    def ticket(self) -> Ticket:
        return self.spots[0].ticket

    def waiter(self, poller: Poller | None = None) -> Waiter:
        """The Waiter for this ticket (``poller``: an event loop's, for ``acquire_async``)."""
        return Waiter(
            self.settings,
            self.spots,
            self.budgets,
            self.deadline,
            self.start,
            room=self.room,
            poller=poller,
            prefetch=self.warm,
            prefer=self.prefer,
            models=self.models,
        )

    def leave(self, cause: BaseException | None = None) -> None:
        """Leave the line (timeout, Ctrl-C, cancellation): the successor wakes.

        ``cause``, what cut the wait short, is logged as a ``leave`` event (``waited_s``, the
        ``signal``), so that history and the report see the wait end; a LockTimeout has its
        own ``timeout`` event already.  A copy the waiter had granted is given back too.
        """
        for spot in self.spots:
            spot.leave()
        if cause is not None and not isinstance(cause, LockTimeout):
            sig = _signal_of(cause)
            self.settings.emit(
                "leave",
                **event_fields(self.ticket),
                waited_s=round(time.monotonic() - self.start, 6),
                signal=sig,
                reason=f"interrupted by {sig}" if sig else _reason_of(cause),
            )


def _signal_of(cause: BaseException) -> str | None:
    """The signal behind an exception: SIGINT for Ctrl-C, ``signum`` for a handler's own."""
    if isinstance(cause, KeyboardInterrupt):
        return "SIGINT"
    signum = getattr(cause, "signum", None)  # gpulock run's SIGTERM/SIGHUP handler
    if isinstance(signum, int):
        try:
            return signal.Signals(signum).name
        except ValueError:
            return f"signal {signum}"
    return None


def _reason_of(cause: BaseException) -> str:
    aio = sys.modules.get("asyncio")  # loaded wherever a wait can be cancelled: never import it
    if aio is not None and isinstance(cause, aio.CancelledError):
        return "cancelled"  # acquire_async's task was cancelled (gpulock serve: a client left)
    return f"error: {type(cause).__name__}"
