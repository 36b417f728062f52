"""The status snapshot as the table ``gpulock status`` prints: the same object, for a person.

``render(snap)`` reads the snapshot alone (``gpulock.status.snapshot``, plus the CLI's
``config_problems``), never the state folder, so the table cannot say what ``--json`` does not:
a few lines of news (the governor, the cluster, the devices, the config), one table per GPU's
line and per set of GPUs, then the resident models, the warming ahead, the tenants that could
not be asked, the processes using GPU memory and today's model calls.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from gpulock.core import clusterview
from gpulock.core.units import format_duration, format_gpus, format_size, format_usd

_COLUMNS = ("#", "TICKET", "STATE", "NAME", "PID", "USER", "NEED", "WAITED", "HELD", "LEASE")


def render(snap: dict[str, Any]) -> str:
    """The snapshot as the table ``gpulock status`` prints."""
    lines = _news(snap)
    if not snap["gpus"]:
        lines.append(f"no GPU queues yet (state folder {snap['state_dir']})")
        lines += _render_residents(snap.get("residents", []))
        lines += _render_tenants(snap.get("tenants", []))
        lines += _render_processes(snap["devices"])
        lines += _render_usage(snap.get("usage"))
        return "\n".join(lines)
    for g in snap["gpus"]:
        lines += _render_gpu(g, snap)
    for line in snap.get("sets") or []:
        n = sum(1 for e in line["waiters"] if e["state"] == "waiting")
        lines.append(f"{format_gpus(line['gpus'])} (one line)  -  {n} waiting")
        lines += _rows(line["waiters"])
    lines += _render_residents(snap.get("residents", []))
    lines += _render_prewarm(snap.get("prewarm"))
    lines += _render_tenants(snap.get("tenants", []))
    lines += _render_processes(snap["devices"])
    lines += _render_usage(snap.get("usage"))
    stale = [e for g in snap["gpus"] for e in g["holders"] + g["waiters"] if e["stale"]]
    stale += [e for line in snap.get("sets") or [] for e in line["waiters"] if e["stale"]]
    orphans = [n for g in snap["gpus"] for n in g.get("orphan_fifos", [])]
    if stale or orphans:
        lines.append(
            "! stale entries: 'gpulock break --stale' removes dead ones and ends hung ones"
            + (" (and removes orphan FIFOs)" if orphans else "")
        )
    return "\n".join(lines)


def _news(snap: dict[str, Any]) -> list[str]:
    """The lines above the tables: the governor, the cluster, the devices, the config."""
    lines: list[str] = []
    gov = snap.get("governor")
    if gov is not None:
        if gov["live"]:
            since = time.strftime("%H:%M:%S", time.localtime(gov["since_wall"]))
            lines.append(f"governor: level {gov['level']} since {since} (pid {gov['pid']})")
        elif gov["published_level"] != "normal":
            # Only when it matters: a dead governor's "normal" changes nothing, but a stale
            # "freeze" would have held every admission, had it been believed.
            lines.append(f"governor: not running (last word {gov['published_level']!r} ignored)")
    if snap.get("cluster"):
        c = snap["cluster"]
        lines.append(
            clusterview.View(c["host"], c["hosts"], c["redis"], c["problem"], 0, 0, 0).line()
        )
    if snap.get("devices_problem"):
        # A shell that lacks the tour's GPULOCK_SIMULATE (another terminal) is told so: the
        # sizes and the free memory then show as they do where the jobs run.
        lines.append(
            f"devices: {snap['devices_problem']} (no GPU here? GPULOCK_SIMULATE=24GiB "
            "pretends one, as in the tour)"
        )
    problems = snap.get("config_problems") or []
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        lines.append(f"config: {problems[0]}{more}: see 'gpulock config check'")
    return lines


def _render_gpu(g: dict[str, Any], snap: dict[str, Any]) -> list[str]:
    """One GPU's line: its head (sizes, what is claimed and free, who holds and waits), the
    table of its tickets, and what in its queue folder is not a ticket."""
    entries = g["holders"] + g["waiters"]
    head = f"gpu{g['gpu']}"
    if g["total_bytes"] is not None:
        head += _sizes(g, snap)
    n_wait = sum(1 for e in g["waiters"] if e["state"] == "waiting")
    n_hold = sum(1 for e in g["holders"] if e["state"] in ("holding", "hung"))
    n_set = sum(
        1
        for line in snap.get("sets") or []
        if g["gpu"] in line["gpus"]
        for e in line["waiters"]
        if e["state"] == "waiting"
    )
    head += f"  -  {n_hold} holding, {n_wait} waiting" if entries else "  -  idle"
    if n_set:
        head += f" (and {n_set} for a set of GPUs, below)"
    lines = [head]
    if entries:
        lines += _rows(entries)
    for ig in g["ignored"]:
        lines.append(f"  ignored {ig['file']}: {ig['reason']}")
    for name in g.get("orphan_fifos", []):
        lines.append(f"  orphan {name}: no ticket and no process holds it ! (stale)")
    return lines


def _sizes(g: dict[str, Any], snap: dict[str, Any]) -> str:
    """A sized GPU's head: ``  simulated 24.0 GiB, reserve 2.4 GiB, used ..., free ...``."""
    head = (
        f"  {g['source']} {format_size(g['total_bytes'])}"
        f", reserve {format_size(g['reserve_bytes'])}"
    )
    dev = next((d for d in snap["devices"] if d["index"] == g["gpu"]), None)
    if dev is not None and dev["used_bytes"] is not None:
        head += f", used {format_size(dev['used_bytes'])}"
    if dev is not None and dev.get("reserved_bytes"):
        head += f", driver-reserved {format_size(dev['reserved_bytes'])}"
    if g.get("claimed_bytes"):
        live = [e for e in g["holders"] if e["state"] in ("holding", "hung")]
        exclusive = any(e["need_bytes"] is None for e in live)
        head += f", claimed {format_size(g['claimed_bytes'])}"
        head += " (exclusive)" if exclusive else " by holders"
    free = g.get("free_bytes")
    if free is None and dev is not None:
        free = dev["free_bytes"]
    if free is not None:
        head += f", free {format_size(free)}"
    return head


