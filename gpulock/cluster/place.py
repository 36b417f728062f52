"""Where a gpu candidate runs: this host or a live peer, by the smallest expected start (pure).

A location's expected start is its line's wait estimate, plus the candidate's load time unless
it is warm there, plus ``remote_penalty`` for a peer (the network, and the risk).  Ties stay
local.  A peer whose governor says ``freeze``, one without a gateway, one whose report is older
than three heartbeats, or one that failed on this call is not a location.

Heartbeats are seconds old when read, so a burst of agents would all pile onto the one peer that
looked idle (herding).  Two counts keep them apart: the peer's report counts the requests in
its line (waiting ones are in its estimate), and this host counts the requests it has itself
sent to each peer that the report cannot show yet (``in_transit``): each adds one typical hold
(``hold_s``) to the peer's wait.  Those are the requests sent after the report was made, and
those sent shortly before it (``TRANSIT_S``): a request takes a while to reach the peer's line
(the network, the peer's own choice), so a report made meanwhile does not count it; forgetting
it when that report arrived sent a burst's next requests to the peer that looked idle again.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from gpulock.cluster.config import GONE_AFTER_HEARTBEATS
from gpulock.cluster.report import GpuLine, HostReport

# A forwarded request's time to show in the peer's line (the network, the peer's choice), and
# the hosts' clocks' skew: a report made less than this after a request was sent may miss it.
TRANSIT_S: Final = 0.25


def in_transit(sent_wall: Iterable[float], report_at_wall: float) -> int:
    """How many of the requests sent to a peer (at these wall times, this host's clock) its
    report made at ``report_at_wall`` does not show (see the module doc)."""
    return sum(1 for t in sent_wall if t > report_at_wall - TRANSIT_S)


class Sent:
    """When this process sent requests to each peer, for as long as the peer's report may not
    show them (``in_transit``): the one bookkeeping of ``gpulock serve`` and of ``get_model``."""

    def __init__(self) -> None:
        self._times: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    def add(self, host: str, report_at_wall: float | None, now_wall: float) -> None:
        """One more request sent to ``host``, whose last report was made at ``report_at_wall``
        (None: none read).  Sends that report shows are forgotten (a newer one shows them too)."""
        with self._lock:
            times = self._times.get(host, [])
            if report_at_wall is not None:
                times = [t for t in times if in_transit((t,), report_at_wall)]
            self._times[host] = [*times, now_wall]

    def counts(self, reports: Iterable[HostReport]) -> dict[str, int]:
        """The requests sent to each of these peers that its report does not show yet."""
        with self._lock:
            return {
                r.host: n
                for r in reports
                if (n := in_transit(self._times.get(r.host, ()), r.at_wall))
            }


@dataclass(frozen=True, slots=True)
class Location:
    host: str
    local: bool
    start_s: float
    reason: str  # "starts in ~0 s (warm)", "~41 s behind 2 tickets"
    gateway: str | None = None
    gpu: int | None = None

    @property
    def label(self) -> str:
        return "here" if self.local else self.host


def here(
    host: str, wait_s: float | None, ahead: int, *, warm: bool, load_s: float, gpu: int | None
) -> Location:
    """This host's own location, from the router's verdict on the local line."""
    wait = wait_s or 0.0
    start = wait + (0.0 if warm else load_s)
    return Location(host, True, start, _reason(start, ahead, warm, load_s), gpu=gpu)


def alive(report: HostReport, now_wall: float) -> bool:
    return now_wall - report.at_wall <= GONE_AFTER_HEARTBEATS * max(report.heartbeat_s, 0.1)


def peer(
    report: HostReport,
    name: str,
    *,
    sent: int = 0,
    penalty_s: float = 0.0,
    deadline_s: float | None = None,
) -> Location | None:
    """``report``'s location for candidate ``name``; None when it cannot run it now (or its
    line's wait passes the deadline, as a local line's would)."""
    runs = report.runs(name)
    if runs is None or report.gateway is None or report.level == "freeze":
        return None
    gpus = [g for g in report.gpus if not runs.gpus or g.index in runs.gpus]
    if not gpus:
        return None

    def wait(g: GpuLine) -> float:
        own = runs.wait_on(g.index)  # the candidate's own, where the host published it
        g_wait = own if own is not None else g.est_wait_s
        base = g_wait if g_wait is not None else (g.holding + g.waiting) * g.hold_s  # a hold each
        return base + sent * g.hold_s

    best = min(gpus, key=wait)
    ahead = best.holding + best.waiting + sent
    line_s = wait(best) + penalty_s
    if deadline_s is not None and ahead and line_s > deadline_s:
        return None
    warm = name in report.warm
    start = line_s + (0.0 if warm else runs.load_s)
    return Location(
        report.host,
        False,
        start,
        _reason(start, ahead, warm, runs.load_s),
        gateway=report.gateway,
        gpu=best.index,
    )


def locations(
    name: str,
    local: Location | None,
    reports: Sequence[HostReport],
    *,
    me: str,
    now_wall: float,
    penalty_s: float,
    sent: Mapping[str, int] | None = None,
    exclude: Collection[str] = (),
    deadline_s: float | None = None,
) -> list[Location]:
    """Every location for ``name``, best first (ties: this host first)."""
    sent = sent or {}
    out = [local] if local is not None else []
    for r in reports:
        if r.host == me or r.host in exclude or not alive(r, now_wall):
            continue
        loc = peer(r, name, sent=sent.get(r.host, 0), penalty_s=penalty_s, deadline_s=deadline_s)
        if loc is not None:
            out.append(loc)
    # sorted() is stable and the local one is first: an equal start stays here.
    return sorted(out, key=lambda loc: (round(loc.start_s, 6), not loc.local))


def explain(tier: str, name: str, locs: Sequence[Location]) -> str:
    """``gpu tiny-gpu on b: starts in ~0 s (warm); here: ~41 s behind 2 tickets``."""
    if not locs:
        return f"{tier} {name}: nowhere to run"
    best, rest = locs[0], locs[1:]
    where = "here" if best.local else f"on {best.host}"
    text = f"{tier} {name} {where}: {best.reason}"
    return text + "".join(f"; {loc.label}: {loc.reason}" for loc in rest)


def _reason(start_s: float, ahead: int, warm: bool, load_s: float) -> str:
    text = f"starts in ~{start_s:.0f} s"
    if ahead:
        text = f"~{start_s:.0f} s behind {ahead} ticket{'s' if ahead != 1 else ''}"
    return text + (" (warm)" if warm else f" (load ~{load_s:.0f} s)")
