"""Foresight: when each resident model will be needed next, what reloading it costs, and the
victim order that follows (Belady's rule, weighted by reload cost).

Pure: every input is an argument (the models, the declared future, the past, the time), so a
table test covers "the digest runs at 07:00, the tagger every 15 minutes" in microseconds, and
the live eviction (``gpulock.residents.eviction``, the governor) and ``gpulock replay`` share this
one decision.  Gathering the inputs (the event log, the line, the crontab) is
``gpulock.residents.foresight_inputs``.

It lives in ``core`` because every floor that evicts reads it: the residents' room, the governor
(which meets gpulock at ``gpulock.core`` and ``gpulock.arbiter``) and the replay at the top.

Next use (``NextUse``, from the line, the crontab and fleets, and each model's own rhythm or
time of day) is ``gpulock.core.nextuse``; its records and ``next_uses`` are named here too.

Victim order (``order``): pinned and in-use models are never candidates (the callers filter
them; ``order`` drops them too).  Under ``foresight`` the model with the highest
``distance / confidence / reload_s`` goes first (a large model needed in 2 minutes stays over
a small one needed in an hour); unknown next use counts as infinitely far; ties, and the whole
order under ``lru``, by the caller's own key ("today's order").
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, TypeVar

from gpulock.core.nextuse import UNKNOWN_SOURCE, NextUse, Planned, Use, line_plans, next_uses


class ConfigLike(Protocol):
    """What ``policy_of`` reads of ``gpulock.core.config.Config`` (which imports this module
    to check the key when a file is loaded: no import back)."""

    def settings_of(self, name: str, keys: Sequence[str]) -> Mapping[str, Any] | None: ...

    def error(self, key: str, problem: str, hint: str | None = None) -> Exception: ...


__all__ = [
    "POLICIES",
    "Forecast",
    "Load",
    "NextUse",
    "Planned",
    "ReloadCost",
    "Use",
    "forecast",
    "line_plans",
    "next_uses",
    "order",
    "policy_of",
    "reload_costs",
]

POLICIES: Final = ("foresight", "lru")
KEYS: Final = ("policy",)  # of the config's ``eviction:`` section
DEFAULT_POLICY: Final = "foresight"
DISK_BYTES_PER_S: Final = 1024**3  # a cold read and upload, when nothing was ever measured
CACHED_BYTES_PER_S: Final = 8 * 1024**3  # from the page cache
DEFAULT_RELOAD_S: Final = 10.0  # a model of unknown size
MIN_RELOAD_S: Final = 0.1
UNNEEDED_FACTOR: Final = 10.0  # "much longer than its reload time"

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Load:
    """One past load of ``model``: how many bytes, how long it took."""

    model: str
    load_s: float
    bytes: int | None = None


@dataclass(frozen=True, slots=True)
class ReloadCost:
    """Seconds to load ``model`` again; ``source``: measured, throughput, size or unknown."""

    seconds: float
    source: str


@dataclass(frozen=True, slots=True)
class Forecast:
    """Next uses and reload costs by model name, at ``now_wall``: what ``order`` reads."""

    now_wall: float
    next: Mapping[str, NextUse]
    reload: Mapping[str, ReloadCost]
    bytes: Mapping[str, int | None] = field(default_factory=dict)

    def score(self, model: str) -> float:
        """How good a victim: the distance to its next use (over the confidence), times the
        bytes it frees per second its reload costs; inf when never expected.

        Per byte, not per model: evicting a small model frees little, and a model of
        known size that reloads at the usual speed scores exactly its distance (Belady's
        rule).  A model slower to load than its size says (a tenant that starts a process,
        a slow disk) stays longer; one of unknown size counts as loading at the usual speed.
        """
        d = self.distance(model)
        if d is None:
            return math.inf
        rc = self.reload.get(model)
        size = self.bytes.get(model)
        if rc is None or not size:
            return d
        usual = size / DISK_BYTES_PER_S  # what its size would cost at the usual speed
        return d * usual / max(rc.seconds, MIN_RELOAD_S)

    def rate(self, model: str) -> float:
        """Reload seconds per second until its next use: what keeping it saves, per second
        (0 when never expected)."""
        d = self.distance(model)
        if d is None:
            return 0.0
        return self.reload_s(model) / max(d, 1.0)

    def distance(self, model: str) -> float | None:
        """Seconds to the next use over its confidence; None when never expected."""
        nu = self.next.get(model)
        if nu is None or nu.at_wall is None or nu.confidence <= 0:
            return None
        return max(nu.at_wall - self.now_wall, 0.0) / max(nu.confidence, 0.05)

    def unneeded(self, model: str, factor: float = UNNEEDED_FACTOR) -> bool:
        """No use expected within ``factor`` times its reload time (or none at all): keeping
        it loaded saves less than the memory it holds costs the others."""
        d = self.distance(model)
        if d is None:
            return True
        return d / max(self.reload_s(model), MIN_RELOAD_S) >= factor

    def reload_s(self, model: str) -> float:
        """Its reload seconds; ``DEFAULT_RELOAD_S`` when nothing is known."""
        rc = self.reload.get(model)
        return rc.seconds if rc is not None else DEFAULT_RELOAD_S

    def why(self, model: str) -> dict[str, Any]:
        """The evidence for an ``evict`` event: next use, its source, the reload cost."""
        nu = self.next.get(model)
        rc = self.reload.get(model)
        return {
            "next_use_s": None if nu is None else _round(nu.in_s(self.now_wall)),
            "next_use_source": UNKNOWN_SOURCE if nu is None else nu.source,
            "reload_s": None if rc is None else round(rc.seconds, 3),
        }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


# --- reload cost -------------------------------------------------------------------------------


def reload_costs(
    models: Mapping[str, int | None],
    loads: Iterable[Load],
    *,
    cached: Mapping[str, float] | None = None,
) -> dict[str, ReloadCost]:
    """Seconds to reload each model (name -> bytes): the median of its own past loads; else
    its bytes at this machine's measured throughput (median over every load with a size);
    else its bytes at ``DISK_BYTES_PER_S`` (or ``CACHED_BYTES_PER_S`` for the share of the
    file in the page cache, ``cached``: name -> 0..1).
    """
    own: dict[str, list[float]] = {}
    rates: list[float] = []
    for ld in loads:
        if ld.load_s <= 0:
            continue
        own.setdefault(ld.model, []).append(ld.load_s)
        if ld.bytes:
            rates.append(ld.bytes / ld.load_s)
    rate = statistics.median(rates) if rates else None
    out: dict[str, ReloadCost] = {}
    for m, size in models.items():
        if m in own:
            out[m] = ReloadCost(statistics.median(own[m]), "measured")
        elif size and rate:
            out[m] = ReloadCost(size / rate, "throughput")
        elif size:
            hot = min(max((cached or {}).get(m, 0.0), 0.0), 1.0)
            out[m] = ReloadCost(
                size * hot / CACHED_BYTES_PER_S + size * (1 - hot) / DISK_BYTES_PER_S, "size"
            )
        else:
            out[m] = ReloadCost(DEFAULT_RELOAD_S, "unknown")
    return out


def forecast(
    models: Mapping[str, int | None],
    planned: Iterable[Planned],
    history: Iterable[Use],
    loads: Iterable[Load],
    now_wall: float,
    *,
    utc_offset_s: float = 0.0,
    cached: Mapping[str, float] | None = None,
) -> Forecast:
    """``next_uses`` and ``reload_costs`` in one record, for ``order``."""
    return Forecast(
        now_wall,
        next_uses(models, planned, history, now_wall, utc_offset_s=utc_offset_s),
        reload_costs(models, loads, cached=cached),
        dict(models),
    )


# --- victim order ------------------------------------------------------------------------------


def order(
    items: Iterable[T],
    *,
    model: Callable[[T], str],
    today: Callable[[T], Any],
    forecast: Forecast | None,
    policy: str = DEFAULT_POLICY,
    pinned: Callable[[T], bool] = lambda _: False,
    in_use: Callable[[T], bool] = lambda _: False,
    room_bytes: int | None = None,
    size: Callable[[T], int | None] | None = None,
) -> list[T]:
    """Victims first.  ``today``: the caller's own key (cold-start first, then least recently
    used...), the whole order under ``lru`` or without a forecast, the tie-break otherwise.
    Pinned and in-use items are never returned.

    ``room_bytes`` (with ``size``): the bytes to free, when known.  Then, after the models
    nobody is expected to use, the cheapest set of victims that frees the rest
    (``gpulock.core.cover``) comes first, the others after it.
    """
    cands = [x for x in items if not pinned(x) and not in_use(x)]
    if policy == "lru" or forecast is None:
        return sorted(cands, key=today)
    ranked = sorted(cands, key=lambda x: (-forecast.score(model(x)), today(x)))
    if room_bytes is None or size is None or len(ranked) < 2:
        return ranked
    from gpulock.core import cover

    # Models nobody is expected to use go first, in today's order (cold-start first): the
    # cheapest cover is for what they leave short.
    never = [x for x in ranked if forecast.distance(model(x)) is None]
    known = ranked[len(never) :]
    short = room_bytes - sum(size(x) or 0 for x in never)
    if short <= 0 or len(known) < 2:
        return ranked
    found = cover.cheapest(
        [cover.Candidate(size(x) or 0, forecast.rate(model(x))) for x in known], short
    )
    if found is None:
        return ranked
    chosen = set(found)
    return never + [known[i] for i in found] + [x for i, x in enumerate(known) if i not in chosen]


def policy_of(config: ConfigLike) -> str:
    """``eviction.policy`` from the config (``foresight`` or ``lru``), validated."""
    section = config.settings_of("eviction", KEYS)
    if section is None:
        return DEFAULT_POLICY
    value = section.get("policy", DEFAULT_POLICY)
    if value not in POLICIES or not isinstance(value, str):
        raise config.error(
            "eviction.policy",
            f"expected one of {', '.join(POLICIES)}, got {value!r}",
            hint="foresight: by predicted next use and reload cost; lru: least recently used",
        )
    return value
