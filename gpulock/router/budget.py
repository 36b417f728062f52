"""Cloud budgets held under concurrency: reserve a call's most cost before it, settle after.

A call's cost is bounded before it runs: its prompt (counted as ``gpulock.router.tokens``
says: the provider's tokenizer where this machine has it, else a per-endpoint ratio or a bound
of a token a byte) at the input price plus ``max_tokens`` at the output price.  ``reserve``
counts that bound against the model's ``daily_budget`` and ``router.daily_budget`` atomically
(the ledger file's lock on one host; a Lua script in Redis across a cluster,
``gpulock.cluster.spend``), so ten agents making calls at once never spend past a budget;
``settle`` replaces it by what the call cost (what it did not use is given back at once),
``release`` gives it back when the call failed.

In a cluster whose Redis cannot be used (down, partitioned, a wrong password), each budget is
capped at this host's share (the budget divided by the hosts last seen), so a partition cannot
overspend; the host's ledger keeps its spend, and the next reservation once Redis is back adds
it to the shared total (and refills a Redis that came back empty).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpulock.core.settings import Settings
from gpulock.core.units import format_usd
from gpulock.router import ledger, tokens
from gpulock.router.choose import cid
from gpulock.router.routes import Candidate, RouterSettings


@dataclass(frozen=True, slots=True)
class Reservation:
    key: str
    amount_usd: float
    clustered: bool  # also counted in the cluster's Redis
    # Taken from a block this process holds (``gpulock.router.allowance``), on this day: it is
    # settled into that block, in memory (``gpulock.router.books``).  None: reserved in the
    # ledger for this call alone, settled there.
    block_day: str | None = None


@dataclass(frozen=True, slots=True)
class Granted:
    """What the cluster's Redis granted a block: slots, or USD (``clustered``), or nothing
    because Redis cannot be used (``share``: this host then keeps to its share of each limit:
    the limit divided by the hosts last seen)."""

    amount: float
    clustered: bool
    share: int = 1
    tight: bool = False  # the budget is near its end (gpulock.router.allowance.tight)


def bound_usd(
    c: Candidate, payload: Any, max_tokens: int, extra: Mapping[str, Any] | None = None
) -> float:
    """What a call reserves: its prompt counted as ``gpulock.router.tokens`` counts it for this
    candidate, at the input price, plus ``max_tokens`` at the output price."""
    n, _exact = tokens.prompt_tokens(
        payload, tokenizer=c.tokenizer, bytes_per_token=c.bytes_per_token, extra=extra
    )
    return (n * c.price_in_per_1k + max_tokens * c.price_out_per_1k) / 1000


def reserving(
    c: Candidate, payload: Any, max_tokens: int, extra: Mapping[str, Any] | None = None
) -> tuple[float, str]:
    """(what a call reserves, in USD; how that was counted, for ``route --explain``)."""
    n = tokens.count_prompt(
        payload, tokenizer=c.tokenizer, bytes_per_token=c.bytes_per_token, extra=extra
    )
    usd = (n.tokens * c.price_in_per_1k + max_tokens * c.price_out_per_1k) / 1000
    return usd, f"{n.tokens} prompt tokens ({n.how}) + max_tokens {max_tokens}"


def explain(c: Candidate) -> str:
    """How this candidate's calls are reserved against their budget (``route --explain``)."""
    if c.tokenizer and tokens.available(c.tokenizer):
        how = f"counted with tiktoken {c.tokenizer} (as the provider counts)"
    elif c.bytes_per_token:
        how = f"its UTF-8 bytes / {c.bytes_per_token:g} (bytes_per_token)"
    else:
        how = "its UTF-8 bytes (a token is at least one byte: an upper bound)"
    if c.tokenizer and not tokens.available(c.tokenizer):
        how += f"; {c.tokenizer}'s data is not on this machine (install the tokens extra)"
    return (
        f"reserves per call: the prompt {how}, plus the chat format's tokens, at "
        f"${c.price_in_per_1k:g}/1k, + max_tokens ({c.max_tokens} unless the call says) at "
        f"${c.price_out_per_1k:g}/1k; settled to the provider's count when it answers"
    )


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


