"""``gpulock replay``'s cost-aware bound: the fewest reload seconds any eviction policy could
spend on a trace.  Pure.

Belady's rule (evict the model needed furthest ahead) is the offline optimum only when every
model has the same size and the same reload cost.  With a 1 GiB tagger beside a 14 GiB
digest it is a next-use oracle, not a bound: keeping the large model and reloading the small
one twice can beat it, and foresight (which weighs reload cost) sometimes does.  This module
computes the real optimum of the reload seconds, exactly, by dynamic programming over the sets
of models that can be resident together, where that is small enough to compute.

The problem it solves is a relaxation of the replay's: the jobs reach the GPU in the order
they arrived (the line is first in, first out, whatever the policy), and after each grant the
resident models must leave room for that job (its model, plus its ``need`` beyond the model's
size, or nothing else at all for an exclusive job); other holders' working memory is ignored
and models may leave at any moment, for free.  Every schedule the replay can play is one of
these, so the optimum here is a lower bound on every policy's reload seconds (as long as the
trace's jobs declare a ``need`` at least their model's size, so the replay never over-commits).

The frontier is the set of (resident set -> cheapest cost) after each job, less the sets
another one dominates (a superset that cost no more: models can always leave later, for
free).  Loading is on demand only (the optimum never needs to load early), and evictions are
the inclusion-minimal sets that make room.  When the frontier grows past ``MAX_STATES`` the
bound is given up (None): a trace with many models of many sizes, where it cannot be computed
here in reasonable time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Protocol

MAX_STATES: Final = 3000  # frontier size past which the bound is not computed
MAX_MODELS: Final = 24


class Job(Protocol):
    """What the bound reads of a ``gpulock.replay_sim.Arrival``."""

    @property
    def time_s(self) -> float: ...
    @property
    def model(self) -> str: ...
    @property
    def model_bytes(self) -> int: ...
    @property
    def need_bytes(self) -> int | None: ...


@dataclass(frozen=True, slots=True)
class Bound:
    """The optimum: total reload seconds, and the loads and bytes of one schedule reaching it."""

    load_s: float
    loads: int
    loaded_bytes: int


def bound(
    jobs: Sequence[Job],
    capacity_bytes: int,
    load_s_of: dict[str, float],
    default_rate_bytes_per_s: float,
    *,
    max_states: int = MAX_STATES,
) -> Bound | None:
    """The fewest reload seconds for ``jobs`` on ``capacity_bytes``; None
    when the frontier outgrows ``max_states`` (or the trace has more than ``MAX_MODELS``
    models).  A job whose model alone does not fit is left out (the replay counts it unfit).
    """
    index: dict[str, int] = {}
    sizes: list[int] = []
    costs: list[float] = []
    steps: list[tuple[int, int, bool]] = []  # (model bit index or -1, room bytes, exclusive)
    for j in sorted(jobs, key=lambda j: j.time_s):  # the line's order: first come, first served
        exclusive = j.need_bytes is None
        if not j.model:
            if exclusive:
                steps.append((-1, 0, True))
            continue
        if j.model not in index:
            if len(index) >= MAX_MODELS:
                return None
            index[j.model] = len(sizes)
            sizes.append(j.model_bytes)
            costs.append(load_s_of.get(j.model, j.model_bytes / default_rate_bytes_per_s))
        k = index[j.model]
        size = sizes[k]
        room = size if exclusive else max(j.need_bytes or 0, size)
        if size > capacity_bytes or room > capacity_bytes:
            continue
        steps.append((k, room, exclusive))
    # frontier: resident set (bitmask) -> (seconds, loads, bytes)
    frontier: dict[int, tuple[float, int, int]] = {0: (0.0, 0, 0)}
    for k, room, exclusive in steps:
        nxt: dict[int, tuple[float, int, int]] = {}
        moved = False  # did any set change?  A hit that needs no room changes none
        for state, (cost, loads, loaded) in frontier.items():
            if k < 0:
                _keep(nxt, 0, (cost, loads, loaded))
                continue
            bit = 1 << k
            if not state & bit:
                cost, loads, loaded = cost + costs[k], loads + 1, loaded + sizes[k]
                moved = True
            if exclusive:
                moved = moved or state != bit
                _keep(nxt, bit, (cost, loads, loaded))
                continue
            others = state & ~bit
            over = _sum(others, sizes) + room - capacity_bytes
            if over <= 0:
                _keep(nxt, others | bit, (cost, loads, loaded))
                continue
            moved = True
            for gone in _minimal_covers(others, sizes, over):
                _keep(nxt, (others & ~gone) | bit, (cost, loads, loaded))
        frontier = _undominated(nxt, costs) if moved else nxt
        if len(frontier) > max_states:
            return None
    best = min(frontier.values())
    return Bound(best[0], best[1], best[2])


def _keep(
    into: dict[int, tuple[float, int, int]], state: int, value: tuple[float, int, int]
) -> None:
    old = into.get(state)
    if old is None or value < old:
        into[state] = value


def _sum(mask: int, sizes: Sequence[int]) -> int:
    total, k = 0, 0
    while mask:
        if mask & 1:
            total += sizes[k]
        mask >>= 1
        k += 1
    return total


def _bits(mask: int) -> list[int]:
    out, k = [], 0
    while mask:
        if mask & 1:
            out.append(k)
        mask >>= 1
        k += 1
    return out


def _minimal_covers(mask: int, sizes: Sequence[int], over: int) -> list[int]:
    """Every inclusion-minimal subset of ``mask`` whose sizes add up to ``over`` or more."""
    items = sorted(_bits(mask), key=lambda k: -sizes[k])
    out: list[int] = []

    def walk(i: int, chosen: int, total: int, members: list[int]) -> None:
        if total >= over:
            if all(total - sizes[m] < over for m in members):
                out.append(chosen)
            return
        for j in range(i, len(items)):
            k = items[j]
            members.append(k)
            walk(j + 1, chosen | (1 << k), total + sizes[k], members)
            members.pop()

    walk(0, 0, 0, [])
    return out


def _undominated(
    states: dict[int, tuple[float, int, int]], costs: Sequence[float]
) -> dict[int, tuple[float, int, int]]:
    """Drop each set another one dominates: ``t`` dominates ``s`` when ``s`` costs at least
    ``t``'s cost plus the reload of every model ``s`` has and ``t`` lacks (``t`` can follow
    ``s``'s schedule from here, loading each of those at most once, on demand).  A superset
    that costs no more is the simplest case."""
    kept: dict[int, tuple[float, int, int]] = {}
    for state, value in sorted(states.items(), key=lambda kv: (kv[1], -kv[0].bit_count())):
        cost = value[0]
        if any(cost >= v[0] + _cost(state & ~t, costs) for t, v in kept.items()):
            continue
        kept[state] = value
    return kept


def _cost(mask: int, costs: Sequence[float]) -> float:
    total, k = 0.0, 0
    while mask:
        if mask & 1:
            total += costs[k]
        mask >>= 1
        k += 1
    return total
