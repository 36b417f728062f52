"""Where a gpu candidate runs (``gpulock.cluster.place``) and what a host's report holds
(``gpulock.cluster.report``): pure functions, table tests."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest

from gpulock.cluster import place, report
from gpulock.cluster.report import GpuLine, HostReport, Runs

NOW = 1_000_000.0


def peer(
    name: str,
    *,
    wait: float | None = 0.0,
    holding: int = 0,
    waiting: int = 0,
    warm: bool = False,
    level: str = "normal",
    age: float = 0.5,
    gateway: str | None = "http://peer",
    runs: bool = True,
    load_s: float = 5.0,
) -> HostReport:
    return HostReport(
        host=name,
        gateway=gateway,
        at_wall=NOW - age,
        heartbeat_s=2.0,
        level=level,
        gpus=(GpuLine(0, 24 << 30, 20 << 30, holding, waiting, wait, 4.0),),
        candidates=(Runs("tiny-gpu", load_s, (0,)),) if runs else (),
        warm=frozenset({"tiny-gpu"}) if warm else frozenset(),
    )


def local(wait: float, ahead: int = 0, *, warm: bool = False) -> place.Location:
    return place.here("a", wait, ahead, warm=warm, load_s=5.0, gpu=0)


def best(loc: place.Location | None, *reports: HostReport, **kw: object) -> str:
    locs = place.locations(
        "tiny-gpu",
        loc,
        reports,
        me="a",
        now_wall=NOW,
        penalty_s=1.0,
        **kw,  # type: ignore[arg-type]
    )
    return locs[0].label


def test_a_busy_local_gpu_sends_work_to_an_idle_peer() -> None:
    assert best(local(41.0, 2), peer("b")) == "b"


def test_a_warm_peer_wins_over_a_cold_local_load() -> None:
    assert best(local(0.0), peer("b", warm=True)) == "b"  # 0 + 1 (penalty) < 0 + 5 (load)
    assert best(local(0.0, warm=True), peer("b", warm=True)) == "here"


def test_ties_stay_local() -> None:
    # here: 1 s of wait + 5 s of load; b: 0 + 5 + 1 (penalty): the same start
    assert best(local(1.0), peer("b")) == "here"


@pytest.mark.parametrize(
    ("why", "p"),
    [
        ("frozen by its governor", peer("b", warm=True, level="freeze")),
        ("silent for 3 heartbeats", peer("b", warm=True, age=6.5)),
        ("no gateway: sends work, takes none", peer("b", warm=True, gateway=None)),
        ("cannot run the candidate", peer("b", warm=True, runs=False)),
        ("this host's own report", peer("a", warm=True)),
    ],
)
def test_a_peer_that_is_no_location(why: str, p: HostReport) -> None:
    assert best(local(30.0, 1), p) == "here", why


def test_a_peer_that_failed_on_this_call_is_skipped() -> None:
    assert best(local(30.0, 1), peer("b"), peer("c", wait=2.0), exclude={"b"}) == "c"
    assert best(local(30.0, 1), peer("b"), exclude={"b"}) == "here"


def test_requests_sent_since_a_heartbeat_spread_a_burst_over_the_peers() -> None:
    """Herding: both peers look idle; what this host sent since their heartbeat counts."""
    b, c = peer("b"), peer("c")
    assert best(local(60.0, 3), b, c) == "b"
    assert best(local(60.0, 3), b, c, sent={"b": 1}) == "c"  # b: +1 hold of 4 s
    assert best(local(60.0, 3), b, c, sent={"b": 2, "c": 1}) == "c"


def test_requests_on_their_way_count_until_a_report_can_show_them() -> None:
    """A report made just after requests were sent (before they reached the peer's line) does
    not show them: they still count; those sent well before it are in it, and count no more."""
    assert place.in_transit([NOW - 5.0, NOW - 0.1, NOW + 1.0], NOW) == 2
    assert place.in_transit([NOW - place.TRANSIT_S - 0.01], NOW) == 0


def test_the_heartbeat_keeps_counting_sends_a_new_report_cannot_show_yet(tmp_path: Path) -> None:
    """Forgetting what was sent whenever a new report arrived sent a burst's next requests to
    the peer that looked idle again (a skewed load kept piling onto one peer)."""
    from gpulock.cluster.config import ClusterConfig
    from gpulock.cluster.heartbeat import Fleet, Heartbeat
    from gpulock.core.config import parse_config
    from gpulock.core.settings import load as load_settings

    settings = load_settings(parse_config("simulate: 24GiB\n", "test.yaml"), tmp_path)
    cc = ClusterConfig(redis_url="redis://127.0.0.1:9/0", host="a")
    hb = Heartbeat(settings, cc, lambda now: peer("a"))

    def seen(at_wall: float) -> None:
        b = replace(peer("b"), at_wall=at_wall)
        hb.fleet = Fleet((b,), True, None, time.time())

    seen(time.time() - 1.0)
    hb.count_sent("b")
    hb.count_sent("b")
    assert hb.sent() == {"b": 2}
    seen(time.time())  # made while the two were on their way: it shows neither
    assert hb.sent() == {"b": 2}
    hb.count_sent("b")
    assert hb.sent() == {"b": 3}
    seen(time.time() + place.TRANSIT_S + 0.01)  # a report that shows all three
    assert hb.sent() == {}


def test_a_candidates_own_published_wait_stands_over_the_gpus() -> None:
    """The GPU's estimate is an exclusive newcomer's; a candidate whose need shares the GPU
    with its holders (or a command tenant's, whose calls take no ticket) waits less."""
    busy = peer("b", wait=60.0, holding=1, warm=True)
    assert best(local(30.0, 1), busy) == "here"
    own = replace(busy, candidates=(Runs("tiny-gpu", 5.0, (0,), (0.0,)),))
    assert best(local(30.0, 1), own) == "b"
    again = report.parse(json.loads(json.dumps(own.as_dict())))
    assert again is not None and again.candidates == own.candidates


def test_an_unknown_estimate_counts_a_hold_per_ticket() -> None:
    assert best(local(6.0, 1), peer("b", wait=None, holding=1, waiting=1)) == "here"  # 8+5+1


def test_explain_names_every_location() -> None:
    locs = place.locations(
        "tiny-gpu", local(41.0, 2), [peer("b", warm=True)], me="a", now_wall=NOW, penalty_s=0.0
    )
    text = place.explain("gpu", "tiny-gpu", locs)
    assert text == (
        "gpu tiny-gpu on b: starts in ~0 s (warm); here: ~46 s behind 2 tickets (load ~5 s)"
    )


def test_a_report_round_trips_and_readers_skip_what_they_cannot_read() -> None:
    r = peer("b", warm=True, holding=1, waiting=2, wait=3.25)
    again = report.parse(json.loads(json.dumps(r.as_dict())))
    assert again is not None
    assert again.as_dict() == r.as_dict()
    newer = {**r.as_dict(), "future_key": [1, 2]}
    parsed = report.parse(newer)
    assert parsed is not None and parsed.extra == {"future_key": [1, 2]}
    broken = [{**r.as_dict(), "gpus": "no"}, {**r.as_dict(), "host": ""}]
    for bad in (None, [], {"format": "x"}, *broken):
        assert report.parse(bad) is None


def test_load_time_when_none_was_measured() -> None:
    assert report.load_estimate_s(None) == 1.0
    assert report.load_estimate_s(512 << 20) == 1.0
    assert report.load_estimate_s(8 << 30) == 8.0


def test_a_deadline_applies_to_a_peer_as_it_does_here() -> None:
    busy_peer = peer("b", wait=40.0, holding=1, warm=True)
    assert best(local(60.0, 2), busy_peer) == "b"
    assert best(local(60.0, 2), busy_peer, deadline_s=30.0) == "here"  # 40 s + 1 s > 30 s
    assert best(local(60.0, 2), peer("b", warm=True), deadline_s=0.0) == "b"  # empty line


def test_the_call_counter_says_which_host_ran_the_call() -> None:
    from gpulock.metrics.tally import Tally, fold

    t = Tally()
    for host in ("b", "b", "a"):
        fold(t, {"event": "call", "task": "chat", "tier": "gpu", "model": "m", "ok": True,
                 "host": host})  # fmt: skip
    calls = t.counters["gpulock_router_calls"]
    assert calls[("chat", "gpu", "m", "ok", "b")] == 2
    assert calls[("chat", "gpu", "m", "ok", "a")] == 1


# --- a peer that failed: skipped until it beats again; how long a peer may stay silent ---------


def test_a_failing_peer_is_skipped_until_its_heartbeat_moves(tmp_path: Path) -> None:
    from gpulock.cluster import failing
    from gpulock.core.settings import load

    s = load(None, str(tmp_path / "state"))
    assert failing.failing_now(s, [("b", 100.0)]) == frozenset()
    failing.mark(s, "b", 100.0, "timeout", now_wall=103.0)
    assert failing.failing_now(s, [("b", 100.0), ("c", 100.0)]) == {"b"}  # its report unmoved
    assert failing.failing_now(s, [("b", 102.0)]) == frozenset()  # it beat since: back
    failing.mark(s, "b", 90.0, "timeout", now_wall=104.0)  # an older report cannot undo it
    assert failing.read(s)["b"].beat_wall == 100.0
    (tmp_path / "state" / failing.FILE).write_text("{not json")
    assert failing.failing_now(s, [("b", 100.0)]) == frozenset()  # damaged: nobody marked


@pytest.mark.parametrize(
    ("start_s", "wait_s", "timeout_s", "silent_s"),
    [
        (1.5, None, 600.0, 6.5),  # peer_timeout (5 s) past the expected start
        (1.5, 0.5, 600.0, 5.5),  # never past the deadline by more than peer_timeout
        (None, 20.0, 600.0, 5.0),  # no estimate: peer_timeout from now
        (30.0, None, 10.0, 10.0),  # never past the candidate's own timeout
    ],
)
def test_a_peer_may_stay_silent_peer_timeout_past_its_start_within_the_deadline(
    start_s: float | None, wait_s: float | None, timeout_s: float, silent_s: float
) -> None:
    from gpulock.router.backends.peer import silence_s

    assert silence_s(5.0, start_s, wait_s, timeout_s) == pytest.approx(silent_s)
