"""Asking a resident model's owner to let go, and checking the memory really came back.

``evict`` (and ``gpulock evict``), ``make_room`` (a waiter that needs room) and ``admit``
(before a load) are the requester's side of ``gpulock.residents.owner``; they talk to the owner's
control thread through ``gpulock.residents.control``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from gpulock.core import claim, devices
from gpulock.core import settings as settings_mod
from gpulock.core.config import Config
from gpulock.core.settings import Settings
from gpulock.core.units import format_size, parse_size
from gpulock.lock.room import TENANT_CALL as TENANT_CALL  # routers reach it here, a door
from gpulock.residents import control
from gpulock.residents.outcome import EvictResult
from gpulock.residents.owner import ResidentError
from gpulock.residents.registry import Record, Registry, all_records, probe_devices

MIN_ADMIT_RESERVE_BYTES = 800 * 1024**2  # CUDA context, driver and fragmentation headroom
VERIFY_S = 5.0  # how long a requester waits for freed memory to show (Ollama waits as long)


class AdmissionRefused(ResidentError):
    """Loading this much would eat into the GPU's reserve: refused before CUDA runs out."""

    def __init__(self, gpu: int, bytes_: int, free_bytes: int, reserve_bytes: int) -> None:
        self.gpu = gpu
        self.bytes = bytes_
        self.free_bytes = free_bytes
        self.reserve_bytes = reserve_bytes
        super().__init__(
            f"loading {format_size(bytes_)} on gpu{gpu} would leave "
            f"{format_size(max(free_bytes - bytes_, 0))} free, under the "
            f"{format_size(reserve_bytes)} reserve",
            hint="gpulock status shows what holds the memory; gpulock evict NAME frees idle models",
        )


def find(
    settings: Settings, target: str, *, gpu: int | None = None, tenant: str | None = None
) -> list[Record]:
    """Records whose id is ``target``, or whose model name is ``target``.

    Tenant models count (their id is ``TENANT/MODEL``); ``tenant`` keeps only that tenant's.
    """
    if tenant is not None:
        from gpulock.tenants.survey import find_spec

        find_spec(settings, tenant)  # an unknown tenant is an error listing the known ones
    recs = all_records(settings)
    hits = [r for r in recs if r.id == target] or [r for r in recs if r.name == target]
    return [
        r for r in hits
        if (gpu is None or r.gpu == gpu) and (tenant is None or r.tenant == tenant)
    ]  # fmt: skip


def evict(
    settings: Settings,
    record: Record,
    *,
    force: bool = False,
    timeout_s: float = 10.0,
    verify_s: float = VERIFY_S,
    reason: str = "requested",
    answer_s: float | None = None,
    why: dict[str, Any] | None = None,
) -> EvictResult:
    """Ask the owner to unload ``record``; then check the GPU's memory came back.

    ``answer_s``: how long to wait for the owner's answer (default ``timeout_s`` + 5 s: the
    owner's own deadline, then time to unload).  ``why``: why this victim (foresight's next
    use, reload cost, the runner-up), recorded in the ``evict`` event.
    """
    if record.tenant is not None:
        from gpulock.residents import tenant_evict

        return tenant_evict.evict(
            settings, record, force=force, timeout_s=timeout_s, reason=reason,
            verify_s=max(verify_s, min(tenant_evict.VERIFY_S, timeout_s)), why=why,
        )  # fmt: skip
    start = time.monotonic()
    reg = Registry(settings)

    def result(
        outcome: str, detail: str, freed: int | None = None, unverified: int | None = None
    ) -> EvictResult:
        """``freed``: bytes a probe saw come back; ``unverified``: what the model declared,
        where nothing could check it (in the event as ``declared_bytes``, never as freed)."""
        res = EvictResult(
            record.id, record.name, record.gpu, record.pid, outcome, detail, freed,
            round(time.monotonic() - start, 6),
        )  # fmt: skip
        declared = {"declared_bytes": unverified} if unverified is not None else {}
        settings.emit(
            "evict", resident=record.id, name=record.name, gpu=record.gpu, pid=record.pid,
            outcome=outcome, detail=detail, freed_bytes=freed, **declared,
            elapsed_s=res.elapsed_s, force=force, reason=reason, **(why or {}),
        )  # fmt: skip
        return res

    if not claim.held(reg.claim_path(record.owner)):
        reg.records()  # cleans it
        return result("owner-gone", "its owner had exited; record removed", unverified=record.bytes)
    before = _memory_of(settings, record)
    try:
        reply = control.ask(
            reg.socket_path(record.owner),
            {"op": "evict", "id": record.id, "force": force, "timeout_s": timeout_s},
            timeout_s + 5.0 if answer_s is None else answer_s,
        )
    except TimeoutError:
        return result("no-answer", f"owner pid {record.pid} did not answer in {timeout_s:g} s")
    except OSError as e:
        if not claim.held(reg.claim_path(record.owner)):
            return result("owner-gone", "its owner exited meanwhile", unverified=record.bytes)
        return result("no-answer", f"control socket: {e.strerror or e}")
    if not reply.get("ok"):
        return result(str(reply.get("outcome", "refused")), str(reply.get("detail", "")))
    freed = _verify_freed(settings, record, before, verify_s)
    if freed is None:
        said = reply.get("bytes")
        return result(
            "unloaded", "unloaded; no memory probe to verify",
            unverified=said if isinstance(said, int) else record.bytes,
        )  # fmt: skip
    if freed <= 0:
        return result("not-freed", "unloaded but memory not freed", 0)
    return result("freed", f"freed {format_size(freed)}", freed)


