"""The ledger of a process that answers many calls (``gpulock serve``): in memory, written behind,
its limits taken in blocks.

The ledger file (``gpulock.router.ledger``) is read and written whole under a lock: right for a
cron agent's one call, but at hundreds of calls a second one change per call was most of the
gateway's CPU.  ``Books`` keeps serve's view of it in memory:

* ``view()``: the file as last read, with this process's calls not yet written added.  The
  file is looked at (one ``stat``) at most every ``look_s``, and read again only when it
  changed: what other processes write (an agent's cooldown or spend) shows within that time,
  and what this process writes at once (a failure's cooldown, a block) at once (``changed()``).
* ``admit(...)``: a cloud call with limits (a ``rate_limit``, a ``daily_budget``) admitted:
  its request slot and its reservation taken from the blocks this process holds, in memory;
  when they are short, from the shared ledger (``gpulock.router.blocks``: a block at a time,
  sized to this process's demand, never more than a small share of what is left).
  ``release(...)``: a call that did not happen gives its reservation back.
* ``record(...)``: a call that answered.  Its ``call`` event is emitted at once (the event log
  gathers a busy server's events itself: ``gpulock.core.events.Batch``); its reservation is
  settled into its block at once, in memory (what it did not use is free again for the next
  call); its part of the ledger (usage) is counted in the view at once, and written to the file
  at once when the last write is older than ``every_s`` (the first call after a quiet while:
  ``gpulock status`` shows it at once), else with the others that come meanwhile, in one locked
  change at most ``every_s`` after the last.
* ``idle()``: the line went idle: the blocks' unused slots and budget go back to the shared
  ledger, with the calls that wait, in one locked change.  ``close()`` (serve stopping) too.

An endpoint without limits thus costs a request no file access at all, and one with limits a
file access a block.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from gpulock.core.settings import Settings
from gpulock.core.units import calendar_day
from gpulock.router import accounting, budget, ledger
from gpulock.router.blocks import Blocks
from gpulock.router.budget import Reservation
from gpulock.router.choose import Host, Verdict
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
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.settings = settings
        self.rs = rs
        self.every_s = every_s
        self.look_s = look_s
        self.clock = clock
        self.wall = wall
        self.utc = ledger.utc_day(settings)
        self._path = str(ledger.path(settings))
        self._pending: list[ledger.Call] = []
        self._view: ledger.Ledger | None = None
        self._stamp: tuple[Any, ...] | None = None
        self._looked_at = -1e18
        self._timer: asyncio.TimerHandle | None = None
        self._written_at = -1e18
        self._lock = threading.Lock()  # the view and what waits: brief, never across I/O
        self.writes = 0  # locked changes of the file made by flush() (for the tests)
        self.blocks = Blocks(
            settings,
            rs,
            pending=self._handed_over,
            unpend=self._unpend,
            changed=self.changed,
            wall=wall,
            environ=environ,
        )

    @property
    def meetings(self) -> int:
        """Changes of the shared ledger made to take or give back blocks (for the tests)."""
        return self.blocks.meetings

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
        day = calendar_day(wall, utc=self.utc)
        try:
            st = os.stat(self._path)
        except OSError:
            return (None, day)
        return (st.st_ino, st.st_mtime_ns, st.st_size, day)

    # --- admitting (gpulock.router.blocks) -----------------------------------------------------

    def admit(
        self, task: str, c: Candidate, v: Verdict, need_usd: float | None
    ) -> tuple[Verdict, Reservation | None]:
        """``Blocks.admit``: may call the cluster's Redis (run it off the event loop there)."""
        return self.blocks.admit(task, c, v, need_usd)

    def from_hold(self, c: Candidate, need_usd: float | None) -> tuple[Reservation | None] | None:
        return self.blocks.from_hold(c, need_usd)

    def release(self, r: Reservation) -> None:
        """A call that did not happen gives its reservation back (into its block)."""
        if r.block_day is None:
            budget.release(self.settings, r)
        else:
            self.blocks.release(r)

    def seen(self, host: Host) -> Host:
        return self.blocks.seen(host)

    def holding(self) -> bool:
        return self.blocks.holding()

    def idle(self) -> None:
        """The line went idle: what the blocks hold unused goes back (``Blocks.idle``)."""
        self.blocks.idle()

    def close(self) -> None:
        """Serve stops: what the blocks hold goes back, what waits is written."""
        self.idle()
        self.flush()

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
        reservation: Reservation | None = None,
        **fields: Any,
    ) -> float:
        """Count a call that answered (see the module doc); returns its cost."""
        r = reservation
        reserved = r.amount_usd if r is not None else 0.0
        if r is not None and r.block_day is not None:
            cost = accounting.cost_usd(c, tokens_in, tokens_out)
            self.blocks.settle(r, cost)
            # Its spend is in the block already: the ledger's record counts its usage only.
            k = accounting.answered(c, task, agent, tokens_in, tokens_out, cost, fields)
            self._gather(k)
        else:
            k = accounting.answered(c, task, agent, tokens_in, tokens_out, reserved, fields)
            if reserved or c.daily_budget_usd is not None or self.rs.daily_budget_usd is not None:
                ledger.record_calls(self.settings, [k])  # budgets are judged on it: at once
                self.changed()
            else:
                self._gather(k)
        accounting.answered_event(self.settings, c, k, latency_s, fields)
        return k.cost_usd

    def _take_pending(self) -> list[ledger.Call]:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            batch, self._pending = self._pending, []
            self._written_at = self.clock()
        return batch

    def _handed_over(self) -> list[ledger.Call]:
        """What waits, for a meeting to write in its change (maybe in a thread: the loop's
        timer is left to fire, and finds nothing)."""
        with self._lock:
            batch, self._pending = self._pending, []
            self._written_at = self.clock()
        return batch

    def _unpend(self, batch: list[ledger.Call]) -> None:
        with self._lock:  # kept for the next try (a full disk, a folder made unwritable)
            self._pending[:0] = batch

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
        batch = self._take_pending()
        if not batch:
            return
        try:
            ledger.record_calls(self.settings, batch)
        except Exception:
            self._unpend(batch)
            raise
        self.writes += 1
        self.changed()
