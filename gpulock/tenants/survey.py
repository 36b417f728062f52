"""Asking every tenant at once what it holds, and turning the answers into resident records.

``survey(settings)`` lists every configured tenant in parallel (one thread each, a short
timeout each, one deadline for all): a tenant that is down, hangs, answers a 500 or garbage
makes its own ``Listing`` say so (``reachable`` false, ``error`` in words) and never delays
the others past the deadline or raises.  ``to_records`` makes each listed model a
``gpulock.residents.registry.Record`` whose ``tenant`` is the tenant's name and whose id is
``TENANT/MODEL``: from there on it is a resident like any other (status, the governor,
room-for-a-waiter, ``gpulock evict``).
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from gpulock.core import devices
from gpulock.residents.registry import Record
from gpulock.core.settings import Settings
from gpulock.tenants import procs, usage
from gpulock.tenants.base import Adapter, TenantModel
from gpulock.tenants.http import TenantError
from gpulock.core.tenantspec import TenantSpec

LIST_TIMEOUT_S = 0.6  # per request: a local server answers in milliseconds
DEADLINE_S = 0.8  # for the whole survey: `gpulock status` answers within 1 s


@dataclass(frozen=True, slots=True)
class Listing:
    """One tenant as the survey found it (the ``gpulock tenants --json`` entry)."""

    tenant: str
    kind: str  # as configured
    url: str | None
    gpu: int
    reachable: bool
    actual_kind: str | None = None  # as it says it is (llama-server: router or single-model)
    error: str | None = None
    models: tuple[TenantModel, ...] = ()
    notes: tuple[str, ...] = ()
    pids: tuple[int, ...] = ()  # processes listening on its port (this user's, or all as root)
    elapsed_s: float = 0.0


# kind -> (module, class): one module per kind, imported when a tenant of that kind is used.
ADAPTERS = {
    "ollama": ("ollama", "OllamaAdapter"),
    "llama-server": ("llama_server", "LlamaServerAdapter"),
    "llama-swap": ("llama_swap", "LlamaSwapAdapter"),
    "vllm": ("vllm", "VllmAdapter"),
    "comfyui": ("comfyui", "ComfyUIAdapter"),
    "localai": ("localai", "LocalAIAdapter"),
}


def adapter_for(
    spec: TenantSpec, settings: Settings, *, timeout_s: float = LIST_TIMEOUT_S
) -> Adapter:
    """The adapter of ``spec.kind`` (its module imported on first use)."""
    if spec.kind == "command":
        from gpulock.tenants.command import CommandAdapter

        return CommandAdapter(spec, timeout_s=timeout_s, settings=settings)
    module, name = ADAPTERS[spec.kind]
    cls: type[Adapter] = getattr(importlib.import_module(f"gpulock.tenants.{module}"), name)
    return cls(spec, timeout_s=timeout_s)


def find_spec(settings: Settings, name: str) -> TenantSpec:
    """The configured tenant ``name``; a GpulockError listing the known ones otherwise."""
    for s in settings.config.tenants:
        if s.name == name:
            return s
    known = ", ".join(s.name for s in settings.config.tenants) or "none is configured"
    raise TenantError(f"no tenant {name!r}", hint=f"tenants: {known}")


def list_one(spec: TenantSpec, settings: Settings, timeout_s: float = LIST_TIMEOUT_S) -> Listing:
    start = time.monotonic()

    def listing(**kw: Any) -> Listing:
        return Listing(
            spec.name, spec.kind, spec.url, spec.gpu,
            elapsed_s=round(time.monotonic() - start, 6), **kw,
        )  # fmt: skip

    try:
        seen = adapter_for(spec, settings, timeout_s=timeout_s).list()
    except TenantError as e:
        return listing(reachable=False, error=str(e))
    except Exception as e:  # an adapter bug must not take `gpulock status` down with it
        return listing(reachable=False, error=f"internal error: {e!r}"[:300])
    return listing(
        reachable=True, actual_kind=seen.actual_kind, models=seen.models, notes=seen.notes
    )


def with_pids(li: Listing) -> Listing:
    """The listing with the pids listening on its port (``/proc/net/tcp``: not free, so only
    asked for where NVML's per-process figures need them, and by ``gpulock tenants``)."""
    if li.kind == "command" or not li.reachable:
        return li
    from dataclasses import replace

    return replace(li, pids=procs.pids_on_port(procs.port_of(li.url)))


def survey(
    settings: Settings,
    *,
    names: list[str] | None = None,
    timeout_s: float = LIST_TIMEOUT_S,
    deadline_s: float = DEADLINE_S,
) -> list[Listing]:
    """Every configured tenant (or those ``names``), listed in parallel, in config order."""
    specs = [s for s in settings.config.tenants if names is None or s.name in names]
    results: dict[str, Listing] = {}

    def work(spec: TenantSpec) -> None:
        results[spec.name] = list_one(spec, settings, timeout_s)

    threads = [threading.Thread(target=work, args=(s,), daemon=True) for s in specs]
    for t in threads:
        t.start()
    end = time.monotonic() + deadline_s
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    out = []
    for s in specs:
        got = results.get(s.name)
        if got is None:  # a server that drips bytes slower than the socket timeout notices
            got = Listing(
                s.name, s.kind, s.url, s.gpu, reachable=False,
                error=f"no complete answer in {deadline_s:g} s", elapsed_s=deadline_s,
            )  # fmt: skip
        out.append(got)
    return out


def to_records(
    settings: Settings,
    listings: list[Listing],
    *,
    report: devices.DeviceReport | None = None,
    now_wall: float | None = None,
    track: bool = True,
) -> list[Record]:
    """Each listed model holding memory, as a resident record (``tenant`` set).

    ``report``: an NVML report gives each model the memory of its process (a llama-server
    router child, a LocalAI backend, a command server) or, for a one-process server, of the
    server's processes; a simulated GPU leaves ``measured_bytes`` None (the server's own
    figure is ``declared_bytes``).  ``track``: update the usage file (last use).
    """
    now = time.time() if now_wall is None else now_wall
    specs = {s.name: s for s in settings.config.tenants}
    rows: list[tuple[Listing, TenantModel]] = [
        (li, m) for li in listings for m in li.models if m.state != "sleeping"
    ]
    last: dict[str, float | None] = {}
    if not track and rows:
        last = usage.peek(settings)
    elif track:
        asked = frozenset(li.tenant for li in listings if li.reachable)
        seen = {f"{li.tenant}/{m.name}": m.fingerprint for li, m in rows}
        obs = usage.observe(settings, seen, now, asked=asked)
        last = obs.last_used
        _residency_events(settings, rows, obs)
    nvml = report is not None and report.source == "nvml"
    if nvml:
        listings = [with_pids(li) for li in listings]
        rows = [(li, m) for li in listings for m in li.models if m.state != "sleeping"]
    out = []
    for li, m in rows:
        spec = specs.get(li.tenant)
        rid = f"{li.tenant}/{m.name}"
        child = _child_pid(li, m) if nvml else None
        pid = m.pid or child or (li.pids[0] if li.pids else 0)
        measured = _measured(report, li, m, pid, child)
        used = last.get(rid)
        pinned = spec is not None and m.name in spec.pinned
        out.append(
            Record(
                id=rid,
                name=m.name,
                gpu=li.gpu,
                owner=f"tenant:{li.tenant}",
                pid=pid,
                uid=os.getuid(),
                user=li.tenant,
                program=li.actual_kind or li.kind,
                policy="pinned" if pinned else "persistent",
                loaded_wall=now,
                last_used_wall=used if used is not None else now,
                declared_bytes=m.size_bytes,
                measured_bytes=measured,
                in_use=bool(m.in_use),
                tenant=li.tenant,
                tenant_state=m.state,
                idle_known=used is not None,
            )
        )
    return out


def _residency_events(
    settings: Settings, rows: list[tuple[Listing, TenantModel]], obs: usage.Observed
) -> None:
    """A ``resident`` event when a tenant model first shows, an ``unload`` when it is gone
    from an answering tenant's listing: the report draws tenant residencies like others."""
    by_id = {f"{li.tenant}/{m.name}": (li, m) for li, m in rows}
    for rid in obs.appeared:
        li, m = by_id[rid]
        settings.emit(
            "resident", resident=rid, name=m.name, gpu=li.gpu, tenant=li.tenant,
            declared_bytes=m.size_bytes, state=m.state,
        )  # fmt: skip
    for rid in obs.vanished:
        tenant, _, name = rid.partition("/")
        spec = next((s for s in settings.config.tenants if s.name == tenant), None)
        settings.emit(
            "unload", resident=rid, name=name, gpu=spec.gpu if spec else None, tenant=tenant,
            reason="no longer in the tenant's listing",
        )  # fmt: skip


def _child_pid(li: Listing, m: TenantModel) -> int | None:
    """A llama-server router child's pid, from the port in its arguments."""
    if m.detail and m.detail.startswith("child port "):
        try:
            pids = procs.pids_on_port(int(m.detail.rsplit(" ", 1)[1]))
        except ValueError:
            return None
        return pids[0] if pids else None
    return None


def _measured(
    report: devices.DeviceReport | None, li: Listing, m: TenantModel, pid: int, child: int | None
) -> int | None:
    if report is None or pid <= 0:
        return None
    dev = report.get(li.gpu)
    if dev is None or dev.source == "simulated":
        return None
    if m.pid is not None or child is not None or len(li.models) == 1:
        return devices.process_used_bytes(report, li.gpu, pid)
    return None  # several models in one process: NVML cannot split it between them


def summary(li: Listing) -> dict[str, Any]:
    """A listing as JSON (``gpulock tenants --json``, ``gpulock status --json`` ``tenants``)."""
    return {
        "tenant": li.tenant,
        "kind": li.kind,
        "actual_kind": li.actual_kind,
        "url": li.url,
        "gpu": li.gpu,
        "reachable": li.reachable,
        "error": li.error,
        "notes": list(li.notes),
        "pids": list(li.pids),
        "elapsed_s": li.elapsed_s,
        "models": [
            {
                "name": m.name,
                "id": f"{li.tenant}/{m.name}",
                "state": m.state,
                "size_bytes": m.size_bytes,
                "in_use": m.in_use,
                "pid": m.pid,
                "detail": m.detail,
            }
            for m in li.models
        ],
    }


def entries(settings: Settings, *, now_wall: float | None = None) -> list[dict[str, Any]]:
    """``gpulock tenants --json``'s entries: each listing with pids, last use and idle time."""
    now = time.time() if now_wall is None else now_wall
    listings = [with_pids(li) for li in survey(settings)]
    last = {r.id: r for r in to_records(settings, listings, now_wall=now)}
    out = []
    for li in listings:
        e = summary(li)
        for m in e["models"]:
            r = last.get(m["id"])
            known = r is not None and r.idle_known
            m["last_used_wall"] = r.last_used_wall if known and r is not None else None
            m["idle_s"] = round(now - r.last_used_wall, 3) if known and r is not None else None
        out.append(e)
    return out


def render(rows: list[dict[str, Any]]) -> str:
    """The entries as ``gpulock tenants`` prints them."""
    from gpulock.core.units import format_duration, format_size

    lines = []
    for e in rows:
        where = f"{e['url']}  gpu{e['gpu']}"
        if not e["reachable"]:
            lines.append(f"{e['tenant']}  {e['kind']}  {where}  unreachable: {e['error']}")
            continue
        kind = e["actual_kind"] or e["kind"]
        lines.append(f"{e['tenant']}  {kind}  {where}  {len(e['models'])} model(s)")
        lines += [f"  note: {note}" for note in e["notes"]]
        for m in e["models"]:
            size = format_size(m["size_bytes"]) if m["size_bytes"] is not None else "size ?"
            idle = format_duration(m["idle_s"]) if m["idle_s"] is not None else "?"
            use = {True: "in use", False: "idle", None: "in use ?"}[m["in_use"]]
            lines.append(f"  {m['name']}  {m['state']}  {size}  last use {idle} ago  {use}")
    return "\n".join(lines)
