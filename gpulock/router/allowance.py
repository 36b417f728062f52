"""What a long-lived process holds ahead of its calls: request slots and budget taken from the
shared ledger in blocks, spent in memory (``gpulock.router.books`` meets the ledger with them).

``gpulock serve`` admits hundreds of calls a second to one endpoint.  Judging each against the
ledger file (read it whole, change it, write it whole, under its lock: three times a call) cost
it ~5 ms of CPU a call.  So serve takes from the shared ledger (the file; in a cluster, Redis
too) in blocks, and admits the calls in between from memory:

* **request slots**: a ``rate_limit``'s slots are taken for the wall clock's current second:
  as many as this process admitted in the last second, or twice as many as it already took in
  this one once a block runs out; never more than ``SHARE`` of the slots still free in the
  minute's window (at least one).  A slot is used in the second it was counted in (the ledger
  keeps requests by second: ``gpulock.router.ledger``), so the window stays true; what a second
  did not use is given back at the next meeting or when the line goes idle.
* **budget**: a call's reservation (its most cost: ``gpulock.router.budget``) is taken from
  what the process holds; when that is short, the call meets the ledger and reserves itself
  plus, ahead, what the process reserved in the last second (twice what it took in this one
  once that runs out), never more than ``SHARE`` of what would be left of the budget after it.
  A call that answered is settled into the block (what it did not use goes back into it, at
  once); one that failed gives its reservation back into it.  The unused part is given back to
  the ledger when the line goes idle, and when serve stops.

Whatever a block holds is counted in the shared ledger as requests made or money spent for as
long as it is held, so every other process and host sees it taken: a check-and-reserve under the
ledger's lock (Redis's script in a cluster) still decides every block, and a budget is never
passed by more than the one call whose real cost passes its bound, exactly as without blocks.
Since a block is at most ``SHARE`` of what is left, the last calls stay usable by every process.

Nothing here reads a file, a clock or the network: the caller passes the time and does the I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SHARE = 0.125  # the most a block takes of what is left (of a window's slots, of a budget)
EPS_USD = 1e-9  # what budget checks forgive (the ledger rounds to 1e-8)


def slots_block(limit: int, used: int, wanted: int) -> int:
    """How many request slots to take at once: none when ``used`` fills ``limit``; else what is
    ``wanted`` (at least one), never more than ``SHARE`` of the slots left (at least one)."""
    left = limit - used
    if left <= 0:
        return 0
    return max(1, min(wanted, math.floor(left * SHARE)))


def tight(need_usd: float, left_usd: float | None) -> bool:
    """Whether a budget is near its end for calls of ``need_usd``: what would be left after
    one is too little to hold a whole one ahead (``SHARE`` of it).  A process then holds
    nothing ahead, and gives back at once what each call did not use, as a single call's
    reservation does: the last calls stay usable by every process."""
    return left_usd is not None and (left_usd - need_usd) * SHARE < need_usd


def usd_ahead(need_usd: float, left_usd: float | None, wanted_usd: float) -> float:
    """What to reserve ahead, beyond a call's own ``need_usd``: what is ``wanted`` beyond the
    call, never more than ``SHARE`` of what would be left after the call (``left_usd``: of the
    tightest budget, before this call; None: no budget), in whole calls like this one (a part
    of a call would be of no use here, and of none to the others while held)."""
    ahead = max(0.0, wanted_usd - need_usd)
    if left_usd is not None:
        ahead = min(ahead, max(0.0, (left_usd - need_usd) * SHARE))
    if need_usd <= 0:
        return 0.0
    return round(math.floor(ahead / need_usd + 1e-9) * need_usd, 10)


@dataclass(slots=True)
class Demand:
    """How much a process took in the current second and the one before (calls, USD)."""

    second: int = -1
    now: float = 0.0  # taken in ``second``
    last: float = 0.0  # taken in the second before (0 when it was quieter than that)

    def add(self, second: int, amount: float) -> None:
        self._roll(second)
        self.now += amount

    def wanted(self, second: int, block_ran_out: bool) -> float:
        """A block's size: last second's, or twice this second's when a block ran out in it."""
        self._roll(second)
        return max(self.last, 2 * self.now if block_ran_out else 0.0)

    def _roll(self, second: int) -> None:
        if second != self.second:
            self.last = self.now if second == self.second + 1 else 0.0
            self.now = 0.0
            self.second = second


@dataclass(slots=True)
class Hold:
    """One endpoint's (cid's) blocks as this process holds them.

    Slots: ``slots_free`` of the requests counted in the ledger in ``second`` are not used
    yet.  Budget: ``free_usd`` is counted in the ledger as spent (``day``'s spend) and not used
    by any call yet; it is good until ``day_end_wall`` (the next day starts from zero, and
    what was held yesterday is no longer counted anywhere).  ``tight``: the budget is near
    its end (``tight()``): nothing is kept.  ``clustered``: the blocks are counted in the
    cluster's Redis too (what is given back goes back there as well)."""

    second: int = -1
    slots_free: int = 0
    slots_clustered: bool = False
    free_usd: float = 0.0
    day: str = ""
    day_end_wall: float = 0.0
    usd_clustered: bool = False
    tight: bool = False
    calls: Demand | None = None
    usd: Demand | None = None

    def slot_ready(self, second: int) -> bool:
        return self.second == second and self.slots_free > 0

    def usd_ready(self, need_usd: float, now_wall: float) -> bool:
        return now_wall < self.day_end_wall and self.free_usd + EPS_USD >= need_usd

    def wanted_slots(self, second: int) -> int:
        calls = self.calls if self.calls is not None else Demand()
        self.calls = calls
        return max(1, math.ceil(calls.wanted(second, self.second == second)))

    def wanted_usd(self, need_usd: float, second: int) -> float:
        usd = self.usd if self.usd is not None else Demand()
        self.usd = usd
        ran_out = usd.second == second and usd.now > 0
        return max(need_usd, usd.wanted(second, ran_out))

    def took(self, second: int, slots: int, usd: float) -> None:
        """Count what one admission took (the demand that sizes the next blocks)."""
        if slots:
            self.calls = self.calls if self.calls is not None else Demand()
            self.calls.add(second, slots)
        if usd:
            self.usd = self.usd if self.usd is not None else Demand()
            self.usd.add(second, usd)

    def settle(self, day: str, reserved_usd: float, cost_usd: float) -> float:
        """A call reserved from this hold (on ``day``) answered: what it did not use goes back
        into the block.  Returns what the ledger must count at once (0 mostly): what it cost
        past its reservation and the block, or (``tight``) less what it did not use."""
        if day != self.day:  # reserved yesterday: today's ledger never counted it
            return 0.0
        self.free_usd = round(self.free_usd + reserved_usd - cost_usd, 10)
        if self.free_usd < 0:
            owed, self.free_usd = -self.free_usd, 0.0
            return owed
        if self.tight and self.free_usd:
            back, self.free_usd = self.free_usd, 0.0
            return -back
        return 0.0

    def give_back(self, day: str, reserved_usd: float) -> None:
        """A call reserved from this hold failed: its reservation goes back into the block."""
        if day == self.day:
            self.free_usd = round(self.free_usd + reserved_usd, 10)
