"""The report's numbers: percentiles, step series per GPU and the tables (pure).

Per holder (runs, waits, timeouts, time held), per agent (``agent`` events), per route tier
(``route`` and ``call`` events) and per model (``call``).  Percentiles interpolate linearly
between the closest ranks.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gpulock.report.model import (
    AgentStats,
    GpuSeries,
    Hold,
    HolderStats,
    ModelStats,
    Point,
    Residency,
    TierStats,
    Wait,
)
from gpulock.report.values import as_int, as_num, as_span, as_text


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100), interpolating between closest ranks; None if empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * min(max(q, 0.0), 100.0) / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def clip(start: float, end: float, lo: float, hi: float) -> tuple[float, float] | None:
    s, t = max(start, lo), min(end, hi)
    return (s, t) if t >= s and end >= lo else None


def steps(intervals: Iterable[tuple[float, float, float]], lo: float, hi: float) -> list[Point]:
    """A step series: the sum of ``value`` over the (start, end, value) intervals open at each
    change, from ``lo`` to ``hi`` (intervals are clipped to it)."""
    deltas: dict[float, float] = defaultdict(float)
    for start, end, value in intervals:
        span = clip(start, end, lo, hi)
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


def gpu_series(
    gpu: int,
    holds: list[Hold],
    waits: list[Wait],
    res: list[Residency],
    used: list[Point],
    lo: float,
    hi: float,
) -> GpuSeries:
    mine_h = [h for h in holds if h.gpu == gpu]
    exclusive = [clip(h.start_wall, h.end_wall, lo, hi) for h in mine_h if h.need_bytes is None]
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


def holder_stats(
    runs: Mapping[str, list[float]],
    timeouts: Counter[str],
    held_by: dict[str, float],
    cut_by: Counter[str],
) -> tuple[HolderStats, ...]:
    """One row per holder name; ``runs``: the waits of its acquires, ``timeouts`` its give-ups."""
    names = dict.fromkeys([*runs, *timeouts, *held_by])
    return tuple(
        HolderStats(
            name=n,
            runs=len(runs.get(n, ())),
            waits_p50_s=percentile(runs.get(n, []), 50),
            waits_p99_s=percentile(runs.get(n, []), 99),
            timeouts=timeouts[n],
            held_s=round(held_by.get(n, 0.0), 6),
            cut_short=cut_by[n],
        )
        for n in names
    )


def agent_stats(events: list[dict[str, Any]]) -> tuple[AgentStats, ...]:
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        by[as_text(e.get("agent") or e.get("name"), "?")].append(e)
    out = []
    for agent, es in by.items():
        outcomes = Counter(as_text(e.get("outcome")) for e in es)
        durations = [d for e in es if (d := as_span(e.get("duration_s"))) is not None]
        reasons = [as_text(e.get("reason")) for e in es if e.get("outcome") != "ok"]
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


def tier_stats(routes: list[dict[str, Any]], calls: list[dict[str, Any]]) -> tuple[TierStats, ...]:
    n_routes = Counter(as_text(e.get("tier"), "none") for e in routes)
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in calls:
        by[as_text(e.get("tier"), "?")].append(e)
    return tuple(
        TierStats(
            tier=t,
            routes=n_routes[t],
            calls=len(by.get(t, [])),
            failed=sum(1 for e in by.get(t, []) if e.get("ok") is False),
            tokens_in=_sum_int(by.get(t, []), "tokens_in"),
            tokens_out=_sum_int(by.get(t, []), "tokens_out"),
            cost_usd=_sum_num(by.get(t, []), "cost_usd"),
            latency_p50_s=percentile(_spans(by.get(t, []), "latency_s"), 50),
        )
        for t in dict.fromkeys([*n_routes, *by])
    )


def model_stats(calls: list[dict[str, Any]]) -> tuple[ModelStats, ...]:
    by: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for e in calls:
        by[(as_text(e.get("model"), "?"), as_text(e.get("tier"), "?"))].append(e)
    return tuple(
        ModelStats(
            model=model,
            tier=tier,
            calls=len(es),
            failed=sum(1 for e in es if e.get("ok") is False),
            tokens_in=_sum_int(es, "tokens_in"),
            tokens_out=_sum_int(es, "tokens_out"),
            cost_usd=_sum_num(es, "cost_usd"),
            latency_p50_s=percentile(_spans(es, "latency_s"), 50),
            latency_p99_s=percentile(_spans(es, "latency_s"), 99),
        )
        for (model, tier), es in by.items()
    )


def _nums(es: list[dict[str, Any]], key: str) -> list[float]:
    return [v for e in es if (v := as_num(e.get(key))) is not None]


def _spans(es: list[dict[str, Any]], key: str) -> list[float]:
    """Durations only: a -1e308 and a 1e308 are finite, but their percentile is not."""
    return [v for e in es if (v := as_span(e.get(key))) is not None]


def _sum_int(es: list[dict[str, Any]], key: str) -> int:
    return sum(v for e in es if (v := as_int(e.get(key))) is not None)


def _sum_num(es: list[dict[str, Any]], key: str) -> float:
    return round(sum(_nums(es, key)), 6)
