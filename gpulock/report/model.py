"""The report's records: what ``build`` makes of an event log, and what the page draws.

Frozen, slotted dataclasses; ``*_wall`` are epoch seconds, ``*_s`` durations in seconds.
``summary`` turns the tables (not the drawing data) into the ``--json`` object.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Point = tuple[float, float]
Row = tuple[str, int | None, str]  # a timeline row: (lane, gpu, name)


@dataclass(frozen=True, slots=True)
class Hold:
    """One holder's time on a GPU.  ``end``: release | cleanup | break | open (no end logged)."""

    gpu: int | None
    ticket: int | None
    name: str
    start_wall: float
    end_wall: float
    need_bytes: int | None
    end: str
    killed: bool = False  # a ``kill`` event named it
    why: str = ""  # the reason the cleanup/break/kill gave

    @property
    def cut_short(self) -> bool:
        return self.end != "release" or self.killed


@dataclass(frozen=True, slots=True)
class Wait:
    """One waiter's time in line.  ``end``: acquire | timeout | cleanup | break | open."""

    gpu: int | None
    ticket: int | None
    name: str
    start_wall: float
    end_wall: float
    end: str


@dataclass(frozen=True, slots=True)
class Residency:
    """A resident model in VRAM.  ``end``: evict | cleanup | unload | open."""

    gpu: int | None
    resident: str
    name: str
    start_wall: float
    end_wall: float
    declared_bytes: int | None
    end: str


@dataclass(frozen=True, slots=True)
class Marker:
    """A moment worth a symbol.  ``lane``: holder | resident | governor (the row it sits on)."""

    kind: str
    at_wall: float
    gpu: int | None
    lane: str
    name: str
    text: str


@dataclass(frozen=True, slots=True)
class LevelSpan:
    level: str
    start_wall: float
    end_wall: float


@dataclass(frozen=True, slots=True)
class GpuSeries:
    """Step series (value from each point's time until the next) of one GPU, and samples."""

    gpu: int
    queue: tuple[Point, ...]
    held_bytes: tuple[Point, ...]
    resident_bytes: tuple[Point, ...]
    used_fraction: tuple[Point, ...]  # governor's measurements: samples, not steps
    exclusive: tuple[tuple[float, float], ...]  # holds without a need: the whole GPU


@dataclass(frozen=True, slots=True)
class HolderStats:
    name: str
    runs: int
    waits_p50_s: float | None
    waits_p99_s: float | None
    timeouts: int
    held_s: float
    cut_short: int


@dataclass(frozen=True, slots=True)
class AgentStats:
    agent: str
    runs: int
    ok: int
    skip: int
    error: int
    other: int  # any other outcome (the runtime's "stop", say)
    duration_p50_s: float | None
    last_reason: str


@dataclass(frozen=True, slots=True)
class TierStats:
    tier: str  # "none": a route that found no model
    routes: int
    calls: int
    failed: int  # calls with ok false
    tokens_in: int
    tokens_out: int
    cost_usd: float
    latency_p50_s: float | None


@dataclass(frozen=True, slots=True)
class ModelStats:
    model: str
    tier: str
    calls: int
    failed: int
    tokens_in: int
    tokens_out: int
    cost_usd: float
    latency_p50_s: float | None
    latency_p99_s: float | None


@dataclass(frozen=True, slots=True)
class Totals:
    handoffs: int = 0  # acquires
    waits: int = 0
    waits_p50_s: float | None = None
    waits_p99_s: float | None = None
    timeouts: int = 0
    cut_short: int = 0
    held_s: float = 0.0
    evictions: int = 0
    evictions_freed: int = 0
    level_changes: int = 0
    level_now: str | None = None
    agent_runs: int = 0
    agent_ok: int = 0
    agent_skips: int = 0
    agent_errors: int = 0
    agent_other: int = 0
    missed_fires: int = 0  # fleet-missed: scheduled runs the fleet dropped
    missed_late: int = 0  # ...because they could not start within misfire_grace
    route_choices: int = 0
    calls: int = 0
    calls_failed: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    cost_usd: float = 0.0


@dataclass(frozen=True, slots=True)
class ReportData:
    """Everything the page shows; ``start_wall`` is None when no event lies in the window."""

    start_wall: float | None
    end_wall: float | None
    since_wall: float | None
    events: int  # events in the window
    ignored: int  # records that were not events (no kind, no time)
    gpus: tuple[int, ...] = ()
    holds: tuple[Hold, ...] = ()
    waits: tuple[Wait, ...] = ()
    residencies: tuple[Residency, ...] = ()
    markers: tuple[Marker, ...] = ()
    levels: tuple[LevelSpan, ...] = ()
    series: tuple[GpuSeries, ...] = ()
    holders: tuple[HolderStats, ...] = ()
    agents: tuple[AgentStats, ...] = ()
    tiers: tuple[TierStats, ...] = ()
    models: tuple[ModelStats, ...] = ()
    totals: Totals = field(default_factory=Totals)
    kinds: tuple[tuple[str, int], ...] = ()
