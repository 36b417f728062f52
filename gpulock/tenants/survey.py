"""Asking every tenant at once what it holds.

``survey(settings)`` lists every configured tenant in parallel (one thread each, a short
timeout each, one deadline for all): a tenant that is down, hangs, answers a 500 or garbage
makes its own ``Listing`` say so (``reachable`` false, ``error`` in words) and never delays
the others past the deadline or raises.  What the tenants hold becomes residents in
``gpulock.residents.registry`` (``to_records``): this package sees nothing of the records.
"""

from __future__ import annotations

import importlib
import threading
import time
from dataclasses import dataclass
from typing import Any

from gpulock.core import devices
from gpulock.core.errors import known_hint
from gpulock.core.settings import Settings
from gpulock.core.tenantspec import TenantSpec
from gpulock.tenants import procs
from gpulock.tenants.base import Adapter, TenantModel
from gpulock.tenants.http import TenantError

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
    known = [s.name for s in settings.config.tenants]
    hint = known_hint(name, known, "tenants") if known else "tenants: none is configured"
    raise TenantError(f"no tenant {name!r}", hint=hint)


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


def child_pid(li: Listing, m: TenantModel) -> int | None:
    """A llama-server router child's pid, from the port in its arguments."""
    if m.detail and m.detail.startswith("child port "):
        try:
            pids = procs.pids_on_port(int(m.detail.rsplit(" ", 1)[1]))
        except ValueError:
            return None
        return pids[0] if pids else None
    return None


def measured_bytes(
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