def _rows(entries: list[dict[str, Any]]) -> list[str]:
    """A line's table: one row per ticket (a pool's line over its first ticket)."""
    lines: list[str] = []
    rows = [(*_COLUMNS, "COMMAND")]
    for e in entries:
        rows.append(
            (
                str(e["position"] + 1),
                str(e["ticket"]),
                e["state"]
                + _spread(e)
                + (" !" if e["stale"] else "")
                + _warming(e.get("prefetch")),
                e["name"],
                str(e["pid"]),
                e["user"],
                "exclusive" if e["need_bytes"] is None else format_size(e["need_bytes"]),
                format_duration(e["waited_s"]),
                format_duration(e["held_s"]) if e["held_s"] is not None else "-",
                format_duration(e["lease_s"]) if e["lease_s"] is not None else "-",
                _short(" ".join(e["command"]), 40),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    shown: set[int] = set()
    for i, r in enumerate(rows):
        p = entries[i - 1].get("pool") if i else None
        if p is not None and p["pid"] not in shown:  # the pool, over its first ticket
            shown.add(p["pid"])
            lines.append(_pool_line(p))
        cells = [c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)]
        lines.append("  " + "  ".join(cells) + "  " + r[-1])
    return lines


def _pool_line(p: dict[str, Any]) -> str:
    need = format_size(p["need_bytes"]) if isinstance(p.get("need_bytes"), int) else "?"
    n = p["workers"]
    return f"  pool {p['name']} ({n} worker{'s' if n != 1 else ''}, max {p['max']}, need {need})"


def _spread(e: dict[str, Any]) -> str:
    """``holding gpus 0,1`` for a multi-GPU holder; ``waiting for 2`` GPUs at once."""
    granted = e.get("granted") or []
    if len(granted) > 1:
        return " " + format_gpus(granted)
    if isinstance(e.get("gpus"), int) and not granted:
        return f" for {e['gpus']}"
    return ""


def _warming(p: dict[str, Any] | None) -> str:
    """A waiter's warming, for the STATE cell: ``(warming 37%)``, ``(warm)``..."""
    if not p:
        return ""
    total, done = p["bytes_total"], p["bytes_done"]
    pct = f"{100 * done // total}%" if total else "0%"
    if p["state"] == "warming":
        return f" (warming {pct} of {format_size(total)})"
    if p["state"] == "done" or p["reason"] == "cached":
        return " (warm)"
    if p["state"] == "skipped":
        return f" (not warmed: {p['reason'] or 'skipped'})"
    return ""


def _render_usage(u: dict[str, Any] | None) -> list[str]:
    if not u:
        return []
    budget = u["daily_budget_usd"]
    spend = f"${u['cloud_spend_usd']:.4f}" + (
        f" of {format_usd(budget)}" if budget is not None else ""
    )
    tiers = ", ".join(
        f"{tier} {int(row.get('calls', 0))}" for tier, row in sorted(u["by_tier"].items())
    )
    today = "today (UTC)" if "by_host" in u else "today"
    lines = [f"model calls {today}: {tiers or 'none'}; cloud spend {spend}"]
    if len(u.get("by_host") or {}) > 1:
        lines.append(
            "  by host: "
            + ", ".join(
                f"{host} {int(row.get('calls', 0))} call{'' if row.get('calls') == 1 else 's'}"
                + (f" ${row['cost_usd']:.4f}" if row.get("cost_usd") else "")
                for host, row in sorted(u["by_host"].items())
            )
        )
    for agent, row in sorted(u["by_agent"].items()):
        calls = int(row.get("calls", 0))
        lines.append(
            f"  {agent}: {calls} call{'' if calls == 1 else 's'}, "
            f"{int(row.get('tokens_in', 0))}+{int(row.get('tokens_out', 0))} tokens, "
            f"${row.get('cost_usd', 0):.4f}"
        )
    return lines


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    ]


