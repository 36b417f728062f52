"""How long a newcomer would wait for a GPU, from who is in line: a pure function.

The router rejects a gpu candidate whose queue wait would pass the caller's deadline, so this
estimate is its core promise.  One GPU-wide median of recent holds is blind to who is in line: a
6 s render job holding the GPU and two 3 s TTS jobs waiting read as "~0.1 s" when the history is
full of quick taggers.  Jobs recur under the same names, so each ticket ahead is estimated from
its own name's hold history (the GPU's when its name has none), and:

- a **holder** that has held ``e`` seconds has ``h - e`` left for the past holds ``h`` longer
  than ``e`` (its remaining time given that it is still running, not the typical hold minus
  ``e``, which reads 0 for any holder past the median); a holder longer than every hold seen has
  about as long again to go (``e``: the doubling rule for a run of unknown length);
- a **waiter** ahead takes one hold of its name;
- **sharing**: the queue is played through the lock's own rule (queue.decide): first come,
  first served; a ticket with a ``need`` starts next to holders with needs while the sum fits the
  budget; an exclusive one (no need) waits until nobody holds;
- each duration is taken at the quantile ``q`` (p90 by default) of its history, so the deadline
  is decided against a wait that is rarely passed, not against the median that is passed half of
  the time.

``bench/wait_estimate.py`` replays recorded queues against this and the old median estimate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

DEFAULT_QUANTILE = 0.9
PER_NAME = 20  # holds kept per name: recent enough to follow a job that changed
PER_GPU = 50  # holds kept for the GPU-wide fallback


@dataclass(frozen=True, slots=True)
class Queued:
    """A ticket ahead of the newcomer, in queue order."""

    name: str
    need_bytes: int | None  # None: exclusive
    held_s: float | None = None  # seconds held so far; None: still waiting


@dataclass(frozen=True, slots=True)
class HoldHistory:
    """Past hold lengths (seconds, oldest first): per ticket name and for the whole GPU."""

    by_name: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    gpu: tuple[float, ...] = ()
    default_s: float = 30.0  # ``router.hold_estimate``: a hold's length before any history

    def of(self, name: str) -> tuple[float, ...]:
        return self.by_name.get(name) or self.gpu


def history_from(
    holds: Sequence[tuple[str, float]], default_s: float, *, per_name: int = PER_NAME
) -> HoldHistory:
    """A HoldHistory from ``(name, held_s)`` pairs, oldest first."""
    by_name: dict[str, list[float]] = {}
    for name, held in holds:
        by_name.setdefault(name, []).append(held)
    return HoldHistory(
        {n: tuple(h[-per_name:]) for n, h in by_name.items()},
        tuple(h for _n, h in holds[-PER_GPU:]),
        default_s,
    )


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile by nearest rank (never below the smallest nor above the largest)."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def hold_left(t: Queued, history: HoldHistory, q: float) -> float:
    """Seconds ``t`` will still hold (all of its hold when it has not started)."""
    past = history.of(t.name)
    elapsed = t.held_s
    if elapsed is None:
        return quantile(past, q) if past else history.default_s
    longer = [h - elapsed for h in past if h > elapsed]
    if longer:
        return quantile(longer, q)
    if not past:
        return max(history.default_s - elapsed, elapsed)
    return elapsed  # longer than every hold seen: about as long again


def estimate_wait(
    line: Sequence[Queued],
    history: HoldHistory,
    *,
    need_bytes: int | None = None,
    budget_bytes: int | None = None,
    q: float = DEFAULT_QUANTILE,
) -> float:
    """Seconds until a newcomer with ``need_bytes`` (None: exclusive) would hold, at quantile
    ``q``; ``line`` is everyone ahead of it in queue order (holders first)."""
    running: list[tuple[float, int | None]] = []  # (ends at, need) of those holding
    for t in line:
        if t.held_s is not None:
            running.append((hold_left(t, history, q), t.need_bytes))
    start = 0.0
    for t in line:
        if t.held_s is None:
            start = _admit(t.need_bytes, running, start, budget_bytes)
            running.append((start + hold_left(t, history, q), t.need_bytes))
    return _admit(need_bytes, running, start, budget_bytes)


def _admit(
    need: int | None, running: list[tuple[float, int | None]], start: float, budget: int | None
) -> float:
    """When a ticket whose turn comes at ``start`` holds: FIFO, nobody starts before the one
    ahead of it did; then it waits until the holders leave it room (removed from ``running``)."""
    running.sort(key=lambda r: r[0])
    while running and not _fits(need, [n for _e, n in running], budget):
        start = max(start, running.pop(0)[0])
    return start


def _fits(need: int | None, holding: Sequence[int | None], budget: int | None) -> bool:
    """The lock's sharing rule (gpulock.lock.queue): needs share while their sum fits the budget."""
    if not holding:
        return True
    if need is None or budget is None or any(n is None for n in holding):
        return False
    return sum(n for n in holding if n is not None) + need <= budget


__all__ = [
    "DEFAULT_QUANTILE",
    "HoldHistory",
    "Queued",
    "estimate_wait",
    "history_from",
    "hold_left",
    "quantile",
]
