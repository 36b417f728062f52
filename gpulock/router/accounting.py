"""The one accounting path for model calls, whichever door they came through.

``router.get_model``'s handles (and so the agents, which call it) and ``gpulock serve``'s
requests both call a chosen candidate the same way, and both go through here:

* ``admit`` before the call: a cloud candidate's limits (its ``daily_budget``, the router's
  ``daily_budget``, its ``rate_limit``, a cooldown, its key variable) are judged again, with the
  same rule the chooser uses (``gpulock.router.choose``), under the ledger's lock; when it fits, the
  request is counted in the rate limit's window at once, in the same locked change.  So two
  processes (or two of serve's requests at once) cannot both take the last request of a minute.
  Local candidates are admitted at once: their limits are the lock's and the governor's.
* ``record`` after a call that answered: its cost (tokens times the route's ``price``) is
  spent in the ledger (``<state>/router/ledger.json``: what later budgets, ``gpulock status``'s
  ``usage`` and ``gpulock route --explain`` read) and a ``call`` event is written (what the
  report and the metrics, ``gpulock_router_cost_usd_total`` among them, read).
* ``failed`` after a call that failed: a cooldown for every process where the failure blames the
  endpoint, and a ``call`` event with ``ok: false``.
* ``refusal``: when a task has no candidate left and limits are why, what to tell the caller
  (``"budget"`` or ``"rate"``, with a Retry-After for a rate limit): serve answers it as a 429.

A budget is judged before each call, and the cost is known only after it: the call that crosses
a budget is finished and counted, and so are calls already under way at that moment.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpulock.core.settings import Settings
from gpulock.router import ledger
from gpulock.router.backends import BackendError
from gpulock.router.choose import Choice, Host, Verdict, choose, cid
from gpulock.router.routes import Candidate, RouterSettings

# HTTP statuses that blame this one request (its keywords, its size), not the endpoint.
REQUEST_FAULTS = frozenset({400, 413, 422})
# Failures that show a peer silent, gone or broken (not busy, not the request's fault): the
# peer is failing for every caller of this host until its heartbeat moves.
PEER_FAILURES = frozenset({"timeout", "connection", "server"})


def admit(
    settings: Settings,
    rs: RouterSettings,
    task: str,
    c: Candidate,
    *,
    environ: Mapping[str, str] | None = None,
    now_wall: float | None = None,
) -> Verdict:
    """The candidate judged again now (see the module doc): ``ok`` means go ahead, and for a
    cloud candidate its request is already counted against its rate limit."""
    if c.tier != "cloud":
        return Verdict(c, True, "local")
    now = time.time() if now_wall is None else now_wall
    env = os.environ if environ is None else environ
    if not limited(c, rs):
        # Nothing to take under the lock: only cooldowns and the key are judged, from a read.
        # (Counting every request of an endpoint without a rate limit grew the ledger by a
        # time stamp a request, read and written whole each time: serve's throughput fell
        # from thousands of requests a second to about 140.)
        return _judge(task, c, rs, ledger.peek(settings, now_wall=now), env, now)
    with ledger.change(settings, now_wall=now) as led:
        v = _judge(task, c, rs, led, env, now)
        if v.ok and c.rate_limit_per_min is not None:
            led.take_requests(cid(c), now)
    return v


def limited(c: Candidate, rs: RouterSettings) -> bool:
    """Whether a cloud candidate has an accounting limit (a rate limit, its own or the router's
    daily budget): what ``admit`` must take under the ledger's lock."""
    return c.tier == "cloud" and (
        c.rate_limit_per_min is not None
        or c.daily_budget_usd is not None
        or rs.daily_budget_usd is not None
    )


def _judge(
    task: str,
    c: Candidate,
    rs: RouterSettings,
    led: ledger.Ledger,
    env: Mapping[str, str],
    now: float,
) -> Verdict:
    host = Host(
        env=frozenset({c.api_key_env} if c.api_key_env and env.get(c.api_key_env) else ()),
        spend_today_usd=dict(led.spend_usd),
        daily_budget_usd=rs.daily_budget_usd,
        cooldown_until=led.cooldown_until(),
        requests_last_min=led.requests_last_min(now),
        now_wall=now,
    )
    return choose(task, [c], host).verdicts[0]


def cost_usd(c: Candidate, tokens_in: int, tokens_out: int) -> float:
    return (tokens_in * c.price_in_per_1k + tokens_out * c.price_out_per_1k) / 1000


def record(
    settings: Settings,
    c: Candidate,
    *,
    task: str,
    agent: str,
    tokens_in: int,
    tokens_out: int,
    latency_s: float,
    reserved_usd: float = 0.0,
    **fields: Any,
) -> float:
    """Count a call that answered: spend and usage in the ledger, a ``call`` event.  ``fields``
    go into the event as they are (``gpu``, serve's ``via``, ``ticket``, ``host``...).
    ``reserved_usd``: what ``gpulock.router.budget.reserve`` counted before the call (settled here).
    Returns its cost."""
    k = answered(c, task, agent, tokens_in, tokens_out, reserved_usd, fields)
    ledger.record_calls(settings, [k])
    answered_event(settings, c, k, latency_s, fields)
    return k.cost_usd


