"""``gpulock report``: one self-contained HTML page telling what a state folder's GPUs did.

Built from the event log alone (``<state>/events.jsonl`` and its rotated generation), in two
steps: ``build(events)`` turns events into data (pure: holds, waits, resident models, markers,
governor levels, step series and tables), ``render_html(data)`` turns that data into one HTML
file with inline CSS, inline SVG and a few lines of inline JavaScript (sortable tables): no
network, no external file, so it can be mailed or opened from a cron box's disk.

What is drawn, and from which events:

* holds: ``acquire`` to ``release`` of the same (gpu, ticket).  A hold with no ``release`` ends
  at its ``cleanup`` or ``break`` (drawn *cut short*), or stays open to the end of the log; a
  ``kill`` marks it cut short too.  A ``release`` whose ``acquire`` lies before the log (or the
  ``--since`` window) starts at ``ts - held_s``.
* waits: ``wait`` to the ``acquire``, ``timeout``, ``cleanup`` or ``break`` of that ticket; the
  queue length of a GPU is the number of waits open at each moment.
* VRAM: the ``need_bytes`` of the holders that declared one, summed while they hold; resident
  models' ``declared_bytes`` from ``resident`` to their ``evict`` (when it freed them),
  ``cleanup`` or ``unload`` (no such event is written yet: a model its owner unloads stays
  counted until the end of the log); and the used share the governor measured, from the
  ``vram.gpuN`` values in the evidence of its ``escalate``/``deescalate``/``governor`` events.
  Exclusive holds (no need) take the whole GPU and are shown as bands.
* markers: ``timeout``, ``kill``, ``break``, ``cleanup``, ``stale``, ``evict``, ``oom``, level
  changes and ``governor-error``; governor levels as background bands.
* tables: per holder (runs, waits p50/p99, timeouts, time held), per agent (``agent`` events:
  ok / skip / error), route choices by tier (``route``) and model calls (``call``).

The log is user-controlled text: every string is HTML-escaped, every field is type-checked,
unknown events and garbage are counted, never fatal.  Percentiles interpolate linearly between
the closest ranks (``percentile``).
"""

from __future__ import annotations

import argparse
import html
import json
import math
import os
import re
import signal
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpulock.cli import Parser, UsageError, parse_since, report
from gpulock.errors import GpulockError
from gpulock.units import format_duration, format_size

EX_OK = 0
FORMAT = "gpulock-report/1"
LEVELS = ("normal", "reduce", "evict-idle", "force-evict", "freeze")  # as governor.model has them
EVICTED = frozenset({"freed", "unloaded", "owner-gone", "already-unloaded"})  # the model left
EPOCH_FLOOR = 1e9  # a bare --since number this large is an epoch time (2001-09-09), not an age
TS_MAX = 1e10  # year 2286: later (or negative) times are garbage
SPAN_MAX_S = 1e8  # three years: a longer wait or hold is garbage
LOST_WAIT_MIN_S = 0.1  # see _lost_wait
NAME_MAX = 120  # longer names from the log are cut: a label is not a place for a novel

Point = tuple[float, float]
Row = tuple[str, int | None, str]  # a timeline row: (lane, gpu, name)


# --- data ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hold:
    """One holder's time on a GPU.  ``end``: release | cleanup | break | open (no end logged)."""

    gpu: int | None
    ticket: int | None
    name: str
    start_wall: float
    end_wall: float
    need_bytes: int | None
    end: str
    killed: bool = False  # a ``kill`` event named it
    why: str = ""  # the reason the cleanup/break/kill gave

    @property
    def cut_short(self) -> bool:
        return self.end != "release" or self.killed


@dataclass(frozen=True, slots=True)
class Wait:
    """One waiter's time in line.  ``end``: acquire | timeout | cleanup | break | open."""

    gpu: int | None
    ticket: int | None
    name: str
    start_wall: float
    end_wall: float
    end: str


@dataclass(frozen=True, slots=True)
class Residency:
    """A resident model in VRAM.  ``end``: evict | cleanup | unload | open."""

    gpu: int | None
    resident: str
    name: str
    start_wall: float
    end_wall: float
    declared_bytes: int | None
    end: str


@dataclass(frozen=True, slots=True)
class Marker:
    """A moment worth a symbol.  ``lane``: holder | resident | governor (the row it sits on)."""

    kind: str
    at_wall: float
    gpu: int | None
    lane: str
    name: str
    text: str


@dataclass(frozen=True, slots=True)
class LevelSpan:
    level: str
    start_wall: float
    end_wall: float


@dataclass(frozen=True, slots=True)
class GpuSeries:
    """Step series (value from each point's time until the next) of one GPU, and samples."""

    gpu: int
    queue: tuple[Point, ...]
    held_bytes: tuple[Point, ...]
    resident_bytes: tuple[Point, ...]
    used_fraction: tuple[Point, ...]  # governor's measurements: samples, not steps
    exclusive: tuple[tuple[float, float], ...]  # holds without a need: the whole GPU


@dataclass(frozen=True, slots=True)
class HolderStats:
    name: str
    runs: int
    waits_p50_s: float | None
    waits_p99_s: float | None
    timeouts: int
    held_s: float
    cut_short: int


@dataclass(frozen=True, slots=True)
class AgentStats:
    agent: str
    runs: int
    ok: int
    skip: int
    error: int
    other: int  # any other outcome (the runtime's "stop", say)
    duration_p50_s: float | None
    last_reason: str


@dataclass(frozen=True, slots=True)
class TierStats:
    tier: str  # "none": a route that found no model
    routes: int
    calls: int
    failed: int  # calls with ok false
    tokens_in: int
    tokens_out: int
    cost_usd: float
    latency_p50_s: float | None


@dataclass(frozen=True, slots=True)
class ModelStats:
    model: str
    tier: str
    calls: int
    failed: int
    tokens_in: int
    tokens_out: int
    cost_usd: float
    latency_p50_s: float | None
    latency_p99_s: float | None


@dataclass(frozen=True, slots=True)
class Totals:
    handoffs: int = 0  # acquires
    waits: int = 0
    waits_p50_s: float | None = None
    waits_p99_s: float | None = None
    timeouts: int = 0
    cut_short: int = 0
    held_s: float = 0.0
    evictions: int = 0
    evictions_freed: int = 0
    level_changes: int = 0
    level_now: str | None = None
    agent_runs: int = 0
    agent_ok: int = 0
    agent_skips: int = 0
    agent_errors: int = 0
    agent_other: int = 0
    route_choices: int = 0
    calls: int = 0
    calls_failed: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    cost_usd: float = 0.0


@dataclass(frozen=True, slots=True)
class ReportData:
    """Everything the page shows; ``start_wall`` is None when no event lies in the window."""

    start_wall: float | None
    end_wall: float | None
    since_wall: float | None
    events: int  # events in the window
    ignored: int  # records that were not events (no kind, no time)
    gpus: tuple[int, ...] = ()
    holds: tuple[Hold, ...] = ()
    waits: tuple[Wait, ...] = ()
    residencies: tuple[Residency, ...] = ()
    markers: tuple[Marker, ...] = ()
    levels: tuple[LevelSpan, ...] = ()
    series: tuple[GpuSeries, ...] = ()
    holders: tuple[HolderStats, ...] = ()
    agents: tuple[AgentStats, ...] = ()
    tiers: tuple[TierStats, ...] = ()
    models: tuple[ModelStats, ...] = ()
    totals: Totals = field(default_factory=Totals)
    kinds: tuple[tuple[str, int], ...] = ()


# --- field access: the log is untrusted ------------------------------------------------------


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    try:
        f = float(v)
    except OverflowError:  # JSON integers have no limit
        return None
    return f if math.isfinite(f) else None


def _int(v: Any) -> int | None:
    ok = isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63
    return v if ok else None


def _span(v: Any) -> float | None:
    """A duration field: None unless a plausible number of seconds."""
    f = _num(v)
    return f if f is not None and 0 <= f <= SPAN_MAX_S else None


def _text(v: Any, default: str = "") -> str:
    if v is None:
        return default
    s = v if isinstance(v, str) else json.dumps(v, default=str)
    return s if len(s) <= NAME_MAX else s[: NAME_MAX - 1] + "…"


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100), interpolating between closest ranks; None if empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * min(max(q, 0.0), 100.0) / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# --- build: events -> data (pure) ------------------------------------------------------------

Key = tuple[int | None, int | str | None]


@dataclass(slots=True)
class _Open:
    start: float
    gpu: int | None
    ticket: int | None
    name: str
    need: int | None = None
    killed: bool = False
    why: str = ""


