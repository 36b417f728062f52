"""The governor's data: what it measures (Snapshot), remembers (State) and decides (Action).

All frozen records, so ``policy.decide`` is a pure function of them and a table test can
script any day of signals without a GPU.  Units are in the names; unknown values are None
and never cause an action.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpulock.core.foresight import Forecast

LEVELS = ("normal", "reduce", "evict-idle", "force-evict", "freeze")


@dataclass(frozen=True, slots=True)
class ResidentView:
    """A resident model as the policy needs it (from ``gpulock.residents.registry.Record``)."""

    id: str
    name: str
    gpu: int
    pid: int
    policy: str  # persistent | cold-start | pinned
    bytes: int | None
    in_use: bool
    last_used_wall: float
    owner_holds_lock: bool = False  # its process holds a GPU ticket: never force-evicted
    torch_allocated_bytes: int | None = None
    torch_reserved_bytes: int | None = None
    tenant: str | None = None  # a tenant's model (gpulock.tenants): the tenant's name
    idle_known: bool = True  # False: nobody knows its last use, so it is never "idle"
    min_idle_s: float | None = None  # its tenant's own min_idle; None: the watchdog's


@dataclass(frozen=True, slots=True)
class GpuSignals:
    index: int
    total_bytes: int | None
    used_bytes: int | None  # NVML, or the simulated count


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One pass's measurements.  ``local_minutes`` is the local time of day (0..1439)."""

    now_wall: float
    local_minutes: int
    gpus: tuple[GpuSignals, ...] = ()
    residents: tuple[ResidentView, ...] = ()
    psi_some_avg10: float | None = None  # % of time some task stalled on memory (10 s avg)
    psi_full_avg10: float | None = None
    swap_bytes_per_s: float | None = None  # swap in + out
    oom_reports: int = 0  # OOMs reported by residents since the last pass
    oom_kills: int | None = None  # the kernel's OOM kills since the last pass (/proc/vmstat)
    # Next uses and reload costs (gpulock.core.foresight); None: victims in the governor's own
    # order (``eviction.policy: lru``, or nothing could be gathered).
    forecast: Forecast | None = None


@dataclass(frozen=True, slots=True)
class ScheduleWindow:
    start_minutes: int  # local time of day, 0..1439
    end_minutes: int  # may be before start: the window crosses midnight
    threshold: float  # fraction of total memory, 0..1

    def contains(self, minutes: int) -> bool:
        if self.start_minutes == self.end_minutes:
            return True  # "00:00" to "00:00": the whole day
        if self.start_minutes < self.end_minutes:
            return self.start_minutes <= minutes < self.end_minutes
        return minutes >= self.start_minutes or minutes < self.end_minutes

    @property
    def length_minutes(self) -> int:
        return (self.end_minutes - self.start_minutes) % 1440 or 1440


@dataclass(frozen=True, slots=True)
class GovernorConfig:
    """Every threshold in one place; the defaults are the documented ones."""

    interval_s: float = 60.0
    # watchdog
    threshold: float = 0.85
    schedule: tuple[ScheduleWindow, ...] = ()
    min_idle_s: float = 600.0
    hysteresis: float = 0.05
    evict_unneeded: bool = False  # tight memory: persistent models not needed for long leave
    # governor ladder
    samples: int = 3  # a signal over its threshold this many passes in a row climbs a step
    cooldown_s: float = 300.0  # every signal clear this long walks a step down
    vram_pressure: float = 0.95  # used fraction
    fragmentation_bytes: int = 2 * 1024**3  # torch reserved - allocated, summed per GPU
    unregistered_bytes: int | None = None  # NVML used - registered; None: not a signal
    psi_some: float = 20.0  # avg10 %
    psi_full: float = 5.0
    swap_bytes_per_s: float = 32 * 1024**2
    oom_reports: int = 1
    oom_kills: int = 1  # kernel OOM kills in one pass: the ladder goes to evict-idle at once
    force_kill: bool = False  # terminate owners that ignore a force-evict past the grace
    grace_s: float = 10.0


@dataclass(frozen=True, slots=True)
class State:
    """What the governor remembers between passes."""

    level: str = "normal"
    level_since_wall: float = 0.0
    over: tuple[tuple[str, int], ...] = ()  # signal -> consecutive passes over threshold
    clear_since_wall: float | None = None  # every signal clear since then

    def over_count(self, signal: str) -> int:
        return dict(self.over).get(signal, 0)


@dataclass(frozen=True, slots=True)
class Action:
    """One thing to do, with why: every action becomes an event carrying its evidence."""

    kind: str  # "evict" | "force-evict" | "level"
    reason: str
    gpu: int | None = None
    resident: str | None = None  # resident id
    name: str | None = None
    bytes: int | None = None
    level: str | None = None  # for "level": the new level
    evidence: dict[str, float | int | str | None] = field(default_factory=dict)