def _memory_of(settings: Settings, record: Record) -> int | None:
    """Memory the owner uses on the record's GPU: NVML per process, or the simulated count.

    Tenants are left out of the simulated count: asking them over HTTP on every poll would
    only add their noise to this owner's before and after.
    """
    report = probe_devices(settings, tenants=[])
    dev = report.get(record.gpu)
    if dev is None:
        return None
    if dev.source == "simulated":
        return dev.used_bytes
    return devices.process_used_bytes(report, record.gpu, record.pid)


def _verify_freed(
    settings: Settings, record: Record, before: int | None, wait_s: float
) -> int | None:
    """Bytes that came back (None: cannot tell).  NVML lags an unload: poll up to ``wait_s``."""
    if before is None:
        return None
    deadline = time.monotonic() + wait_s
    pause = 0.01
    while True:
        after = _memory_of(settings, record)
        if after is None:
            return None
        if after < before or time.monotonic() >= deadline:
            return before - after
        time.sleep(pause)  # NVML has no notification: back off up to 0.2 s
        pause = min(pause * 2, 0.2)


def make_room(
    settings: Settings,
    gpu: int,
    need_bytes: int,
    *,
    exclude_pid: int,
    timeout_s: float = 10.0,
    reason: str = "room for a waiter",
    keep_ids: frozenset[str] = frozenset(),
    name: str | None = None,
) -> list[EvictResult]:
    """Evict idle, unpinned models of other processes until ``need_bytes`` are free.

    Victims in ``victim_order``: by foresight (the model needed last, weighted by its reload
    cost) or, under ``eviction.policy: lru``, cold-start models before persistent ones, then
    least recently used first.  In-use and pinned models are never chosen.  Tenant models
    (``gpulock.tenants``) are victims like any other.  Under foresight, the models the
    ticket ``name`` is known to call (its agent's past ``call`` events) that are resident
    already count toward its need and stay, like its own process's models.  ``timeout_s``
    bounds the whole attempt, not each eviction.  Returns what was tried; nothing when the
    GPU's free memory is unknown.
    """
    tenants = _tenant_records(settings)
    dev = probe_devices(settings, tenants=tenants).get(gpu)
    if dev is None or dev.free_bytes is None:
        return []
    records = Registry(settings).records() + tenants
    # The requester's own models are in memory already: a persistent model's next call needs
    # no room for itself, so nobody else's idle model should pay for it.
    # (A tenant's model is the server's, whatever process the server happens to be.)
    mine = [r for r in records if r.gpu == gpu and r.pid == exclude_pid and r.tenant is None]
    # Likewise the models this ticket's agent is about to call, when they are loaded already.
    expected = [r for r in _expected(settings, name, records, gpu) if r not in mine]
    keep_ids = keep_ids | {r.id for r in expected}
    own = sum(r.bytes or 0 for r in mine + expected)
    short = need_bytes - dev.free_bytes - own
    if short <= 0:
        return []
    cands = [
        r
        for r in records
        if r.gpu == gpu and (r.pid != exclude_pid or r.tenant is not None) and r.id not in keep_ids
    ]
    victims, whys = victim_order(settings, cands, gpu, room_bytes=short)
    deadline = time.monotonic() + timeout_s  # for all of them: the waiter has a deadline
    silent: set[str] = set()  # owners that did not answer are not asked again
    results = []
    for i, r in enumerate(victims):
        left = deadline - time.monotonic()
        if short <= 0 or left <= 0:
            break
        if r.owner in silent:
            continue
        res = evict(
            settings, r, timeout_s=left / 2, answer_s=left, verify_s=min(VERIFY_S, left),
            reason=reason, why=whys[i],
        )  # fmt: skip
        results.append(res)
        if res.outcome == "no-answer":
            silent.add(r.owner)
        if res.ok:
            short -= res.freed_bytes or r.bytes or 0
    return results


