"""The governor's decisions, as one pure function: ``decide(snapshot, state, config, now)``.

Two duties:

**Watchdog.**  For each GPU whose used memory is known and above the threshold in force (the
config's ``threshold``, or that of the schedule window containing the local time of day; the
shortest such window wins; windows may cross midnight), evict idle models until the GPU is
projected under ``threshold - hysteresis``.  A model is a candidate when it is not pinned, not
in use and idle for at least ``min_idle``.

**Governor ladder.**  Signals, each against its threshold: VRAM used fraction per GPU,
fragmentation per GPU (torch reserved - allocated, summed over the residents that report it),
unregistered memory per GPU (used - what residents declare, when configured), host memory
pressure (PSI some/full avg10), swap traffic, OOM reports, kernel OOM kills.  A signal over
its threshold for ``samples`` passes in a row climbs one step of
``normal -> reduce -> evict-idle -> force-evict -> freeze``; after every signal has stayed
clear for ``cooldown`` the ladder walks one step down (and the cooldown starts again).  Each
level includes the actions of the levels below it:

* ``reduce`` -- published only: routers and residents shrink contexts and batches.
* ``evict-idle`` -- evict idle, unpinned models (no ``min_idle``), on every GPU whose signals
  are over (until projected under ``vram_pressure - hysteresis``) or one model per pass for a
  host-wide signal.
* ``force-evict`` -- the same, and in-use models too, unless their process holds a GPU ticket.
* ``freeze`` -- new GPU admissions wait (the lock reads the published level).

**Kernel OOM kills** (``oom_kill`` in ``/proc/vmstat`` went up since the last pass) are not a
trend to confirm over ``samples`` passes: the host already ran out of memory and the kernel
killed a process.  One pass with ``oom_kills`` or more sends the ladder straight to
``evict-idle`` (from any lower level), so idle models hand their memory back before the next
kill; it does not go to ``force-evict`` (that would kill work in progress on evidence that
says nothing about which process caused the shortage) nor to ``freeze``.  It then walks down
by the usual cooldown.

**Victims** are chosen by cost, never by name: cold-start models before persistent ones
(they declared that reloading is their way of life), then the longest idle first (least
likely to be needed soon), then the largest first (fewer evictions to reach the target).
Pinned models are never chosen.  Tenant models (``gpulock.tenants``) are chosen the same way;
one whose last use is unknown (``idle_known`` false) is never idle: only ``force-evict`` takes it.

Unknown signals (None) are neither over nor a reason to act: missing evidence never evicts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from gpulock.core import foresight
from gpulock.core.foresight import Forecast
from gpulock.governor.model import (
    LEVELS,
    Action,
    GovernorConfig,
    GpuSignals,
    ResidentView,
    Snapshot,
    State,
)

GPU_SIGNALS = ("vram", "fragmentation", "unregistered")
HOST_SIGNALS = ("psi_some", "psi_full", "swap", "oom", "oom_kill")


@dataclass(frozen=True, slots=True)
class Reading:
    """One signal's value against its threshold; ``over`` is None when the value is unknown."""

    name: str
    value: float | None
    threshold: float | None
    gpu: int | None = None

    @property
    def over(self) -> bool | None:
        if self.value is None or self.threshold is None:
            return None
        return self.value >= self.threshold

    @property
    def key(self) -> str:
        return self.name if self.gpu is None else f"{self.name}.gpu{self.gpu}"


def threshold_in_force(config: GovernorConfig, local_minutes: int) -> float:
    """The watchdog threshold at this local time of day: the shortest window that holds it."""
    windows = [w for w in config.schedule if w.contains(local_minutes)]
    if not windows:
        return config.threshold
    return min(windows, key=lambda w: w.length_minutes).threshold


def readings(snapshot: Snapshot, config: GovernorConfig) -> list[Reading]:
    """Every signal of this pass, known or not."""
    out: list[Reading] = []
    for g in snapshot.gpus:
        frac = g.used_bytes / g.total_bytes if g.used_bytes is not None and g.total_bytes else None
        out.append(Reading("vram", frac, config.vram_pressure, g.index))
        res = [r for r in snapshot.residents if r.gpu == g.index]
        frags = [
            r.torch_reserved_bytes - r.torch_allocated_bytes
            for r in res
            if r.torch_reserved_bytes is not None and r.torch_allocated_bytes is not None
        ]
        frag = sum(frags) if frags else None
        out.append(Reading("fragmentation", frag, config.fragmentation_bytes, g.index))
        if config.unregistered_bytes is not None and g.used_bytes is not None:
            # a resident of unknown size makes "what nobody declared" unknown too
            sizes = [r.bytes for r in res if r.bytes is not None]
            unreg = None if len(sizes) < len(res) else g.used_bytes - sum(sizes)
            out.append(Reading("unregistered", unreg, config.unregistered_bytes, g.index))
    out.append(Reading("psi_some", snapshot.psi_some_avg10, config.psi_some))
    out.append(Reading("psi_full", snapshot.psi_full_avg10, config.psi_full))
    out.append(Reading("swap", snapshot.swap_bytes_per_s, config.swap_bytes_per_s))
    out.append(Reading("oom", float(snapshot.oom_reports), float(config.oom_reports)))
    kills = None if snapshot.oom_kills is None else float(snapshot.oom_kills)
    out.append(Reading("oom_kill", kills, float(config.oom_kills)))
    return out


