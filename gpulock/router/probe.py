"""What this machine looks like now, as the chooser's ``Host``: the I/O half of the router.

Reads the GPUs (simulated or NVML, through ``gpulock.residents.registry.probe_devices``), each
GPU's line (holders and waiters, through ``gpulock.status.line``), recent hold times from the
tail of the event log (for the wait estimate), the governor's published level, the ledger
(cooldowns, spend, requests), which API-key variables are set, which model files exist, and the
models already loaded in this process.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from gpulock import status
from gpulock.core import events, level, statefile
from gpulock.core import gguf as gguf_info
from gpulock.core.errors import StateDirError
from gpulock.core.settings import Settings
from gpulock.residents import registry
from gpulock.router import gguf_cache, ledger, tools
from gpulock.router.choose import GpuView, Host, cid
from gpulock.router.routes import Candidate, RouterSettings
from gpulock.router.tools import ToolSupport
from gpulock.router.waitest import HoldHistory, Queued, estimate_wait, history_from

TAIL_BYTES = 64 * 1024  # enough for the last few hundred events
MAX_HOLD_S = 365 * 86400.0  # a longer held_s in the log is garbage


def recent_holds(state_dir: Path, gpu: int) -> list[tuple[str, float]]:
    """``(name, held_s)`` of the ``release`` events of ``gpu`` in the log's tail, newest last.

    The log is read like every state file: a symlink or a FIFO in its place is not followed or
    waited on (no history then), and a ``held_s`` no hold can have (negative, NaN, infinite,
    longer than a year) is skipped rather than let one line drag the estimate anywhere.
    """
    try:
        tail = statefile.read_tail(events.log_path(state_dir), TAIL_BYTES)
    except (OSError, StateDirError):
        return []
    holds: list[tuple[str, float]] = []
    for line in (tail or b"").splitlines():
        if b'"release"' not in line:
            continue
        try:
            e = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if not isinstance(e, dict):
            continue
        held = e.get("held_s")
        if (
            e.get("event") == "release"
            and e.get("gpu") == gpu
            and isinstance(held, int | float)
            and not isinstance(held, bool)
            and 0 <= held <= MAX_HOLD_S  # False for NaN as well
        ):
            name = e.get("name")
            holds.append((name if isinstance(name, str) else "", float(held)))
    return holds


def hold_history(state_dir: Path, gpu: int, default_s: float) -> HoldHistory:
    """The GPU's recent holds per ticket name, for gpulock.router.waitest."""
    return history_from(recent_holds(state_dir, gpu), default_s)


def vram_estimator(
    tenant_sizes: Mapping[str, int] | None = None, settings: Settings | None = None
) -> Callable[[Candidate], int | None]:
    """VRAM of a candidate: its ``vram:``; a tenant's model, from ``tenant_sizes``
    (``TENANT/MODEL`` -> bytes, as the tenants report the models they hold); else from its GGUF
    header (cached in the state folder when ``settings`` is given: a cron process then does not
    parse the header)."""

    def vram_of(c: Candidate) -> int | None:
        if c.vram_bytes is not None:
            return c.vram_bytes
        if c.tenant is not None:
            return (tenant_sizes or {}).get(f"{c.tenant}/{c.model}")
        if not c.local:
            return None
        try:
            if settings is None:
                info = gguf_info.read_info(c.model)
            else:
                info = gguf_cache.read_info_cached(settings, c.model)
        except (OSError, gguf_info.GGUFError):
            return None
        return gguf_info.estimate_vram(info, n_ctx=c.n_ctx, n_gpu_layers=c.n_gpu_layers)

    return vram_of


def host(
    settings: Settings,
    candidates: Sequence[Candidate],
    rs: RouterSettings,
    *,
    warm: set[str] | None = None,
    environ: Mapping[str, str] | None = None,
    now_wall: float | None = None,
    led: ledger.Ledger | None = None,
    level_now: str | None = None,
) -> Host:
    """What this machine has now for ``candidates``.  ``led``: the ledger as the caller keeps
    it (``gpulock.router.books``; else read from its file); ``level_now``: the governor's level
    as the caller knows it (else read)."""
    now = time.time() if now_wall is None else now_wall
    env = os.environ if environ is None else environ
    gpus: list[GpuView] = []
    problem = None
    tenant_warm: set[str] = set()
    tenant_sizes: dict[str, int] = {}
    trecs: list[registry.Record] | None = None
    if any(c.tenant is not None for c in candidates):
        # Which tenant models are held now (warm) and their sizes: one survey, also used
        # for the GPUs' used memory below.
        trecs = registry.tenant_records(settings)
        for r in trecs:
            tenant_warm.add(f"tenant:{r.id}")
            if r.bytes is not None:
                tenant_sizes[r.id] = r.bytes
    if any(c.tier == "gpu" for c in candidates):
        report = registry.probe_devices(settings, tenants=trecs)
        problem = report.problem
        for d in report.devices:
            gpus.append(
                _gpu_view(settings, d.index, d.total_bytes, d.free_bytes, rs, now, d.used_bytes)
            )
    keys = {c.api_key_env for c in candidates if c.api_key_env}
    if led is None:
        led = ledger.read(settings, now_wall=now)
    vram_of = vram_estimator(tenant_sizes, settings)
    return Host(
        gpus=tuple(gpus),
        gpu_problem=problem,
        level=level.current(settings) if level_now is None else level_now,
        warm=frozenset((warm or set()) | tenant_warm),
        env=frozenset(k for k in keys if env.get(k)),
        missing_files=frozenset(c.model for c in candidates if c.local and not _file(c.model)),
        spend_today_usd=dict(led.spend_usd),
        daily_budget_usd=rs.daily_budget_usd,
        cooldown_until=_cooldowns(settings, led),
        requests_last_min=led.requests_last_min(now),
        now_wall=now,
        vram_of=vram_of,
        tools_of=tools_prober(settings),
    )