@dataclass(slots=True)
class _Builder:
    lo: float  # the window's start (-inf: no --since)
    first_ts: float
    holds: list[Hold] = field(default_factory=list)
    waits: list[Wait] = field(default_factory=list)
    residencies: list[Residency] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)
    open_holds: dict[Key, _Open] = field(default_factory=dict)
    open_waits: dict[Key, _Open] = field(default_factory=dict)
    open_res: dict[str, _Open] = field(default_factory=dict)
    level: str | None = None
    level_start: float = 0.0
    levels: list[LevelSpan] = field(default_factory=list)
    level_changes: int = 0
    used: dict[int, list[Point]] = field(default_factory=lambda: defaultdict(list))
    runs: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    timeouts: Counter[str] = field(default_factory=Counter)
    evictions: int = 0
    evictions_freed: int = 0
    agent_events: list[dict[str, Any]] = field(default_factory=list)
    routes: list[dict[str, Any]] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)

    # Events that can end a hold or a wait (of the same gpu + ticket).
    def ticket_event(self, ts: float, kind: str, e: dict[str, Any]) -> None:
        gpu, ticket, name = _int(e.get("gpu")), _int(e.get("ticket")), _text(e.get("name"), "?")
        key: Key = (gpu, ticket if ticket is not None else "name:" + name)
        inside = ts >= self.lo
        if kind == "wait":
            self._close_wait(key, ts, "open")  # a repeated wait: keep the latest
            self.open_waits[key] = _Open(ts, gpu, ticket, name)
        elif kind == "acquire":
            waited = _span(e.get("waited_s"))
            if not self._close_wait(key, ts, "acquire") and _lost_wait(waited, ts, self.first_ts):
                self.waits.append(Wait(gpu, ticket, name, ts - (waited or 0.0), ts, "acquire"))
            self._close_hold(key, ts, "open")  # acquired twice: the first never ended
            self.open_holds[key] = _Open(ts, gpu, ticket, name, need=_int(e.get("need_bytes")))
            if inside:
                self.runs[name].append(waited if waited is not None else 0.0)
        elif kind == "release":
            if not self._close_hold(key, ts, "release"):
                held = _span(e.get("held_s"))
                if held is not None:  # its acquire is before the log: start from held_s
                    need = _int(e.get("need_bytes"))
                    self.holds.append(Hold(gpu, ticket, name, ts - held, ts, need, "release"))
        elif kind == "timeout":
            if not self._close_wait(key, ts, "timeout"):
                waited = _span(e.get("waited_s")) or 0.0
                self.waits.append(Wait(gpu, ticket, name, ts - waited, ts, "timeout"))
            if inside:
                self.timeouts[name] += 1
                self._mark(kind, ts, gpu, "holder", name, f"gave up after {_dur(e, 'waited_s')}")
        else:  # cleanup | break | kill | stale
            why = _text(e.get("reason") or e.get("action"))
            if kind == "kill":
                h = self.open_holds.get(key)
                if h is not None:
                    h.killed, h.why = True, f"{_text(e.get('signal'))} {why}".strip()
            elif kind in ("cleanup", "break"):
                self._close_hold(key, ts, kind, why)
                self._close_wait(key, ts, kind)
            if inside:
                self._mark(kind, ts, gpu, "holder", name, _why(kind, why, e))

    def _close_wait(self, key: Key, ts: float, end: str) -> bool:
        w = self.open_waits.pop(key, None)
        if w is None:
            return False
        self.waits.append(Wait(w.gpu, w.ticket, w.name, w.start, ts, end))
        return True

    def _close_hold(self, key: Key, ts: float, end: str, why: str = "") -> bool:
        h = self.open_holds.pop(key, None)
        if h is None:
            return False
        hold = Hold(h.gpu, h.ticket, h.name, h.start, ts, h.need, end, h.killed, why or h.why)
        self.holds.append(hold)
        return True

    def resident_event(self, ts: float, kind: str, e: dict[str, Any]) -> None:
        rid, name, gpu = _text(e.get("resident")), _text(e.get("name"), "?"), _int(e.get("gpu"))
        inside = ts >= self.lo
        if kind == "resident":
            self._close_res(rid, ts, "open")
            self.open_res[rid] = _Open(ts, gpu, None, name, need=_int(e.get("declared_bytes")))
            return
        outcome = _text(e.get("outcome"))
        if kind == "evict":
            if outcome in EVICTED:
                self._close_res(rid, ts, "evict")
            if inside:
                self.evictions += 1
                self.evictions_freed += outcome in EVICTED
                detail = f"{outcome}: {_text(e.get('reason') or e.get('detail'))}"
                self._mark(kind, ts, gpu, "resident", name, detail)
            return
        if kind in ("cleanup", "unload"):
            self._close_res(rid, ts, kind)
        if inside:
            why = _text(e.get("reason") or e.get("signal"))
            self._mark(kind, ts, gpu, "resident", name, why)

    def _close_res(self, rid: str, ts: float, end: str) -> None:
        r = self.open_res.pop(rid, None)
        if r is not None:
            self.residencies.append(Residency(r.gpu, rid, r.name, r.start, ts, r.need, end))

    def governor_event(self, ts: float, kind: str, e: dict[str, Any]) -> None:
        evidence = e.get("evidence")
        if isinstance(evidence, dict):
            for k, v in evidence.items():
                m = _VRAM_KEY.match(str(k))
                frac = _num(v)
                if m and frac is not None:
                    self.used[int(m.group(1))].append((ts, frac))
        new = e.get("level")
        if isinstance(new, str) and new:
            new = _text(new)
            if self.level is None:
                before = e.get("from_level")
                self.level = _text(before) if isinstance(before, str) and before else new
                self.level_start = self.first_ts
            if new != self.level:
                self.levels.append(LevelSpan(self.level, self.level_start, ts))
                self.level, self.level_start = new, ts
                self.level_changes += ts >= self.lo
        if ts >= self.lo and kind != "governor":
            text = _text(e.get("reason") or e.get("error"))
            label = (
                f"{_text(e.get('from_level'), '?')} → {_text(new)}"
                if kind != "governor-error"
                else ""
            )
            self._mark(kind, ts, None, "governor", "governor", f"{label} {text}".strip())

    def _mark(self, kind: str, ts: float, gpu: int | None, lane: str, name: str, text: str) -> None:
        self.markers.append(Marker(kind, ts, gpu, lane, name, text))

    def finish(self, end: float) -> None:
        for key in list(self.open_waits):
            self._close_wait(key, end, "open")
        for key, h in list(self.open_holds.items()):
            self._close_hold(key, end, "open", h.why or "no release in the log")
        for rid in list(self.open_res):
            self._close_res(rid, end, "open")
        if self.level is not None:
            self.levels.append(LevelSpan(self.level, self.level_start, end))


_VRAM_KEY = re.compile(r"^vram\.gpu(\d{1,4})$")
_TICKET_KINDS = frozenset(
    {"wait", "acquire", "release", "timeout", "cleanup", "break", "kill", "stale"}
)
_RESIDENT_KINDS = frozenset({"resident", "evict", "unload", "oom"})  # and cleanup/kill of one
_GOVERNOR_KINDS = frozenset({"escalate", "deescalate", "governor", "governor-error"})


def _why(kind: str, why: str, e: dict[str, Any]) -> str:
    """A ticket marker's words: the signal sent, or how hung a stale holder looked."""
    if kind == "kill":
        return f"{_text(e.get('signal'))}: {why}"
    if kind == "stale":
        return f"no heartbeat for {_dur(e, 'heartbeat_age_s')} (lease {_dur(e, 'lease_s')})"
    return why


def _lost_wait(waited_s: float | None, ts: float, first_ts: float) -> bool:
    """An acquire without a ``wait`` event: did its wait begin before the log did?

    An immediate grant also takes a few milliseconds, so only a wait too long for that counts.
    """
    return waited_s is not None and waited_s >= LOST_WAIT_MIN_S and ts - waited_s < first_ts


def _dur(e: dict[str, Any], key: str) -> str:
    return format_duration(_num(e.get(key)))


