"""One meeting of a process's blocks with the shared ledger: the steps that take the next blocks.

``gpulock.router.blocks`` keeps the blocks in memory and meets the shared ledger when they run
short.  A ``Meeting`` records what that meeting detached, wanted and took; the steps here fill
it: Redis's scripts first in a cluster (``take_cluster``: the truth across hosts), then, inside
one locked change of this host's file, the request slots (``take_slots``) and the budget
(``take_usd``), each judged as ``gpulock.router.accounting.admit`` and
``gpulock.router.budget.reserve`` judge a call.  What Redis granted and the file did not take
goes back afterwards (``give_back_cluster``).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpulock.core.settings import Settings
from gpulock.router import allowance, budget, ledger
from gpulock.router.choose import Verdict
from gpulock.router.routes import Candidate, RouterSettings


@dataclass(slots=True)
class Meeting:
    """What one meeting with the shared ledger detached, wanted and took."""

    need_usd: float | None
    old: tuple[int, int, bool] | None = None  # (second, free slots, clustered) replaced
    wanted_slots: int = 0
    slots: int = 0  # slots taken (granted by Redis, or by this host's file)
    slots_clustered: bool = False
    slots_here: bool = False  # counted in this host's file
    rate_share: int = 1
    usd: bool = False  # a budget block is taken
    held: float = 0.0  # the budget held unused, folded into the new block
    wanted_usd: float = 0.0
    got_usd: float = 0.0  # counted as spent for the new block (the call's need, less held)
    usd_clustered: bool = False
    usd_here: bool = False
    usd_share: int = 1
    tight: bool = False  # the budget is near its end: nothing is kept (allowance.tight)
    held_clustered: bool = False  # ``held`` is counted in Redis too
    held_back: bool = False  # refused: ``held`` went back to the shared ledger


def take_cluster(
    settings: Settings, rs: RouterSettings, c: Candidate, key: str, m: Meeting
) -> Verdict | None:
    """The cluster's part, first: its scripts are the truth across hosts.  The slots of an
    earlier second given back, the next slots and budget taken; returns the refusal, or None."""
    need = m.need_usd or 0.0
    why: Verdict | None = None
    if m.old is not None:
        if m.old[1] and m.old[2]:
            budget.give_back_slots(settings, key, m.old[0], m.old[1])
        g = budget.take_slots(settings, c, m.wanted_slots, allowance.SHARE)
        if isinstance(g, str):
            why = Verdict(c, False, g, limit="rate")
        else:
            m.slots, m.slots_clustered, m.rate_share = int(g.amount), g.clustered, g.share
    if why is None and m.usd:
        g2 = budget.reserve_ahead(
            settings, rs, c, need - m.held, m.wanted_usd - need, allowance.SHARE, m.held, need,
        )  # fmt: skip
        if isinstance(g2, str):
            why = Verdict(c, False, g2, limit="budget")
        else:
            m.got_usd, m.usd_clustered, m.usd_share = g2.amount, g2.clustered, g2.share
            m.tight = g2.tight
    return why


def take_slots(
    led: ledger.Ledger, c: Candidate, key: str, m: Meeting, wall: float
) -> Verdict | None:
    """The request slots, in this host's file (``led``, under its lock): the block Redis
    granted, else one sized here; returns the refusal, or None."""
    used = led.requests_last_min(wall).get(key, 0)
    if not m.slots_clustered:
        m.slots = host_slots(c, used, m.wanted_slots, m.rate_share)
    if m.slots < 1:
        return Verdict(c, False, _rate_why(used, c, m.rate_share), limit="rate")
    led.take_requests(key, wall, m.slots)
    m.slots_here = True
    return None


def take_usd(
    led: ledger.Ledger,
    c: Candidate,
    rs: RouterSettings,
    key: str,
    m: Meeting,
    held_elsewhere_usd: float,
) -> Verdict | None:
    """The budget block, in this host's file (``led``, under its lock); ``held_elsewhere_usd``:
    what this process's other blocks keep unused.  Returns the refusal, or None."""
    need = m.need_usd or 0.0
    spent = led.spend_usd.get(key, 0.0) - m.held
    total = sum(led.spend_usd.values()) - m.held - held_elsewhere_usd
    where = "on this host" if m.usd_share == 1 else "on this host (its share)"
    # Granted by Redis or not, this host's file is judged too (at the full budget
    # when Redis answered: the file counts this host's spend only).
    no, left = budget.over_budget(c, rs, spent, total, need, m.usd_share, where)
    if no is not None:
        return Verdict(c, False, no, limit="budget")
    if not m.usd_clustered:
        ahead = allowance.usd_ahead(need, left, m.wanted_usd)
        m.got_usd = round(need - m.held + ahead, 10)
        m.tight = allowance.tight(need, left)
    led.spend_usd[key] = round(max(0.0, spent + m.held + m.got_usd), 8)
    m.usd_here = True
    return None


def give_back_held(led: ledger.Ledger, key: str, m: Meeting) -> None:
    """No call of this size fits: what is held goes back at once (the next process may have a
    smaller one)."""
    spent = led.spend_usd.get(key, 0.0) - m.held
    led.spend_usd[key] = round(max(0.0, spent), 8)
    m.held_back = True


def give_back_cluster(settings: Settings, key: str, m: Meeting, second: int) -> None:
    """What Redis granted a meeting that this host's file did not take: given back."""
    if m.slots_clustered and m.slots and not m.slots_here:
        budget.give_back_slots(settings, key, second, m.slots)
        m.slots = 0
    if m.usd_clustered and m.got_usd and not m.usd_here:
        budget.give_back_usd(settings, key, m.got_usd)
        m.got_usd = 0.0
    if m.held_back and m.held_clustered:
        budget.give_back_usd(settings, key, m.held)
        m.held_back = False


def host_slots(c: Candidate, used: int, wanted: int, share: int) -> int:
    """Slots to take in this host's file, with ``used`` taken: a block of the limit's
    (one at a time, within its share, while a cluster's Redis cannot be used)."""
    limit = c.rate_limit_per_min or 0
    if share > 1:
        return 1 if used + 1 <= limit / share else 0
    return allowance.slots_block(limit, used, wanted)


def _rate_why(used: int, c: Candidate, share: int) -> str:
    limit = c.rate_limit_per_min
    if share > 1:
        return (
            f"rate limit: {used} requests in the last minute on this host "
            f"(its share of {limit} while the cluster's Redis is unavailable)"
        )
    return f"rate limit: {used} requests in the last minute (of {limit})"
