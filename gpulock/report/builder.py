"""``build(events)``: what the event log says the GPUs did, as a ReportData (pure).

What is built, and from which events:

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
* tables (``stats``): per holder, per agent (``agent`` events: ok / skip / error), route
  choices by tier (``route``) and model calls (``call``).

Unknown events and garbage are counted, never fatal.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from gpulock.core.units import format_duration
from gpulock.report.model import (
    AgentStats,
    Hold,
    LevelSpan,
    Marker,
    ModelStats,
    Point,
    ReportData,
    Residency,
    Totals,
    Wait,
)
from gpulock.report.stats import (
    agent_stats,
    clip,
    gpu_series,
    holder_stats,
    model_stats,
    percentile,
    tier_stats,
)
from gpulock.report.values import as_int, as_num, as_span, as_text

EVICTED = frozenset(
    {"freed", "unloaded", "owner-gone", "already-unloaded", "gone"}
)  # the model left
TS_MAX = 1e10  # year 2286: later (or negative) times are garbage
LOST_WAIT_MIN_S = 0.1  # see _lost_wait

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
    killed_runs: list[dict[str, Any]] = field(default_factory=list)  # fleet-run, outcome killed
    missed: Counter[str] = field(default_factory=Counter)  # fleet-missed by reason
    routes: list[dict[str, Any]] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)

    # Events that can end a hold or a wait (of the same gpu + ticket).  ``echo``: the same
    # event again for another GPU of a multi-GPU ticket (``per_gpu``): its hold and wait are
    # drawn on that GPU too, but it is counted once.
    def ticket_event(self, ts: float, kind: str, e: dict[str, Any], echo: bool = False) -> None:
        gpu, ticket = as_int(e.get("gpu")), as_int(e.get("ticket"))
        name = as_text(e.get("name"), "?")
        key: Key = (gpu, ticket if ticket is not None else "name:" + name)
        inside = ts >= self.lo and not echo
        if kind == "wait":
            self._close_wait(key, ts, "open")  # a repeated wait: keep the latest
            self.open_waits[key] = _Open(ts, gpu, ticket, name)
        elif kind == "acquire":
            waited = as_span(e.get("waited_s"))
            if not self._close_wait(key, ts, "acquire") and _lost_wait(waited, ts, self.first_ts):
                self.waits.append(Wait(gpu, ticket, name, ts - (waited or 0.0), ts, "acquire"))
            if e.get("_line_only"):
                return  # granted another GPU of its set: its wait in this line ends here
            self._close_hold(key, ts, "open")  # acquired twice: the first never ended
            self.open_holds[key] = _Open(ts, gpu, ticket, name, need=as_int(e.get("need_bytes")))
            if inside:
                self.runs[name].append(waited if waited is not None else 0.0)
        elif kind == "release":
            if not self._close_hold(key, ts, "release"):
                held = as_span(e.get("held_s"))
                if held is not None:  # its acquire is before the log: start from held_s
                    need = as_int(e.get("need_bytes"))
                    self.holds.append(Hold(gpu, ticket, name, ts - held, ts, need, "release"))
        elif kind == "timeout":
            if not self._close_wait(key, ts, "timeout"):
                waited = as_span(e.get("waited_s")) or 0.0
                self.waits.append(Wait(gpu, ticket, name, ts - waited, ts, "timeout"))
            if inside:
                self.timeouts[name] += 1
                self._mark(kind, ts, gpu, "holder", name, f"gave up after {_dur(e, 'waited_s')}")
        elif kind == "leave":  # Ctrl-C or a signal in line: the wait ends there
            if not self._close_wait(key, ts, "leave"):
                waited = as_span(e.get("waited_s")) or 0.0
                self.waits.append(Wait(gpu, ticket, name, ts - waited, ts, "leave"))
            self._close_hold(key, ts, "leave")  # granted just as it left
        else:  # cleanup | break | kill | stale
            why = as_text(e.get("reason") or e.get("action"))
            if kind == "kill":
                h = self.open_holds.get(key)
                if h is not None:
                    h.killed, h.why = True, f"{as_text(e.get('signal'))} {why}".strip()
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
        rid, name = as_text(e.get("resident")), as_text(e.get("name"), "?")
        gpu = as_int(e.get("gpu"))
        inside = ts >= self.lo
        if kind == "resident":
            self._close_res(rid, ts, "open")
            self.open_res[rid] = _Open(ts, gpu, None, name, need=as_int(e.get("declared_bytes")))
            return
        outcome = as_text(e.get("outcome"))
        if kind == "evict":
            if outcome in EVICTED:
                self._close_res(rid, ts, "evict")
            if inside:
                self.evictions += 1
                self.evictions_freed += outcome == "freed"  # verified; "unloaded" is not
                detail = f"{outcome}: {as_text(e.get('reason') or e.get('detail'))}"
                self._mark(kind, ts, gpu, "resident", name, detail)
            return
        if kind in ("cleanup", "unload"):
            self._close_res(rid, ts, kind)
        if inside:
            why = as_text(e.get("reason") or e.get("signal"))
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
                frac = as_num(v)
                if m and frac is not None:
                    self.used[int(m.group(1))].append((ts, frac))
        new = e.get("level")
        if isinstance(new, str) and new:
            new = as_text(new)
            if self.level is None:
                before = e.get("from_level")
                self.level = as_text(before) if isinstance(before, str) and before else new
                self.level_start = self.first_ts
            if new != self.level:
                self.levels.append(LevelSpan(self.level, self.level_start, ts))
                self.level, self.level_start = new, ts
                self.level_changes += ts >= self.lo
        if ts >= self.lo and kind != "governor":
            text = as_text(e.get("reason") or e.get("error"))
            label = (
                f"{as_text(e.get('from_level'), '?')} → {as_text(new)}"
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


def per_gpu(kind: str, e: dict[str, Any]) -> list[dict[str, Any]]:
    """A set ticket's event once per GPU it is about: its wait, grant (which ends its wait in
    every line of its set), timeout or leave in the line of each GPU of its set; its release
    on each GPU it held.  A copy for a GPU of its set it was not granted says ``_line_only``."""
    if kind in ("cleanup", "break"):
        return [e]  # about its copy in one folder already
    held = e.get("granted")
    granted: list[Any] = held if isinstance(held, list) else []
    gpus: Any = granted
    if kind != "release":
        gpus = e.get("gpu_set") if isinstance(e.get("gpu_set"), list) else e.get("gpus")
    if not isinstance(gpus, list) or (len(gpus) < 2 and len(granted) < 2):
        return [e]  # a pinned ticket: as it was
    ordered = [e.get("gpu"), *(g for g in gpus if g != e.get("gpu"))]
    out = []
    for g in ordered:
        if isinstance(g, int):
            line_only = kind == "acquire" and g not in granted
            out.append({**e, "gpu": g, "_line_only": True} if line_only else {**e, "gpu": g})
    return out


_TICKET_KINDS = frozenset(
    {"wait", "acquire", "release", "timeout", "leave", "cleanup", "break", "kill", "stale"}
)
_RESIDENT_KINDS = frozenset({"resident", "evict", "unload", "oom"})  # and cleanup/kill of one
_GOVERNOR_KINDS = frozenset({"escalate", "deescalate", "governor", "governor-error"})


def _why(kind: str, why: str, e: dict[str, Any]) -> str:
    """A ticket marker's words: the signal sent, or how hung a stale holder looked."""
    if kind == "kill":
        return f"{as_text(e.get('signal'))}: {why}"
    if kind == "stale":
        return f"no heartbeat for {_dur(e, 'heartbeat_age_s')} (lease {_dur(e, 'lease_s')})"
    return why