def build(
    events: Iterable[Any], *, now_wall: float | None = None, since_wall: float | None = None
) -> ReportData:
    """The report's data from events in any order; garbage is counted in ``ignored``.

    ``since_wall``: the window starts here (earlier events still tell what was open then).
    ``now_wall``: holds, waits and models with no end in the log run until then (default:
    the last event).
    """
    good: list[tuple[float, int, dict[str, Any]]] = []
    ignored = 0
    for i, e in enumerate(events):
        ts = _num(e.get("ts")) if isinstance(e, dict) else None
        if ts is not None and not 0 <= ts < TS_MAX:
            ts = None  # a time no clock wrote would stretch the timeline to nothing
        if ts is None or not isinstance(e.get("event"), str):
            ignored += 1
            continue
        good.append((ts, i, e))
    good.sort(key=lambda x: (x[0], x[1]))  # stable: same-time events keep the log's order
    lo = -math.inf if since_wall is None else since_wall
    inside = [x for x in good if x[0] >= lo]
    if not inside:
        return ReportData(None, None, since_wall, 0, ignored)
    last = good[-1][0]
    b = _Builder(lo=lo, first_ts=good[0][0])
    kinds: Counter[str] = Counter()
    for ts, _, e in good:
        kind = e["event"]
        if ts >= lo:
            kinds[kind] += 1
        _dispatch(b, ts, kind, e)
    anything_open = bool(b.open_holds or b.open_waits or b.open_res)
    end = max(last, now_wall) if now_wall is not None and anything_open else last
    b.finish(end)
    return _assemble(b, inside[0][0], end, since_wall, len(inside), ignored, kinds)


def _dispatch(b: _Builder, ts: float, kind: str, e: dict[str, Any]) -> None:
    if kind in ("cleanup", "kill") and e.get("resident") is not None:
        b.resident_event(ts, kind, e)
    elif kind in _TICKET_KINDS:
        b.ticket_event(ts, kind, e)
    elif kind in _RESIDENT_KINDS:
        b.resident_event(ts, kind, e)
    elif kind in _GOVERNOR_KINDS:
        b.governor_event(ts, kind, e)
    elif ts >= b.lo and kind == "agent":
        b.agent_events.append(e)
    elif ts >= b.lo and kind == "route":
        b.routes.append(e)
    elif ts >= b.lo and kind == "call":
        b.calls.append(e)


def _clip(start: float, end: float, lo: float, hi: float) -> tuple[float, float] | None:
    s, t = max(start, lo), min(end, hi)
    return (s, t) if t >= s and end >= lo else None


def _assemble(
    b: _Builder,
    first_inside: float,
    end: float,
    since: float | None,
    n_events: int,
    ignored: int,
    kinds: Counter[str],
) -> ReportData:
    lo = b.lo
    holds = [h for h in b.holds if h.end_wall >= lo and h.start_wall <= end]
    waits = [w for w in b.waits if w.end_wall >= lo and w.start_wall <= end]
    res = [r for r in b.residencies if r.end_wall >= lo and r.start_wall <= end]
    levels = [lv for lv in b.levels if lv.end_wall >= lo]
    starts = [first_inside, *(h.start_wall for h in holds), *(w.start_wall for w in waits)]
    starts += [r.start_wall for r in res]
    start = max(min(starts), lo)
    holds.sort(key=lambda h: h.start_wall)
    waits.sort(key=lambda w: w.start_wall)
    res.sort(key=lambda r: r.start_wall)
    seen = [*(h.gpu for h in holds), *(w.gpu for w in waits), *(r.gpu for r in res)]
    seen += [m.gpu for m in b.markers]
    gpus = sorted({g for g in seen if g is not None} | set(b.used))
    series = tuple(_gpu_series(g, holds, waits, res, b.used.get(g, []), start, end) for g in gpus)
    held_by: dict[str, float] = defaultdict(float)
    cut_by: Counter[str] = Counter()
    for h in holds:
        span = _clip(h.start_wall, h.end_wall, start, end)
        held_by[h.name] += (span[1] - span[0]) if span else 0.0
        cut_by[h.name] += h.cut_short
    holders = _holder_stats(b, held_by, cut_by)
    agents = _agent_stats(b.agent_events)
    models = _model_stats(b.calls)
    totals = _totals(
        b, sum(1 for w in waits if w.start_wall >= lo), held_by, cut_by, agents, models
    )
    return ReportData(
        start_wall=start,
        end_wall=end,
        since_wall=since,
        events=n_events,
        ignored=ignored,
        gpus=tuple(gpus),
        holds=tuple(holds),
        waits=tuple(waits),
        residencies=tuple(res),
        markers=tuple(sorted(b.markers, key=lambda m: m.at_wall)),
        levels=tuple(LevelSpan(lv.level, max(lv.start_wall, start), lv.end_wall) for lv in levels),
        series=series,
        holders=holders,
        agents=agents,
        tiers=_tier_stats(b.routes, b.calls),
        models=models,
        totals=totals,
        kinds=tuple(sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0]))),
    )


def _totals(
    b: _Builder,
    waits: int,
    held_by: dict[str, float],
    cut_by: Counter[str],
    agents: tuple[AgentStats, ...],
    models: tuple[ModelStats, ...],
) -> Totals:
    all_waits = [w for ws in b.runs.values() for w in ws]
    return Totals(
        handoffs=len(all_waits),
        waits=waits,
        waits_p50_s=percentile(all_waits, 50),
        waits_p99_s=percentile(all_waits, 99),
        timeouts=sum(b.timeouts.values()),
        cut_short=sum(cut_by.values()),
        held_s=round(sum(held_by.values()), 6),
        evictions=b.evictions,
        evictions_freed=b.evictions_freed,
        level_changes=b.level_changes,
        level_now=b.level,
        agent_runs=sum(a.runs for a in agents),
        agent_ok=sum(a.ok for a in agents),
        agent_skips=sum(a.skip for a in agents),
        agent_errors=sum(a.error for a in agents),
        agent_other=sum(a.other for a in agents),
        route_choices=len(b.routes),
        calls=len(b.calls),
        calls_failed=sum(1 for e in b.calls if e.get("ok") is False),
        tokens_in=sum(t.tokens_in for t in models),
        tokens_out=sum(t.tokens_out for t in models),
        cost_usd=round(sum(t.cost_usd for t in models), 6),
    )


def steps(intervals: Iterable[tuple[float, float, float]], lo: float, hi: float) -> list[Point]:
    """A step series: the sum of ``value`` over the (start, end, value) intervals open at each
    change, from ``lo`` to ``hi`` (intervals are clipped to it)."""
    deltas: dict[float, float] = defaultdict(float)
    for start, end, value in intervals:
        span = _clip(start, end, lo, hi)
        if span is None or value == 0:
            continue
        deltas[span[0]] += value
        if span[1] < hi:
            deltas[span[1]] -= value
    out: list[Point] = [(lo, 0.0)]
    level = 0.0
    for t in sorted(deltas):
        level += deltas[t]
        v = round(level, 6)
        if t == out[-1][0]:
            out[-1] = (t, v)
        elif v != out[-1][1]:
            out.append((t, v))
    return out


def _gpu_series(
    gpu: int,
    holds: list[Hold],
    waits: list[Wait],
    res: list[Residency],
    used: list[Point],
    lo: float,
    hi: float,
) -> GpuSeries:
    mine_h = [h for h in holds if h.gpu == gpu]
    exclusive = [_clip(h.start_wall, h.end_wall, lo, hi) for h in mine_h if h.need_bytes is None]
    return GpuSeries(
        gpu=gpu,
        queue=tuple(steps(((w.start_wall, w.end_wall, 1) for w in waits if w.gpu == gpu), lo, hi)),
        held_bytes=tuple(
            steps(((h.start_wall, h.end_wall, h.need_bytes or 0) for h in mine_h), lo, hi)
        ),
        resident_bytes=tuple(
            steps(
                ((r.start_wall, r.end_wall, r.declared_bytes or 0) for r in res if r.gpu == gpu),
                lo,
                hi,
            )
        ),
        used_fraction=tuple(p for p in used if lo <= p[0] <= hi),
        exclusive=tuple(x for x in exclusive if x is not None),
    )


def _holder_stats(
    b: _Builder, held_by: dict[str, float], cut_by: Counter[str]
) -> tuple[HolderStats, ...]:
    names = dict.fromkeys([*b.runs, *b.timeouts, *held_by])
    return tuple(
        HolderStats(
            name=n,
            runs=len(b.runs.get(n, ())),
            waits_p50_s=percentile(b.runs.get(n, []), 50),
            waits_p99_s=percentile(b.runs.get(n, []), 99),
            timeouts=b.timeouts[n],
            held_s=round(held_by.get(n, 0.0), 6),
            cut_short=cut_by[n],
        )
        for n in names
    )


def _agent_stats(events: list[dict[str, Any]]) -> tuple[AgentStats, ...]:
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        by[_text(e.get("agent") or e.get("name"), "?")].append(e)
    out = []
    for agent, es in by.items():
        outcomes = Counter(_text(e.get("outcome")) for e in es)
        durations = [d for e in es if (d := _num(e.get("duration_s"))) is not None]
        reasons = [_text(e.get("reason")) for e in es if e.get("outcome") != "ok"]
        out.append(
            AgentStats(
                agent=agent,
                runs=len(es),
                ok=outcomes["ok"],
                skip=outcomes["skip"],
                error=outcomes["error"],
                other=len(es) - outcomes["ok"] - outcomes["skip"] - outcomes["error"],
                duration_p50_s=percentile(durations, 50),
                last_reason=next((r for r in reversed(reasons) if r), ""),
            )
        )
    return tuple(out)


