"""What every GPU queue looks like now: a JSON-able snapshot and its human rendering.

``snapshot()`` is the documented ``gpulock status --json`` object (``"version": 1``):

* ``gpus``: one object per GPU with ``gpu``, ``total_bytes``, ``reserve_bytes``,
  ``budget_bytes`` (None when the size is unknown), ``claimed_bytes`` (what the live holders
  claim: the whole GPU while one holds it exclusively, else the sum of their needs; None when
  an exclusive holder's GPU size is unknown), ``free_bytes`` (the GPU less the larger of what
  the device reports used and what is claimed; None when unknown), ``holders`` and ``waiters``
  (queue order)
  and ``ignored`` (files in the queue folder that are not readable tickets, with the reason),
  ``orphan_fifos`` (``<seq>.fifo`` files without a ticket that no process holds: debris of a
  holder killed inside its release; ``gpulock break --stale`` removes them).
* ``sets``: the tickets that wait for a set of GPUs (``--gpu any``, ``--gpu 0,2``, ``--gpus 2``),
  each shown once, under its set rather than under each GPU of it: one object per set with
  ``gpus`` (the set) and ``waiters`` (queue order).  Their copies in each GPU's line are not in
  that GPU's ``waiters``; a multi-GPU holder is in the ``holders`` of each GPU it holds.
* every holder/waiter entry: ``ticket``, ``name``, ``pid``, ``state`` (``holding``,
  ``waiting``, ``hung``: alive past its lease without a heartbeat, ``dead``: its owner is gone
  and the ticket awaits cleanup), ``stale`` (hung or dead), ``position`` (0 = head), ``user``,
  ``uid``, ``host``, ``command``, ``need_bytes`` (None = exclusive), ``lease_s``,
  ``created_wall``, ``granted_wall``, ``waited_s``, ``held_s``, ``heartbeat_age_s``,
  ``child_pid``, ``gpus`` (the set asked, as a list: ``[1]`` for a ticket pinned to gpu1, every
  GPU for ``--gpu any``; or the number asked at once, for ``--gpus 2``), ``gpu_set`` (the GPUs
  it may be granted on, always a list), ``granted`` (the GPUs it holds: empty while it waits),
  ``prefetch`` (a waiter warming its files, see ``gpulock.lock.prefetch_progress``:
  ``state`` ``warming``/``done``/``skipped``, ``reason``, ``paths``, ``bytes_done``,
  ``bytes_total``, ``bytes_read``, ``updated_wall``; None when it warms nothing, and always for
  holders), ``pool`` (a ticket of a ``gpulock pool``: ``name``, ``pid``, ``workers`` running,
  ``max``, ``min``, ``need_bytes`` and ``worker``, the index of the worker on this ticket, None
  for the pool's waiting ticket; None for any other ticket).
* ``devices``: the probed GPUs; ``devices_problem``: why none could be probed, or None.
* ``residents``: every resident model, library and tenant alike: ``id`` (a tenant model's is
  ``TENANT/MODEL``), ``tenant`` (the tenant's name, None for a library resident),
  ``tenant_state`` (``loading``, ``loaded``, ``unloading``; None for a library resident),
  ``name``, ``pid``, ``gpu``, sizes, ``policy``, ``in_use``, ``idle_s`` (None: in use, or a
  tenant model whose last use is not known yet), ``last_use_seen`` (False: a tenant model
  never seen in use, whose ``idle_s`` is only the time since first seen), ``next_use`` (when
  foresight expects its next use, epoch seconds; None: unknown), ``next_use_source``
  (``waiter``, ``cron``, ``rhythm``, ``time-of-day``, ``history`` or ``unknown``; see
  ``gpulock.core.foresight``) and the rest of the record.
* ``tenants``: one entry per configured tenant, as ``gpulock tenants --json`` shows it.
* ``usage``: today's model calls as the router counted them (``<state>/router/ledger.json``):
  ``day``, ``cloud_spend_usd``, ``daily_budget_usd`` (``router.daily_budget``, None when unset)
  and ``by_agent`` / ``by_task`` / ``by_tier`` (and ``by_host`` in a cluster: the host that ran
  each call, a peer's name for a call sent there), each name -> ``calls``, ``tokens_in``,
  ``tokens_out``, ``cost_usd``; None when the router has not been used today.  In a cluster
  ``day`` is the UTC day, as the cluster's budgets count it; on a host alone, the local day.

Reading status never changes the queue.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpulock.core import clusterview, devices, level
from gpulock.core.errors import GpulockError
from gpulock.core.settings import Settings
from gpulock.core.units import (
    calendar_day,
    format_duration,
    format_gpus,
    format_size,
    format_usd,
    parse_usd,
)
from gpulock.lock import prefetch_progress, queue
from gpulock.lock.census import queue_gpus
from gpulock.lock.queuedir import QueueDir, TicketFile
from gpulock.lock.ticket import Ticket
from gpulock.pool import record as pool_record
from gpulock.residents import registry

VERSION = 1


@dataclass(frozen=True, slots=True)
class Place:
    """One live ticket in a GPU's line, as the packages above gpulock may read it."""

    ticket: int
    name: str
    need_bytes: int | None  # None: exclusive
    holding: bool
    granted_wall: float | None