def _lost_wait(waited_s: float | None, ts: float, first_ts: float) -> bool:
    """An acquire without a ``wait`` event: did its wait begin before the log did?

    An immediate grant also takes a few milliseconds, so only a wait too long for that counts.
    """
    return waited_s is not None and waited_s >= LOST_WAIT_MIN_S and ts - waited_s < first_ts


def _dur(e: dict[str, Any], key: str) -> str:
    return format_duration(as_span(e.get(key)))  # 1e308 is finite, but not as milliseconds


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
        ts = as_num(e.get("ts")) if isinstance(e, dict) else None
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
        for i, copy in enumerate(per_gpu(kind, e)):
            b.ticket_event(ts, kind, copy, echo=i > 0)
    elif kind in _RESIDENT_KINDS:
        b.resident_event(ts, kind, e)
    elif kind in _GOVERNOR_KINDS:
        b.governor_event(ts, kind, e)
    elif ts >= b.lo and kind == "agent":
        b.agent_events.append(e)
    elif ts >= b.lo and kind == "fleet-run" and e.get("outcome") == "killed":
        b.killed_runs.append(e)
    elif ts >= b.lo and kind == "fleet-missed":
        b.missed[str(e.get("reason"))] += 1
    elif ts >= b.lo and kind == "route":
        b.routes.append(e)
    elif ts >= b.lo and kind == "call":
        b.calls.append(e)


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
    series = tuple(gpu_series(g, holds, waits, res, b.used.get(g, []), start, end) for g in gpus)
    held_by: dict[str, float] = defaultdict(float)
    cut_by: Counter[str] = Counter()
    for h in holds:
        span = clip(h.start_wall, h.end_wall, start, end)
        held_by[h.name] += (span[1] - span[0]) if span else 0.0
        cut_by[h.name] += h.cut_short
    holders = holder_stats(b.runs, b.timeouts, held_by, cut_by)
    agents = agent_stats(b.agent_events + _unrecorded_deaths(b))
    models = model_stats(b.calls)
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
        tiers=tier_stats(b.routes, b.calls),
        models=models,
        totals=totals,
        kinds=tuple(sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0]))),
    )


def _unrecorded_deaths(b: _Builder) -> list[dict[str, Any]]:
    """Runs the fleet saw killed (SIGKILL, the OOM killer) that could not write their own
    ``agent`` event: counted as runs with outcome ``killed``, not lost."""
    recorded = {as_int(e.get("pid")) for e in b.agent_events}  # a list there is unhashable
    return [
        {
            "agent": e.get("agent"),
            "outcome": "killed",
            "reason": f"exit {e.get('exit')}",
            "duration_s": e.get("duration_s"),
            "pid": e.get("pid"),
        }
        for e in b.killed_runs
        if as_int(e.get("pid")) not in recorded
    ]


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
        missed_fires=sum(b.missed.values()),
        missed_late=b.missed["late"],
        route_choices=len(b.routes),
        calls=len(b.calls),
        calls_failed=sum(1 for e in b.calls if e.get("ok") is False),
        tokens_in=sum(t.tokens_in for t in models),
        tokens_out=sum(t.tokens_out for t in models),
        cost_usd=round(sum(t.cost_usd for t in models), 6),
    )
