"""Which victims free a given number of bytes at the least expected reload cost.  Pure.

Foresight's victim order (``gpulock.core.foresight.order``) sorts models by their distance to
the next use per byte freed: Belady's rule, per byte.  Making room for a ``need`` is a
knapsack, though: when 1 GiB is missing, evicting the 14 GiB model needed in 20 minutes frees
13 GiB nobody asked for and costs its whole reload, where the 1 GiB model needed in 15
minutes would have done.  So when the room to make is known, the victims are the set that
covers it at the least *cost rate* (each model's reload seconds over the seconds to its next
use), less what the bytes freed beyond the need are worth: the next eviction would have taken
that many bytes of the models that stay, the cheapest per byte first.  On ``bench/replay.py``'s
mix of sizes that is 7 % fewer reload seconds than Belady's count and changes nothing where
the sizes are equal (docs/foresight.md).

Only inclusion-minimal covers are weighed (a victim more than needed is never cheaper), among
the ``limit`` best victims by score, and at most ``MAX_COVERS`` of them: past that the caller
keeps the plain order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

LIMIT: Final = 12  # candidates weighed (the best by score): 2^12 subsets at most
MAX_COVERS: Final = 2000


@dataclass(frozen=True, slots=True)
class Candidate:
    """One possible victim: the bytes it frees and its cost rate (reload s / s to next use;
    0 when it is never expected)."""

    bytes: int
    rate: float


def cheapest(
    cands: Sequence[Candidate], short_bytes: int, *, limit: int = LIMIT
) -> list[int] | None:
    """Indexes (into ``cands``, which come best victim first) of the cheapest cover of
    ``short_bytes``, best first; None when no cover exists among the first ``limit`` or there
    are too many to weigh."""
    pool = list(range(min(limit, len(cands))))
    if short_bytes <= 0 or not pool or any(cands[i].bytes <= 0 for i in pool):
        return None
    covers: list[list[int]] = []

    def walk(j: int, chosen: list[int], total: int) -> bool:
        if total >= short_bytes:
            if all(total - cands[i].bytes < short_bytes for i in chosen):
                covers.append(list(chosen))
            return len(covers) < MAX_COVERS
        for k in range(j, len(pool)):
            chosen.append(pool[k])
            going = walk(k + 1, chosen, total + cands[pool[k]].bytes)
            chosen.pop()
            if not going:
                return False
        return True

    if not walk(0, [], 0):
        return None
    if not covers:
        return None

    cheap_first = sorted(pool, key=lambda i: cands[i].rate / cands[i].bytes)

    def value(cover: list[int]) -> tuple[float, int]:
        left = sum(cands[i].bytes for i in cover) - short_bytes  # freed beyond the need
        saved = 0.0  # what the surplus saves the next time: the cheapest of those that stay
        for i in cheap_first:
            if left <= 0:
                break
            if i in cover:
                continue
            part = min(left, cands[i].bytes)
            saved += cands[i].rate * part / cands[i].bytes
            left -= part
        return sum(cands[i].rate for i in cover) - saved, min(cover)

    return min(covers, key=value)
