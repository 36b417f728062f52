"""Foresight: when each resident model will be needed next, what reloading it costs, and the
victim order that follows (Belady's rule, weighted by reload cost).

Pure: every input is an argument (the models, the declared future, the past, the time), so a
table test covers "the digest runs at 07:00, the tagger every 15 minutes" in microseconds, and
the live eviction (``gpulock.residents.eviction``, the governor) and ``gpulock replay`` share this
one decision.  Gathering the inputs (the event log, the line, the crontab) is
``gpulock.residents.foresight_inputs``.

It lives in ``core`` because every floor that evicts reads it: the residents' room, the governor
(which meets gpulock at ``gpulock.core`` and ``gpulock.arbiter``) and the replay at the top.

Next use, from the strongest evidence first:

1. ``Planned`` uses: a waiter in line that needs the model (now, sure), a crontab or fleet
   entry's next fire mapped to the models its agent asks for (``confidence`` as given).
2. The model's history (``Use``): uses closer than ``BURST_S`` are one session; sessions at a
   regular interval (median absolute deviation within ``RHYTHM_SPREAD`` of the median) give a
   *rhythm*; sessions at the same time of day (within ``TOD_WINDOW_S``) on two or more days give a
   *time of day*; any two sessions give a weak guess from their mean gap.
3. Nothing: unknown (``at_wall`` None), evicted first.

The earliest estimate with confidence >= ``SURE`` wins; else the most confident one.

Victim order (``order``): pinned and in-use models are never candidates (the callers filter
them; ``order`` drops them too).  Under ``foresight`` the model with the highest
``distance / confidence / reload_s`` goes first (a large model needed in 2 minutes stays over
a small one needed in an hour); unknown next use counts as infinitely far; ties, and the whole
order under ``lru``, by the caller's own key ("today's order").
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, TypeVar


class ConfigLike(Protocol):
    """What ``policy_of`` reads of ``gpulock.core.config.Config`` (which imports this module
    to check the key when a file is loaded: no import back)."""

    def settings_of(self, name: str, keys: Sequence[str]) -> Mapping[str, Any] | None: ...

    def error(self, key: str, problem: str, hint: str | None = None) -> Exception: ...


__all__ = [
    "POLICIES",
    "Forecast",
    "Load",
    "NextUse",
    "Planned",
    "ReloadCost",
    "Use",
    "forecast",
    "line_plans",
    "next_uses",
    "order",
    "policy_of",
    "reload_costs",
]

POLICIES: Final = ("foresight", "lru")
KEYS: Final = ("policy",)  # of the config's ``eviction:`` section
DEFAULT_POLICY: Final = "foresight"
DAY_S: Final = 86400.0
BURST_S: Final = 120.0  # uses closer than this are one session (a batch of calls)
RHYTHM_SPREAD: Final = 0.1  # median absolute deviation / median interval for a rhythm
TOD_WINDOW_S: Final = 900.0  # same time of day: within 15 minutes
SURE: Final = 0.5  # estimates at least this sure compete on time; weaker ones only as fallback
MAX_SESSIONS: Final = 200  # per model: the recent past says enough, and it bounds the cost
DISK_BYTES_PER_S: Final = 1024**3  # a cold read and upload, when nothing was ever measured
CACHED_BYTES_PER_S: Final = 8 * 1024**3  # from the page cache
DEFAULT_RELOAD_S: Final = 10.0  # a model of unknown size
MIN_RELOAD_S: Final = 0.1
LINE_STEP_S: Final = 10.0  # a waiter one place further back in the line needs its model later
UNNEEDED_FACTOR: Final = 10.0  # "much longer than its reload time"

T = TypeVar("T")


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


UNKNOWN_SOURCE: Final = "unknown"


@dataclass(frozen=True, slots=True)
class Load:
    """One past load of ``model``: how many bytes, how long it took."""

    model: str
    load_s: float
    bytes: int | None = None


@dataclass(frozen=True, slots=True)
class ReloadCost:
    """Seconds to load ``model`` again; ``source``: measured, throughput, size or unknown."""

    seconds: float
    source: str


@dataclass(frozen=True, slots=True)
class Forecast:
    """Next uses and reload costs by model name, at ``now_wall``: what ``order`` reads."""

    now_wall: float
    next: Mapping[str, NextUse]
    reload: Mapping[str, ReloadCost]
    bytes: Mapping[str, int | None] = field(default_factory=dict)

    def score(self, model: str) -> float:
        """How good a victim: the distance to its next use (over the confidence), times the
        bytes it frees per second its reload costs; inf when never expected.

        Per byte, not per model: evicting a small model frees little, and a model of
        known size that reloads at the usual speed scores exactly its distance (Belady's
        rule).  A model slower to load than its size says (a tenant that starts a process,
        a slow disk) stays longer; one of unknown size counts as loading at the usual speed.
        """
        d = self.distance(model)
        if d is None:
            return math.inf
        rc = self.reload.get(model)
        size = self.bytes.get(model)
        if rc is None or not size:
            return d
        usual = size / DISK_BYTES_PER_S  # what its size would cost at the usual speed
        return d * usual / max(rc.seconds, MIN_RELOAD_S)

    def rate(self, model: str) -> float:
        """Reload seconds per second until its next use: what keeping it saves, per second
        (0 when never expected)."""
        d = self.distance(model)
        if d is None:
            return 0.0
        rc = self.reload.get(model)
        return (rc.seconds if rc is not None else DEFAULT_RELOAD_S) / max(d, 1.0)

    def distance(self, model: str) -> float | None:
        """Seconds to the next use over its confidence; None when never expected."""
        nu = self.next.get(model)
        if nu is None or nu.at_wall is None or nu.confidence <= 0:
            return None
        return max(nu.at_wall - self.now_wall, 0.0) / max(nu.confidence, 0.05)

    def unneeded(self, model: str, factor: float = UNNEEDED_FACTOR) -> bool:
        """No use expected within ``factor`` times its reload time (or none at all): keeping
        it loaded saves less than the memory it holds costs the others."""
        d = self.distance(model)
        if d is None:
            return True
        rc = self.reload.get(model)
        return d / max(rc.seconds if rc is not None else DEFAULT_RELOAD_S, MIN_RELOAD_S) >= factor

    def why(self, model: str) -> dict[str, Any]:
        """The evidence for an ``evict`` event: next use, its source, the reload cost."""
        nu = self.next.get(model)
        rc = self.reload.get(model)
        return {
            "next_use_s": None if nu is None else _round(nu.in_s(self.now_wall)),
            "next_use_source": UNKNOWN_SOURCE if nu is None else nu.source,
            "reload_s": None if rc is None else round(rc.seconds, 3),
        }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _short(seconds: float) -> str:
    s = max(seconds, 0.0)
    if s < 90:
        return f"{s:.0f}s"
    if s < 5400:
        return f"{s / 60:.0f}m"
    return f"{s / 3600:.1f}h"


# --- next use ----------------------------------------------------------------------------------


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


# --- reload cost -------------------------------------------------------------------------------


def reload_costs(
    models: Mapping[str, int | None],
    loads: Iterable[Load],
    *,
    cached: Mapping[str, float] | None = None,
) -> dict[str, ReloadCost]:
    """Seconds to reload each model (name -> bytes): the median of its own past loads; else
    its bytes at this machine's measured throughput (median over every load with a size);
    else its bytes at ``DISK_BYTES_PER_S`` (or ``CACHED_BYTES_PER_S`` for the share of the
    file in the page cache, ``cached``: name -> 0..1).
    """
    own: dict[str, list[float]] = {}
    rates: list[float] = []
    for ld in loads:
        if ld.load_s <= 0:
            continue
        own.setdefault(ld.model, []).append(ld.load_s)
        if ld.bytes:
            rates.append(ld.bytes / ld.load_s)
    rate = statistics.median(rates) if rates else None
    out: dict[str, ReloadCost] = {}
    for m, size in models.items():
        if m in own:
            out[m] = ReloadCost(statistics.median(own[m]), "measured")
        elif size and rate:
            out[m] = ReloadCost(size / rate, "throughput")
        elif size:
            hot = min(max((cached or {}).get(m, 0.0), 0.0), 1.0)
            out[m] = ReloadCost(
                size * hot / CACHED_BYTES_PER_S + size * (1 - hot) / DISK_BYTES_PER_S, "size"
            )
        else:
            out[m] = ReloadCost(DEFAULT_RELOAD_S, "unknown")
    return out


def forecast(
    models: Mapping[str, int | None],
    planned: Iterable[Planned],
    history: Iterable[Use],
    loads: Iterable[Load],
    now_wall: float,
    *,
    utc_offset_s: float = 0.0,
    cached: Mapping[str, float] | None = None,
) -> Forecast:
    """``next_uses`` and ``reload_costs`` in one record, for ``order``."""
    return Forecast(
        now_wall,
        next_uses(models, planned, history, now_wall, utc_offset_s=utc_offset_s),
        reload_costs(models, loads, cached=cached),
        dict(models),
    )


# --- victim order ------------------------------------------------------------------------------


def order(
    items: Iterable[T],
    *,
    model: Callable[[T], str],
    today: Callable[[T], Any],
    forecast: Forecast | None,
    policy: str = DEFAULT_POLICY,
    pinned: Callable[[T], bool] = lambda _: False,
    in_use: Callable[[T], bool] = lambda _: False,
    room_bytes: int | None = None,
    size: Callable[[T], int | None] | None = None,
) -> list[T]:
    """Victims first.  ``today``: the caller's own key (cold-start first, then least recently
    used...), the whole order under ``lru`` or without a forecast, the tie-break otherwise.
    Pinned and in-use items are never returned.

    ``room_bytes`` (with ``size``): the bytes to free, when known.  Then, after the models
    nobody is expected to use, the cheapest set of victims that frees the rest
    (``gpulock.core.cover``) comes first, the others after it.
    """
    cands = [x for x in items if not pinned(x) and not in_use(x)]
    if policy == "lru" or forecast is None:
        return sorted(cands, key=today)
    ranked = sorted(cands, key=lambda x: (-forecast.score(model(x)), today(x)))
    if room_bytes is None or size is None or len(ranked) < 2:
        return ranked
    from gpulock.core import cover

    # Models nobody is expected to use go first, in today's order (cold-start first): the
    # cheapest cover is for what they leave short.
    never = [x for x in ranked if forecast.distance(model(x)) is None]
    known = ranked[len(never) :]
    short = room_bytes - sum(size(x) or 0 for x in never)
    if short <= 0 or len(known) < 2:
        return ranked
    found = cover.cheapest(
        [cover.Candidate(size(x) or 0, forecast.rate(model(x))) for x in known], short
    )
    if found is None:
        return ranked
    chosen = set(found)
    return never + [known[i] for i in found] + [x for i, x in enumerate(known) if i not in chosen]


def policy_of(config: ConfigLike) -> str:
    """``eviction.policy`` from the config (``foresight`` or ``lru``), validated."""
    section = config.settings_of("eviction", KEYS)
    if section is None:
        return DEFAULT_POLICY
    value = section.get("policy", DEFAULT_POLICY)
    if value not in POLICIES or not isinstance(value, str):
        raise config.error(
            "eviction.policy",
            f"expected one of {', '.join(POLICIES)}, got {value!r}",
            hint="foresight: by predicted next use and reload cost; lru: least recently used",
        )
    return value