def _tier_stats(routes: list[dict[str, Any]], calls: list[dict[str, Any]]) -> tuple[TierStats, ...]:
    n_routes = Counter(_text(e.get("tier"), "none") for e in routes)
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in calls:
        by[_text(e.get("tier"), "?")].append(e)
    return tuple(
        TierStats(
            tier=t,
            routes=n_routes[t],
            calls=len(by.get(t, [])),
            failed=sum(1 for e in by.get(t, []) if e.get("ok") is False),
            tokens_in=_sum_int(by.get(t, []), "tokens_in"),
            tokens_out=_sum_int(by.get(t, []), "tokens_out"),
            cost_usd=_sum_num(by.get(t, []), "cost_usd"),
            latency_p50_s=percentile(_nums(by.get(t, []), "latency_s"), 50),
        )
        for t in dict.fromkeys([*n_routes, *by])
    )


def _model_stats(calls: list[dict[str, Any]]) -> tuple[ModelStats, ...]:
    by: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for e in calls:
        by[(_text(e.get("model"), "?"), _text(e.get("tier"), "?"))].append(e)
    return tuple(
        ModelStats(
            model=model,
            tier=tier,
            calls=len(es),
            failed=sum(1 for e in es if e.get("ok") is False),
            tokens_in=_sum_int(es, "tokens_in"),
            tokens_out=_sum_int(es, "tokens_out"),
            cost_usd=_sum_num(es, "cost_usd"),
            latency_p50_s=percentile(_nums(es, "latency_s"), 50),
            latency_p99_s=percentile(_nums(es, "latency_s"), 99),
        )
        for (model, tier), es in by.items()
    )


def _nums(es: list[dict[str, Any]], key: str) -> list[float]:
    return [v for e in es if (v := _num(e.get(key))) is not None]


def _sum_int(es: list[dict[str, Any]], key: str) -> int:
    return sum(v for e in es if (v := _int(e.get(key))) is not None)


def _sum_num(es: list[dict[str, Any]], key: str) -> float:
    return round(sum(_nums(es, key)), 6)


# --- plain text and JSON ---------------------------------------------------------------------


def summary_lines(data: ReportData) -> list[str]:
    """The summary in a few plain lines (what ``make demo`` prints)."""
    if data.start_wall is None or data.end_wall is None:
        since = f" since {_clock(data.since_wall)}" if data.since_wall is not None else ""
        return [f"log: empty (no events{since})"]
    t = data.totals
    gpus = ", ".join(f"gpu{g}" for g in data.gpus) or "no GPU"
    lines = [
        f"log: {data.events} events from {_clock(data.start_wall)} to {_clock(data.end_wall)} "
        f"({format_duration(data.end_wall - data.start_wall)}), {gpus}",
        f"GPU handoffs: {t.handoffs} ({t.cut_short} cut short), "
        f"held {format_duration(t.held_s)} in all",
        f"waits: {t.waits}, p50 {format_duration(t.waits_p50_s)}, "
        f"p99 {format_duration(t.waits_p99_s)}; timeouts: {t.timeouts}",
    ]
    if t.agent_runs:
        lines.append(
            f"runs: {t.agent_runs} (ok {t.agent_ok}, skips {t.agent_skips}, "
            f"errors {t.agent_errors}" + (f", other {t.agent_other})" if t.agent_other else ")")
        )
    else:
        holders = sum(1 for h in data.holders if h.runs)
        lines.append(
            f"runs: {t.handoffs} GPU holds by {holders} holders; skips: {t.timeouts} "
            "(timed out waiting)"
        )
    lines.append(f"evictions: {t.evictions} ({t.evictions_freed} freed memory)")
    now = f" (now {t.level_now})" if t.level_now else ""
    lines.append(f"governor level changes: {t.level_changes}{now}")
    tiers = ", ".join(f"{x.tier} {x.routes}" for x in data.tiers if x.routes)
    lines.append(f"route choices by tier: {tiers or 'none logged'}")
    if t.calls:
        lines.append(
            f"model calls: {t.calls} ({t.calls_failed} failed), {t.tokens_in} tokens in, "
            f"{t.tokens_out} out, "
            f"${t.cost_usd:.4f}"
        )
    return lines


def summary(data: ReportData) -> dict[str, Any]:
    """The ``--json`` object: totals and tables (the drawing data is left out)."""
    return {
        "format": FORMAT,
        "start_wall": data.start_wall,
        "end_wall": data.end_wall,
        "since_wall": data.since_wall,
        "events": data.events,
        "ignored": data.ignored,
        "gpus": list(data.gpus),
        "totals": asdict(data.totals),
        "holders": [asdict(x) for x in data.holders],
        "agents": [asdict(x) for x in data.agents],
        "tiers": [asdict(x) for x in data.tiers],
        "models": [asdict(x) for x in data.models],
        "levels": [asdict(x) for x in data.levels],
        "kinds": dict(data.kinds),
    }


def _clock(wall: float | None, fmt: str = "%Y-%m-%d %H:%M:%S") -> str:
    if wall is None:
        return "?"
    try:
        return time.strftime(fmt, time.localtime(wall))
    except (OverflowError, OSError, ValueError):
        return f"{wall:.0f}"


# --- render: data -> one HTML page -----------------------------------------------------------

W, LEFT, RIGHT = 1200, 210, 24  # the SVGs' coordinate width, label column, right margin
PW = W - LEFT - RIGHT
ROW_H, BAR_H, AXIS_H = 20, 12, 24
CHART_H = 150
MERGE_ABOVE = 4000  # more bars than this in the timeline: bars close together merge
MERGE_GAP_PX = 3.0  # ...when less than this apart (about a minute in a 12-hour report)
PALETTE = (
    "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948",
    "#b07aa1", "#ff9da7", "#9c755f", "#8cd17d", "#499894", "#d37295",
)  # fmt: skip
LEVEL_CLASS = {lv: f"lv-{lv}" for lv in LEVELS}  # a class name never comes from the log
_STEPS_S = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300,
    600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400, 172800, 604800,
)  # fmt: skip


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


class _Scale:
    """Wall time to x in the SVGs' coordinates; every chart shares it, so they line up."""

    def __init__(self, t0: float, t1: float) -> None:
        self.t0 = t0
        self.t1 = t1 if t1 - t0 >= 1e-3 else t0 + 1.0  # one event: a 1 s window, not 0
        self.k = PW / (self.t1 - self.t0)

    def x(self, t: float) -> float:
        return LEFT + (t - self.t0) * self.k

    def ticks(self, want: int = 8) -> tuple[list[float], float]:
        span = self.t1 - self.t0
        step = next((s for s in _STEPS_S if span / s <= want), _STEPS_S[-1])
        off = _utc_offset(self.t0)  # align ticks to the local clock
        t = math.ceil((self.t0 + off) / step) * step - off
        out: list[float] = []
        while t <= self.t1 + 1e-9 and len(out) < 4 * want:
            out.append(t)
            t += step
        return out, step

    def label(self, t: float, step: float) -> str:
        if step >= 86400:
            return _clock(t, "%m-%d")
        if step >= 60:
            return _clock(t, "%H:%M")
        text = _clock(t, "%H:%M:%S")
        if step < 1:
            digits = 1 if step >= 0.1 else 2 if step >= 0.01 else 3
            text += f"{t % 1:.{digits}f}"[1:]
        return text


def _utc_offset(wall: float) -> int:
    try:
        return time.localtime(wall).tm_gmtoff
    except (OverflowError, OSError, ValueError):
        return 0


def _f(v: float) -> str:
    """A coordinate: one decimal, no trailing zero (compact SVG)."""
    s = f"{v:.1f}"
    return s[:-2] if s.endswith(".0") else s


def _axis(scale: _Scale, top: float, bottom: float, labels_at: float) -> list[str]:
    ticks, step = scale.ticks()
    out = []
    for t in ticks:
        x = _f(scale.x(t))
        out.append(f'<line class="grid" x1="{x}" x2="{x}" y1="{_f(top)}" y2="{_f(bottom)}"/>')
        out.append(
            f'<text class="tick" x="{x}" y="{_f(labels_at)}" text-anchor="middle">'
            f"{_e(scale.label(t, step))}</text>"
        )
    return out