def line(settings: Settings, gpu: int) -> list[Place]:
    """The live tickets of ``gpu``'s line (holders and waiters), in ticket order.

    The door through which a router reads a line to estimate a wait: dead and unreadable
    tickets are left out, and the queue folder's layout stays the lock's own business.
    """
    qdir = QueueDir(settings, gpu, create=False)
    out = []
    for seq, tf, _why in qdir.scan():
        if tf is None or not qdir.alive(seq):
            continue
        t = tf.ticket
        out.append(Place(t.seq, t.name, t.need_bytes, t.holding, t.granted_wall))
    return out


def gpu_indices(settings: Settings, report: devices.DeviceReport) -> list[int]:
    """GPUs to show: those probed plus any other with a queue folder that holds something.

    An empty queue folder of a GPU the probe does not list is debris (a ``--gpu 7`` taken
    before such indices were refused), not a GPU: shown only when nothing could be probed.
    """
    probed = {d.index for d in report.devices}
    extra = {
        g
        for g in queue_gpus(settings)
        if g not in probed and (not probed or _has_files(settings.gpu_dir(g, create=False)))
    }
    return sorted(probed | extra)


def _has_files(path: Path) -> bool:
    try:
        return bool(os.listdir(path))
    except OSError:
        return False


def entry(qdir: QueueDir, tf: TicketFile, position: int, now_w: float) -> dict[str, Any]:
    t = tf.ticket
    alive = qdir.alive(t.seq)
    hung = alive and queue.is_hung(t, tf.mtime_wall, now_w)
    if not alive:
        state = "dead"
    elif hung:
        state = "hung"
    else:
        state = "holding" if t.holding else "waiting"
    waited_until = t.granted_wall if t.holding else now_w
    return {
        "ticket": t.seq,
        "name": t.name,
        "pid": t.pid,
        "state": state,
        "stale": state in ("hung", "dead"),
        "position": position,
        "user": t.user,
        "uid": t.uid,
        "host": t.host,
        "command": list(t.command),
        "need_bytes": t.need_bytes,
        "lease_s": t.lease_s,
        "created_wall": t.created_wall,
        "granted_wall": t.granted_wall,
        "waited_s": round(max(0.0, (waited_until or now_w) - t.created_wall), 3),
        "held_s": round(now_w - t.granted_wall, 3) if t.granted_wall else None,
        "heartbeat_age_s": (
            round(now_w - queue.heartbeat_wall(t, tf.mtime_wall), 3) if t.holding else None
        ),
        "child_pid": t.child_pid,
        **_gpus_of(t),
        "pool": None,  # a gpulock pool's ticket: filled in by snapshot()
        "prefetch": None if t.holding else prefetch_progress.read_progress(qdir, tf),
    }


def _gpus_of(t: Ticket) -> dict[str, Any]:
    """An entry's ``gpus`` (the set asked, or the count), ``gpu_set`` and ``granted``."""
    if not t.gpus and t.count == 1:  # pinned: its own GPU (the common case, kept cheap)
        return {"gpus": [t.gpu], "gpu_set": [t.gpu], "granted": [t.gpu] if t.holding else []}
    gset = list(t.gpu_set)
    return {
        "gpus": t.count if t.count > 1 else gset,
        "gpu_set": gset,
        "granted": list(t.held_gpus),
    }


