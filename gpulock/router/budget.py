"""Cloud budgets held under concurrency: reserve a call's most cost before it, settle after.

A call's cost is bounded before it runs: its prompt (at most a token per character) at the
input price plus ``max_tokens`` at the output price.  ``reserve`` counts that bound against the
model's ``daily_budget`` and ``router.daily_budget`` atomically (the ledger file's lock on one
host; a Lua script in Redis across a cluster, ``gpulock.cluster.spend``), so ten agents making calls
at once never spend past a budget; ``settle`` replaces it by what the call cost, ``release`` gives
it back when the call failed.

In a cluster whose Redis cannot be used (down, partitioned, a wrong password), each budget is
capped at this host's share (the budget divided by the hosts last seen), so a partition cannot
overspend; the host's ledger keeps its spend, and the next reservation once Redis is back adds
it to the shared total (and refills a Redis that came back empty).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from gpulock.core.settings import Settings
from gpulock.core.units import format_usd
from gpulock.router import ledger
from gpulock.router.choose import cid
from gpulock.router.routes import Candidate, RouterSettings


@dataclass(frozen=True, slots=True)
class Reservation:
    key: str
    amount_usd: float
    clustered: bool  # also counted in the cluster's Redis


def bound_usd(c: Candidate, payload: Any, max_tokens: int) -> float:
    """The most a call can cost: every prompt character a token, every output token used."""
    chars = len(payload) if isinstance(payload, str) else len(json.dumps(payload, default=str))
    return (chars * c.price_in_per_1k + max_tokens * c.price_out_per_1k) / 1000


def take_request(settings: Settings, c: Candidate) -> str | None:
    """In a cluster, take one of the endpoint's ``rate_limit`` requests this minute, across
    every host, atomically; why not, or None when taken (or there is no limit or cluster).
    While Redis cannot be used, this host keeps to its share of the limit."""
    limit = c.rate_limit_per_min
    if limit is None or c.tier != "cloud" or settings.config.section("cluster") is None:
        return None
    from gpulock.cluster import ratelimit
    from gpulock.cluster.store import Unavailable
    from gpulock.router import peers

    key = cid(c)
    try:
        ok, used = ratelimit.take(peers.store(settings), key, limit)
    except Unavailable:
        share = limit / max(1, peers.hosts_last_seen(settings))
        used_here = ledger.read(settings).requests_last_min(time.time()).get(key, 0)
        if used_here + 1 > share:
            return (
                f"rate limit: {used_here} requests in the last minute on this host "
                f"(its share of {limit} while the cluster's Redis is unavailable)"
            )
        return None
    if not ok:
        return f"rate limit: {used} requests in the last minute across the cluster (of {limit})"
    return None


def needed(c: Candidate, rs: RouterSettings) -> bool:
    return c.tier == "cloud" and (c.daily_budget_usd is not None or rs.daily_budget_usd is not None)


def reserve(
    settings: Settings, rs: RouterSettings, c: Candidate, amount_usd: float
) -> Reservation | str:
    """A Reservation, or why not (the budget that would be passed)."""
    key = cid(c)
    model_budget, total_budget = c.daily_budget_usd, rs.daily_budget_usd
    clustered = False
    if settings.config.section("cluster") is not None:
        from gpulock.cluster import spend
        from gpulock.cluster.store import Unavailable
        from gpulock.router import peers

        try:
            ok, model, total = spend.reserve(
                peers.store(settings),
                key,
                amount_usd,
                model_budget_usd=model_budget,
                total_budget_usd=total_budget,
                local_spend_usd=ledger.read(settings).spend_usd,
                hosts_expected=peers.hosts_last_seen(settings),
            )
        except Unavailable:
            share = max(1, peers.hosts_last_seen(settings))  # this host's share, no more
            model_budget = None if model_budget is None else model_budget / share
            total_budget = None if total_budget is None else total_budget / share
        else:
            if not ok:
                return _why(c, rs, model, total, amount_usd, "across the cluster")
            clustered = True
    ok, model, total = ledger.reserve(
        settings, key, amount_usd, model_budget_usd=model_budget, total_budget_usd=total_budget
    )
    if not ok:
        if clustered:
            _settle_cluster(settings, key, -amount_usd)
        return _why(c, rs, model, total, amount_usd, "on this host")
    return Reservation(key, amount_usd, clustered)


def settled(settings: Settings, r: Reservation, cost_usd: float) -> None:
    """The cluster's part of settling (the ledger's is ``accounting.record(reserved_usd=...)``)."""
    if r.clustered:
        _settle_cluster(settings, r.key, cost_usd - r.amount_usd)


def release(settings: Settings, r: Reservation) -> None:
    ledger.release(settings, r.key, r.amount_usd)
    settled(settings, r, 0.0)


def _settle_cluster(settings: Settings, key: str, delta: float) -> None:
    from gpulock.cluster import spend
    from gpulock.cluster.store import Unavailable
    from gpulock.router import peers

    try:
        spend.settle(peers.store(settings), key, delta)
    except Unavailable:
        pass  # the ledger has it; a reservation left too high only errs on the safe side


def _why(
    c: Candidate, rs: RouterSettings, model: float, total: float, amount: float, where: str
) -> str:
    if c.daily_budget_usd is not None and model + amount > c.daily_budget_usd:
        return (
            f"daily budget: ${model:.4f} spent {where} today + up to ${amount:.4f} for this call "
            f"> {format_usd(c.daily_budget_usd)}"
        )
    budget = rs.daily_budget_usd or 0.0
    return (
        f"cloud budget: ${total:.4f} spent {where} today + up to ${amount:.4f} for this call "
        f"> {format_usd(budget)} (router.daily_budget)"
    )
