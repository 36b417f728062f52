"""The blocks a process that makes many calls (``gpulock serve``) holds ahead of them: request
slots and budget taken from the shared ledger (the file, and in a cluster Redis) a block at a
time, and its calls admitted from them in memory (the rules: ``gpulock.router.allowance``).

* ``admit(...)``: a cloud call with limits (a ``rate_limit``, a ``daily_budget``) admitted:
  its request slot and its reservation taken from the blocks, in memory; when they are short,
  from the shared ledger in one meeting: Redis's scripts first in a cluster, then one locked
  change of the file that judges the call as ``gpulock.router.accounting.admit`` and
  ``gpulock.router.budget.reserve`` do, takes the next blocks (sized to this process's demand,
  never more than a small share of what is left), gives back the slots an earlier second did
  not use, and writes the calls that wait to be written (``gpulock.router.books``).
* ``settle(...)``, ``release(...)``: a call that answered, or did not happen: its reservation
  back into its block (near a budget's end, ``allowance.tight``, back to the ledger at once).
* ``idle()``: the line went idle: what the blocks hold unused goes back, in one change.
* ``seen(host)``: the chooser's view without what the blocks hold unused (counted in the file
  as taken, yet this process's own to use).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace

from gpulock.core.settings import Settings
from gpulock.core.units import calendar_day, day_ends_at
from gpulock.router import budget, ledger, meeting
from gpulock.router.allowance import Hold
from gpulock.router.budget import Reservation
from gpulock.router.choose import Host, Verdict, choose, cid
from gpulock.router.routes import Candidate, RouterSettings


@dataclass(frozen=True, slots=True)
class _Back:
    """What one hold gives back: unused slots of a second, unused budget."""

    key: str
    second: int
    slots: int
    slots_clustered: bool
    usd: float
    usd_clustered: bool


class Blocks:
    def __init__(
        self,
        settings: Settings,
        rs: RouterSettings,
        *,
        pending: Callable[[], list[ledger.Call]],
        unpend: Callable[[list[ledger.Call]], None],
        changed: Callable[[], None],
        wall: Callable[[], float] = time.time,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        """``pending`` takes the calls that wait to be written (written in a meeting's change),
        ``unpend`` puts them back when it fails; ``changed``: the file was changed here."""
        self.settings = settings
        self.rs = rs
        self.wall = wall
        self.environ = os.environ if environ is None else environ
        self.clustered = settings.config.section("cluster") is not None
        self.utc = ledger.utc_day(settings)
        self._pending = pending
        self._unpend = unpend
        self._changed = changed
        self._lock = threading.Lock()  # the holds: brief, never across I/O
        self._meeting = threading.Lock()  # one meeting with the shared ledger at a time
        self._holds: dict[str, Hold] = {}
        self.meetings = 0  # changes of the shared ledger made to take or give back blocks

    def seen(self, host: Host) -> Host:
        """``host`` (built from ``view()``) as the chooser must see it: what this process's
        blocks hold unused is counted in the file as spent or taken, but is free to this
        process's calls."""
        with self._lock:
            if not any(h.slots_free or h.free_usd for h in self._holds.values()):
                return host
            spend, requests = self._unheld(
                host.spend_today_usd, host.requests_last_min, host.now_wall
            )
        return replace(host, spend_today_usd=spend, requests_last_min=requests)

    def _unheld(
        self, spend: Mapping[str, float], requests: Mapping[str, int], now: float
    ) -> tuple[dict[str, float], dict[str, int]]:
        """``spend`` and ``requests`` less what the holds keep unused (under ``_lock``)."""
        second = int(now // 1)
        out_spend, out_req = dict(spend), dict(requests)
        for key, h in self._holds.items():
            if h.free_usd and key in out_spend and now < h.day_end_wall:
                out_spend[key] = max(0.0, out_spend[key] - h.free_usd)
            if h.slots_free and h.second == second and key in out_req:
                out_req[key] = max(0, out_req[key] - h.slots_free)
        return out_spend, out_req

    def admit(
        self, task: str, c: Candidate, v: Verdict, need_usd: float | None
    ) -> tuple[Verdict, Reservation | None]:
        """A cloud call to ``c`` (chosen: ``v``) with limits, admitted: its request slot (a
        ``rate_limit``), and ``need_usd`` (its most cost; None: no budget) reserved.  From
        this process's blocks, else from the shared ledger (see the module doc).  Returns
        ``(v, reservation)``, or the refusal's verdict (``limit``: "rate" or "budget") and
        None.  May call the cluster's Redis: run it off the event loop in a cluster."""
        taken = self.from_hold(c, need_usd)
        if taken is not None:
            return v, taken[0]
        key = cid(c)
        with self._meeting:
            wall = self.wall()  # now: another meeting may have run meanwhile
            taken = self._from_hold(key, c, need_usd, wall)  # ... and taken enough
            if taken is not None:
                return v, taken[0]
            return self._meet(task, key, c, v, need_usd, wall)

    def from_hold(self, c: Candidate, need_usd: float | None) -> tuple[Reservation | None] | None:
        """``admit`` from memory only: (the reservation or None,); None: the blocks are
        short (``admit`` then meets the shared ledger)."""
        return self._from_hold(cid(c), c, need_usd, self.wall())

    def _from_hold(
        self, key: str, c: Candidate, need_usd: float | None, wall: float
    ) -> tuple[Reservation | None] | None:
        second = int(wall // 1)
        rate = c.rate_limit_per_min is not None
        with self._lock:
            h = self._holds.get(key)
            if h is None or (rate and not h.slot_ready(second)):
                return None
            if need_usd is not None and not h.usd_ready(need_usd, wall):
                return None
            return (_take_one(h, key, rate, need_usd, second),)

    def _meet(
        self, task: str, key: str, c: Candidate, v: Verdict, need_usd: float | None, wall: float
    ) -> tuple[Verdict, Reservation | None]:
        """Judge and take under the ledger's lock (and Redis's scripts first, in a cluster):
        the next blocks, with the slots of an earlier second given back and the calls that
        wait written, in one change of the file.  Under ``_meeting``."""
        second = int(wall // 1)
        day = calendar_day(wall, utc=self.utc)
        rate = c.rate_limit_per_min is not None
        with self._lock:
            h = self._holds.setdefault(key, Hold())
            # What this meeting replaces, detached so that no call takes it meanwhile: the
            # slots of an earlier second (given back), the budget held unused (folded into
            # the new block).
            m = meeting.Meeting(need_usd)
            if rate and not h.slot_ready(second):
                m.old = (h.second, h.slots_free, h.slots_clustered)
                h.slots_free = 0
                m.wanted_slots = h.wanted_slots(second)
            if need_usd is not None and not h.usd_ready(need_usd, wall):
                m.usd = True
                m.held = h.free_usd if h.day == day and wall < h.day_end_wall else 0.0
                m.held_clustered = h.usd_clustered
                h.free_usd = 0.0
                m.wanted_usd = h.wanted_usd(need_usd, second)
            batch = self._pending()
        try:
            why = self._take(task, key, c, m, batch, wall)
        except BaseException:
            with self._lock:  # the file could not be changed: held again, waiting again
                if m.old is not None and h.second == m.old[0]:
                    h.slots_free += m.old[1]
                h.free_usd = round(h.free_usd + m.held, 10)
            self._unpend(batch)
            m.held_back = m.slots_here = m.usd_here = False
            meeting.give_back_cluster(self.settings, key, m, second)
            raise
        self.meetings += 1
        self._changed()
        with self._lock:
            if m.slots_here:
                h.second, h.slots_free, h.slots_clustered = second, m.slots, m.slots_clustered
            if m.usd_here:  # all of it unused for now, this call's part taken below
                h.free_usd = round(h.free_usd + m.held + m.got_usd, 10)
                h.day, h.day_end_wall = day, day_ends_at(wall, utc=self.utc)
                h.usd_clustered, h.tight = m.usd_clustered, m.tight
            elif m.usd and not m.held_back:
                h.free_usd = round(h.free_usd + m.held, 10)  # refused: held as it was
            r = _take_one(h, key, rate, need_usd, second) if why is None else None
        meeting.give_back_cluster(self.settings, key, m, second)
        return (v, r) if why is None else (why, None)

    def _take(
        self,
        task: str,
        key: str,
        c: Candidate,
        m: meeting.Meeting,
        batch: list[ledger.Call],
        wall: float,
    ) -> Verdict | None:
        """The meeting's I/O: Redis's scripts (in a cluster), then the file's change.  Fills
        ``m`` with what was taken; returns the refusal, or None."""
        why = meeting.take_cluster(self.settings, self.rs, c, key, m) if self.clustered else None
        with ledger.change(self.settings, now_wall=wall) as led:
            for k in batch:  # the calls that waited to be written: in this change
                ledger.count(led, k, wall)
            if m.old is not None and m.old[1]:
                led.give_back_requests(key, m.old[0], m.old[1])
            if why is None:
                why = self._judge(task, c, led, wall, key, m.held)
            if why is None and m.old is not None:
                why = meeting.take_slots(led, c, key, m, wall)
            if why is None and m.usd:
                why = meeting.take_usd(led, c, self.rs, key, m, self._held_usd(key))
            if why is not None and why.limit == "budget" and m.held:
                meeting.give_back_held(led, key, m)
        return why

    def _held_usd(self, but: str) -> float:
        """What the other holds keep unused (counted in the file's spend)."""
        with self._lock:
            return sum(h.free_usd for k, h in self._holds.items() if k != but)

    def _judge(
        self,
        task: str,
        c: Candidate,
        led: ledger.Ledger,
        wall: float,
        key: str,
        held: float,
    ) -> Verdict | None:
        """The chooser's rule on the file as it is now (cooldowns, the key variable, a budget
        spent, the window full), less what this process holds unused; None when it fits."""
        spend, requests = dict(led.spend_usd), led.requests_last_min(wall)
        with self._lock:
            spend, requests = self._unheld(spend, requests, wall)
        if held and key in spend:
            spend[key] = max(0.0, spend[key] - held)
        env = self.environ
        host = Host(
            env=frozenset({c.api_key_env} if c.api_key_env and env.get(c.api_key_env) else ()),
            spend_today_usd=spend,
            daily_budget_usd=self.rs.daily_budget_usd,
            cooldown_until=led.cooldown_until(),
            requests_last_min=requests,
            now_wall=wall,
        )
        v = choose(task, [c], host).verdicts[0]
        return None if v.ok else v

    def settle(self, r: Reservation, cost_usd: float) -> None:
        """A call reserved from a block answered at ``cost_usd``: settled into its block (what
        it did not use is free again), or at once where the block cannot (``Hold.settle``)."""
        assert r.block_day is not None
        with self._lock:
            h = self._holds.get(r.key)
            delta = h.settle(r.block_day, r.amount_usd, cost_usd) if h is not None else 0.0
        if delta:
            self._spend_now(r, delta)

    def release(self, r: Reservation) -> None:
        """A call reserved from a block did not happen: its reservation back into the block."""
        assert r.block_day is not None
        with self._lock:
            h = self._holds.get(r.key)
            if h is not None:
                h.give_back(r.block_day, r.amount_usd)

    # --- giving back -------------------------------------------------------------------------

    def holding(self) -> bool:
        """Whether the blocks hold anything unused."""
        with self._lock:
            return any(h.slots_free or h.free_usd for h in self._holds.values())

    def idle(self) -> None:
        """Give back what the blocks hold unused, with the calls that wait, in one change."""
        if not self.holding():
            return
        with self._meeting, self._detached() as back:
            batch = self._pending()
            try:
                self._give_back(back, batch)
            except BaseException:
                self._unpend(batch)
                raise

    @contextlib.contextmanager
    def _detached(self) -> Iterator[list[_Back]]:
        """What every hold keeps unused, taken off the holds (put back if the change fails)."""
        wall = self.wall()
        back: list[_Back] = []
        with self._lock:
            for key, h in self._holds.items():
                usd = h.free_usd if wall < h.day_end_wall else 0.0
                slots = h.slots_free if ledger.in_window(h.second, wall) else 0
                if slots or usd:
                    b = _Back(key, h.second, slots, h.slots_clustered, usd, h.usd_clustered)
                    back.append(b)
                h.slots_free, h.free_usd = 0, 0.0
        try:
            yield back
        except BaseException:
            with self._lock:
                for b in back:
                    h = self._holds[b.key]
                    h.free_usd = round(h.free_usd + b.usd, 10)
                    if h.second == b.second:
                        h.slots_free += b.slots
            raise

    def _give_back(self, back: list[_Back], batch: list[ledger.Call]) -> None:
        if not back and not batch:
            return
        wall = self.wall()
        with ledger.change(self.settings, now_wall=wall) as led:
            for k in batch:
                ledger.count(led, k, wall)
            for b in back:
                if b.slots:
                    led.give_back_requests(b.key, b.second, b.slots)
                if b.usd:
                    spent = led.spend_usd.get(b.key, 0.0) - b.usd
                    led.spend_usd[b.key] = round(max(0.0, spent), 8)
        self.meetings += 1
        self._changed()
        if self.clustered:
            for b in back:
                if b.slots and b.slots_clustered:
                    budget.give_back_slots(self.settings, b.key, b.second, b.slots)
                if b.usd and b.usd_clustered:
                    budget.give_back_usd(self.settings, b.key, b.usd)

    def _spend_now(self, r: Reservation, delta_usd: float) -> None:
        """Add ``delta_usd`` (negative: give back) to the shared spend, at once."""
        with ledger.change(self.settings) as led:
            spent = led.spend_usd.get(r.key, 0.0) + delta_usd
            led.spend_usd[r.key] = round(max(0.0, spent), 8)
        self._changed()
        if r.clustered:
            budget.give_back_usd(self.settings, r.key, -delta_usd)


def _take_one(
    h: Hold, key: str, rate: bool, need_usd: float | None, second: int
) -> Reservation | None:
    """One call's part taken from ``h`` (its slot, its reservation) and counted in its demand;
    the reservation, or None without a budget (under ``Blocks._lock``)."""
    r = None
    if rate:
        h.slots_free -= 1
    if need_usd is not None:
        h.free_usd = round(h.free_usd - need_usd, 10)
        r = Reservation(key, need_usd, h.usd_clustered, block_day=h.day)
    h.took(second, 1 if rate else 0, need_usd or 0.0)
    return r