def gpu_snapshot(
    settings: Settings,
    gpu: int,
    dev: devices.Device | None,
    now_w: float,
    set_waiters: list[tuple[QueueDir, TicketFile]] | None = None,
) -> dict[str, Any]:
    """One GPU's line.  ``set_waiters`` collects the copies of tickets waiting for a set (shown
    under their set, not here)."""
    qdir = QueueDir(settings, gpu, create=False)
    holders: list[dict[str, Any]] = []
    waiters: list[dict[str, Any]] = []
    ignored: list[dict[str, Any]] = []
    position = 0
    for seq, tf, why in qdir.scan():
        if tf is None:
            ignored.append({"file": qdir.ticket_path(seq).name, "reason": why})
            continue
        if tf.ticket.spans and not tf.ticket.holding and set_waiters is not None:
            set_waiters.append((qdir, tf))
            position += 1
            continue
        e = entry(qdir, tf, position, now_w)
        position += 1
        (holders if tf.ticket.holding else waiters).append(e)
    total = dev.total_bytes if dev else None
    reserve = settings.config.reserve_bytes(total) if total is not None else None
    claimed = claimed_bytes([e for e in holders if e["state"] in ("holding", "hung")], total)
    used = dev.used_bytes if dev else None
    free = free_bytes(total, used, claimed, dev.free_bytes if dev else None)
    return {
        "gpu": gpu,
        "name": dev.name if dev else None,
        "source": dev.source if dev else None,
        "total_bytes": total,
        "reserve_bytes": reserve,
        "budget_bytes": total - reserve if total is not None and reserve is not None else None,
        "claimed_bytes": claimed,
        "free_bytes": free,
        "holders": holders,
        "waiters": waiters,
        "ignored": ignored,
        "orphan_fifos": [qdir.fifo_path(s).name for s in qdir.orphan_fifos()],
    }


def free_bytes(
    total: int | None, used: int | None, claimed: int | None, device_free: int | None
) -> int | None:
    """A GPU's free memory as ``gpulock status`` shows it (and the cluster publishes it, and
    the router reads it): the GPU less the larger of what is in use and what the lock's holders
    claim (an exclusive holder claims it all), never more than the device says is free."""
    if total is None or (used is None and claimed is None):
        return None
    free = max(total - max(used or 0, claimed or 0), 0)
    return free if device_free is None else min(free, device_free)


def claimed_bytes(holders: Sequence[dict[str, Any]], total: int | None) -> int | None:
    """What live holders claim: an exclusive one the whole GPU, the others their needs."""
    if any(e["need_bytes"] is None for e in holders):
        return total
    return sum(int(e["need_bytes"]) for e in holders)


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


def snapshot(settings: Settings, *, now_wall: float | None = None) -> dict[str, Any]:
    now_w = time.time() if now_wall is None else now_wall
    tenants: list[dict[str, Any]] = []
    trecs: list[registry.Record] = []
    if settings.config.tenants:  # the tenants package is imported only when some are configured
        from gpulock.tenants import survey

        listings = survey.survey(settings)
        tenants = [survey.summary(li) for li in listings]
        trecs = registry.to_records(settings, listings, now_wall=now_w)
    report = registry.probe_devices(settings, tenants=trecs)
    if trecs and report.source == "nvml":
        trecs = registry.to_records(settings, listings, report=report, now_wall=now_w, track=False)
    recs = registry.Registry(settings, create=False).records(clean=False) + trecs
    copies: list[tuple[QueueDir, TicketFile]] = []
    gpus = [
        gpu_snapshot(settings, i, report.get(i), now_w, copies)
        for i in gpu_indices(settings, report)
    ]
    sets = set_lines(copies, gpus, now_w)
    _mark_pools(gpus, pool_record.live(settings), sets)
    registered: dict[int, str] = {
        r.pid: f"tenant {r.tenant}" if r.tenant else f"resident {r.name}" for r in recs if r.pid
    }
    for g in gpus:
        for e in g["holders"]:
            registered.setdefault(e["pid"], f"holder of ticket {e['ticket']}")
            if e["child_pid"] is not None:
                registered.setdefault(e["child_pid"], f"command of ticket {e['ticket']}")
    return {
        "version": VERSION,
        "state_dir": str(settings.state_dir),
        "generated_wall": now_w,
        "governor": governor_entry(settings, now_w),
        "devices": [device_entry(d, registered) for d in report.devices],
        "devices_problem": report.problem,
        "gpus": gpus,
        "sets": sets,
        "residents": _with_next_use(settings, recs, now_w),
        "tenants": tenants,
        "usage": usage_entry(settings, now_w),
        "cluster": cluster_entry(settings, now_w),
        "prewarm": prewarm_entry(settings),
    }