def answered(
    c: Candidate,
    task: str,
    agent: str,
    tokens_in: int,
    tokens_out: int,
    reserved_usd: float,
    fields: Mapping[str, Any],
) -> ledger.Call:
    """The ledger's record of a call that answered (its request was counted by ``admit``)."""
    return ledger.Call(
        cid(c),
        cost_usd(c, tokens_in, tokens_out),
        agent,
        task,
        c.tier,
        tokens_in,
        tokens_out,
        count_request=False,  # admit() counted it when the call began
        reserved_usd=reserved_usd,
        host=str(fields.get("host") or ""),
    )


def answered_event(
    settings: Settings, c: Candidate, k: ledger.Call, latency_s: float, fields: Mapping[str, Any]
) -> None:
    call_event(
        settings,
        c,
        task=k.task,
        agent=k.agent,
        ok=True,
        latency_s=latency_s,
        tokens_in=k.tokens_in,
        tokens_out=k.tokens_out,
        cost_usd=round(k.cost_usd, 8),
        **fields,
    )


def cools_down(e: BackendError) -> bool:
    """Whether a failure should keep every process off this candidate for a while.

    A long GPU queue is not the model's fault, and a request refused for its own content (HTTP
    400, 413, 422; a prompt longer than a local model's context) says nothing about the next
    request; these fall back without a cooldown.  Everything else (429, 5xx, timeouts, refused
    connections, 401/403/404, a model that will not load) cools the candidate down for all.
    """
    if e.kind in ("busy", "request"):
        return False
    return not (e.kind == "client" and e.status in REQUEST_FAULTS)


def failed(
    settings: Settings,
    rs: RouterSettings,
    c: Candidate,
    e: BackendError,
    *,
    task: str,
    agent: str,
    latency_s: float,
    **fields: Any,
) -> float | None:
    """Count a call that failed: a cooldown when it blames the endpoint (``cools_down``), and a
    ``call`` event with ``ok: false``.  Returns the cooldown's length, or None."""
    cooled = None
    if cools_down(e):
        cooled = ledger.record_failure(
            settings,
            cid(c),
            reason=e.short,
            base_s=rs.cooldown_s,
            max_s=rs.max_cooldown_s,
            retry_after_s=e.retry_after_s,
            count_request=False,  # admit() counted it when the call began
        )
        if settings.config.section("cluster") is not None:  # cooled for every host
            from gpulock.cluster import cooldowns
            from gpulock.router import peers

            peers.share_cooldown(settings, cid(c), cooled, e.short)
            if c.host is not None:  # a peer that failed: no host sends it work for a while
                peers.share_cooldown(settings, cooldowns.peer(c.host), cooled, e.short)
                if e.kind in PEER_FAILURES:  # nor any caller here, until it beats again
                    peers.peer_failed(settings, c.host, e.short)
    call_event(
        settings,
        c,
        task=task,
        agent=agent,
        ok=False,
        latency_s=latency_s,
        error=e.short,
        detail=e.detail,
        cooldown_s=cooled,
        **fields,
    )
    return cooled


def call_event(
    settings: Settings,
    c: Candidate,
    *,
    task: str,
    agent: str,
    ok: bool,
    latency_s: float,
    **fields: Any,
) -> None:
    """One ``call`` event: who called, which model, how it went, what it cost."""
    counts = {"tokens_in": 0, "tokens_out": 0, "cost_usd": 0.0}
    # The tenant that served it: foresight's pre-warm asks that server to load the model
    # ahead of the agent's next run (gpulock.residents.prewarm).
    served = {"tenant": c.tenant} if c.tenant else {}
    settings.emit(
        "call",
        task=task,
        agent=agent,
        tier=c.tier,
        model=c.name,
        ok=ok,
        latency_s=round(latency_s, 6),
        **{**counts, **served, **fields},
    )


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a task has no candidate left, when accounting limits are why."""

    kind: str  # "budget" or "rate"
    message: str
    retry_after_s: float | None = None  # a rate limit: when the first request leaves the window


def refusal(
    settings: Settings,
    choice: Choice,
    refused: Mapping[str, Verdict] | None = None,
    *,
    now_wall: float | None = None,
) -> Refusal | None:
    """The limits that left ``choice`` with no candidate, or None when none did.

    ``refused``: verdicts of ``admit`` that refused candidates on this call (by cid), which
    stand for the choice's own verdict of the same candidate.  A rate limit wins over a budget:
    it ends within a minute.
    """
    if choice.chosen is not None:
        return None
    by_cid = {cid(v.candidate): v for v in choice.verdicts}
    by_cid.update(refused or {})
    limited = [v for v in by_cid.values() if not v.ok and v.limit is not None]
    if not limited:
        return None
    message = f"no model available for {choice.task!r}: " + "; ".join(
        f"{v.candidate.name}: {v.reason}" for v in by_cid.values()
    )
    rated = [v.candidate for v in limited if v.limit == "rate"]
    if not rated:
        return Refusal("budget", message)
    now = time.time() if now_wall is None else now_wall
    led = ledger.read(settings, now_wall=now)
    waits = []
    for c in rated:
        wait = led.first_leaves_in(cid(c), c.rate_limit_per_min or 0, now)
        if wait is not None:
            waits.append(wait)
    retry = max(1.0, min(waits)) if waits else ledger.RATE_WINDOW_S
    return Refusal("rate", message, round(retry, 3))
