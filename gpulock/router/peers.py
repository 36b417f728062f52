"""``get_model`` and ``gpulock route`` in a cluster: the chosen gpu candidate may run on a peer.

Imported only when the config has a ``cluster:`` section.  After the local choice, a gpu
candidate of this host (``placeable``: llama.cpp, or a tenant's model) is placed by
``gpulock.cluster.place``: this host (its line's wait estimate, plus the load unless warm) against
every live peer that runs a candidate of that name (its published estimate, plus the load unless
warm there, plus ``remote_penalty``).  When a peer starts sooner, the chosen verdict becomes that
peer's: the same candidate, called through the peer's gateway (``base_url``, ``model`` = the
candidate's name, ``host`` = the peer), where it waits in the peer's line under the agent's
name, and runs there through the peer's own candidate of that name (its llama.cpp, or its own
tenant: the peer's Ollama, vLLM, or ``kind: command`` server).  Ties stay local.

Warm means the same on both sides: here, the candidate's cid is in ``Host.warm`` (loaded in this
process, or held by its tenant now, as ``gpulock.router.probe`` surveys it); a peer publishes the
names of its candidates whose cid is in its own ``Host.warm``.

The peers' reports are read from Redis at most once per half heartbeat per process; a Redis
that is down costs one short timeout, then routing stays local until its back-off passes.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from gpulock.core.settings import Settings
from gpulock.router.choose import Choice, Host, Verdict, cid, line_wait
from gpulock.router.routes import Candidate

if TYPE_CHECKING:
    from gpulock.cluster.config import ClusterConfig
    from gpulock.cluster.place import Sent
    from gpulock.cluster.report import HostReport
    from gpulock.cluster.store import Store

ENV_HOST = "GPULOCK_HOST"


def here_name(settings: Settings) -> str:
    """This host's name: ``$GPULOCK_HOST``, else ``cluster.host``, else the hostname."""
    if os.environ.get(ENV_HOST):
        return os.environ[ENV_HOST]
    section = settings.config.section("cluster")
    if isinstance(section, dict) and isinstance(section.get("host"), str) and section["host"]:
        return str(section["host"]).strip()
    return socket.gethostname()


@dataclass
class _View:
    cc: ClusterConfig
    store: Store
    reports: tuple[HostReport, ...] = ()
    read_at: float = -1e9
    hosts_seen: int = 0  # at the last successful read
    cooldowns: dict[str, tuple[float, str]] | None = None
    cooldowns_at: float = -1e9


_views: dict[tuple[Any, ...], _View] = {}
# A long-running server (``gpulock serve``) reads the cooldowns with its heartbeat, in its own
# thread, and feeds them here: its event loop then never waits on Redis.
_cooldown_feed: Callable[[], dict[str, tuple[float, str]]] | None = None


def feed_cooldowns(feed: Callable[[], dict[str, tuple[float, str]]] | None) -> None:
    global _cooldown_feed
    _cooldown_feed = feed


_sent: Sent | None = None  # when this process sent requests to each peer (herding)


def _sends() -> Sent:
    global _sent
    if _sent is None:
        from gpulock.cluster.place import Sent

        _sent = Sent()
    return _sent


def _view(settings: Settings) -> _View:
    from gpulock.cluster import config as cluster_config
    from gpulock.cluster.store import Store

    cc = cluster_config.load(settings.config)
    assert cc is not None
    key = (cc.redis_url, cc.prefix, cc.host, cc.password_env)
    v = _views.get(key)
    if v is None or v.cc != cc:
        v = _views[key] = _View(cc, Store(cc))
    return v


def peers(settings: Settings) -> tuple[ClusterConfig, tuple[HostReport, ...]]:
    """The cluster's config and the live hosts' reports (none while Redis is unavailable)."""
    from gpulock.cluster import report
    from gpulock.cluster.store import Unavailable

    v = _view(settings)
    now = time.monotonic()
    if now - v.read_at >= v.cc.heartbeat_s / 2:
        v.read_at = now
        try:
            raw = v.store.hosts()
        except Unavailable:
            v.reports = ()
        else:
            v.reports = tuple(r for r in (report.parse(o) for o in raw) if r is not None)
            v.hosts_seen = len(v.reports)
    return v.cc, v.reports


def placeable(c: Candidate) -> bool:
    """Whether a gpu candidate of this host may run on a peer instead: llama.cpp, or a
    tenant's model (the peer calls its own tenant); not one that is a peer's already."""
    return c.tier == "gpu" and c.host is None and (c.local or c.tenant is not None)


def offers(choice: Choice) -> Iterator[tuple[Verdict, bool]]:
    """The verdicts a peer may take, in route order, each with whether this host competes for
    it too: every local gpu candidate passed over only for its line (longer than the deadline;
    this host does not), then the chosen one when it is a placeable gpu candidate (it does).

    Offering the passed-over ones keeps an agent from waiting out its deadline here, or falling
    back to a smaller tier or the cloud, while a peer's GPU sits idle.  ``relocate`` here and
    ``gpulock.serve.cluster_link`` both walk this."""
    for v in choice.verdicts:
        c = v.candidate
        if v is choice.chosen:
            if placeable(c):
                yield v, True
            return
        if placeable(c) and not v.ok and " queue: " in v.reason:
            yield v, False


def relocate(
    settings: Settings, choice: Choice, host: Host, deadline_s: float | None = None
) -> Choice:
    """``choice`` with its gpu verdict moved to the peer that starts it soonest (if any), the
    ``offers`` tried in turn."""
    for v, here_too in offers(choice):
        moved = _place(settings, choice, host, v, deadline_s, here_too=here_too)
        if here_too or moved is not choice:
            return moved
    return choice