def take_slots(settings: Settings, c: Candidate, wanted: int, share: float) -> Granted | str:
    """In a cluster, take up to ``wanted`` of the endpoint's ``rate_limit`` slots for this
    second across every host, atomically (never more than ``share`` of those left, at least
    one): Granted, or why not.  Granted(0, clustered=False, share=N) when Redis cannot be
    used: the caller keeps this host to its share of the limit."""
    from gpulock.cluster import ratelimit
    from gpulock.cluster.store import Unavailable
    from gpulock.router import peers

    limit = c.rate_limit_per_min or 0
    try:
        store = peers.store(settings)
        ok, used, n = ratelimit.take_block(store, cid(c), limit, wanted, share=share)
    except Unavailable:
        return Granted(0, False, max(1, peers.hosts_last_seen(settings)))
    if not ok:
        return f"rate limit: {used} requests in the last minute across the cluster (of {limit})"
    return Granted(n, True)


def give_back_slots(settings: Settings, key: str, second: int, n: int) -> None:
    """In a cluster, uncount slots of ``second`` never used (a Redis that cannot be used keeps
    them counted: too many, never too few)."""
    from gpulock.cluster import ratelimit
    from gpulock.cluster.store import Unavailable
    from gpulock.router import peers

    try:
        ratelimit.give_back(peers.store(settings), key, second, n)
    except Unavailable:
        pass


def reserve_ahead(
    settings: Settings,
    rs: RouterSettings,
    c: Candidate,
    amount_usd: float,
    ahead_usd: float,
    share: float,
    held_usd: float,
    unit_usd: float,
) -> Granted | str:
    """In a cluster, reserve ``amount_usd`` against the endpoint's budgets across every host
    and up to ``ahead_usd`` more (never more than ``share`` of what would be left, in whole
    ``unit_usd``: calls like this one): Granted (the whole amount reserved), or why not.
    ``held_usd``: what this host holds unused (in the shared spend, folded into this block):
    said apart in a refusal.  Granted(0, clustered=False, share=N) when Redis cannot be used."""
    from gpulock.cluster import spend
    from gpulock.cluster.store import Unavailable
    from gpulock.router import peers

    try:
        ok, model, total, granted, left = spend.reserve_block(
            peers.store(settings),
            cid(c),
            amount_usd,
            ahead_usd=ahead_usd,
            share=share,
            unit_usd=unit_usd,
            model_budget_usd=c.daily_budget_usd,
            total_budget_usd=rs.daily_budget_usd,
            local_spend_usd=ledger.read(settings).spend_usd,
            hosts_expected=peers.hosts_last_seen(settings),
        )
    except Unavailable:
        return Granted(0.0, False, max(1, peers.hosts_last_seen(settings)))
    if not ok:
        return _why(
            c, rs, model - held_usd, total - held_usd, amount_usd + held_usd, "across the cluster"
        )
    return Granted(granted, True, tight=left is not None and (left - amount_usd) * share < unit_usd)


def give_back_usd(settings: Settings, key: str, usd: float) -> None:
    """In a cluster, give back budget held and never used."""
    _settle_cluster(settings, key, -usd)


def over_budget(
    c: Candidate,
    rs: RouterSettings,
    model_usd: float,
    total_usd: float,
    need_usd: float,
    share: int,
    where: str,
) -> tuple[str | None, float | None]:
    """Would ``need_usd`` pass the candidate's or the router's budget (each divided by
    ``share``), with ``model_usd`` and ``total_usd`` spent?  (Why, or None; what is left of
    the tightest budget before this call, None: no budget.)"""
    left = None
    for budget, spent in ((c.daily_budget_usd, model_usd), (rs.daily_budget_usd, total_usd)):
        if budget is not None:
            room = budget / share - spent
            left = room if left is None else min(left, room)
    if left is not None and need_usd > left + 1e-9:
        return _why(c, rs, model_usd, total_usd, need_usd, where), left
    return None, left


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
