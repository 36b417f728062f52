"""One ticket's wait for its grant: scan, decide, watch, sleep until the kernel says.

A waiter wakes on the kernel's word (``POLLERR`` on a watched claim, a doorbell in its own),
on its own timeout, at the lease expiry of a holder it watches (to handle a hung holder),
and, as a guard against the unforeseen, re-checks that the tickets it watches still exist
every ``SAFETY_RECHECK_S`` seconds, doubling while nothing happens: nothing polls faster.

``GPULOCK_SAFETY_RECHECK_S`` (seconds; a test and debugging knob, not a setting) replaces
that first re-check interval.  Tests set it to an hour so that a handoff can only be explained
by a kernel wake-up, without asserting how fast it came.
"""

from __future__ import annotations

import math
import os
import select
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from gpulock.core import claim, devices, level
from gpulock.core.errors import LockTimeout
from gpulock.core.settings import Settings
from gpulock.core.statefile import atomic_write
from gpulock.lock import exitwait, hung, sigwake
from gpulock.lock.ahead import scan_ahead
from gpulock.lock.census import tickets_of
from gpulock.lock.exitwait import Poller
from gpulock.lock.lines import Line, count_ahead, decide_lines, free_memory, nearest_line
from gpulock.lock.queuedir import Spot
from gpulock.lock.room import Kept, Request, Room, calls_of, require
from gpulock.lock.ticket import Ticket, encode, event_fields
from gpulock.lock.watches import Watches

if TYPE_CHECKING:
    from gpulock.lock.prefetch import Prefetch

SAFETY_RECHECK_S = 2.0  # first guard re-check; doubles while nothing happens...
SAFETY_RECHECK_MAX_S = 30.0  # ...up to this, so hundreds of idle waiters cost ~nothing
ENV_SAFETY_RECHECK = "GPULOCK_SAFETY_RECHECK_S"  # test/debug knob (see the module docstring)
# The key of the governor's claim among watched FIFOs (tickets are keyed (gpu, seq), gpu >= 0).
GOVERNOR_WATCH = (-1, 0)


