"""When each model will be needed next, and how sure that is: the declared future (the line, a
crontab or fleet entry) first, then the model's own past.

Pure, like the rest of foresight (``gpulock.core.foresight``, which turns these next uses and
the reload costs into a victim order).  From the strongest evidence first:

1. ``Planned`` uses: a waiter in line that needs the model (now, sure), a crontab or fleet
   entry's next fire mapped to the models its agent asks for (``confidence`` as given).
2. The model's history (``Use``): uses closer than ``BURST_S`` are one session; sessions at a
   regular interval (median absolute deviation within ``RHYTHM_SPREAD`` of the median) give a
   *rhythm*; sessions at the same time of day (within ``TOD_WINDOW_S``) on two or more days give a
   *time of day*; any two sessions give a weak guess from their mean gap.
3. Nothing: unknown (``at_wall`` None), evicted first.

The earliest estimate with confidence >= ``SURE`` wins; else the most confident one.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

DAY_S: Final = 86400.0
BURST_S: Final = 120.0  # uses closer than this are one session (a batch of calls)
RHYTHM_SPREAD: Final = 0.1  # median absolute deviation / median interval for a rhythm
TOD_WINDOW_S: Final = 900.0  # same time of day: within 15 minutes
SURE: Final = 0.5  # estimates at least this sure compete on time; weaker ones only as fallback
MAX_SESSIONS: Final = 200  # per model: the recent past says enough, and it bounds the cost
LINE_STEP_S: Final = 10.0  # a waiter one place further back in the line needs its model later
UNKNOWN_SOURCE: Final = "unknown"


@dataclass(frozen=True, slots=True)
class Use:
    """One past use of ``model`` (a call, a load, a ticket that asked for it), by ``by`` (the
    agent or ticket name; ``""``: unknown).  Rhythms are an agent's: a model shared by a
    15-minute tagger and an hourly digest has no rhythm of its own, but each user has one."""

    model: str
    at_wall: float
    by: str = ""


@dataclass(frozen=True, slots=True)
class Planned:
    """A declared future use: a waiter in line (``source`` "waiter"), a cron or fleet fire."""

    model: str
    at_wall: float
    source: str  # waiter | cron | fleet | trace
    label: str = ""  # who: the agent or ticket name
    confidence: float = 1.0


@dataclass(frozen=True, slots=True)
class NextUse:
    """The expected time of ``model``'s next use and how sure it is (0..1)."""

    model: str
    at_wall: float | None  # None: unknown
    confidence: float
    source: str  # waiter | cron | fleet | rhythm | time-of-day | history | unknown
    label: str = ""

    def in_s(self, now_wall: float) -> float | None:
        return None if self.at_wall is None else max(self.at_wall - now_wall, 0.0)

    def describe(self, now_wall: float, fmt_time: Callable[[float], str] | None = None) -> str:
        """``~07:00 (digest, cron)``, ``in 5m (rhythm)``, ``unknown``."""
        if self.at_wall is None:
            return "unknown"
        when = fmt_time(self.at_wall) if fmt_time else f"in {_short(self.at_wall - now_wall)}"
        who = f"{self.label}, {self.source}" if self.label else self.source
        return f"~{when} ({who})" if fmt_time else f"{when} ({who})"


def _short(seconds: float) -> str:
    s = max(seconds, 0.0)
    if s < 90:
        return f"{s:.0f}s"
    if s < 5400:
        return f"{s / 60:.0f}m"
    return f"{s / 3600:.1f}h"


def line_plans(
    waiting: Iterable[tuple[str, Iterable[str]]], now_wall: float, *, step_s: float = LINE_STEP_S
) -> list[Planned]:
    """The line as planned uses: the waiters (name, models), in line order.  The first is due
    now, each next one ``step_s`` later: all of them are needed soon, the back of the line
    last (so Belady's rule holds within the line)."""
    return [
        Planned(m, now_wall + k * step_s, "waiter", name)
        for k, (name, models) in enumerate(waiting)
        for m in models
    ]


def next_uses(
    models: Iterable[str],
    planned: Iterable[Planned],
    history: Iterable[Use],
    now_wall: float,
    *,
    utc_offset_s: float = 0.0,
) -> dict[str, NextUse]:
    """The next use of each of ``models``.  ``utc_offset_s``: local time minus UTC, for the
    time-of-day rule (a 07:00 digest is 07:00 local)."""
    wanted = set(models)
    plans: dict[str, list[Planned]] = {}
    for p in planned:
        if p.model in wanted and p.at_wall >= now_wall - BURST_S:
            plans.setdefault(p.model, []).append(p)
    past: dict[str, dict[str, list[float]]] = {}
    for u in history:
        if u.model in wanted and u.at_wall <= now_wall:
            past.setdefault(u.model, {}).setdefault(u.by, []).append(u.at_wall)
    return {
        m: _next_use(m, plans.get(m, ()), past.get(m, {}), now_wall, utc_offset_s) for m in wanted
    }