def _rows(data: ReportData) -> list[Row]:
    """Timeline rows in order: per GPU its holders, then its models; the governor last."""
    seen: dict[Row, None] = {}
    items: list[tuple[float, str, int | None, str]] = [
        *((h.start_wall, "holder", h.gpu, h.name) for h in data.holds),
        *((w.start_wall, "holder", w.gpu, w.name) for w in data.waits),
        *((r.start_wall, "resident", r.gpu, r.name) for r in data.residencies),
        *((m.at_wall, m.lane, m.gpu, m.name) for m in data.markers if m.lane != "governor"),
    ]
    for _, lane, gpu, name in sorted(items, key=lambda x: x[0]):
        seen.setdefault((lane, gpu, name), None)
    lane_rank = {"holder": 0, "resident": 1}
    rows = sorted(seen, key=lambda r: (r[1] is None, r[1] or 0, lane_rank.get(r[0], 2)))
    if any(m.lane == "governor" for m in data.markers) or any(
        lv.level != "normal" for lv in data.levels
    ):
        rows.append(("governor", None, "governor"))
    return rows


def _mark_path(kind: str, x: float, y: float) -> str:
    r = 5.0
    if kind == "timeout" or kind == "governor-error":
        a, b, c, d = _f(x - r), _f(x + r), _f(y - r), _f(y + r)
        return f"M{a} {c}L{b} {d}M{a} {d}L{b} {c}"
    if kind in ("evict", "deescalate", "kill"):
        return f"M{_f(x - r)} {_f(y - r)}L{_f(x + r)} {_f(y - r)}L{_f(x)} {_f(y + r)}Z"
    if kind == "escalate":
        return f"M{_f(x - r)} {_f(y + r)}L{_f(x + r)} {_f(y + r)}L{_f(x)} {_f(y - r)}Z"
    return f"M{_f(x)} {_f(y - r)}L{_f(x + r)} {_f(y)}L{_f(x)} {_f(y + r)}L{_f(x - r)} {_f(y)}Z"


def _hold_title(h: Hold) -> str:
    where = f"gpu{h.gpu}" if h.gpu is not None else "gpu ?"
    ticket = f" ticket {h.ticket}" if h.ticket is not None else ""
    need = f", need {format_size(h.need_bytes)}" if h.need_bytes else ", exclusive"
    end = {
        "release": "released",
        "open": "no release in the log",
        "cleanup": "cleaned up",
        "break": "broken",
    }.get(h.end, h.end)
    why = f" ({h.why})" if h.why and h.cut_short else ""
    killed = ", killed" if h.killed else ""
    return (
        f"{h.name} · {where}{ticket}{need} · {_clock(h.start_wall, '%H:%M:%S')} for "
        f"{format_duration(h.end_wall - h.start_wall)} · {end}{killed}{why}"
    )


def _background(
    data: ReportData, scale: _Scale, rows: list[Row], y_of: list[int], height: int
) -> list[str]:
    """Stripes, governor level bands, the time grid and the row labels."""
    out = []
    for i in range(1, len(rows), 2):
        out.append(f'<rect class="stripe" x="0" y="{y_of[i]}" width="{W}" height="{ROW_H}"/>')
    for lv in data.levels:
        if lv.level == "normal":
            continue
        x0, x1 = scale.x(lv.start_wall), scale.x(lv.end_wall)
        cls = LEVEL_CLASS.get(lv.level, "lv-other")
        out.append(
            f'<rect class="level {cls}" x="{_f(x0)}" y="{AXIS_H}" width="{_f(max(x1 - x0, 1))}" '
            f'height="{height - AXIS_H}"><title>governor level {_e(lv.level)} from '
            f"{_e(_clock(lv.start_wall))} for {_e(format_duration(lv.end_wall - lv.start_wall))}"
            "</title></rect>"
        )
    out += _axis(scale, AXIS_H - 4, height, 14)
    last_gpu: object = object()
    for i, (lane, gpu, name) in enumerate(rows):
        y = y_of[i]
        if gpu != last_gpu and lane != "governor":
            out.append(f'<line class="gpu-sep" x1="0" x2="{W}" y1="{y}" y2="{y}"/>')
        last_gpu = gpu
        where = "" if lane == "governor" else (f"gpu{gpu} " if gpu is not None else "gpu? ")
        icon = "model " if lane == "resident" else ""
        out.append(
            f'<text class="row-label {lane}" x="{LEFT - 8}" y="{y + ROW_H / 2 + 4:.0f}" '
            f'text-anchor="end">{_e(where)}{icon}{_e(name)}</text>'
        )
    return out


def _timeline(data: ReportData, scale: _Scale) -> str:
    rows = _rows(data)
    if not rows:
        return '<p class="none">nothing was held, waited for or loaded in this window</p>'
    index = {r: i for i, r in enumerate(rows)}
    y_of = [AXIS_H + i * ROW_H for i in range(len(rows))]
    height = AXIS_H + len(rows) * ROW_H + 6
    out = [
        f'<svg class="timeline" viewBox="0 0 {W} {height}" width="100%" role="img" '
        f'aria-label="timeline of GPU holders">',
        '<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)"><rect width="3" height="6" fill="#fff" '
        'fill-opacity=".55"/></pattern></defs>',
    ]
    out += _background(data, scale, rows, y_of, height)
    color = {r: PALETTE[i % len(PALETTE)] for i, r in enumerate(rows)}
    merge = len(data.holds) + len(data.waits) + len(data.residencies) > MERGE_ABOVE
    bars = _Merger()  # drawn singly (in bars.out) unless merge
    for w in data.waits:
        r = ("holder", w.gpu, w.name)
        if merge:
            x0, x1 = scale.x(w.start_wall), scale.x(w.end_wall)
            bars.add(r, x0, x1, y_of[index[r]], color[r], "wait")
        else:
            bars.out.append(_wait_rect(w, scale, y_of[index[r]], color[r]))
    for h in data.holds:
        r = ("holder", h.gpu, h.name)
        if merge and not h.cut_short:  # cut-short holds are rare and always drawn alone
            bars.add(
                r, scale.x(h.start_wall), scale.x(h.end_wall), y_of[index[r]], color[r], "hold"
            )
        else:
            bars.out.append(_hold_rect(h, scale, y_of[index[r]], color[r]))
    for res in data.residencies:
        r = ("resident", res.gpu, res.name)
        if merge:
            x0, x1 = scale.x(res.start_wall), scale.x(res.end_wall)
            bars.add(r, x0, x1, y_of[index[r]], "", "resident")
        else:
            bars.out.append(_resident_rect(res, scale, y_of[index[r]]))
    out += bars.finish()
    out += _marks(data, scale, index, y_of)
    out.append("</svg>")
    return "".join(out)


_MARK_CLASSES = frozenset(
    {"timeout", "kill", "break", "cleanup", "stale", "evict", "oom", "escalate", "deescalate",
     "governor-error", "unload"}
)  # fmt: skip
_BAR_GEOMETRY = {"hold": (4, BAR_H), "wait": (5, BAR_H - 2), "resident": (6, BAR_H - 4)}


class _Merger:
    """With a huge log, bars of one row and kind less than a pixel apart become one rect."""

    def __init__(self) -> None:
        self.out: list[str] = []
        self.pending: dict[tuple[Row, str], list[Any]] = {}  # -> [x0, x1, n, y, fill]

    def add(self, row: Row, x0: float, x1: float, y: int, fill: str, cls: str) -> None:
        p = self.pending.get((row, cls))
        if p is not None and x0 - p[1] < MERGE_GAP_PX:
            p[1], p[2] = max(p[1], x1), p[2] + 1
            return
        if p is not None:
            self._flush((row, cls))
        self.pending[(row, cls)] = [x0, x1, 1, y, fill]

    def _flush(self, key: tuple[Row, str]) -> None:
        (_, _, name), cls = key
        x0, x1, n, y, fill = self.pending.pop(key)
        dy, h = _BAR_GEOMETRY[cls]
        paint = f' fill="{fill}"' if fill else ""
        self.out.append(
            f'<rect class="{cls} merged" data-n="{n}" x="{_f(x0)}" y="{y + dy}" '
            f'width="{_f(max(x1 - x0, 1))}" height="{h}"{paint}>'
            f"<title>{_e(name)}: {n} {cls} bars</title></rect>"
        )

    def finish(self) -> list[str]:
        for key in list(self.pending):
            self._flush(key)
        return self.out


def _wait_rect(w: Wait, scale: _Scale, y: int, fill: str) -> str:
    x0, x1 = scale.x(w.start_wall), scale.x(w.end_wall)
    return (
        f'<rect class="wait" x="{_f(x0)}" y="{y + 5}" width="{_f(max(x1 - x0, 1))}" '
        f'height="{BAR_H - 2}" fill="{fill}"><title>{_e(w.name)} waited '
        f"{_e(format_duration(w.end_wall - w.start_wall))} → {_e(w.end)}</title></rect>"
    )


