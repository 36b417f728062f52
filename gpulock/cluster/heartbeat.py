"""The heartbeat: every ``cluster.heartbeat``, publish this host and read the others.

``tick(now)`` does one pass; ``run(stop)`` is the loop around it, one pass a heartbeat, in a
thread of ``gpulock serve`` (Redis calls never run on the event loop).  Each pass:

1. build this host's report (a callable given by the server: GPUs, lines, candidates, warm);
2. publish it (expires after three heartbeats) and read every live host's report;
3. write ``<state>/cluster.json`` (``gpulock.core.clusterview``) for ``gpulock status``;
4. on a change of Redis's health, emit ``cluster-degraded`` or ``cluster-restored``.

When Redis fails, the peers last read are dropped (a partitioned host routes locally only)
and the host keeps serving its own line: nothing here waits longer than the store's timeout.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from gpulock.cluster import cooldowns, spend
from gpulock.cluster import report as report_mod
from gpulock.cluster.config import ClusterConfig
from gpulock.cluster.place import Sent
from gpulock.cluster.report import HostReport
from gpulock.cluster.store import Store, Unavailable
from gpulock.core import clusterview
from gpulock.core.settings import Settings


@dataclass(frozen=True, slots=True)
class Fleet:
    """What the last heartbeat read: the live hosts' reports, and Redis's health."""

    reports: tuple[HostReport, ...] = ()
    redis_ok: bool = False
    problem: str | None = None
    read_wall: float = 0.0
    cooling: frozenset[str] = frozenset()  # peers cooling down after a failure (any host's)
    cooldowns: Mapping[str, tuple[float, str]] = field(default_factory=dict)  # every endpoint's
    spend: Mapping[str, float] = field(default_factory=dict)  # today's cloud spend, by cid


class Heartbeat:
    def __init__(
        self,
        settings: Settings,
        cc: ClusterConfig,
        build: Callable[[float], HostReport],
        *,
        store: Store | None = None,
        ledger_spend: Callable[[], Mapping[str, float]] | None = None,
    ) -> None:
        """``ledger_spend``: this host's cloud spend today by cid, from its own ledger: each
        beat refills Redis with it (``gpulock.cluster.spend.refill``)."""
        self.settings = settings
        self.cc = cc
        self.build = build
        self.store = store or Store(cc)
        self.ledger_spend = ledger_spend
        self.fleet = Fleet()
        self._was_up: bool | None = None
        self._hosts_seen = 1
        self._sent = Sent()  # requests sent to each peer, recently (herding: gpulock.cluster.place)

    # --- one pass ----------------------------------------------------------------------------

    def tick(self, now_wall: float | None = None) -> None:
        now = time.time() if now_wall is None else now_wall
        mine = self.build(now)
        try:
            if self.ledger_spend is not None:
                spend.refill(self.store, self.ledger_spend())
            self.store.publish(mine.as_dict(), now_wall=now)
            raw = self.store.hosts()
            cooling = cooldowns.read(self.store, now_wall=now)
            spent = spend.spent(self.store, now_wall=now)
        except Unavailable as e:
            self.fleet = Fleet((), False, self.store.problem or str(e), now)
            self._changed(False)
            self._view(now)
            return
        reports = tuple(r for r in (report_mod.parse(o) for o in raw) if r is not None)
        peers = cooldowns.cooling_peers(cooling)
        self.fleet = Fleet(reports, True, None, now, peers, cooling, spent)
        self._hosts_seen = max(1, len(reports))
        self._changed(True)
        self._view(now)

    def run(self, stop: threading.Event) -> None:
        """Beat until ``stop`` is set; then withdraw this host at once."""
        while not stop.is_set():
            started = time.monotonic()
            try:
                self.tick()
            except Exception as e:  # a bad report must not end the heartbeat for good
                self.settings.emit("cluster-error", host=self.cc.host, error=type(e).__name__)
            stop.wait(max(0.0, self.cc.heartbeat_s - (time.monotonic() - started)))
        try:
            self.store.withdraw()
        except Unavailable:
            pass  # its report expires by itself
        self.store.close()

    def start(self) -> tuple[threading.Thread, threading.Event]:
        stop = threading.Event()
        t = threading.Thread(target=self.run, args=(stop,), name="gpulock-cluster", daemon=True)
        t.start()
        return t, stop

    # --- herding -----------------------------------------------------------------------------

    def sent(self) -> dict[str, int]:
        """Requests sent to each peer that its report (as last read) does not show yet."""
        return self._sent.counts(self.fleet.reports)

    def count_sent(self, host: str) -> None:
        at = next((r.at_wall for r in self.fleet.reports if r.host == host), None)
        self._sent.add(host, at, time.time())

    # --- edges -------------------------------------------------------------------------------

    def _changed(self, up: bool) -> None:
        if up == self._was_up:
            return
        first = self._was_up is None
        self._was_up = up
        if not up:
            self.settings.emit(
                "cluster-degraded", host=self.cc.host, problem=self.fleet.problem or "unreachable"
            )
        elif not first:
            self.settings.emit("cluster-restored", host=self.cc.host, hosts=self._hosts_seen)

    def _view(self, now: float) -> None:
        try:
            clusterview.write(
                self.settings,
                clusterview.View(
                    host=self.cc.host,
                    hosts=self._hosts_seen,
                    redis="ok" if self.fleet.redis_ok else "down",
                    problem=self.fleet.problem,
                    heartbeat_s=self.cc.heartbeat_s,
                    updated_wall=now,
                    pid=os.getpid(),
                ),
            )
        except OSError:
            pass  # status loses one line; serving goes on