def set_lines(
    copies: list[tuple[QueueDir, TicketFile]], gpus: list[dict[str, Any]], now_w: float
) -> list[dict[str, Any]]:
    """The tickets waiting for a set of GPUs, once each (from their first copy), grouped by
    set; a ticket already holding (a grant in progress: its last copies leave) is left out."""
    holding = {e["ticket"] for g in gpus for e in g["holders"]}
    seen: set[int] = set()
    by_set: dict[tuple[int, ...], list[dict[str, Any]]] = {}
    for qdir, tf in sorted(copies, key=lambda c: (c[1].ticket.seq, c[0].gpu)):
        t = tf.ticket
        if t.seq in seen or t.seq in holding:
            continue
        seen.add(t.seq)
        line = by_set.setdefault(t.gpu_set, [])
        line.append(entry(qdir, tf, len(line), now_w))
    return [{"gpus": list(k), "waiters": v} for k, v in sorted(by_set.items())]


def prewarm_entry(settings: Settings) -> dict[str, Any] | None:
    """What the governor is warming ahead of its predicted use, and why; None when nothing
    (``gpulock.residents.prewarm``)."""
    from gpulock.residents.prewarm_state import published

    doc = published(settings)
    if doc is None or not (doc["entries"] or doc["waiting"]):
        return None
    return doc


def _mark_pools(
    gpus: list[dict[str, Any]],
    pools: list[dict[str, Any]],
    sets: list[dict[str, Any]] | None = None,
) -> None:
    """Give each ticket of a running ``gpulock pool`` its ``pool`` object (others: None)."""
    by_pid = {p["pid"]: p for p in pools}
    lines = [g["holders"] + g["waiters"] for g in gpus]
    lines += [s["waiters"] for s in sets or []]
    for entries in lines:
        for e in entries:
            p = by_pid.get(e["pid"])
            if p is None:
                e["pool"] = None
                continue
            workers = [w for w in p.get("workers", []) if isinstance(w, dict)]
            worker = next((w.get("index") for w in workers if w.get("ticket") == e["ticket"]), None)
            e["pool"] = {
                "name": p.get("name"),
                "pid": p["pid"],
                "workers": len(workers),
                "max": p.get("max"),
                "min": p.get("min"),
                "need_bytes": p.get("need_bytes"),
                "worker": worker,
            }


def _pool_line(p: dict[str, Any]) -> str:
    need = format_size(p["need_bytes"]) if isinstance(p.get("need_bytes"), int) else "?"
    n = p["workers"]
    return f"  pool {p['name']} ({n} worker{'s' if n != 1 else ''}, max {p['max']}, need {need})"


def _with_next_use(
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

    from gpulock.core.state import read_small

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


_COLUMNS = ("#", "TICKET", "STATE", "NAME", "PID", "USER", "NEED", "WAITED", "HELD", "LEASE")


def render(snap: dict[str, Any]) -> str:
    """The snapshot as the table ``gpulock status`` prints."""
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
    if not snap["gpus"]:
        lines.append(f"no GPU queues yet (state folder {snap['state_dir']})")
        lines += _render_residents(snap.get("residents", []))
        lines += _render_tenants(snap.get("tenants", []))
        lines += _render_processes(snap["devices"])
        lines += _render_usage(snap.get("usage"))
        return "\n".join(lines)
    for g in snap["gpus"]:
        entries = g["holders"] + g["waiters"]
        head = f"gpu{g['gpu']}"
        if g["total_bytes"] is not None:
            head += (
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
        lines.append(head)
        if entries:
            lines += _rows(entries)
        for ig in g["ignored"]:
            lines.append(f"  ignored {ig['file']}: {ig['reason']}")
        for name in g.get("orphan_fifos", []):
            lines.append(f"  orphan {name}: no ticket and no process holds it ! (stale)")
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
    from gpulock.core import foresight  # as _with_next_use: only where a resident is shown

    source, by = r.get("next_use_source"), r.get("next_use_by")
    nu = foresight.NextUse("", at, 1.0, source or foresight.UNKNOWN_SOURCE, by or "")
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