def _hold_rect(h: Hold, scale: _Scale, y: int, fill: str) -> str:
    x0, x1 = scale.x(h.start_wall), scale.x(h.end_wall)
    width = _f(max(x1 - x0, 2))
    ticket = "" if h.ticket is None else f' data-ticket="{h.ticket}"'
    text = (
        f'<rect class="hold{" cut" if h.cut_short else ""}" data-gpu="{_e(h.gpu)}"{ticket} '
        f'x="{_f(x0)}" y="{y + 4}" width="{width}" height="{BAR_H}" fill="{fill}">'
        f"<title>{_e(_hold_title(h))}</title></rect>"
    )
    if h.cut_short:  # the hatch and a red end say "this hold did not end by a release"
        text += (
            f'<rect class="cut-hatch" x="{_f(x0)}" y="{y + 4}" width="{width}" '
            f'height="{BAR_H}" fill="url(#hatch)"/><line class="cut-end" x1="{_f(x1)}" '
            f'x2="{_f(x1)}" y1="{y + 1}" y2="{y + ROW_H - 1}"/>'
        )
    return text


def _resident_rect(res: Residency, scale: _Scale, y: int) -> str:
    x0, x1 = scale.x(res.start_wall), scale.x(res.end_wall)
    size = format_size(res.declared_bytes) if res.declared_bytes else "size unknown"
    return (
        f'<rect class="resident" x="{_f(x0)}" y="{y + 6}" width="{_f(max(x1 - x0, 1))}" '
        f'height="{BAR_H - 4}"><title>model {_e(res.name)} ({_e(res.resident)}), {size}, '
        f"resident {_e(format_duration(res.end_wall - res.start_wall))} → "
        f"{_e(res.end)}</title></rect>"
    )


def _marks(data: ReportData, scale: _Scale, index: dict[Row, int], y_of: list[int]) -> list[str]:
    """One symbol per marker; in a huge log, one per row, kind and 6 pixels, with a count."""
    groups: dict[tuple[Row, str, int], list[Marker]] = defaultdict(list)
    merge = len(data.markers) > MERGE_ABOVE
    for i, m in enumerate(data.markers):
        r = ("governor", None, "governor") if m.lane == "governor" else (m.lane, m.gpu, m.name)
        if r in index:
            groups[(r, m.kind, int(scale.x(m.at_wall) / 6) if merge else i)].append(m)
    out = []
    for (r, kind, _), ms in groups.items():
        m = ms[0]
        y = y_of[index[r]] + ROW_H / 2
        cls = kind if kind in _MARK_CLASSES else "other"
        if len(ms) == 1:
            title = f"{m.kind} · {m.name} · {_clock(m.at_wall, '%H:%M:%S')}"
            title += f" · {m.text}" if m.text else ""
        else:
            title = f"{len(ms)} x {m.kind} · {m.name} · from {_clock(m.at_wall, '%H:%M:%S')}"
        out.append(
            f'<path class="mark {cls}" d="{_mark_path(kind, scale.x(m.at_wall), y)}">'
            f"<title>{_e(title)}</title></path>"
        )
    return out


def _nice(v: float) -> float:
    """The smallest 1, 2, 2.5 or 5 times a power of ten at or above ``v`` (> 0)."""
    if v <= 0:
        return 1.0
    p = 10.0 ** math.floor(math.log10(v))
    return next(m * p for m in (1, 2, 2.5, 5, 10) if m * p >= v * (1 - 1e-9))


def _downsample(points: Sequence[Point], scale: _Scale) -> list[Point]:
    """Steps as drawn: beyond ~4 per pixel column, keep each column's first, max, min, last."""
    if len(points) <= 4 * PW:
        return list(points)
    out: list[Point] = []
    col: list[Point] = []
    key = None
    for p in points:
        k = int(scale.x(p[0]))
        if k != key and col:
            out += _column(col)
            col = []
        key = k
        col.append(p)
    out += _column(col)
    return out


def _column(col: list[Point]) -> list[Point]:
    if len(col) <= 4:
        return col
    t = col[0][0]
    hi = max(col, key=lambda p: p[1])
    lo = min(col, key=lambda p: p[1])
    return [col[0], (t, hi[1]), (t, lo[1]), (t, col[-1][1])]


def _chart(
    scale: _Scale,
    series: Sequence[tuple[str, str, Sequence[Point]]],
    y_max: float,
    y_label: Any,
    *,
    bands: Sequence[tuple[float, float]] = (),
    samples: bool = False,
    cls: str = "",
) -> str:
    """A step (or sample) line chart on the shared time axis, y from 0 to ``y_max``."""
    top, bottom = 10, CHART_H - 24

    def y(v: float) -> float:
        return bottom - (bottom - top) * min(max(v / y_max, 0.0), 1.05)

    out = [f'<svg class="chart {cls}" viewBox="0 0 {W} {CHART_H}" width="100%" role="img">']
    for s, t in bands:
        x0, x1 = scale.x(s), scale.x(t)
        out.append(
            f'<rect class="band" x="{_f(x0)}" y="{top}" width="{_f(max(x1 - x0, 1))}" '
            f'height="{bottom - top}"><title>exclusive hold: the whole GPU</title></rect>'
        )
    out += _axis(scale, top, bottom, CHART_H - 8)
    for frac in (0.0, 0.5, 1.0):
        yy = _f(y(y_max * frac))
        out.append(f'<line class="grid" x1="{LEFT}" x2="{W - RIGHT}" y1="{yy}" y2="{yy}"/>')
        out.append(
            f'<text class="tick" x="{LEFT - 8}" y="{_f(y(y_max * frac) + 4)}" '
            f'text-anchor="end">{_e(y_label(y_max * frac))}</text>'
        )
    for i, (name, color, points) in enumerate(series):
        if not points:
            continue
        pts = _downsample(points, scale)
        if samples:
            d = "M" + "L".join(f"{_f(scale.x(t))} {_f(y(v))}" for t, v in pts)
            dots = "".join(
                f'<circle cx="{_f(scale.x(t))}" cy="{_f(y(v))}" r="2.5" fill="{color}"/>'
                for t, v in pts[:2000]
            )
        else:
            parts = [f"M{_f(scale.x(pts[0][0]))} {_f(y(pts[0][1]))}"]
            for t, v in pts[1:]:
                parts.append(f"H{_f(scale.x(t))}V{_f(y(v))}")
            parts.append(f"H{_f(scale.x(scale.t1))}")
            d, dots = "".join(parts), ""
        out.append(
            f'<path class="series s{i}" d="{d}" stroke="{color}"><title>{_e(name)}</title></path>'
            f"{dots}"
        )
    out.append("</svg>")
    return "".join(out)


def _key(series: Sequence[tuple[str, str, Sequence[Point]]], band: str = "") -> str:
    """The line colours of a chart, in words."""
    items = [
        f'<span><svg width="22" height="10"><line x1="0" x2="22" y1="5" y2="5" stroke="{c}" '
        f'stroke-width="2.5"/></svg>{_e(name)}</span>'
        for name, c, _ in series
    ]
    if band:
        items.append(
            '<span><svg width="22" height="10"><rect width="22" height="10" class="band"/></svg>'
            f"{_e(band)}</span>"
        )
    return '<div class="legend">' + "".join(items) + "</div>"


def _size_max(v: float) -> tuple[float, Any]:
    unit = 1024**3 if v >= 1024**3 else 1024**2
    return _nice(v / unit) * unit, lambda b: format_size(round(b)) if b else "0"


def _gpu_charts(data: ReportData, scale: _Scale) -> tuple[str, str]:
    queue, vram = [], []
    for s in data.series:
        q_max = max((v for _, v in s.queue), default=0.0)
        ym = max(1.0, float(math.ceil(q_max)))
        if ym > 4:
            ym = _nice(ym)
            ym += ym % 2  # an even top: the middle tick is a whole number of waiters
        queue.append(
            f"<h3>gpu{s.gpu}: waiters in line (peak {q_max:.0f})</h3>"
            + _chart(scale, [("waiters", "#e15759", s.queue)], ym, lambda v: f"{v:g}", cls="queue")
        )
        b_max = max([v for _, v in s.held_bytes] + [v for _, v in s.resident_bytes] + [0.0])
        if b_max > 0 or s.exclusive:
            top, fmt = _size_max(b_max or 1024**3)
            series = [
                ("held by lock holders (their --need)", "#4e79a7", s.held_bytes),
                ("resident models (declared)", "#b07aa1", s.resident_bytes),
            ]
            band = "exclusive hold (no --need: the whole GPU)" if s.exclusive else ""
            vram.append(
                f"<h3>gpu{s.gpu}: VRAM claimed (peak {_e(format_size(round(b_max)))})</h3>"
                + _key(series, band)
                + _chart(scale, series, top, fmt, bands=s.exclusive, cls="vram")
            )
        if s.used_fraction:
            used = [("used share of the GPU's memory", "#e15759", s.used_fraction)]
            vram.append(
                f"<h3>gpu{s.gpu}: VRAM used, as the governor measured it</h3>"
                + _key(used)
                + _chart(
                    scale,
                    used,
                    1.0,
                    lambda v: f"{v * 100:.0f}%",
                    samples=True,
                    cls="vram-used",
                )
            )
    if not vram:
        vram.append('<p class="none">no VRAM data in this log</p>')
    if not queue:
        queue.append('<p class="none">no GPU queue events in this log</p>')
    return "".join(queue), "".join(vram)


