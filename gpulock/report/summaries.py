"""The report as a few plain lines (``make demo``, ``gpulock report --out``) or as JSON."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from gpulock.core.level import LEVELS
from gpulock.core.units import format_duration
from gpulock.report.model import ReportData
from gpulock.report.values import clock

FORMAT = "gpulock-report/1"


def _levels(data: ReportData) -> str:
    """`` (highest freeze, now reduce)``: how far up the ladder it went, and where it ended."""
    now = data.totals.level_now
    if not now:
        return ""
    rank = {name: i for i, name in enumerate(LEVELS)}
    seen = [lv.level for lv in data.levels if lv.level in rank]
    top = max(seen, key=rank.__getitem__, default=now)
    return f" (now {now})" if top == now else f" (highest {top}, now {now})"


def summary_lines(data: ReportData) -> list[str]:
    """The summary in a few plain lines (what ``make demo`` prints)."""
    if data.start_wall is None or data.end_wall is None:
        since = f" since {clock(data.since_wall)}" if data.since_wall is not None else ""
        return [f"log: empty (no events{since})"]
    t = data.totals
    gpus = ", ".join(f"gpu{g}" for g in data.gpus) or "no GPU"
    lines = [
        f"log: {data.events} events from {clock(data.start_wall)} to {clock(data.end_wall)} "
        f"({format_duration(data.end_wall - data.start_wall)}), {gpus}",
        f"GPU handoffs: {t.handoffs} ({t.cut_short} cut short), "
        f"held {format_duration(t.held_s)} in all",
        f"waits: p50 {format_duration(t.waits_p50_s)}, p99 {format_duration(t.waits_p99_s)} "
        f"over {t.handoffs} grants ({t.waits} queued behind a holder); timeouts: {t.timeouts}",
    ]
    if t.agent_runs:
        lines.append(
            f"runs: {t.agent_runs} (ok {t.agent_ok}, skips {t.agent_skips}, "
            f"errors {t.agent_errors}"
            + (f", killed or stopped {t.agent_other})" if t.agent_other else ")")
        )
    else:
        holders = sum(1 for h in data.holders if h.runs)
        lines.append(
            f"runs: {t.handoffs} GPU holds by {holders} holders; skips: {t.timeouts} "
            "(timed out waiting)"
        )
    if t.missed_fires:
        running = t.missed_fires - t.missed_late
        lines.append(
            f"missed fires: {t.missed_fires} (the fleet dropped them: {t.missed_late} could not "
            f"start within misfire_grace, {running} came while the agent's last run still ran)"
        )
    lines.append(f"evictions: {t.evictions} ({t.evictions_freed} freed memory)")
    lines.append(f"governor level changes: {t.level_changes}{_levels(data)}")
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