class Waiter:
    """One ticket's wait for its grant: scan, decide, watch, sleep until the kernel says.

    A ticket pinned to one GPU waits in one line; a ticket for a set of GPUs in the line of
    each (``gpulock.lock.queue.decide_set``), woken by whatever changes any of them.
    """

    def __init__(
        self,
        settings: Settings,
        spots: Sequence[Spot],
        budgets: Mapping[int, int | None],
        deadline: float | None,
        start: float,
        *,
        room: Room,
        poller: Poller | None = None,
        prefetch: Prefetch | None = None,
        prefer: Mapping[int, str] | None = None,
        models: Sequence[str] = (),
    ) -> None:
        self.settings = settings
        self.room = require(room)  # makes room before the grant (gpulock.lock.room)
        self.lines = [Line(spot, budgets.get(spot.gpu)) for spot in spots]
        self.me = spots[0].ticket  # the first copy: what events and reasons name
        self.spans = self.me.spans  # several lines (or GPUs): else exactly the one-GPU path
        self.deadline = deadline
        self.start = start
        self.prefer = dict(prefer or {})  # GPU -> why the caller knows the job is warm there
        self.models = tuple(models)  # what the job will load (its prefetch files), for placing
        self.chosen: tuple[int, ...] = ()  # the GPUs decided on, once step() returns None
        # The blocking form sleeps in poll(); ``gpulock.lock.aiolock`` passes its event loop's.
        self._poll: select.poll | None = None
        if poller is None:
            poller = self._poll = select.poll()
        self.poller: Poller = poller
        self.watches = Watches(poller)  # what it sleeps on (gpulock.lock.watches)
        for spot in spots:
            assert spot.fd is not None
            self.watches.add_mine(spot.fd)
        self.hung = hung.HungHolders(settings, SAFETY_RECHECK_S)  # holders past their lease
        self.announced = False
        self.safety_first_s = safety_recheck_s()
        self.safety_s = self.safety_first_s
        self.freeze_ends: float | None = None  # monotonic time the governor's freeze goes stale
        self.kept: Kept | None = None  # what stayed after an exclusive clear
        self.cleared_early = False  # command tenants stopped while this exclusive one waits
        # Dead holders ahead whose processes have not finished exiting (gpulock.lock.exitwait).
        self.exits = exitwait.ExitWatch(
            self.poller,
            settings.config.exit_wait_s,
            lambda gpu: devices.gpu_pids(gpu, settings.config),
            lambda kind, **f: settings.emit(kind, **event_fields(self.me), **f),
            tickets_of=lambda pid, ticks: tickets_of(settings, pid, ticks),
        )
        self.rescan = True  # look at the queue on the next step
        self.prefetch = prefetch  # warms the job's files while it waits (gpulock.lock.prefetch)

    def wait(self) -> Ticket:
        poll = self._poll
        if poll is None:
            raise RuntimeError("this Waiter sleeps on an event loop: step() and woken() only")
        granted = False
        # A signal's Python handler (``gpulock run``'s leave-the-line) runs only between
        # bytecodes: the wake-up pipe in the poll set makes one that lands just before
        # poll() is entered wake it now, not at the next safety re-check (gpulock.lock.sigwake).
        wake_up = sigwake.SignalWake()
        # Set once registered: the finally unregisters only that (gpulock.lock.watches).
        wake_fd: int | None = None
        try:
            while (wake := self.step()) is not None:
                if wake_fd is None and (sfd := wake_up.open()) is not None:
                    poll.register(sfd, select.POLLIN)
                    wake_fd = sfd
                ready = poll.poll(max(0, math.ceil((wake - time.monotonic()) * 1000)))
                if wake_up.fd is not None and any(fd == wake_up.fd for fd, _ in ready):
                    wake_up.drain()  # the pending handler runs once we are back in Python
                    ready = [(fd, ev) for fd, ev in ready if fd != wake_up.fd]
                    if not ready:
                        continue  # a signal whose handler did not stop the wait
                self.woken([fd for fd, _ in ready])
            self._make_room()
            ticket = self._grant()
            granted = True
            return ticket
        finally:
            if wake_fd is not None:
                poll.unregister(wake_fd)
            wake_up.close()
            self.close(granted=granted)

    def close(self, *, granted: bool = False) -> None:
        """Stop watching (the tickets ahead, any dead holder's processes, my own claims) and
        warming.  The claims themselves stay open: the Lease (or ``Queued.leave``) owns them."""
        self.watches.close()  # safe however a signal interrupts it (gpulock.lock.watches)
        self.exits.close()
        if self.prefetch is not None:
            self.prefetch.stop(granted=granted)

    def granted_spots(self) -> list[Spot]:
        """The copies of the GPUs chosen (after the grant: those it holds), in GPU order."""
        if not self.spans:
            return [self.lines[0].spot]
        chosen = self.chosen or (self.me.gpu,)
        return [line.spot for line in self.lines if line.gpu in chosen]

    # One step of the wait, shared by the blocking ``wait`` above and the event loop's
    # ``gpulock.lock.aiolock``: the two differ only in how they sleep until ``step``'s wake time.
    def step(self) -> float | None:
        """Look at the queue if something changed: None when this ticket may hold the GPU now
        (the caller makes room and grants; ``chosen`` says which GPUs), else the monotonic
        time to wake at the latest.  Raises LockTimeout at the deadline."""
        if self.rescan:
            fds: dict[tuple[int, int], int] = {}
            for line in self.lines:
                line.ahead, got = scan_ahead(self.settings, self.me.seq, line, self.exits.blocks)
                fds.update(((line.gpu, seq), fd) for seq, fd in got.items())
            grant, watch, reason = self._decide()
            frozen = level.freeze(self.settings) if grant else None
            if grant and frozen is None:
                for fd in fds.values():
                    os.close(fd)
                self.chosen = grant
                return None
            if not grant and not self.cleared_early and self._command_tenant_holds():
                self._stop_command_tenants()
            self.watches.rewatch(watch, fds)
            self.freeze_ends = None
            if frozen is not None:
                reason = "the governor froze new GPU admissions"
                self._watch_governor(frozen)
            if not self.announced:
                self.announced = True
                self.settings.emit(
                    "wait",
                    **event_fields(self.me),
                    ahead=count_ahead(self.me, self.lines),
                    reason=reason,
                )
            if self.prefetch is not None:
                line = nearest_line(self.lines)
                self.prefetch.on_rescan(line, line.ahead)
        now = time.monotonic()
        if self.deadline is not None and now >= self.deadline:
            raise self._timeout()
        wake = now + self.safety_s
        if self.deadline is not None:
            wake = min(wake, self.deadline)
        wake = min(wake, self._hung_holders(now))
        if self.freeze_ends is not None:
            wake = min(wake, self.freeze_ends)
        return min(wake, self.exits.wake_at())

    def _decide(self) -> tuple[tuple[int, ...], set[tuple[int, int]], str]:
        """The rule over this ticket's lines: (GPUs to take now, (gpu, seq) to watch, why)."""
        return decide_lines(self.me, self.lines, self._placing)

    def _placing(self, ready: Sequence[int]) -> tuple[dict[int, str], dict[int, int | None]]:
        """Where the job's model is warm (the caller's word, then the room's: resident models)
        and each ready GPU's free memory (the device's, else its budget less its holders')."""
        warm = {g: why for g, why in self.prefer.items() if g in ready}
        where = getattr(self.room, "where_warm", None)
        if where is not None:
            try:
                for g, why in where(self.settings, self._room_request("placing", 5.0)).items():
                    warm.setdefault(g, why)
            except Exception:  # a placement hint must never stop a grant
                pass
        return warm, free_memory(self.lines, ready, self.settings.config)

    def _leave_other_lines(self) -> None:
        """Granted: the copies in the lines of GPUs not taken leave (their successors wake).
        Only now, after the grant's event: until then the ticket stands in every line of its
        set, so the event log shows no later ticket granted one of them while it waited."""
        if not self.spans:
            return
        for line in self.lines:
            if line.gpu in self.chosen or line.spot.fd is None:
                continue
            self.watches.drop_mine(line.spot.fd)
            line.spot.leave()

    def woken(self, ready: Sequence[int]) -> None:
        """After the sleep: ``ready`` are the descriptors that woke us (none: a timed wake)."""
        self.rescan = bool(ready) or self._due()
        self.safety_s = (
            self.safety_first_s
            if self.rescan
            else min(self.safety_s * 2, max(SAFETY_RECHECK_MAX_S, self.safety_first_s))
        )
        for fd in ready:
            if fd in self.watches.mine:
                claim.drain(fd)  # doorbells
            else:
                self.exits.on_ready(fd)  # a dead holder's process exited (if it is one)

    def _watch_governor(self, word: level.Published) -> None:
        """While frozen: wake when the governor dies (its claim), rings, or its word goes stale."""
        self.freeze_ends = time.monotonic() + max(0.0, level.stale_at_wall(word) - time.time())
        try:
            fd = claim.watch(level.claim_path(self.settings))
        except claim.NotAClaim:
            fd = None
        if fd is not None:
            self.watches.watch(GOVERNOR_WATCH, fd)

    def _due(self) -> bool:
        """After a timed wake: does anything need a fresh look?"""
        if self.freeze_ends is not None and time.monotonic() >= self.freeze_ends:
            return True
        blockers = any(line.exit_blockers for line in self.lines)
        if blockers and time.monotonic() >= self.exits.wake_at():
            return True
        now_w = time.time()
        for line in self.lines:
            for tf in line.ahead:
                if (line.gpu, tf.ticket.seq) not in self.watches.watched:
                    continue
                if not line.qdir.ticket_path(tf.ticket.seq).exists():
                    return True  # the guard: released while a stray fork kept its FIFO open
                if self.hung.overdue(tf, now_w):
                    return True
        return self.hung.killing

    def _room_request(self, reason: str, cap_s: float, gpu: int | None = None) -> Request:
        left = None if self.deadline is None else self.deadline - time.monotonic()
        me = self.me
        return Request(
            gpu=me.gpu if gpu is None else gpu,
            need_bytes=me.need_bytes,
            seq=me.seq,
            name=me.name,
            pid=me.pid,
            calls=calls_of(me.command),
            timeout_s=cap_s if left is None else max(min(left, cap_s), 0.5),
            reason=f"{reason} {me.seq} ({me.name})",
            gpus=me.gpu_set,
            models=self.models,
        )

    def _make_room(self) -> None:
        """Before the grant: idle models of other processes leave first (``self.room``), on
        each GPU it takes.

        Models kept in GPU memory between calls (by processes that do not hold the lock) would
        otherwise make a granted load fail with a CUDA OOM; an exclusive holder gets the GPU to
        itself.  What stays (pinned, busy, an unload that failed) is named in the grant event.
        """
        for gpu in self.chosen or (self.me.gpu,):
            if self.me.need_bytes is None:
                req = self._room_request("exclusive ticket", 30.0, gpu)
                kept = self.room.make(self.settings, req)
                if kept is not None:
                    self.kept = (self.kept or []) + kept if self.spans else kept
                continue
            self.room.make(self.settings, self._room_request("room for ticket", 10.0, gpu))

    def _stop_command_tenants(self) -> None:
        """A command tenant's server holds its ticket for as long as it runs: an exclusive
        waiter would wait for ever behind it.  Stop it (if idle) now, once per wait."""
        self.cleared_early = True
        for line in self._tenant_lines():
            kept = self.room.unblock(
                self.settings, self._room_request("exclusive ticket", 30.0, line.gpu)
            )
            if kept is not None:
                self.kept = (self.kept or []) + kept

    def _command_tenant_holds(self) -> bool:
        return bool(self._tenant_lines())

    def _tenant_lines(self) -> list[Line]:
        if self.me.need_bytes is not None or not self.settings.config.exclusive_clears_tenants:
            return []
        return [
            line
            for line in self.lines
            if any(tf.ticket.holding and tf.ticket.name.startswith("tenant:") for tf in line.ahead)
        ]

    def _grant(self) -> Ticket:
        """Mark the copies of the GPUs chosen granted (one event), ring each line's next."""
        now_w = time.time()
        spots = self.granted_spots()
        held = tuple(spot.gpu for spot in spots)
        for spot in spots:
            spot.ticket = spot.ticket.granted(now_w)
            if self.spans:
                spot.ticket = replace(spot.ticket, granted_gpus=held)
            atomic_write(
                spot.qdir.ticket_path(spot.ticket.seq),
                encode(spot.ticket),
                mode=self.settings.file_mode,
            )
        granted = spots[0].ticket
        extra: dict[str, Any] = {}
        if self.kept is not None:  # after an exclusive clear: the models that stayed on its GPU
            extra["tenants_kept"] = [_kept(k) for k in self.kept if k.get("tenant")]
            if residents := [_kept(k) for k in self.kept if not k.get("tenant")]:
                extra["residents_kept"] = residents
        self.settings.emit(
            "acquire",
            **event_fields(granted),
            waited_s=round(time.monotonic() - self.start, 6),
            **extra,
        )
        # The one behind me may share the GPU with me, or now watches a holder with a lease:
        # ring it so it looks again.  Only the nearest live one: no herd.  (Its look also
        # prunes the tickets that left ahead of it now, while I hold, not at my release.)
        for spot in spots:
            spot.qdir.ring_successor(granted.seq)
        self._leave_other_lines()
        return granted

    def _timeout(self) -> LockTimeout:
        waited = time.monotonic() - self.start
        ahead = [tf for line in self.lines for tf in line.ahead]
        holder = next((tf.ticket for tf in ahead if tf.ticket.holding), None)
        if holder is None:
            for line in self.lines:
                holder = next(iter(line.qdir.holders()), None)
                if holder is not None:
                    break
        self.settings.emit(
            "timeout",
            **event_fields(self.me),
            waited_s=round(waited, 6),
            holder_pid=holder.pid if holder else None,
            holder_name=holder.name if holder else None,
        )
        return LockTimeout(
            self.me.gpu,
            waited,
            holder.pid if holder else None,
            holder.name if holder else None,
            queue_ahead=count_ahead(self.me, self.lines),
            gpus=self.me.gpu_set if self.spans else (),
            count=self.me.count,
        )

    def _hung_holders(self, now: float) -> float:
        """Handle watched holders past their lease; return when to look at them next."""
        wake = math.inf
        now_w = time.time()
        seen: set[int] = set()  # a multi-GPU holder ahead in two lines is one holder
        for line in self.lines:
            for tf in line.ahead:
                t = tf.ticket
                if (line.gpu, t.seq) not in self.watches.watched or t.seq in seen:
                    continue
                seen.add(t.seq)
                wake = min(wake, self.hung.wake_at(line.qdir, tf, now, now_w))
        return wake


def _kept(entry: dict[str, str]) -> dict[str, str]:
    return {"id": entry["id"], "why": entry["why"]}


def safety_recheck_s() -> float:
    """The first safety re-check interval: ``SAFETY_RECHECK_S`` unless the knob says else."""
    raw = os.environ.get(ENV_SAFETY_RECHECK, "")
    try:
        value = float(raw)
    except ValueError:
        return SAFETY_RECHECK_S  # unset or garbage: a debugging knob never stops a wait
    return value if math.isfinite(value) and value > 0 else SAFETY_RECHECK_S