def _cell(attr: str, v: Any) -> str:
    """One table cell: numbers right-aligned, with the raw value to sort by."""
    if isinstance(v, str):
        return f"<td>{_e(v)}</td>"
    if attr.endswith("_s"):
        text, key = ("—", -1.0) if v is None else (format_duration(v), v)
    elif attr.endswith("_usd"):
        text, key = f"${v:,.4f}", v
    else:
        text, key = f"{v:,}", v
    return f'<td class="n" data-v="{key:.9g}">{_e(text)}</td>'


def _table(items: Sequence[Any], cols: Sequence[tuple[str, str]], none: str) -> str:
    """A sortable table of ``items`` (dataclasses); ``cols``: (header, attribute) pairs."""
    if not items:
        return f'<p class="none">{_e(none)}</p>'
    head = "".join(
        f"<th>{_e(h)}</th>"
        if isinstance(getattr(items[0], a), str)
        else f'<th class="n">{_e(h)}</th>'
        for h, a in cols
    )
    body = "".join(
        "<tr>" + "".join(_cell(a, getattr(x, a)) for _, a in cols) + "</tr>" for x in items
    )
    return f'<table class="sortable"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


@dataclass(frozen=True, slots=True)
class _Kind:
    event: str
    count: int


_HOLDER_COLS = (
    ("holder", "name"), ("runs", "runs"), ("wait p50", "waits_p50_s"),
    ("wait p99", "waits_p99_s"), ("timeouts", "timeouts"), ("held", "held_s"),
    ("cut short", "cut_short"),
)  # fmt: skip
_AGENT_COLS = (
    ("agent", "agent"), ("runs", "runs"), ("ok", "ok"), ("skip", "skip"), ("error", "error"),
    ("other", "other"), ("duration p50", "duration_p50_s"),
    ("last skip/error", "last_reason"),
)  # fmt: skip
_TIER_COLS = (
    ("tier", "tier"), ("route choices", "routes"), ("calls", "calls"), ("failed", "failed"),
    ("tokens in", "tokens_in"), ("tokens out", "tokens_out"), ("cost", "cost_usd"),
    ("latency p50", "latency_p50_s"),
)  # fmt: skip
_MODEL_COLS = (
    ("model", "model"), ("tier", "tier"), ("calls", "calls"), ("failed", "failed"),
    ("tokens in", "tokens_in"),
    ("tokens out", "tokens_out"), ("cost", "cost_usd"), ("latency p50", "latency_p50_s"),
    ("latency p99", "latency_p99_s"),
)  # fmt: skip


def _tables(data: ReportData) -> str:
    kinds = [_Kind(k, n) for k, n in data.kinds]
    return "".join(
        [
            "<h2>Holders</h2>",
            _table(data.holders, _HOLDER_COLS, "no GPU holders in this window"),
            "<h2>Agent runs</h2>",
            _table(data.agents, _AGENT_COLS, "no agent events in this log"),
            "<h2>Route choices and model calls</h2>",
            _table(data.tiers, _TIER_COLS, "no route or call events in this log"),
            _table(data.models, _MODEL_COLS, "") if data.models else "",
            "<h2>Events</h2>",
            _table(kinds, (("event", "event"), ("count", "count")), "no events"),
        ]
    )


def _cards(data: ReportData) -> str:
    t = data.totals
    cards = [
        ("GPU handoffs", f"{t.handoffs:,}"),
        ("waits p50 / p99", f"{format_duration(t.waits_p50_s)} / {format_duration(t.waits_p99_s)}"),
        ("timeouts", f"{t.timeouts:,}"),
        ("cut short", f"{t.cut_short:,}"),
        ("evictions", f"{t.evictions:,}"),
        (
            "level changes",
            f"{t.level_changes:,}" + (f" (now {t.level_now})" if t.level_now else ""),
        ),
    ]
    if t.agent_runs:
        cards.append(
            ("agent runs", f"{t.agent_runs:,} ({t.agent_skips} skip, {t.agent_errors} err)")
        )
    if t.route_choices or t.calls:
        cards.append(("routes / calls", f"{t.route_choices:,} / {t.calls:,}"))
    if t.cost_usd:
        cards.append(("cost", f"${t.cost_usd:,.4f}"))
    return (
        '<div class="cards">'
        + "".join(
            f'<div class="card"><div class="v">{_e(v)}</div><div class="k">{_e(k)}</div></div>'
            for k, v in cards
        )
        + "</div>"
    )


_LEGEND = (
    '<div class="legend">'
    '<span><svg width="26" height="12"><rect width="26" height="12" fill="#4e79a7"/></svg>'
    "hold (acquire → release)</span>"
    '<span><svg width="26" height="12"><rect width="26" height="12" fill="#4e79a7" '
    'fill-opacity=".25"/></svg>waiting in line</span>'
    '<span><svg width="26" height="12"><rect width="26" height="12" fill="#4e79a7"/>'
    '<rect width="26" height="12" fill="url(#hatch)"/><line x1="25" x2="25" y1="0" y2="12" '
    'stroke="#c0392b" stroke-width="2"/></svg>cut short (no release: cleaned up, broken, '
    "killed, or still open at the end of the log)</span>"
    '<span><svg width="26" height="12"><rect width="26" height="8" y="2" fill="#b07aa1" '
    'fill-opacity=".6"/></svg>resident model</span>'
    '<span><svg width="12" height="12"><path class="mark timeout" d="M1 1L11 11M1 11L11 1"/>'
    "</svg>timeout</span>"
    '<span><svg width="12" height="12"><path class="mark evict" d="M1 1L11 1L6 11Z"/></svg>'
    "eviction / kill</span>"
    '<span><svg width="12" height="12"><path class="mark cleanup" d="M6 1L11 6L6 11L1 6Z"/>'
    "</svg>cleanup / break / stale</span>"
    '<span><svg width="26" height="12"><rect class="level lv-reduce" width="26" height="12"/>'
    '</svg>governor level above normal (reduce, evict-idle, force-evict, <span class="fz">'
    "freeze</span>)</span></div>"
)

_CSS = """
:root{--fg:#1d2330;--mute:#667085;--line:#e4e7ec;--bg:#fff}
*{box-sizing:border-box}
body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--fg);
background:#f6f7f9}
main{max-width:1260px;margin:0 auto;padding:20px 24px 40px}
h1{font-size:22px;margin:0 0 2px}h2{font-size:17px;margin:28px 0 8px}
h3{font-size:13px;margin:14px 0 2px;color:var(--mute);font-weight:600}
.sub{color:var(--mute);margin:0 0 14px}.none{color:var(--mute);font-style:italic}
section{background:var(--bg);border:1px solid var(--line);border-radius:10px;padding:6px 16px 14px;
margin-top:16px}
.cards{display:flex;flex-wrap:wrap;gap:10px}
.card{background:var(--bg);border:1px solid var(--line);border-radius:10px;padding:10px 14px;
min-width:140px}
.card .v{font-size:18px;font-weight:650}.card .k{color:var(--mute);font-size:12px}
.legend{display:flex;flex-wrap:wrap;gap:6px 18px;font-size:12px;color:var(--mute);margin:4px 0 8px}
.legend span{display:inline-flex;align-items:center;gap:6px}
svg text{font-size:11px;fill:#344054}svg .tick{fill:var(--mute);font-size:10px}
.row-label.resident{fill:#7a4f73}.row-label.governor{fill:#8a5a00;font-weight:600}
.grid{stroke:#eef0f3;stroke-width:1}.gpu-sep{stroke:#c9ced6;stroke-width:1}
.stripe{fill:#f8f9fb}
.hold{stroke:#0000;}.hold.cut{stroke:#c0392b;stroke-width:1}.hold.merged{opacity:.85}
.cut-end{stroke:#c0392b;stroke-width:2}
.wait{fill-opacity:.25}
.resident{fill:#b07aa1;fill-opacity:.6}
.mark{stroke-width:1.6;fill:#fff}
.mark.timeout,.mark.governor-error{stroke:#d92d20;fill:none;stroke-width:2.2}
.mark.kill{fill:#d92d20;stroke:#7a1a12}.mark.evict{fill:#7f56d9;stroke:#42307d}
.mark.cleanup,.mark.break{fill:#fdb022;stroke:#93370d}.mark.stale{fill:#fff;stroke:#dc6803}
.mark.oom{fill:#d92d20;stroke:#7a1a12}.mark.escalate{fill:#dc6803;stroke:#93370d}
.mark.deescalate{fill:#12b76a;stroke:#05603a}.mark.other,.mark.unload{fill:#98a2b3;stroke:#475467}
.level{opacity:.55}.lv-reduce{fill:#fef0c7}.lv-evict-idle{fill:#fedf89}
.lv-force-evict{fill:#fecdca}.lv-freeze{fill:#d9d6fe}.lv-other{fill:#eaecf0}
.fz{background:#d9d6fe;padding:0 3px;border-radius:3px}
.series{fill:none;stroke-width:1.8}.band{fill:#98a2b3;fill-opacity:.18}
table{border-collapse:collapse;width:100%;font-size:13px;margin:6px 0 4px}
th,td{padding:5px 10px;border-bottom:1px solid var(--line);text-align:left;white-space:nowrap}
td.n{text-align:right;font-variant-numeric:tabular-nums}
th{cursor:pointer;user-select:none;color:var(--mute);font-weight:600;background:#fafbfc}
th.n{text-align:right}th[data-dir=asc]::after{content:" ▲"}th[data-dir=desc]::after{content:" ▼"}
footer{color:var(--mute);font-size:12px;margin-top:18px}
"""

