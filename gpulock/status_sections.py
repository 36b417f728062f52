"""The snapshot's sections beside the GPUs' lines, each as ``gpulock status --json`` shows it.

The models held (library residents and tenants' models alike, with when foresight expects
each next), the probed devices and who uses their memory, the governor's published word, this
host's view of its cluster, the warming ahead, and today's model calls from the router's ledger
(read here without the router).  Each is read from the state folder as it is; a missing or
damaged file reads as None, never as an error.
"""

from __future__ import annotations

from typing import Any

from gpulock.core import clusterview, devices, level
from gpulock.core.errors import GpulockError
from gpulock.core.settings import Settings
from gpulock.core.units import calendar_day, parse_usd
from gpulock.residents import registry


def resident_entry(r: registry.Record, now_w: float) -> dict[str, Any]:
    idle = None if r.in_use or not r.idle_known else round(max(0.0, now_w - r.last_used_wall), 3)
    return {
        "id": r.id,
        "tenant": r.tenant,
        "name": r.name,
        "pid": r.pid,
        "user": r.user,
        "program": r.program,
        "gpu": r.gpu,
        "declared_bytes": r.declared_bytes,
        "measured_bytes": r.measured_bytes,
        "bytes": r.bytes,
        "policy": r.policy,
        "in_use": r.in_use,
        "uses": r.uses,
        "loaded_wall": r.loaded_wall,
        "last_used_wall": r.last_used_wall,
        "idle_s": idle,
        "last_use_seen": r.use_seen and r.idle_known,
        "tenant_state": r.tenant_state,
        "torch_allocated_bytes": r.torch_allocated_bytes,
        "torch_reserved_bytes": r.torch_reserved_bytes,
    }


def with_next_use(
    settings: Settings, recs: list[registry.Record], now_w: float
) -> list[dict[str, Any]]:
    """``resident_entry`` with the predicted next use (``next_use``, ``next_use_source``,
    ``next_use_by``: the agent or ticket expected to use it)."""
    entries = [resident_entry(r, now_w) for r in recs]
    fc = None
    if recs:
        from gpulock.residents.foresight_inputs import gather, model_key

        fc = gather(settings, recs, sorted({r.gpu for r in recs}), now_wall=now_w)
    for r, e in zip(recs, entries, strict=True):
        nu = fc.next.get(model_key(r)) if fc is not None else None
        e["next_use"] = None if nu is None else nu.at_wall
        e["next_use_source"] = "unknown" if nu is None else nu.source
        e["next_use_by"] = None if nu is None or not nu.label else nu.label
    return entries


def device_entry(d: devices.Device, registered: dict[int, str]) -> dict[str, Any]:
    return {
        "index": d.index,
        "name": d.name,
        "source": d.source,
        "uuid": d.uuid,
        "total_bytes": d.total_bytes,
        "used_bytes": d.used_bytes,
        "free_bytes": d.free_bytes,
        "reserved_bytes": d.reserved_bytes,
        "util_gpu_pct": d.util_gpu_pct,
        "util_mem_pct": d.util_mem_pct,
        "processes": [
            {
                "pid": p.pid,
                "used_bytes": p.used_bytes,
                "kind": p.kind,
                "registered": p.pid in registered,
                "as": registered.get(p.pid),
            }
            for p in d.processes
        ],
    }


def governor_entry(settings: Settings, now_w: float) -> dict[str, Any] | None:
    """The governor's published word, and whether it still counts (None: never ran here)."""
    pub = level.read_raw(settings)
    if pub is None:
        return None
    live = level.read(settings, now_wall=now_w) is not None
    return {
        "level": pub.level if live else "normal",
        "published_level": pub.level,
        "live": live,
        "pid": pub.pid,
        "since_wall": pub.since_wall,
        "updated_wall": pub.updated_wall,
        "interval_s": pub.interval_s,
        "signals": pub.signals,
        "thresholds": pub.thresholds,
    }


def prewarm_entry(settings: Settings) -> dict[str, Any] | None:
    """What the governor is warming ahead of its predicted use, and why; None when nothing
    (``gpulock.residents.prewarm``)."""
    from gpulock.residents.prewarm_state import published

    doc = published(settings)
    if doc is None or not (doc["entries"] or doc["waiting"]):
        return None
    return doc


def cluster_entry(settings: Settings, now_w: float) -> dict[str, Any] | None:
    """This host's last view of its cluster (written by ``gpulock serve``); None without one."""
    view = clusterview.read(settings, now_w)
    if view is None:
        return None
    return {"host": view.host, "hosts": view.hosts, "redis": view.redis, "problem": view.problem}


LEDGER_FORMAT = (
    "gpulock.ledger/1"  # written by gpulock/router/ledger.py; read here without the router
)


def usage_entry(settings: Settings, now_w: float) -> dict[str, Any] | None:
    """Today's router accounting, or None (no ledger, another day's, or unreadable)."""
    import json

    from gpulock.core.statefile import read_small

    try:
        data = read_small(settings.state_dir / "router" / "ledger.json")
        raw = json.loads(data) if data else None
    except (OSError, ValueError, RecursionError, GpulockError):
        return None
    # The ledger's day: the UTC day in a cluster (gpulock.router.ledger.utc_day), else the local
    # day.
    clustered = settings.config.section("cluster") is not None
    day = calendar_day(now_w, utc=clustered)
    if not isinstance(raw, dict) or raw.get("format") != LEDGER_FORMAT or raw.get("day") != day:
        return None
    usage: dict[str, Any] = raw["usage"] if isinstance(raw.get("usage"), dict) else {}
    spend: dict[str, Any] = raw["spend_usd"] if isinstance(raw.get("spend_usd"), dict) else {}
    cloud = sum(float(v) for v in spend.values() if isinstance(v, int | float))
    budget = (settings.config.section("router") or {}).get("daily_budget")
    try:
        budget_usd = None if budget is None else parse_usd(budget)
    except ValueError:
        budget_usd = None
    axes = ("agent", "task", "tier", "host") if clustered else ("agent", "task", "tier")
    return {
        "day": day,
        "cloud_spend_usd": round(float(cloud), 6),
        "daily_budget_usd": budget_usd,
        **{f"by_{axis}": _usage_rows(usage.get(axis)) for axis in axes},
    }


def _usage_rows(rows: Any) -> dict[str, dict[str, Any]]:
    """name -> counts as the documented types (the ledger keeps every figure as a float)."""
    if not isinstance(rows, dict):
        return {}
    out: dict[str, dict[str, Any]] = {}
    for name, row in rows.items():
        if not isinstance(row, dict):
            continue
        try:
            out[str(name)] = {
                "calls": int(row.get("calls", 0)),
                "tokens_in": int(row.get("tokens_in", 0)),
                "tokens_out": int(row.get("tokens_out", 0)),
                "cost_usd": round(float(row.get("cost_usd", 0)), 8),
            }
        except (TypeError, ValueError, OverflowError):
            continue  # a damaged row: skip it, as every reader of state files does
    return out
