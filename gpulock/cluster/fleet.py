"""The fleet as one object (``gpulock cluster --json``, ``GET /gpulock/cluster``) and its table.

::

    {"host": "a", "redis": "ok", "problem": null, "generated_wall": 1764110000.0,
     "hosts": [{"name": "a", "gateway": "http://10.0.0.6:11435", "heartbeat_age_s": 0.4,
                "level": "normal", "in_flight": 0, "warm": ["tiny-gpu"],
                "candidates": ["tiny-gpu"],
                "gpus": [{"index": 0, "total_bytes": ..., "claimed_bytes": ...,
                          "free_bytes": ..., "holding": 1,
                          "waiting": 2, "est_wait_s": 41.0}]}]}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpulock.cluster.report import HostReport
from gpulock.core.units import format_duration, format_size, format_usd


def host_row(r: HostReport, now_wall: float, cooling: bool = False) -> dict[str, Any]:
    return {
        "name": r.host,
        "cooling": cooling,  # cooling down after it failed a request (no work sent to it)
        "gateway": r.gateway,
        "heartbeat_age_s": round(max(0.0, now_wall - r.at_wall), 3),
        "level": r.level,
        "in_flight": r.in_flight,
        "warm": sorted(r.warm),
        "candidates": [c.name for c in r.candidates],
        "gpus": [
            {
                "index": g.index,
                "total_bytes": g.total_bytes,
                "claimed_bytes": g.claimed_bytes,
                "free_bytes": g.free_bytes,
                "holding": g.holding,
                "waiting": g.waiting,
                "est_wait_s": g.est_wait_s,
            }
            for g in r.gpus
        ],
    }


def fleet_object(
    reports: Sequence[HostReport],
    *,
    me: str,
    redis_ok: bool,
    problem: str | None,
    now_wall: float,
    cooling: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    return {
        "host": me,
        "redis": "ok" if redis_ok else "down",
        "problem": problem,
        "generated_wall": round(now_wall, 3),
        "hosts": [
            host_row(r, now_wall, r.host in cooling) for r in sorted(reports, key=lambda r: r.host)
        ],
    }


def spend_entry(by_cid: dict[str, float], budget_usd: float | None, day: str) -> dict[str, Any]:
    """Today's cloud spend across the cluster (the UTC day), against ``router.daily_budget``."""
    return {
        "day": day,
        "total_usd": round(sum(by_cid.values()), 6),
        "daily_budget_usd": budget_usd,
        "by_endpoint": {k: round(v, 6) for k, v in sorted(by_cid.items())},
    }


def render(obj: dict[str, Any]) -> str:
    """The table ``gpulock cluster`` prints: one row a host, one line a GPU under it."""
    hosts = obj["hosts"]
    head = f"cluster: {len(hosts)} host{'s' if len(hosts) != 1 else ''}, redis {obj['redis']}"
    if obj.get("problem"):
        head += f" ({obj['problem']})"
    lines = [head]
    spend = obj.get("spend")
    if spend is not None:
        budget = spend["daily_budget_usd"]
        of = f" of {format_usd(budget)} (router.daily_budget)" if budget is not None else ""
        lines.append(f"cloud spend {spend['day']} (UTC): ${spend['total_usd']:.4f}{of}")
    if not hosts:
        return "\n".join(lines)
    rows = [("HOST", "GATEWAY", "HEARTBEAT", "LEVEL", "IN FLIGHT", "WARM")]
    for h in hosts:
        rows.append(
            (
                h["name"] + (" (this host)" if h["name"] == obj["host"] else ""),
                h["gateway"] or "- (sends work, takes none)",
                format_duration(h["heartbeat_age_s"]) + " ago",
                h["level"] + (" (cooling down)" if h.get("cooling") else ""),
                str(h["in_flight"]),
                ", ".join(h["warm"]) or "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        if i == 0:
            continue
        for g in hosts[i - 1]["gpus"]:
            total, free = format_size(g["total_bytes"]), format_size(g["free_bytes"])  # None: ?
            est = g["est_wait_s"]
            wait = f"~{format_duration(est)}" if est is not None else "unknown"
            lines.append(
                f"    gpu{g['index']}: {total}, free {free}, {g['holding']} holding, "
                f"{g['waiting']} waiting, a newcomer waits {wait}"
            )
    return "\n".join(lines)