# Sortable tables: click a header; numeric cells sort by their data-v.  The attribute set at
# the end tells a reader of the rendered page (and the render test) that the script ran.
_JS = """
(function(){
function key(td){var v=td.getAttribute("data-v");return v===null?td.textContent:parseFloat(v);}
document.querySelectorAll("table.sortable").forEach(function(t){
 t.querySelectorAll("th").forEach(function(th,i){th.addEventListener("click",function(){
  var asc=th.getAttribute("data-dir")!=="asc";
  t.querySelectorAll("th").forEach(function(o){o.removeAttribute("data-dir");});
  th.setAttribute("data-dir",asc?"asc":"desc");
  var b=t.tBodies[0],rows=Array.prototype.slice.call(b.rows);
  rows.sort(function(a,c){var x=key(a.cells[i]),y=key(c.cells[i]);
   return (x<y?-1:x>y?1:0)*(asc?1:-1);});
  rows.forEach(function(r){b.appendChild(r);});});});});
document.documentElement.setAttribute("data-js","ready");
})();
"""


def render_html(
    data: ReportData, *, source: str | None = None, generated_wall: float | None = None
) -> str:
    """The page, one string: inline CSS, SVG and script; every text from the log escaped."""
    where = f"state folder {source} · " if source else ""
    head = (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"<title>gpulock report{' · ' + _e(source) if source else ''}</title>"
        f"<style>{_CSS}</style></head><body><main><h1>gpulock report</h1>"
    )
    generated = f" · generated {_clock(generated_wall)}" if generated_wall is not None else ""
    if data.start_wall is None or data.end_wall is None:
        since = f" since {_clock(data.since_wall)}" if data.since_wall is not None else ""
        return (
            f'{head}<p class="sub">{_e(where)}{_e(generated.lstrip(" ·"))}</p>'
            f'<section><p class="none empty">The event log is empty: no events{_e(since)}.'
            "</p></section></main></body></html>"
        )
    span = format_duration(data.end_wall - data.start_wall)
    tz = _clock(data.start_wall, "%Z")
    sub = (
        f"{where}{_clock(data.start_wall)} → {_clock(data.end_wall)} {tz} ({span}) · "
        f"{data.events:,} events"
        + (f", {data.ignored:,} unreadable records skipped" if data.ignored else "")
        + generated
    )
    scale = _Scale(data.start_wall, data.end_wall)
    queue, vram = _gpu_charts(data, scale)
    return "".join(
        [
            head,
            f'<p class="sub">{_e(sub)}</p>',
            _cards(data),
            "<section><h2>Timeline</h2>",
            _LEGEND,
            _timeline(data, scale),
            "</section><section><h2>Queue length</h2>",
            queue,
            "</section><section><h2>VRAM</h2>",
            vram,
            "</section><section>",
            _tables(data),
            "</section><footer>Times are local. VRAM claimed counts declared sizes (a "
            "holder's --need, a resident model's declared bytes); a model unloaded by its "
            "owner leaves no event, so its bar runs until an eviction, a cleanup or the end of "
            "the log. Hover a bar or a marker for details; click a table header to sort."
            "</footer></main>",
            f"<script>{_JS}</script></body></html>",
        ]
    )


# --- I/O and the command ---------------------------------------------------------------------


def write_report(
    state_dir: Path,
    out_path: Path,
    *,
    since_wall: float | None = None,
    now_wall: float | None = None,
) -> ReportData:
    """Read the state folder's log, write the page to ``out_path`` atomically, return the data.

    Raises GpulockError (with a hint) when ``out_path`` cannot be written.
    """
    from gpulock import events
    from gpulock.state import atomic_write

    now = time.time() if now_wall is None else now_wall
    data = build(events.read(state_dir), now_wall=now, since_wall=since_wall)
    page = render_html(data, source=str(state_dir), generated_wall=now)
    target = Path(out_path).absolute()
    try:
        atomic_write(target, page.encode(), mode=0o644)
    except OSError as e:
        raise GpulockError(
            f"cannot write {target}: {e.strerror or e}",
            hint="give --out a file in a folder you can write to",
        ) from None
    return data


DESCRIPTION = """\
Write one self-contained HTML page (no network, no external files) from the state folder's
event log: a timeline of who held each GPU (waits in light, cut-short holds hatched, timeouts,
evictions, kills and governor levels marked), the queue length and the VRAM claimed over time
per GPU, and tables per holder (runs, waits p50/p99, timeouts, time held), per agent, per
route tier and per model."""

EPILOG = """\
examples:
  gpulock report --out gpu.html                 the whole log
  gpulock report --since 2h --out - > gpu.html  the last two hours, to standard output
  gpulock report --json                         the summary as JSON, no page
exit codes: 0 ok, 1 error (unusable state folder, unwritable --out), 2 usage."""


def build_parser(prog: str = "gpulock report") -> argparse.ArgumentParser:
    p = Parser(
        prog=prog,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", metavar="FILE", help="write the page here; '-' for standard output")
    p.add_argument(
        "--since",
        metavar="WHEN",
        help="only from this moment: a duration ago (10m, 2h, 1d), an epoch time "
        "(1795214127) or an ISO time (2026-11-20T07:00)",
    )
    p.add_argument(
        "--json", action="store_true", help="print the summary (totals and tables) as JSON"
    )
    p.add_argument("--config", metavar="FILE", help="config file (default: the usual lookup)")
    p.add_argument(
        "--state-dir", metavar="DIR", help="state folder (default: $GPULOCK_STATE_DIR, config)"
    )
    return p


def since_wall_of(text: str, now_wall: float) -> float:
    """``--since``: an epoch time (a bare number >= 1e9), else a duration ago or an ISO time."""
    try:
        number = float(text)
    except ValueError:
        number = None
    if number is not None and math.isfinite(number) and number >= EPOCH_FLOOR:
        return number
    return parse_since(text, now_wall)


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(args_list)
    except (UsageError, GpulockError) as e:
        return report(e)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    except BrokenPipeError:  # `gpulock report --out - | head`: the reader left
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EX_OK


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.out is None and not args.json:
        raise UsageError(
            "say where to write the report: --out FILE, or --out - for standard output",
            hint="gpulock report --out gpu.html  (or --json for the summary alone)",
        )
    if args.out == "-" and args.json:
        raise UsageError("--out - and --json both want standard output: choose one")
    now = time.time()
    since = since_wall_of(args.since, now) if args.since else None
    from gpulock import events
    from gpulock.settings import load

    settings = load(args.config, args.state_dir)
    if args.out not in (None, "-"):
        data = write_report(settings.state_dir, Path(args.out), since_wall=since, now_wall=now)
    else:
        data = build(events.read(settings.state_dir), now_wall=now, since_wall=since)
    if args.json:
        print(json.dumps(summary(data), indent=2))
    elif args.out == "-":
        sys.stdout.write(render_html(data, source=str(settings.state_dir), generated_wall=now))
        sys.stdout.flush()
    else:
        print("\n".join(summary_lines(data)))
        print(f"wrote {Path(args.out).absolute()}")
    return EX_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