def tools_prober(settings: Settings) -> Callable[[Candidate], ToolSupport]:
    """Whether a candidate can call tools: its tenant's kind from the config, a llama.cpp
    model's chat template from its GGUF header (read only when asked, cached per file)."""
    kinds = {t.name: t.kind for t in settings.config.tenants}

    def tools_of(c: Candidate) -> ToolSupport:
        template = None
        if c.backend == "llama_cpp" and c.tools is None:
            template = gguf_info.read_chat_template(c.model)
        return tools.support(c, tenant_kind=kinds.get(c.tenant or ""), template=template)

    return tools_of


def _cooldowns(settings: Settings, led: ledger.Ledger) -> dict[str, tuple[float, str]]:
    """This host's cooldowns, and in a cluster every host's (the later end wins)."""
    mine = led.cooldown_until()
    if settings.config.section("cluster") is None:
        return mine
    from gpulock.router import peers

    for key, (until, why) in peers.shared_cooldowns(settings).items():
        if until > mine.get(key, (0.0, ""))[0]:
            mine[key] = (until, why)
    return mine


def _file(path: str) -> bool:
    return os.path.isfile(path)


def _gpu_view(
    settings: Settings,
    index: int,
    total: int | None,
    free: int | None,
    rs: RouterSettings,
    now: float,
    used: int | None = None,
) -> GpuView:
    """One GPU as the router sees it: its line, and its free memory as ``gpulock status``
    shows it (``status.free_bytes``: what the holders claim counts, an exclusive holder's
    whole GPU), less the configured reserve for a newcomer's fit."""
    reserve = settings.config.reserve_bytes(total) if total is not None else None
    budget = total - reserve if total is not None and reserve is not None else None
    tickets = status.line(settings, index)
    holding = [t for t in tickets if t.holding]
    claimed: int | None = sum(t.need_bytes or 0 for t in holding)
    if any(t.need_bytes is None for t in holding):
        claimed = total  # an exclusive holder claims the whole GPU
    if used is None and free is not None and total is not None:
        used = total - free
    shown = status.free_bytes(total, used, claimed, free)
    free = shown
    if free is not None and reserve is not None:
        free = max(0, free - reserve)
    line: list[Queued] = []
    shared: int | None = 0  # the holders' needs, while a newcomer could share (queue.decide)
    for t in tickets:
        if t.holding and t.granted_wall is not None:
            line.append(Queued(t.name, t.need_bytes, max(0.0, now - t.granted_wall)))
            if shared is not None and t.need_bytes is not None:
                shared += t.need_bytes
            else:
                shared = None  # an exclusive holder
        else:
            line.append(Queued(t.name, t.need_bytes))
            shared = None  # a waiter ahead: FIFO, nobody overtakes it
    # Holders first, as the lock plays them: scan() is in ticket order, holders are oldest.
    line.sort(key=lambda q: q.held_s is None)
    if not line:
        return GpuView(index, total, budget, free, 0, 0.0, shared, shown_free_bytes=shown)
    history = hold_history(settings.state_dir, index, rs.hold_estimate_s)
    wait = estimate_wait(line, history, budget_bytes=budget)  # an exclusive newcomer's
    return GpuView(
        index, total, budget, free, len(line), wait, shared, tuple(line), history,
        shown_free_bytes=shown, claimed_bytes=claimed,
    )  # fmt: skip


def warm_models() -> set[str]:
    """cids of the models loaded in this process (none unless the llama backend was used)."""
    import sys

    mod = sys.modules.get("gpulock.router.backends.llama_cpp")
    if mod is None:
        return set()
    loaded: set[str] = mod.loaded_models()
    return loaded


__all__ = ["cid", "hold_history", "host", "recent_holds", "warm_models"]
