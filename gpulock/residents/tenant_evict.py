"""Evicting a tenant's model: ask its server, then verify that the memory came back.

Same outcomes as a library resident (``gpulock.residents.outcome.EvictResult``): ``freed``,
``not-freed``, ``no-answer`` (the server did not answer the listing or the request),
``refused`` (pinned without force; a server that cannot unload), ``busy`` (serving a request:
the server's listing, llama-server's ``/slots``, ComfyUI's queue; or an Ollama model still
listed as expired after the verification window: it frees when its requests end) and
``gone`` (not loaded any more).  An answer is only a promise: the model must leave the
server's listing (or stop holding memory there), and on a real GPU NVML must show its
process's memory fall (or the process gone).
"""

from __future__ import annotations

import time

from gpulock.core import devices
from gpulock.core.settings import Settings
from gpulock.core.units import format_size
from gpulock.residents.outcome import EvictResult
from gpulock.residents.registry import Record, probe_devices
from gpulock.tenants.base import Adapter, TenantModel
from gpulock.tenants.http import TenantBusy, TenantError, TenantUnreachable
from gpulock.tenants.survey import adapter_for

VERIFY_S = 15.0  # a llama-server child and ComfyUI's worker free a little after answering


def _find(adapter: Adapter, name: str) -> TenantModel | None:
    return next((m for m in adapter.list().models if m.name == name), None)


def evict(
    settings: Settings,
    record: Record,
    *,
    force: bool = False,
    timeout_s: float = 10.0,
    verify_s: float = VERIFY_S,
    reason: str = "requested",
) -> EvictResult:
    """Unload ``record`` (a tenant model) through its server and verify; one event."""
    start = time.monotonic()

    def result(outcome: str, detail: str, freed: int | None = None) -> EvictResult:
        pid = record.pid if record.pid > 0 else None  # 0: the server's pid is not known
        res = EvictResult(
            record.id, record.name, record.gpu, pid, outcome, detail, freed,
            round(time.monotonic() - start, 6),
        )  # fmt: skip
        known = {"pid": pid} if pid is not None else {}  # no pid: none in the event
        settings.emit(
            "evict", resident=record.id, name=record.name, gpu=record.gpu, **known,
            tenant=record.tenant, outcome=outcome, detail=detail, freed_bytes=freed,
            elapsed_s=res.elapsed_s, force=force, reason=reason,
        )  # fmt: skip
        return res

    spec = next((s for s in settings.config.tenants if s.name == record.tenant), None)
    if spec is None:
        return result("gone", f"tenant {record.tenant!r} is no longer configured")
    adapter = adapter_for(spec, settings, timeout_s=min(timeout_s, 5.0))
    try:
        model = _find(adapter, record.name)
    except TenantError as e:
        return result("no-answer", str(e))
    if adapter.freed(model):
        return result("gone", "not loaded any more")
    assert model is not None
    if record.name in spec.pinned and not force:
        return result("refused", "pinned (use --force)")
    if model.in_use and not force:
        return result("busy", "serving a request")
    before = _nvml_before(settings, record)
    try:
        said = adapter.unload(record.name, force=force, timeout_s=timeout_s)
    except TenantBusy as e:
        return result("busy", str(e))
    except TenantUnreachable as e:
        return result("no-answer", str(e))
    except TenantError as e:
        return result("refused", str(e))
    # Verify: the server's own listing first (it is the one that knows), then NVML.
    deadline = time.monotonic() + verify_s
    pause = 0.01
    last: TenantModel | None = model
    while True:
        try:
            last = _find(adapter, record.name)
            if adapter.freed(last):
                break
        except TenantError:
            pass  # restarting or busy freeing: keep looking until the deadline
        if time.monotonic() >= deadline:
            if last is not None and last.state == "unloading" and spec.kind == "ollama":
                return result(
                    "busy", f"{said}; still listed as expired after {verify_s:g} s: Ollama frees "
                    "it when its in-flight requests end",
                )  # fmt: skip
            return result("not-freed", f"{said}; still {last.state if last else 'listed'} "
                          f"after {verify_s:g} s", 0)  # fmt: skip
        time.sleep(pause)  # servers have no unload notification: back off up to 0.1 s
        pause = min(pause * 2, 0.1)
    freed = _nvml_freed(settings, record, before, deadline)
    if freed is None:
        size = model.size_bytes if model.size_bytes is not None else record.bytes
        what = f"freed {format_size(size)}" if size is not None else "freed (size unknown)"
        return result("freed", f"{said}; {what} (the server's listing)", size)
    if freed <= 0:
        return result(
            "not-freed", f"{said}; gone from the listing but NVML shows no less memory", 0
        )
    return result("freed", f"{said}; freed {format_size(freed)} (NVML)", freed)


def _nvml_before(settings: Settings, record: Record) -> int | None:
    if record.pid <= 0:
        return None
    report = probe_devices(settings, tenants=[])
    dev = report.get(record.gpu)
    if dev is None or dev.source == "simulated":
        return None
    return devices.process_used_bytes(report, record.gpu, record.pid)


def _nvml_freed(
    settings: Settings, record: Record, before: int | None, deadline: float
) -> int | None:
    """Bytes NVML shows came back for the model's process (None: no NVML figure)."""
    if before is None:
        return None
    while True:
        report = probe_devices(settings, tenants=[])
        after = devices.process_used_bytes(report, record.gpu, record.pid) or 0
        if after < before or time.monotonic() >= deadline:
            return before - after
        time.sleep(0.1)  # NVML lags an unload; no notification to wait on