def _render_residents(recs: list[dict[str, Any]]) -> list[str]:
    if not recs:
        return []
    rows = [("NAME", "ID", "PID", "GPU", "SIZE", "POLICY", "IDLE", "IN USE", "USES", "NEXT USE")]
    for r in recs:
        rows.append(
            (
                r["name"]
                + (
                    f" [{r['tenant_state']}]"
                    if r.get("tenant_state") not in (None, "loaded")
                    else ""
                ),
                r["id"],
                str(r["pid"]) if r["pid"] else "-",
                f"gpu{r['gpu']}",
                format_size(r["bytes"]),
                r["policy"],
                _idle(r),
                "yes" if r["in_use"] else "no",
                str(r["uses"]),
                _next_use(r),
            )
        )
    return ["resident models", *_table(rows)]


def _idle(r: dict[str, Any]) -> str:
    """IDLE: ``-`` in use; ``?`` when nobody saw its last use (a tenant model's idle time is
    then only "since first seen"), never that lower bound passed off as the idle time."""
    if r["in_use"]:
        return "-"
    if r["idle_s"] is None or not r.get("last_use_seen", True):
        return "?"
    return format_duration(r["idle_s"])


def _next_use(r: dict[str, Any]) -> str:
    """``~07:00 (digest, cron)`` (``NextUse.describe``); ``-`` when unknown."""
    at = r.get("next_use")
    if not isinstance(at, int | float):
        return "-"
    from gpulock.core import nextuse  # as status_sections: only where a resident is shown

    source, by = r.get("next_use_source"), r.get("next_use_by")
    nu = nextuse.NextUse("", at, 1.0, source or nextuse.UNKNOWN_SOURCE, by or "")
    return nu.describe(at, lambda t: time.strftime("%H:%M", time.localtime(t)))


def _render_prewarm(p: dict[str, Any] | None) -> list[str]:
    """Models warming ahead of their predicted use, and why (``gpulock.core.prewarm``)."""
    if not p:
        return []
    rows: list[tuple[str, ...]] = [("MODEL", "WARMING", "STATE", "PROGRESS", "WHY")]
    for e in p["entries"]:
        total, done = e.get("bytes_total"), e.get("bytes_done") or 0
        if e.get("how") == "load":
            how = f"loading on {e.get('tenant')}"
            progress = f"gpu{e['gpu']}" if isinstance(e.get("gpu"), int) else "-"
        else:
            how = "page cache"
            pct = f"{100 * done // total}%" if isinstance(total, int) and total else "-"
            progress = f"{pct} of {format_size(total)}" if isinstance(total, int) else "-"
        state = str(e.get("state")) + (f": {e['reason']}" if e.get("reason") else "")
        rows.append((str(e.get("model")), how, state, progress, _prewarm_why(e)))
    lines = ["warming ahead (gpulock governor)", *_table(rows)] if len(rows) > 1 else []
    for w in p["waiting"]:
        what = "page cache" if w.get("how") == "page-cache" else "load"
        lines.append(f"  not warming {w.get('model')} ({what}): {w.get('reason')}")
    return lines


def _prewarm_why(e: dict[str, Any]) -> str:
    """``needed ~07:00 (digest, cron, 95 %)``: the prediction that caused it."""
    at = e.get("next_use_wall")
    if not isinstance(at, int | float):
        return "-"
    who = ", ".join(str(x) for x in (e.get("next_use_by"), e.get("next_use_source")) if x)
    conf = e.get("confidence")
    sure = f", {round(100 * conf)} %" if isinstance(conf, int | float) else ""
    return f"needed ~{time.strftime('%H:%M', time.localtime(at))} ({who}{sure})"


def _render_tenants(tenants: list[dict[str, Any]]) -> list[str]:
    """One line per tenant that could not be asked (the others show as residents)."""
    return [
        f"tenant {t['tenant']} ({t['kind']}, {t['url']}): unreachable: {t['error']}"
        for t in tenants
        if not t["reachable"]
    ]


def _render_processes(devs: list[dict[str, Any]]) -> list[str]:
    procs = [(d, p) for d in devs for p in d["processes"]]
    if not procs:
        return []
    rows = [("GPU", "PID", "USED", "REGISTERED")]
    for d, p in procs:
        rows.append(
            (
                f"gpu{d['index']}",
                str(p["pid"]),
                format_size(p["used_bytes"]),
                p["as"] or "no (not known to gpulock)",
            )
        )
    return ["processes using GPU memory", *_table(rows)]
