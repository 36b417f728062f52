"""The ledger of a process that answers many calls (``gpulock serve``): in memory, written behind.

The ledger file (``gpulock.router.ledger``) is read and written whole under a lock: right for a
cron agent's one call, but at hundreds of calls a second one change per call was most of the
gateway's CPU.  ``Books`` keeps serve's view of it in memory:

* ``view()``: the file as last read, with this process's calls not yet written added.  The
  file is looked at (one ``stat``) at most every ``look_s``, and read again only when it
  changed: what other processes write (an agent's cooldown or spend) shows within that time,
  and what this process writes at once (a failure's cooldown, a reservation) at once
  (``changed()``).
* ``record(...)``: a call that answered.  Its ``call`` event is emitted at once (the event log
  gathers a busy server's events itself: ``gpulock.core.events.Batch``); its part of the
  ledger is counted in the view at once, and written to the file at once when the last write
  is older than ``every_s`` (the first call after a quiet while: ``gpulock status`` shows it
  at once), else with the others that come meanwhile, in one locked change at most
  ``every_s`` after the last.  A call that a budget is judged on (the endpoint's
  ``daily_budget``, or ``router.daily_budget``) is spent in the file at once, its reservation
  settled, exactly as ``gpulock.router.accounting.record`` does: budgets are shared with every
  other process of the host, under the file's lock.
* ``flush()``: write what waits (serve calls it when it stops).

An endpoint without limits thus costs a request no file access at all.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from gpulock.core.settings import Settings
from gpulock.core.units import calendar_day
from gpulock.router import accounting, ledger
from gpulock.router.routes import Candidate, RouterSettings


class Books:
    def __init__(
        self,
        settings: Settings,
        rs: RouterSettings,
        *,
        every_s: float = 0.05,
        look_s: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.rs = rs
        self.every_s = every_s
        self.look_s = look_s
        self.clock = clock
        self.wall = wall
        self._path = str(ledger.path(settings))
        self._pending: list[ledger.Call] = []
        self._view: ledger.Ledger | None = None
        self._stamp: tuple[Any, ...] | None = None
        self._looked_at = -1e18
        self._timer: asyncio.TimerHandle | None = None
        self._written_at = -1e18
        self._lock = threading.Lock()
        self.writes = 0  # locked changes of the file made by flush() (for the tests)

    # --- reading -----------------------------------------------------------------------------

    def view(self) -> ledger.Ledger:
        """The ledger as this process knows it now (never changed by the caller)."""
        now = self.clock()
        with self._lock:
            if self._view is not None and now - self._looked_at < self.look_s:
                return self._view
            self._looked_at = now
            wall = self.wall()
            stamp = self._file_stamp(wall)
            if self._view is None or stamp != self._stamp:
                led = ledger.read(self.settings, now_wall=wall)
                for k in self._pending:
                    ledger.count(led, k, wall)
                self._view, self._stamp = led, stamp
            return self._view

    def changed(self) -> None:
        """The file was changed by this process (a locked change): read it at the next view."""
        with self._lock:
            self._view = None

    def _file_stamp(self, wall: float) -> tuple[Any, ...]:
        day = calendar_day(wall, utc=ledger.utc_day(self.settings))
        try:
            st = os.stat(self._path)
        except OSError:
            return (None, day)
        return (st.st_ino, st.st_mtime_ns, st.st_size, day)

    # --- writing -----------------------------------------------------------------------------

    def record(
        self,
        c: Candidate,
        *,
        task: str,
        agent: str,
        tokens_in: int,
        tokens_out: int,
        latency_s: float,
        reserved_usd: float = 0.0,
        **fields: Any,
    ) -> float:
        """Count a call that answered (see the module doc); returns its cost."""
        k = accounting.answered(c, task, agent, tokens_in, tokens_out, reserved_usd, fields)
        if reserved_usd or c.daily_budget_usd is not None or self.rs.daily_budget_usd is not None:
            ledger.record_calls(self.settings, [k])  # budgets are judged on it: spent at once
            self.changed()
        else:
            self._gather(k)
        accounting.answered_event(self.settings, c, k, latency_s, fields)
        return k.cost_usd

    def _gather(self, k: ledger.Call) -> None:
        now = self.clock()
        with self._lock:
            self._pending.append(k)
            if self._view is not None:
                ledger.count(self._view, k, self.wall())
            if self._timer is not None:
                return
            quiet = now - self._written_at >= self.every_s
        if quiet:
            self.flush()  # the first call after a quiet while is written at once
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()  # no loop to wait on (a test, a tool): written at once
            return
        with self._lock:
            if self._timer is None:
                self._timer = loop.call_later(self._written_at + self.every_s - now, self.flush)

    def flush(self) -> None:
        """Write what waits, in one locked change of the file."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            batch, self._pending = self._pending, []
            self._written_at = self.clock()
        if not batch:
            return
        try:
            ledger.record_calls(self.settings, batch)
        except Exception:
            with self._lock:  # kept for the next try (a full disk, a folder made unwritable)
                self._pending[:0] = batch
            raise
        self.writes += 1
        self.changed()