def victim_order(
    candidates: Iterable[ResidentView], now_wall: float, forecast: Forecast | None = None
) -> list[ResidentView]:
    """Cheapest to evict first.  With a ``forecast`` (``eviction.policy: foresight``): the
    model needed furthest ahead, weighted by its reload cost (``gpulock.core.foresight``);
    ties, and without one, cold-start, then longest idle, then largest."""

    def today(r: ResidentView) -> tuple[int, float, int]:
        idle = now_wall - r.last_used_wall
        return (0 if r.policy == "cold-start" else 1, -idle, -(r.bytes or 0))

    return foresight.order(candidates, model=lambda r: r.name, today=today, forecast=forecast)


def decide(
    snapshot: Snapshot, state: State, config: GovernorConfig, now_wall: float
) -> tuple[list[Action], State]:
    """What to do this pass, and what to remember for the next."""
    reads = readings(snapshot, config)
    evidence = _evidence(reads)
    state, level_actions = _ladder(reads, state, config, now_wall, evidence)
    actions: list[Action] = list(level_actions)
    chosen: set[str] = set()
    # Each GPU's used memory as projected after this pass's evictions; None once a model of
    # unknown size was taken there (the next pass measures again before going further).
    projected: dict[int, float | None] = {g.index: g.used_bytes for g in snapshot.gpus}
    fc = snapshot.forecast

    # The watchdog: thresholds by time of day, idle models only.
    limit = threshold_in_force(config, snapshot.local_minutes)
    for g in snapshot.gpus:
        if g.used_bytes is None or not g.total_bytes or g.used_bytes <= limit * g.total_bytes:
            continue
        target = (limit - config.hysteresis) * g.total_bytes
        idle = [
            r
            for r in _candidates(snapshot, g.index, force=False)
            if _idle_enough(r, config, now_wall)
        ]
        why = (
            f"gpu{g.index} {_pct(g.used_bytes / g.total_bytes)} used > {_pct(limit)} "
            f"threshold in force"
        )
        actions += _evict_until(
            g, target, idle, "evict", why, evidence, chosen, now_wall, projected, fc
        )

    # Keep-alive the other way (watchdog.evict_unneeded): memory is tight (within the
    # hysteresis under the threshold) and a persistent model is not expected for much longer
    # than its reload takes: it leaves now, before the threshold forces a worse choice.
    if config.evict_unneeded and fc is not None:
        actions += _unneeded(snapshot, fc, config, limit, evidence, chosen, now_wall, projected)

    # The ladder's own evictions, from evict-idle up.
    rank = LEVELS.index(state.level)
    if rank >= LEVELS.index("evict-idle"):
        force = rank >= LEVELS.index("force-evict")
        kind = "force-evict" if force else "evict"
        over_gpus = {x.gpu for x in reads if x.gpu is not None and x.over}
        for g in snapshot.gpus:
            if g.index not in over_gpus or g.used_bytes is None or not g.total_bytes:
                continue  # no target without a known total: missing evidence never evicts
            target = (config.vram_pressure - config.hysteresis) * g.total_bytes
            why = f"level {state.level}: gpu{g.index} signals over their thresholds"
            cands = _candidates(snapshot, g.index, force=force)
            actions += _evict_until(
                g, target, cands, kind, why, evidence, chosen, now_wall, projected, fc
            )
        if any(x.over for x in reads if x.gpu is None):
            host = [r for r in _candidates(snapshot, None, force=force) if r.id not in chosen]
            order = victim_order(host, now_wall, fc)
            if order:
                r = order[0]
                why = f"level {state.level}: host memory pressure"
                runner_up = order[1].id if len(order) > 1 else None
                actions.append(_evict_action(r, kind, why, evidence, fc, runner_up))
                chosen.add(r.id)
    return actions, state


def _unneeded(
    snapshot: Snapshot,
    fc: Forecast,
    config: GovernorConfig,
    limit: float,
    evidence: dict[str, float | int | str | None],
    chosen: set[str],
    now_wall: float,
    projected: dict[int, float | None],
) -> list[Action]:
    out: list[Action] = []
    for g in snapshot.gpus:
        used = projected.get(g.index)
        if used is None or not g.total_bytes:
            continue
        floor = (limit - config.hysteresis) * g.total_bytes
        if not floor < used <= limit * g.total_bytes:
            continue
        cands = [
            r
            for r in _candidates(snapshot, g.index, force=False)
            if r.policy == "persistent"
            and _idle_enough(r, config, now_wall)
            and fc.unneeded(r.name)
        ]
        why = (
            f"gpu{g.index} {_pct(used / g.total_bytes)} used, within {_pct(config.hysteresis)} "
            f"of the {_pct(limit)} threshold: no use expected for "
            f"{foresight.UNNEEDED_FACTOR:g}x its reload time"
        )
        out += _evict_until(
            g, floor, cands, "evict", why, evidence, chosen, now_wall, projected, fc
        )
    return out


