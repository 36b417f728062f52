"""What every GPU queue looks like now: a JSON-able snapshot.

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

The GPUs' lines are gathered here; the sections beside them (residents, devices, governor,
cluster, usage, prewarm) in ``gpulock.status_sections``; ``gpulock.status_text`` prints the
whole as the table.  Reading status never changes the queue.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpulock import status_sections as sections
from gpulock.core import devices
from gpulock.core.settings import Settings
from gpulock.lock import prefetch_progress, queue
from gpulock.lock.census import queue_gpus
from gpulock.lock.queuedir import QueueDir, TicketFile
from gpulock.lock.ticket import Ticket
from gpulock.pool import record as pool_record
from gpulock.residents import registry

# The table is gpulock.status_text's; named here too, where `gpulock status`'s callers (tests,
# bench/) have always found it beside the snapshot.
from gpulock.status_text import render as render

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


def snapshot(settings: Settings, *, now_wall: float | None = None) -> dict[str, Any]:
    """The documented ``gpulock status --json`` object (above) as the state is at ``now_wall``."""
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
    registered = _registered(recs, gpus)
    return {
        "version": VERSION,
        "state_dir": str(settings.state_dir),
        "generated_wall": now_w,
        "governor": sections.governor_entry(settings, now_w),
        "devices": [sections.device_entry(d, registered) for d in report.devices],
        "devices_problem": report.problem,
        "gpus": gpus,
        "sets": sets,
        "residents": sections.with_next_use(settings, recs, now_w),
        "tenants": tenants,
        "usage": sections.usage_entry(settings, now_w),
        "cluster": sections.cluster_entry(settings, now_w),
        "prewarm": sections.prewarm_entry(settings),
    }


def _registered(recs: list[registry.Record], gpus: list[dict[str, Any]]) -> dict[int, str]:
    """pid -> what it is to gpulock, for the devices' processes: a tenant's server, a resident's
    owner, a holder, a holder's command."""
    registered: dict[int, str] = {
        r.pid: f"tenant {r.tenant}" if r.tenant else f"resident {r.name}" for r in recs if r.pid
    }
    for g in gpus:
        for e in g["holders"]:
            registered.setdefault(e["pid"], f"holder of ticket {e['ticket']}")
            if e["child_pid"] is not None:
                registered.setdefault(e["child_pid"], f"command of ticket {e['ticket']}")
    return registered


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