def _next_use(
    model: str,
    plans: Sequence[Planned],
    past: Mapping[str, Sequence[float]],
    now: float,
    utc_offset_s: float,
) -> NextUse:
    found = [
        NextUse(model, max(p.at_wall, now), min(max(p.confidence, 0.0), 1.0), p.source, p.label)
        for p in plans
    ]
    for by, times in past.items():  # each user's rhythm
        found += _from_history(model, times, now, utc_offset_s, by)
    if len(past) > 1 and not any(f.confidence >= SURE for f in found):
        merged = [t for times in past.values() for t in times]
        found += _from_history(model, merged, now, utc_offset_s)
    if not found:
        return NextUse(model, None, 0.0, UNKNOWN_SOURCE)
    sure = [f for f in found if f.confidence >= SURE]
    if sure:
        return min(sure, key=lambda f: (f.at_wall or 0.0, -f.confidence))
    return max(found, key=lambda f: (f.confidence, -(f.at_wall or 0.0)))


def sessions(times: Iterable[float]) -> list[float]:
    """Start times of the sessions in ``times``: uses within ``BURST_S`` of the last are one."""
    out: list[float] = []
    last = -math.inf
    for t in sorted(times):
        if t - last > BURST_S:
            out.append(t)
        last = t
    return out[-MAX_SESSIONS:]


def _ongoing(model: str, past: Sequence[float], now: float, by: str = "") -> NextUse | None:
    """The next use of a session still going: its uses (each within ``2 * BURST_S`` of the
    last) come at a steady gap, and the last was less than two gaps ago.

    A model used every two minutes, or every minute, is one endless session to ``sessions``
    (every use is within ``BURST_S`` of the last): without this it would have no rhythm and
    be evicted first, a minute before its next use (the alternating trace in
    docs/foresight.md).
    """
    times = sorted(past)
    if len(times) < 3:
        return None
    run = [times[-1]]
    for t in reversed(times[:-1]):
        # Twice the session gap: a job every two minutes is granted a few seconds late now
        # and then, and a use 121 s after the last must not end the run.
        if run[-1] - t > 2 * BURST_S:
            break
        run.append(t)
        if len(run) > MAX_SESSIONS:
            break
    if len(run) < 3:
        return None
    gaps = [a - b for a, b in itertools.pairwise(run)]
    gap = statistics.median(gaps)
    if gap <= 0 or now - run[0] > 2 * gap:
        return None
    spread = statistics.median(abs(g - gap) for g in gaps) / gap
    if spread > RHYTHM_SPREAD:
        return None
    return NextUse(model, max(run[0] + gap, now), 0.9 - 3 * spread, "session", by)


def _from_history(
    model: str, past: Sequence[float], now: float, utc_offset_s: float, by: str = ""
) -> list[NextUse]:
    out: list[NextUse] = []
    going = _ongoing(model, past, now, by)
    if going is not None:
        out.append(going)
    starts = sessions(past)
    if len(starts) < 2:
        return out
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    last = starts[-1]
    if len(gaps) >= 2:
        period = statistics.median(gaps)
        spread = statistics.median(abs(g - period) for g in gaps) / period if period > 0 else 1.0
        if period > 0 and spread <= RHYTHM_SPREAD:
            late = now - last
            # Overdue by less than half a period: it is about to come (a late cron, a slow
            # queue); later than that, the rhythm moved on to its next beat.
            if late <= period:
                at = last + period
            elif late - period <= period / 2:
                at = now
            else:
                at = last + period * math.ceil(late / period)
            out.append(NextUse(model, at, 0.9 - 3 * spread, "rhythm", by))
    tod = _time_of_day(starts, now, utc_offset_s)
    if tod is not None:
        out.append(NextUse(model, tod, 0.6, "time-of-day", by))
    mean_gap = (last - starts[0]) / (len(starts) - 1)
    at = now + mean_gap
    if at < now:
        at = now + mean_gap
    out.append(NextUse(model, at, 0.2, "history", by))
    return out


def _time_of_day(starts: Sequence[float], now: float, utc_offset_s: float) -> float | None:
    """The next local time of day at which sessions began on two or more different days.

    Linear: sessions fall into ``TOD_WINDOW_S`` slots of the day; a slot counts its own
    sessions and its two neighbours' (so "within 15 minutes" is at most 30 apart).  Different
    days means at least half a day apart, not two calendar dates: a 15-minute rhythm that runs
    across midnight is not a time of day.
    """
    slots = int(DAY_S // TOD_WINDOW_S)
    seen: dict[int, list[float]] = {}  # slot -> the sessions' start times in it
    first: dict[int, float] = {}  # slot -> the earliest time of day seen in it
    for t in starts:
        tod = (t + utc_offset_s) % DAY_S
        slot = int(tod // TOD_WINDOW_S)
        seen.setdefault(slot, []).append(t)
        if slot not in first or tod < first[slot]:
            first[slot] = tod
    now_local = now + utc_offset_s
    today = math.floor(now_local / DAY_S) * DAY_S
    best: float | None = None
    for slot, tod in first.items():
        near = seen[slot] + seen.get((slot - 1) % slots, []) + seen.get((slot + 1) % slots, [])
        if max(near) - min(near) < DAY_S / 2:
            continue
        at = today + tod
        if at < now_local - BURST_S:
            at += DAY_S
        if at < now_local:
            at = now_local
        if best is None or at < best:
            best = at
    return None if best is None else best - utc_offset_s
