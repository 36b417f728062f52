"""``gpulock serve`` in a cluster: what it publishes of this host, and where a request runs.

Imported only when the config has a ``cluster:`` section (the ``cluster`` package and its
``redis`` client stay unloaded otherwise).  ``report(now)`` is the heartbeat's view of this
host: each GPU's line (holders, waiters, the router's wait estimate for a newcomer), the gpu
candidates of the route table that fit one of its GPUs, which are warm, and the requests in
flight.  ``place(...)`` compares this host's verdict with the live peers' reports
(``gpulock.cluster.place``) and names the location with the smallest expected start.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Collection
from contextlib import AsyncExitStack
from dataclasses import replace
from typing import Any

from gpulock.cluster import cooldowns, failing, spend
from gpulock.cluster.config import ClusterConfig
from gpulock.cluster.fleet import fleet_object, spend_entry
from gpulock.cluster.heartbeat import Heartbeat
from gpulock.cluster.place import Location, here, locations
from gpulock.cluster.report import GpuLine, HostReport, Runs, load_estimate_s
from gpulock.cluster.store import Unavailable
from gpulock.core.settings import Settings
from gpulock.router import ledger, probe
from gpulock.router.accounting import PEER_FAILURES
from gpulock.router.backends import BackendError
from gpulock.router.backends.peer import FROM_HEADER, silence_s
from gpulock.router.choose import Choice, Host, Verdict, cid, line_wait
from gpulock.router.routes import Candidate
from gpulock.router.waitest import quantile
from gpulock.serve.dispatch import Dispatcher
from gpulock.serve.engines import Answer, Ask, Usage
from gpulock.serve.opened import Meta, Opened
from gpulock.serve.remote import RemoteEngine


class PeerEngine(RemoteEngine):
    """A peer's gateway: its OpenAI API, with ``model`` = the candidate's name, the agent's
    name and what is left of the deadline, and this host's key when it has one.  A peer that
    sends no response headers within ``peer_timeout`` past its expected start (a frozen host
    still accepts connections) fails like a refused connection: the next location is tried."""

    def __init__(
        self, c: Candidate, client: Any, *, agent: str, left_s: float | None, me: str,
        key_env: str | None, header_timeout_s: float,
    ) -> None:  # fmt: skip
        super().__init__(c, client)
        self.agent = agent
        self.left_s = left_s
        self.me = me
        self.key_env = key_env
        self.header_timeout_s = header_timeout_s

    def _headers(self) -> dict[str, str]:
        out = {"X-Gpulock-Agent": self.agent, FROM_HEADER: self.me}
        if self.left_s is not None:
            out["X-Gpulock-Deadline"] = f"{self.left_s:.3f}s"
        key = os.environ.get(self.key_env or "") if self.key_env else None
        if key:
            out["Authorization"] = f"Bearer {key}"
        return out

    def _timeout(self) -> Any:
        from gpulock.serve.upstream import Timeouts

        return Timeouts(
            total_s=self.candidate.timeout_s,
            connect_s=self.header_timeout_s,
            read_s=self.header_timeout_s,
        )

    async def answer(self, ask: Ask) -> Answer:
        """A whole answer, asked of the peer as a stream: its headers come with the first
        piece (the call has started there), so a long answer is not taken for silence."""
        usage = Usage()
        text = "".join([piece async for piece in self.stream(ask, usage)])
        return Answer(text, usage)


class ClusterLink:
    def __init__(self, settings: Settings, cc: ClusterConfig, dispatcher: Dispatcher) -> None:
        self.settings = settings
        self.cc = cc
        self.d = dispatcher
        self.heartbeat = Heartbeat(
            settings, cc, self.report, ledger_spend=lambda: ledger.read(settings).spend_usd
        )

    # --- what this host publishes ------------------------------------------------------------

    def _warm(self) -> set[str]:
        return probe.warm_models() | {cid(b.candidate) for b in self.d.loaded()}

    def report(self, now_wall: float) -> HostReport:
        gpu_cands = [c for c in self.d.candidates() if c.tier == "gpu"]
        rs = self.d.table.settings
        host = probe.host(self.settings, gpu_cands, rs, warm=self._warm(), now_wall=now_wall)
        gpus = []
        for g in host.gpus:
            hold = self._request_s(g.index)
            holding = sum(1 for q in g.line if q.held_s is not None)
            est = g.est_wait_s if g.ahead else 0.0
            wait, ahead = self._with_own(g.index, est, g.ahead)
            gpus.append(
                GpuLine(
                    g.index,
                    g.total_bytes,
                    g.shown_free_bytes,  # as gpulock status shows it (the lock's claims count)
                    holding,
                    max(0, ahead - holding),
                    wait,
                    hold,
                    claimed_bytes=g.claimed_bytes,
                )
            )
        runs = []
        for c in gpu_cands:
            need = host.vram_of(c)
            fits = tuple(
                g.index
                for g in host.gpus
                if (c.gpu is None or g.index == c.gpu)
                and (need is None or g.budget_bytes is None or need <= g.budget_bytes)
            )
            if fits:
                waits = tuple(self._candidate_wait(host, c, need, i)[0] for i in fits)
                runs.append(Runs(c.name, load_estimate_s(need), fits, waits))
        warm = {c.name for c in gpu_cands if cid(c) in host.warm}
        in_flight = sum(self.d.line.held().values()) + self.d.line.waiting
        return HostReport(
            host=self.cc.host,
            gateway=self.cc.gateway,
            at_wall=now_wall,
            heartbeat_s=self.cc.heartbeat_s,
            level=host.level,
            gpus=tuple(gpus),
            candidates=tuple(runs),
            warm=frozenset(warm),
            in_flight=in_flight,
            pid=os.getpid(),
        )

    # --- where a request runs ----------------------------------------------------------------

    def place(
        self,
        v: Verdict,
        here_wait: tuple[float | None, int] | None,
        exclude: Collection[str],
        deadline_s: float | None = None,
        *,
        warm: bool = False,
    ) -> list[Location]:
        """This host (unless ``here_wait`` is None: its line is past the deadline) and every
        live peer that runs ``v``'s candidate, best first.  ``warm``: the candidate is warm
        here (its cid in the request's ``Host.warm``: loaded in this process, or held by its
        tenant now), as this host's report says it to the peers."""
        c = v.candidate
        local = None
        if here_wait is not None:
            local = here(
                self.cc.host,
                here_wait[0],
                here_wait[1],
                warm=warm,
                load_s=load_estimate_s(v.need_bytes),
                gpu=v.gpu,
            )
        fleet = self.heartbeat.fleet
        if not fleet.redis_ok:
            return [local] if local is not None else []
        beats = ((r.host, r.at_wall) for r in fleet.reports)
        failing_here = failing.failing_now(self.settings, beats)
        return locations(
            c.name,
            local,
            fleet.reports,
            me=self.cc.host,
            now_wall=time.time(),
            penalty_s=self.cc.remote_penalty_s,
            sent=self.heartbeat.sent(),
            exclude=set(exclude) | fleet.cooling | failing_here,
            deadline_s=deadline_s,
        )

    async def relocate(
        self,
        d: Dispatcher,
        ask: Ask,
        choice: Choice,
        host: Host,
        agent: str,
        left: float | None,
    ) -> Opened | None:
        """The request, forwarded to a peer that starts its gpu candidate sooner; None: run
        it here.  The verdicts offered, in turn, are ``gpulock.router.peers.offers``: a local gpu
        candidate passed over only for its line (past the deadline) too."""
        from gpulock.router.peers import offers

        for v, here_too in offers(choice):
            c = v.candidate
            if here_too:
                here_wait = (
                    self._candidate_wait(host, c, v.need_bytes, v.gpu)
                    if v.gpu is not None
                    else line_wait(host, v)
                )
                warm = cid(c) in host.warm
                return await self.try_peers(d, ask, v, here_wait, agent, left, warm=warm)
            opened = await self.try_peers(d, ask, v, None, agent, left)
            if opened is not None:
                return opened
        return None

    async def try_peers(
        self,
        d: Dispatcher,
        ask: Ask,
        v: Verdict,
        here_wait: tuple[float | None, int] | None,
        agent: str,
        left: float | None,
        *,
        warm: bool = False,
    ) -> Opened | None:
        """Forward to the best peer while a peer starts sooner than this host; None: run here.

        A peer that refuses, sends no headers in time, or dies before its first piece is
        skipped for this call and the next location is tried; this host comes last."""
        start = time.monotonic()
        failed: set[str] = set()
        while True:
            locs = self.place(v, here_wait, failed, left, warm=warm)
            if not locs or locs[0].local:
                return None
            loc = locs[0]
            try:
                return await self.forward(d, ask, v, loc, agent, left, start)
            except BackendError as e:
                if e.kind == "request" or e.status in (400, 413, 422):
                    raise  # the request's fault: another host would refuse it too
                failed.add(loc.host)
                self.peer_failed(loc, e, v.candidate.task, agent)
                await asyncio.to_thread(self.cool_peer, loc.host, e.short, e.kind)

    async def forward(
        self,
        d: Dispatcher,
        ask: Ask,
        v: Verdict,
        loc: Location,
        agent: str,
        left: float | None,
        start: float,
    ) -> Opened:
        """Send the request to the peer at ``loc``; it waits in the peer's line there."""
        c = v.candidate
        assert loc.gateway is not None
        # The peer's gateway, not this host's tenant (a tenant's model runs on the peer
        # through the peer's own tenant): its cid, cooldowns and accounting are the peer's.
        peer_c = replace(
            c, backend="openai", model=c.name, base_url=loc.gateway + "/v1", tenant=None
        )
        engine = PeerEngine(
            peer_c,
            d.http(),
            agent=agent,
            left_s=left,
            me=self.cc.host,
            key_env=self.cc.api_key_env,
            header_timeout_s=silence_s(self.cc.peer_timeout_s, loc.start_s, left, c.timeout_s),
        )
        if ask.kind != "embed" and "max_tokens" not in ask.params:
            ask = replace(ask, params={**ask.params, "max_tokens": c.max_tokens})
        self.heartbeat.count_sent(loc.host)
        meta = Meta(c.task, c.tier, c.name, (time.monotonic() - start) * 1000, None, loc.host)
        stack = AsyncExitStack()
        try:
            return await d.run(ask, Opened(meta, stack, peer_c), engine)
        except BaseException:
            await stack.aclose()
            raise

    def peer_failed(self, loc: Location, e: BackendError, task: str, agent: str) -> None:
        self.settings.emit(
            "fallback",
            task=task,
            agent=agent,
            from_model=f"{loc.host}",
            from_tier="peer",
            host=loc.host,
            error=e.short,
        )

    def _request_s(self, gpu: int) -> float:
        """What one more request adds to the wait on ``gpu``: the line's pace, else the median
        of the GPU's recent holds (``router.hold_estimate`` before any)."""
        return self.d.line.request_s(gpu) or _typical_hold(
            self.settings, gpu, self.d.table.settings.hold_estimate_s
        )

    def _candidate_wait(
        self, host: Host, c: Candidate, need: int | None, gpu: int
    ) -> tuple[float | None, int]:
        """A newcomer's wait for ``c`` on ``gpu`` and the requests ahead of it, the same in this
        host's own estimate and in the report its peers read: the GPU's line for its need (it
        may share the GPU with the holders), with this server's own requests at their pace.  A
        ``kind: command`` tenant's calls take no ticket (its server holds one for as long as
        it runs): while it runs, nothing of the line is ahead of them; while it does not, its
        start waits in the line like any load."""
        if self.d.own_ticket(c) and cid(c) in host.warm:
            return 0.0, 0
        return self._with_own(gpu, *line_wait(host, Verdict(c, True, "", gpu=gpu, need_bytes=need)))

    def _with_own(self, gpu: int, wait: float | None, ahead: int) -> tuple[float | None, int]:
        """The wait on ``gpu`` and the requests ahead, counting this server's own requests at
        its pace.  The GPU's queue shows their tickets, but not the requests under a shared
        ticket, and tickets that share the GPU's memory read as no wait, while a llama.cpp
        model runs one call at a time: each request of this server in line adds one request's
        time (the larger of the two estimates stands)."""
        n = self.d.line.busy(gpu)
        if not n:
            return wait, ahead
        own = n * self._request_s(gpu)
        return (own if wait is None else max(wait, own)), max(ahead, n)

    def cool_peer(self, host: str, why: str, kind: str = "server") -> None:
        """The peer cools down for every host (Redis; off the event loop), and one that was
        silent, gone or broken is failing for every caller of this host until it beats again
        (``gpulock.cluster.failing``)."""
        if kind in PEER_FAILURES:
            beat = next((r.at_wall for r in self.heartbeat.fleet.reports if r.host == host), None)
            failing.mark(self.settings, host, time.time() if beat is None else beat, why)
        until = time.time() + self.d.table.settings.cooldown_s
        try:
            cooldowns.share(self.heartbeat.store, cooldowns.peer(host), until, why, self.cc.host)
        except Unavailable:
            pass  # this host skips it for this call; its report expires by itself

    def health(self) -> dict[str, Any]:
        """``/health``'s ``cluster`` entry: hosts seen and Redis's state."""
        f = self.heartbeat.fleet
        return {
            "host": self.cc.host,
            "hosts": len(f.reports) if f.redis_ok else None,
            "redis": "ok" if f.redis_ok else "down",
            "problem": f.problem,
        }

    def fleet_object(self) -> dict[str, Any]:
        """The fleet as the last heartbeat read it (``GET /gpulock/cluster``)."""
        f = self.heartbeat.fleet
        now = time.time()
        obj = fleet_object(
            f.reports,
            me=self.cc.host,
            redis_ok=f.redis_ok,
            problem=f.problem,
            now_wall=now,
            cooling=f.cooling,
        )
        day = spend.day(f.read_wall or now)
        budget = self.d.table.settings.daily_budget_usd
        obj["spend"] = spend_entry(dict(f.spend), budget, day) if f.redis_ok else None
        return obj

    def start(self) -> Callable[[], None]:
        """Start the heartbeat thread; the returned function stops it (and withdraws)."""
        from gpulock.router import peers

        peers.feed_cooldowns(lambda: dict(self.heartbeat.fleet.cooldowns))
        thread, stop = self.heartbeat.start()

        def halt() -> None:
            stop.set()
            thread.join(timeout=2.0)

        return halt


def _typical_hold(settings: Settings, gpu: int, default_s: float) -> float:
    """The median of this GPU's recent holds (``router.hold_estimate`` before any): what one
    more request adds to a peer's wait, for the requests sent since its last heartbeat."""
    history = probe.hold_history(settings.state_dir, gpu, default_s)
    return quantile(history.gpu, 0.5) if history.gpu else default_s