def _expected(
    settings: Settings, name: str | None, records: list[Record], gpu: int
) -> list[Record]:
    """The resident models on ``gpu`` that the ticket ``name`` is known to call (foresight)."""
    if not name or not records:
        return []
    from gpulock.core import foresight

    if foresight.policy_of(settings.config) != "foresight":
        return []
    from gpulock.residents.foresight_inputs import model_key
    from gpulock.residents.foresight_past import read_past

    models = read_past(settings.state_dir, mode=settings.file_mode).models_of.get(name, set())
    return [r for r in records if r.gpu == gpu and model_key(r) in models]


def today_key(r: Record) -> tuple[bool, float]:
    """The order before foresight, and its tie-break: cold-start first, then least recently
    used."""
    return (r.policy != "cold-start", r.last_used_wall)


def victim_order(
    settings: Settings, records: list[Record], gpu: int, *, room_bytes: int | None = None
) -> tuple[list[Record], list[dict[str, Any]]]:
    """Idle, unpinned ``records`` in the order to evict them (``eviction.policy``: by foresight,
    ``gpulock.core.foresight``, or least recently used), each with why it is there: the
    ``evict`` event's ``policy``, ``next_use_s``, ``next_use_source``, ``reload_s`` and the
    ``runner_up``.  ``room_bytes``: the bytes to free, when known (foresight then puts the
    cheapest set that frees them first)."""
    from gpulock.core import foresight

    policy = foresight.policy_of(settings.config)
    cands = [r for r in records if r.policy != "pinned" and not r.in_use]
    fc = None
    if policy == "foresight" and len(cands) > 1:
        from gpulock.residents.foresight_inputs import gather, model_key

        fc = gather(settings, cands, [gpu])
        order = foresight.order(
            cands, model=model_key, today=today_key, forecast=fc, room_bytes=room_bytes,
            size=lambda r: r.bytes,
        )  # fmt: skip
    else:
        order = sorted(cands, key=today_key)
    # A model a pre-warm loaded ahead, not used since, is the first to go: a guess gives way
    # to any real need (a ticket's own models are not candidates: make_room keeps them).
    ahead: dict[str, float] = {}
    if any(r.tenant is not None for r in order):
        from gpulock.residents.prewarm_state import loaded_ahead

        ahead = loaded_ahead(settings)
    if ahead:
        order = [r for r in order if r.id in ahead] + [r for r in order if r.id not in ahead]
    whys: list[dict[str, Any]] = []
    for i, r in enumerate(order):
        why: dict[str, Any] = {"policy": policy}
        if fc is not None:
            why.update(fc.why(r.name))
        if r.id in ahead:
            why["prewarm"] = "loaded ahead, not used yet: undone first"
        why["runner_up"] = order[i + 1].id if i + 1 < len(order) else None
        whys.append(why)
    return order, whys


def _tenant_records(settings: Settings) -> list[Record]:
    if not settings.config.tenants:
        return []
    from gpulock.residents.registry import tenant_records

    return tenant_records(settings)