def _place(
    settings: Settings,
    choice: Choice,
    host: Host,
    v: Verdict,
    deadline_s: float | None,
    *,
    here_too: bool,
) -> Choice:
    from gpulock.cluster import cooldowns, place
    from gpulock.cluster.report import load_estimate_s

    cc, reports = peers(settings)
    c = v.candidate
    local = None
    if here_too:
        wait, ahead = line_wait(host, v)
        load_s = load_estimate_s(v.need_bytes)
        local = place.here(cc.host, wait, ahead, warm=cid(c) in host.warm, load_s=load_s, gpu=v.gpu)
    sent = _sends().counts(reports)
    cooling = cooldowns.cooling_peers(shared_cooldowns(settings)) | failing_peers(settings, reports)
    locs = place.locations(
        c.name,
        local,
        reports,
        me=cc.host,
        now_wall=time.time(),
        penalty_s=cc.remote_penalty_s,
        sent=sent,
        exclude=cooling,
        deadline_s=deadline_s,
    )
    if not locs or (here_too and len(locs) < 2):
        return choice
    best = locs[0]
    others = "; ".join(f"{loc.label}: {loc.reason}" for loc in locs[1:])
    if not here_too:
        others = "; ".join(x for x in (others, f"here: {v.reason}") if x)
    if best.local:
        moved = replace(v, reason=f"{v.reason}; here: {best.reason}; {others}")
    else:
        assert best.gateway is not None
        peer_c = replace(
            c,
            backend="openai",
            model=c.name,
            base_url=best.gateway + "/v1",
            api_key_env=cc.api_key_env,
            host=best.host,
            tenant=None,  # the peer's gateway, not this host's tenant (its cid, its cooldowns)
        )
        report = next(r for r in reports if r.host == best.host)
        moved = Verdict(
            peer_c,
            True,
            f"on {best.host}: {best.reason}; {others}",
            gpu=best.gpu,
            need_bytes=v.need_bytes,
            warm=c.name in report.warm,
            start_s=best.start_s,
        )
    verdicts = tuple(moved if x is v else x for x in choice.verdicts)
    return replace(choice, chosen=moved, verdicts=verdicts)


def failing_peers(settings: Settings, reports: Sequence[HostReport]) -> frozenset[str]:
    """The peers a caller of this host found failing, whose heartbeat has not moved since
    (``gpulock.cluster.failing``): no caller here sends them work meanwhile."""
    from gpulock.cluster import failing

    return failing.failing_now(settings, ((r.host, r.at_wall) for r in reports))


def peer_failed(settings: Settings, peer: str, reason: str) -> None:
    """``peer`` failed a call of this process: every caller of this host skips it until its
    heartbeat moves (its report as this process last read it is the one in force)."""
    from gpulock.cluster import failing

    _cc, reports = peers(settings)
    beat = next((r.at_wall for r in reports if r.host == peer), time.time())
    failing.mark(settings, peer, beat, reason)


def peer_timeout_s(settings: Settings) -> float:
    """``cluster.peer_timeout``: how long past its expected start a peer may stay silent."""
    return _view(settings).cc.peer_timeout_s


def count_sent(settings: Settings, peer: str) -> None:
    """One more request handed to ``peer``, counted by this process for its next choices until
    the peer's report shows it (herding: see ``gpulock.cluster.place``)."""
    _cc, reports = peers(settings)
    at = next((r.at_wall for r in reports if r.host == peer), None)
    _sends().add(peer, at, time.time())


def share_cooldown(settings: Settings, key: str, length_s: float, reason: str) -> None:
    """Cool ``key`` (a cid) down for every host of the cluster, not just this one."""
    from gpulock.cluster import cooldowns
    from gpulock.cluster.store import Unavailable

    v = _view(settings)
    until = time.time() + length_s
    try:
        cooldowns.share(v.store, key, until, reason, v.cc.host)
        if v.cooldowns is not None:
            v.cooldowns[key] = (until, f"{reason} (on {v.cc.host})")
    except Unavailable:
        pass  # this host's ledger has it; the others learn of the endpoint themselves


def shared_cooldowns(settings: Settings) -> dict[str, tuple[float, str]]:
    """The cluster's cooldowns in force (none while Redis is unavailable)."""
    from gpulock.cluster import cooldowns
    from gpulock.cluster.store import Unavailable

    if _cooldown_feed is not None:
        return _cooldown_feed()
    v = _view(settings)
    now = time.monotonic()
    if v.cooldowns is None or now - v.cooldowns_at >= v.cc.heartbeat_s / 2:
        v.cooldowns_at = now
        try:
            v.cooldowns = cooldowns.read(v.store)
        except Unavailable:
            v.cooldowns = {}
    return dict(v.cooldowns)


def store(settings: Settings) -> Store:
    """This process's one connection to the cluster's Redis (with its back-off)."""
    return _view(settings).store


def hosts_last_seen(settings: Settings) -> int:
    """How many hosts share the budgets: as this process last read them, else as this host's
    ``gpulock serve`` last wrote them (``cluster.json``, however old), else 1."""
    v = _view(settings)
    if v.hosts_seen:
        return v.hosts_seen
    from gpulock.core import clusterview

    view = clusterview.read(settings, time.time(), any_age=True)
    return view.hosts if view is not None and view.hosts > 0 else 1
