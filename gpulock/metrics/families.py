"""(status snapshot, tally) -> Prometheus metric families: pure, one call per scrape.

The snapshot is ``gpulock.status.snapshot()`` (the documented ``status --json`` object); the
tally is what ``gpulock.metrics.cursor`` folded from the event log.  Unknown values (a GPU
whose used memory nobody can tell, a resident of unknown size) are left out, never shown as 0.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from gpulock.metrics.specs import BY_NAME, COUNTERS, HISTOGRAMS, Spec
from gpulock.metrics.tally import Tally

LEVELS = ("normal", "reduce", "evict-idle", "force-evict", "freeze")


def families(snap: Mapping[str, Any], tally: Tally) -> list[Metric]:
    """Every family, in the order of ``specs``; families without samples are still listed."""
    out: list[Metric] = [_counter(s, tally) for s in COUNTERS]
    out += [_histogram(s, tally) for s in HISTOGRAMS]
    gauges: dict[str, dict[tuple[str, ...], float]] = defaultdict(dict)
    _queues(snap, gauges)
    _memory(snap, gauges)
    _residents(snap, gauges)
    _governor(snap, gauges)
    _usage(snap, gauges)
    _cluster(snap, gauges)
    for spec in (s for s in BY_NAME.values() if s.kind == "gauge"):
        g = GaugeMetricFamily(spec.name, spec.help, labels=spec.labels)
        for key, value in sorted(gauges.get(spec.name, {}).items()):
            g.add_metric(list(key), value)
        out.append(g)
    return out


def _counter(spec: Spec, tally: Tally) -> Metric:
    c = CounterMetricFamily(spec.name, spec.help, labels=spec.labels)
    for key, value in sorted(tally.counters.get(spec.name, {}).items()):
        c.add_metric(list(key), value)
    return c


def _histogram(spec: Spec, tally: Tally) -> Metric:
    h = HistogramMetricFamily(spec.name, spec.help, labels=spec.labels)
    for key, row in sorted(tally.histograms.get(spec.name, {}).items()):
        cumulative: list[tuple[str, float]] = []
        running = 0.0
        for le, n in zip((*map(_le, spec.buckets), "+Inf"), row[:-1], strict=True):
            running += n
            cumulative.append((le, running))
        h.add_metric(list(key), cumulative, row[-1])
    return h


def _le(bound: float) -> str:
    return str(float(bound))


# --- gauges from the snapshot -------------------------------------------------------------------

Gauges = dict[str, dict[tuple[str, ...], float]]


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def _set(g: Gauges, name: str, key: tuple[str, ...], value: Any) -> None:
    v = _num(value)
    if v is not None:
        g[f"gpulock_{name}"][key] = v


def _plus(g: Gauges, name: str, key: tuple[str, ...], value: float) -> None:
    table = g[f"gpulock_{name}"]
    table[key] = table.get(key, 0.0) + value


def _queues(snap: Mapping[str, Any], g: Gauges) -> None:
    now = _num(snap.get("generated_wall"))
    for q in _dicts(snap.get("gpus")):
        gpu = str(q.get("gpu"))
        # A ticket waiting for a set of GPUs (status shows it once, under its set) waits in
        # the line of each GPU of it: each GPU's gauges count it.
        set_waiters = [
            e
            for line in _dicts(snap.get("sets"))
            if q.get("gpu") in (line.get("gpus") or [])
            for e in _dicts(line.get("waiters"))
        ]
        waiting = [*_dicts(q.get("waiters")), *set_waiters]
        entries = [*_dicts(q.get("holders")), *waiting]
        states = [e.get("state") for e in entries]
        _set(g, "queue_holders", (gpu,), sum(1 for s in states if s in ("holding", "hung")))
        _set(g, "queue_waiters", (gpu,), sum(1 for s in states if s == "waiting"))
        _set(g, "queue_stale", (gpu,), sum(1 for s in states if s in ("hung", "dead")))
        waits = [
            now - created
            for e in waiting
            if e.get("state") == "waiting"
            and now is not None
            and (created := _num(e.get("created_wall"))) is not None
        ]
        _set(g, "queue_oldest_wait_seconds", (gpu,), max([0.0, *waits]))
        claimed = 0.0
        for e in _dicts(q.get("holders")):
            need = _num(e.get("need_bytes"))
            if need is not None and e.get("state") in ("holding", "hung"):
                claimed += need
                _plus(g, "queue_claimed_bytes", (gpu, str(e.get("name", ""))), need)
        _set(g, "gpu_memory_claimed_bytes", (gpu,), claimed)
        _set(g, "gpu_memory_total_bytes", (gpu,), q.get("total_bytes"))
        _set(g, "gpu_memory_reserved_bytes", (gpu,), q.get("reserve_bytes"))


def _memory(snap: Mapping[str, Any], g: Gauges) -> None:
    for d in _dicts(snap.get("devices")):
        gpu = str(d.get("index"))
        _set(g, "gpu_memory_total_bytes", (gpu,), d.get("total_bytes"))
        _set(g, "gpu_memory_used_bytes", (gpu,), d.get("used_bytes"))
        _set(g, "gpu_memory_free_bytes", (gpu,), d.get("free_bytes"))


def _residents(snap: Mapping[str, Any], g: Gauges) -> None:
    for r in _dicts(snap.get("residents")):
        gpu = str(r.get("gpu"))
        tenant = str(r.get("tenant") or "")
        _plus(g, "resident_models", (gpu, tenant), 1)
        _plus(g, "resident_in_use", (gpu, tenant), 1 if r.get("in_use") is True else 0)
        size = _num(r.get("bytes"))
        if size is not None:
            owner = str(r.get("user") or "")  # never the record's "owner": that is a pid
            key = (gpu, str(r.get("name", "")), owner, tenant, str(r.get("policy", "")))
            _plus(g, "resident_bytes", key, size)


# The governor's signals (governor.json) and the thresholds that bound them, under one name.
_SIGNALS = ("psi_some_avg10", "psi_full_avg10", "swap_bytes_per_s", "oom_reports")
_GPU_SIGNALS = ("used_fraction", "used_bytes", "registered_bytes", "fragmentation_bytes")
_THRESHOLDS = {
    "threshold": "watchdog_used_fraction",  # the watchdog's threshold in force
    "vram_pressure": "used_fraction",
    "fragmentation_bytes": "fragmentation_bytes",
    "unregistered_bytes": "unregistered_bytes",
    "psi_some": "psi_some_avg10",
    "psi_full": "psi_full_avg10",
    "swap_bytes_per_s": "swap_bytes_per_s",
    "oom_reports": "oom_reports",
}


def _cluster(snap: Mapping[str, Any], g: Gauges) -> None:
    """From this host's view of its cluster (``gpulock serve``'s heartbeat): absent without."""
    view = _mapping(snap.get("cluster"))
    if not view:
        return
    _set(g, "cluster_hosts", (), view.get("hosts"))
    _set(g, "cluster_redis_up", (), 1 if view.get("redis") == "ok" else 0)


def _governor(snap: Mapping[str, Any], g: Gauges) -> None:
    gov = _mapping(snap.get("governor"))
    live = gov.get("live") is True
    level = gov.get("level") if live else "normal"
    _set(g, "governor_up", (), 1 if live else 0)
    for name in LEVELS:
        _set(g, "governor_level", (name,), 1 if name == level else 0)
    _set(g, "governor_level_index", (), LEVELS.index(level) if level in LEVELS else 0)
    if not gov:
        return
    _set(g, "governor_last_pass_timestamp_seconds", (), gov.get("updated_wall"))
    signals = _mapping(gov.get("signals"))
    for name in _SIGNALS:
        _set(g, "governor_signal", (name, ""), signals.get(name))
    for q in _dicts(signals.get("gpus")):
        for name in _GPU_SIGNALS:
            _set(g, "governor_signal", (name, str(q.get("index"))), q.get(name))
    thresholds = _mapping(gov.get("thresholds"))
    for key, signal in _THRESHOLDS.items():
        _set(g, "governor_threshold", (signal,), thresholds.get(key))


def _usage(snap: Mapping[str, Any], g: Gauges) -> None:
    u = snap.get("usage")
    if not isinstance(u, Mapping):
        return
    _set(g, "router_cloud_spend_today_usd", (), u.get("cloud_spend_usd"))
    _set(g, "router_daily_budget_usd", (), u.get("daily_budget_usd"))


def _mapping(v: Any) -> Mapping[str, Any]:
    return v if isinstance(v, Mapping) else {}


def _dicts(v: Any) -> Iterable[Mapping[str, Any]]:
    return [x for x in v if isinstance(x, Mapping)] if isinstance(v, list) else []