def clear_gpu(
    settings: Settings,
    gpu: int,
    *,
    tenants: bool = True,
    residents: bool = True,
    exclude_pid: int | None = None,
    timeout_s: float = 10.0,
    reason: str = "exclusive grant",
    keep_ids: frozenset[str] = frozenset(),
) -> tuple[list[EvictResult], list[dict[str, str]]]:
    """Unload every idle, unpinned model on ``gpu``: an exclusive holder's GPU is its own.

    ``tenants``: the servers' models; ``residents``: library residents (a ``gpulock.resident``,
    ``gpulock serve``'s models), except those of ``exclude_pid``'s own process.  Each unload
    is verified (``evict``).  Returns what was tried and what stays (``{"id", "why"}``:
    pinned, busy, or the failed outcome; ``tenant``: its tenant's name, "" for a library
    resident), for the grant's event.
    """
    results: list[EvictResult] = []
    kept: list[dict[str, str]] = []
    deadline = time.monotonic() + timeout_s
    records = (_tenant_records(settings) if tenants else []) + (
        Registry(settings, create=False).records() if residents else []
    )
    records = [
        r for r in records if r.gpu == gpu and (r.tenant is not None or r.pid != exclude_pid)
    ]
    # All of them leave, but the deadline may cut the list: the most expendable go first.
    order, whys = victim_order(settings, [r for r in records if r.id not in keep_ids], gpu)
    rank = {r.id: i for i, r in enumerate(order)}
    records.sort(key=lambda r: rank.get(r.id, -1))
    for r in records:
        if r.id in keep_ids:
            kept.append({"id": r.id, "tenant": r.tenant or "", "why": "called by this ticket"})
            continue
        if r.policy == "pinned":
            kept.append({"id": r.id, "tenant": r.tenant or "", "why": "pinned"})
            continue
        if r.in_use:
            kept.append({"id": r.id, "tenant": r.tenant or "", "why": "busy"})
            continue
        left = deadline - time.monotonic()
        if left <= 0:
            kept.append({"id": r.id, "tenant": r.tenant or "", "why": "no time left"})
            continue
        verify_s = left if r.tenant is not None else min(VERIFY_S, left)
        res = evict(
            settings, r, timeout_s=left, verify_s=verify_s, reason=reason, why=whys[rank[r.id]]
        )
        results.append(res)
        if not res.ok:
            kept.append({"id": r.id, "tenant": r.tenant or "", "why": res.outcome})
    return results, kept


def evict_named(
    target: str,
    *,
    gpu: int | None = None,
    force: bool = False,
    timeout: float | str = 10.0,
    config: Config | str | None = None,
    state_dir: str | os.PathLike[str] | None = None,
) -> list[EvictResult]:
    """``gpulock evict`` in Python: ask the owners of model ``target`` (a name or an id)."""
    from gpulock.core.units import parse_duration

    settings = settings_mod.load(config, state_dir)
    timeout_s = parse_duration(timeout, key="timeout")
    return [
        evict(settings, r, force=force, timeout_s=timeout_s)
        for r in find(settings, target, gpu=gpu)
    ]


def admit(
    bytes: int | str,
    gpu: int | None = None,
    *,
    config: Config | str | None = None,
    state_dir: str | os.PathLike[str] | None = None,
) -> int | None:
    """Refuse (AdmissionRefused) a load that would leave less than the reserve free.

    The reserve is max(800 MiB, the config's ``reserve``).  Returns the free bytes seen, or
    None when the GPU's memory is unknown (then nothing can be checked and the load goes on).
    """
    settings = settings_mod.load(config, state_dir)
    gpu_i = settings.config.default_gpu if gpu is None else gpu
    size = parse_size(bytes, key="bytes")
    dev = probe_devices(settings).get(gpu_i)
    if dev is None or dev.total_bytes is None or dev.free_bytes is None:
        return None
    reserve = max(MIN_ADMIT_RESERVE_BYTES, settings.config.reserve_bytes(dev.total_bytes))
    if dev.free_bytes - size < reserve:
        raise AdmissionRefused(gpu_i, size, dev.free_bytes, reserve)
    return dev.free_bytes
