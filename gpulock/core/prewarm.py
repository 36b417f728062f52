"""Pre-warm: a model confidently needed within ``prewarm.lead`` starts warm.  The decision, pure.

Foresight (``gpulock.core.foresight``) knows when each model is needed next.  For a model that
is *not* loaded and whose next use is within ``lead`` (default 2 minutes) with confidence at
least ``min_confidence`` (default 0.8: a crontab or fleet fire, a waiter, a steady rhythm or
session), ``plan`` returns what to do ahead of time, soonest use first:

* **page-cache**: read the model's file (known from its past ``model-load`` events) into the
  page cache, when no ticket holds or waits on any GPU (a pre-warm yields to every real job),
  the disk is idle (busy less than ``DISK_BUSY`` of the last interval, or unknown), and memory
  allows: the bytes still to read, times ``margin``, must fit in ``MemAvailable`` less what the
  files of models needed *sooner* hold in the cache, so warming never pushes out a model
  needed before this one.  One file at a time.
* **load**: ask the tenant that will serve the job (the one its past calls went to) to load the
  model, when that GPU is idle (no ticket holds or waits on it) and its free memory less the
  reserve holds the model's known size: a pre-warm never evicts anything.  One load at a time;
  its file is read into the page cache beside it where known (a llama.cpp server maps its file
  and reads it on the first request, not at the load).

Both yield: a page-cache read stops between chunks when a ticket appears; a load ahead is the
first victim when room is needed, until its job has used it (``gpulock.residents.eviction``).
The acting side is ``gpulock.residents.prewarm`` (driven by the governor's loop).

The ``prewarm:`` config section::

    prewarm:
      enabled: true        # default true; false: the governor never warms ahead
      lead: 2m             # warm what is needed within this long
      min_confidence: 0.8  # how sure the prediction must be (0..1)
      margin: 1.5          # MemAvailable must hold the bytes to read times this
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

from gpulock.core.nextuse import NextUse

DEFAULTS: Final[Mapping[str, Any]] = {
    "enabled": True,
    "lead": "2m",
    "min_confidence": 0.8,
    "margin": 1.5,
}
DISK_BUSY: Final = 0.5  # the disk counts as busy past this share of the last interval
CACHED_ENOUGH: Final = 0.98  # a file this much in the cache needs no warming
HOWS: Final = ("page-cache", "load")


class ConfigLike(Protocol):
    """What ``options`` reads of ``gpulock.core.config.Config``."""

    def section(self, name: str) -> Any: ...

    def error(self, key: str, problem: str, hint: str | None = None) -> Exception: ...


@dataclass(frozen=True, slots=True)
class Options:
    """The ``prewarm:`` section, validated."""

    enabled: bool = True
    lead_s: float = 120.0
    min_confidence: float = 0.8
    margin: float = 1.5


def options(config: ConfigLike) -> Options:
    """The ``prewarm:`` section of ``config``; a bad value is a ConfigError (file:line:key)."""
    from gpulock.core.errors import known_hint, show_value
    from gpulock.core.units import parse_duration

    raw = config.section("prewarm")
    if raw is None:
        return Options()
    if not isinstance(raw, dict):
        raise config.error(
            "prewarm", f"expected a mapping (lead, min_confidence...), got {show_value(raw)}"
        )
    for key in raw:
        if key not in DEFAULTS:
            raise config.error(
                f"prewarm.{key}", f"unknown key {key!r}", hint=known_hint(key, sorted(DEFAULTS))
            )
    enabled = raw.get("enabled", DEFAULTS["enabled"])
    if not isinstance(enabled, bool):
        raise config.error("prewarm.enabled", f"expected true or false, got {show_value(enabled)}")
    lead = raw.get("lead", DEFAULTS["lead"])
    try:
        if isinstance(lead, bool):
            raise ValueError(show_value(lead))
        lead_s = parse_duration(lead, key="prewarm.lead")
    except (ValueError, TypeError):
        raise config.error(
            "prewarm.lead", f"expected a duration like 2m, got {show_value(lead)}"
        ) from None
    if lead_s <= 0:
        raise config.error("prewarm.lead", f"expected a duration above 0, got {show_value(lead)}")
    conf = raw.get("min_confidence", DEFAULTS["min_confidence"])
    if not isinstance(conf, int | float) or isinstance(conf, bool) or not 0 < conf <= 1:
        raise config.error(
            "prewarm.min_confidence",
            f"expected a number above 0 and at most 1, got {show_value(conf)}",
            hint="0.95: a crontab or fleet fire; 0.9 at most: a rhythm; 0.6: a time of day",
        )
    margin = raw.get("margin", DEFAULTS["margin"])
    if not isinstance(margin, int | float) or isinstance(margin, bool) or not margin >= 1.0:
        raise config.error(
            "prewarm.margin", f"expected a number >= 1 (1.5: the file and half again), "
            f"got {show_value(margin)}",
        )  # fmt: skip
    return Options(enabled, float(lead_s), float(conf), float(margin))


@dataclass(frozen=True, slots=True)
class Candidate:
    """A model that is not loaded: when it is needed next, and where it would come from."""

    model: str
    next_use: NextUse
    bytes: int | None = None  # its size in memory (on the GPU), when known
    path: str | None = None  # its file, when known (from its past loads)
    file_bytes: int | None = None
    cached_fraction: float | None = None  # of the file in the page cache; None: unknown
    tenant: str | None = None  # the server its jobs called (it can load ahead)
    gpu: int | None = None


@dataclass(frozen=True, slots=True)
class World:
    """What the machine looks like now, as far as pre-warming cares."""

    now_wall: float
    mem_available_bytes: int | None = None
    disk_busy: float | None = None  # share of the last interval the disk was busy; None: unknown
    busy_gpus: frozenset[int] = frozenset()  # a ticket holds or waits on them
    gpu_free_bytes: Mapping[int, int | None] | None = None  # free less the reserve; None: unknown
    warming: frozenset[tuple[str, str]] = frozenset()  # (model, how) in progress


@dataclass(frozen=True, slots=True)
class Warm:
    """One thing to do ahead of time, with the prediction that caused it."""

    model: str
    how: str  # page-cache | load
    next_use_wall: float
    source: str  # the prediction's: cron, fleet, waiter, rhythm, session...
    label: str  # who is expected to use it
    confidence: float
    path: str | None = None
    tenant: str | None = None
    gpu: int | None = None
    bytes: int | None = None  # to read (page-cache) or to load

    def why(self, now_wall: float) -> dict[str, Any]:
        """The prediction, for the ``prewarm`` event and ``gpulock status``."""
        return {
            "next_use_wall": round(self.next_use_wall, 3),
            "next_use_s": round(max(self.next_use_wall - now_wall, 0.0), 3),
            "next_use_source": self.source,
            "next_use_by": self.label or None,
            "confidence": round(self.confidence, 3),
        }


@dataclass(frozen=True, slots=True)
class Skip:
    """A model due soon that is not warmed now, and why (for ``gpulock status``)."""

    model: str
    how: str
    reason: str


def due(c: Candidate, now_wall: float, opts: Options) -> bool:
    """Whether ``c`` is confidently needed within the lead."""
    nu = c.next_use
    return (
        nu.at_wall is not None
        and nu.confidence >= opts.min_confidence
        and now_wall - 1.0 <= nu.at_wall <= now_wall + opts.lead_s
    )


def plan(cands: Sequence[Candidate], world: World, opts: Options) -> tuple[list[Warm], list[Skip]]:
    """What to warm now (soonest use first) and what not, with why."""
    if not opts.enabled:
        return [], []
    soon = sorted(
        (c for c in cands if due(c, world.now_wall, opts)),
        key=lambda c: (c.next_use.at_wall or 0.0, c.model),
    )
    out: list[Warm] = []
    skips: list[Skip] = []
    reading = any(how == "page-cache" for _, how in world.warming)
    loading = any(how == "load" for _, how in world.warming)
    held_sooner = 0  # cache bytes of the files of models needed before this one
    for c in soon:
        nu = c.next_use
        at = nu.at_wall or world.now_wall
        if c.tenant is not None:
            why = _load_problem(c, world, loading)
            if why is None:
                loading = True
                out.append(Warm(c.model, "load", at, nu.source, nu.label, nu.confidence,
                                tenant=c.tenant, gpu=c.gpu, bytes=c.bytes))  # fmt: skip
            else:
                skips.append(Skip(c.model, "load", why))
        # The file too, where it is known, even beside a load ahead: a server that maps its
        # file (llama.cpp's mmap, the default) reads it on the first request, not at the load.
        if c.path is not None and c.file_bytes:
            why = _page_cache_problem(c, world, opts, held_sooner, reading)
            if why is None:
                reading = True
                left = int(c.file_bytes * (1 - (c.cached_fraction or 0.0)))
                out.append(Warm(c.model, "page-cache", at, nu.source, nu.label, nu.confidence,
                                path=c.path, gpu=c.gpu, bytes=left))  # fmt: skip
            elif why != "cached":
                skips.append(Skip(c.model, "page-cache", why))
            held_sooner += int(c.file_bytes * (c.cached_fraction or 0.0))
    return out, skips


def _page_cache_problem(
    c: Candidate, world: World, opts: Options, held_sooner: int, reading: bool
) -> str | None:
    if (c.model, "page-cache") in world.warming:
        return "warming"
    if c.cached_fraction is not None and c.cached_fraction >= CACHED_ENOUGH:
        return "cached"
    if reading:
        return "another file is warming"
    if world.busy_gpus:
        return "a job holds or waits for a GPU"
    if world.disk_busy is not None and world.disk_busy > DISK_BUSY:
        return f"disk busy ({world.disk_busy:.0%})"
    left = (c.file_bytes or 0) * (1 - (c.cached_fraction or 0.0))
    if world.mem_available_bytes is None:
        return "memory unknown"
    if left * opts.margin > world.mem_available_bytes - held_sooner:
        return "low memory (it would push out a model needed sooner)"
    return None


def _load_problem(c: Candidate, world: World, loading: bool) -> str | None:
    if (c.model, "load") in world.warming:
        return "loading"
    if loading:
        return "another model is loading"
    if c.gpu is None or c.gpu in world.busy_gpus:
        return "its GPU is busy" if c.gpu is not None else "its GPU is unknown"
    free = None if world.gpu_free_bytes is None else world.gpu_free_bytes.get(c.gpu)
    if c.bytes is None or free is None:
        return "its size or the GPU's free memory is unknown"
    if c.bytes > free:
        return "not enough free GPU memory (a pre-warm never evicts)"
    return None