def _idle_enough(r: ResidentView, config: GovernorConfig, now_wall: float) -> bool:
    """Idle for its own ``min_idle_s``, or the watchdog's."""
    min_idle = config.min_idle_s if r.min_idle_s is None else r.min_idle_s
    return now_wall - r.last_used_wall >= min_idle


def _candidates(snapshot: Snapshot, gpu: int | None, *, force: bool) -> list[ResidentView]:
    return [
        r
        for r in snapshot.residents
        if (gpu is None or r.gpu == gpu)
        and r.policy != "pinned"
        and (not r.in_use or (force and not r.owner_holds_lock))
        and (r.idle_known or force)
    ]


def _evict_until(
    g: GpuSignals,
    target_bytes: float,
    candidates: list[ResidentView],
    kind: str,
    why: str,
    evidence: dict[str, float | int | str | None],
    chosen: set[str],
    now_wall: float,
    projected: dict[int, float | None],
    forecast: Forecast | None = None,
) -> list[Action]:
    """Victims in cost order until the GPU is projected under ``target_bytes``.

    A model of unknown size frees an unknown amount: it is taken, but the projection does not
    move, so the next pass measures again before going further.
    """
    used = projected.get(g.index)
    out: list[Action] = []
    if used is None:
        return out
    order = victim_order((c for c in candidates if c.id not in chosen), now_wall, forecast)
    for i, r in enumerate(order):
        if used <= target_bytes:
            break
        runner_up = order[i + 1].id if i + 1 < len(order) else None
        out.append(_evict_action(r, kind, why, evidence, forecast, runner_up))
        chosen.add(r.id)
        if r.bytes is None:
            projected[g.index] = None
            return out
        used -= r.bytes
    projected[g.index] = used
    return out


def _evict_action(
    r: ResidentView,
    kind: str,
    why: str,
    evidence: dict[str, float | int | str | None],
    forecast: Forecast | None = None,
    runner_up: str | None = None,
) -> Action:
    if forecast is not None:  # why this victim: its next use and reload cost, and who was next
        evidence = {**evidence, **forecast.why(r.name), "runner_up": runner_up}
    return Action(
        kind=kind,
        reason=why,
        gpu=r.gpu,
        resident=r.id,
        name=r.name,
        bytes=r.bytes,
        evidence=evidence,
    )


def _ladder(
    reads: list[Reading],
    state: State,
    config: GovernorConfig,
    now_wall: float,
    evidence: dict[str, float | int | str | None],
) -> tuple[State, list[Action]]:
    over = {x.key: (state.over_count(x.key) + 1 if x.over else 0) for x in reads}
    rank = LEVELS.index(state.level)
    kills = next((x for x in reads if x.name == "oom_kill" and x.over), None)
    if kills is not None and rank < LEVELS.index("evict-idle"):
        new = "evict-idle"
        why = f"the kernel's OOM killer ran {kills.value:.0f} time(s) since the last pass"
        nxt = State(level=new, level_since_wall=now_wall, over=(), clear_since_wall=None)
        return nxt, [Action(kind="level", level=new, reason=why, evidence=evidence)]
    triggered = sorted(k for k, n in over.items() if n >= config.samples)
    if triggered and rank < len(LEVELS) - 1:
        new = LEVELS[rank + 1]
        why = f"over threshold for {config.samples} passes: {', '.join(triggered)}"
        nxt = State(level=new, level_since_wall=now_wall, over=(), clear_since_wall=None)
        return nxt, [Action(kind="level", level=new, reason=why, evidence=evidence)]
    counts = tuple(sorted((k, n) for k, n in over.items() if n))
    if counts:  # something is over, not yet for long enough: no cooldown runs
        return replace(state, over=counts, clear_since_wall=None), []
    clear_since = state.clear_since_wall if state.clear_since_wall is not None else now_wall
    if rank > 0 and now_wall - clear_since >= config.cooldown_s:
        new = LEVELS[rank - 1]
        clear_s = now_wall - clear_since
        why = f"every signal clear for {clear_s:.0f} s (cooldown {config.cooldown_s:g} s)"
        nxt = State(level=new, level_since_wall=now_wall, over=(), clear_since_wall=now_wall)
        return nxt, [Action(kind="level", level=new, reason=why, evidence=evidence)]
    return replace(state, over=(), clear_since_wall=clear_since), []


def _evidence(reads: list[Reading]) -> dict[str, float | int | str | None]:
    out: dict[str, float | int | str | None] = {}
    for x in reads:
        out[x.key] = None if x.value is None else round(x.value, 4)
        out[f"{x.key}.threshold"] = None if x.threshold is None else round(x.threshold, 4)
    return out


def _pct(fraction: float) -> str:
    return f"{fraction * 100:.0f}%"
