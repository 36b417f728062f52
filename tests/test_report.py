"""``gpulock report``: the data built from events (pure), the page (escaped, self-contained),
the command on a state folder written by real lock use, and the page as Chromium renders it."""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import Cli, assert_clean_error, error_lines

from gpulock import report
from gpulock.report import build, percentile, render_html, summary, summary_lines

T0 = 1_795_000_000.0  # 2026-11-18: an epoch time like the ones the log carries
GIB = 1024**3
CHROMIUM = "/usr/bin/chromium"
EVIL = "<script>alert(1)</script>"


def ev(t: float, kind: str, **fields: Any) -> dict[str, Any]:
    return {"ts": T0 + t, "event": kind, **fields}


def tk(t: float, kind: str, gpu: int, ticket: int, name: str, **fields: Any) -> dict[str, Any]:
    """An event about a ticket, with the fields the lock gives every one."""
    return ev(t, kind, gpu=gpu, ticket=ticket, pid=100 + ticket, name=name, **fields)


def by_name(holds: tuple[report.Hold, ...]) -> dict[str, report.Hold]:
    return {h.name: h for h in holds}


def rel(points: tuple[tuple[float, float], ...]) -> list[tuple[float, float]]:
    return [(round(t - T0, 6), v) for t, v in points]


# --- build: holds, waits, queue, VRAM --------------------------------------------------------


def test_holds_match_by_gpu_and_ticket_whatever_the_order() -> None:
    events = [
        tk(0, "acquire", 0, 1, "digest", need_bytes=None, waited_s=0.001),
        tk(0.5, "wait", 0, 2, "tagger", need_bytes=6 * GIB),
        tk(0.6, "acquire", 1, 1, "embed", need_bytes=2 * GIB, waited_s=0.0),  # ticket 1, gpu1
        tk(2, "release", 0, 1, "digest", held_s=2.0),
        tk(2, "acquire", 0, 2, "tagger", need_bytes=6 * GIB, waited_s=1.5),
        tk(3, "release", 1, 1, "embed", held_s=2.4),
        tk(4, "release", 0, 2, "tagger", held_s=2.0),
    ]
    random.Random(7).shuffle(events)  # the log is sorted by time, whatever order lines came in
    data = build(events)
    holds = by_name(data.holds)
    assert set(holds) == {"digest", "tagger", "embed"}
    assert (holds["digest"].gpu, holds["digest"].ticket) == (0, 1)
    assert (holds["embed"].gpu, holds["embed"].ticket) == (1, 1)
    assert holds["digest"].end_wall - holds["digest"].start_wall == pytest.approx(2.0)
    assert holds["embed"].start_wall == pytest.approx(T0 + 0.6)
    assert holds["embed"].end_wall == pytest.approx(T0 + 3)
    assert all(h.end == "release" and not h.cut_short for h in data.holds)
    (wait,) = data.waits
    assert (wait.name, wait.end, wait.end_wall - wait.start_wall) == ("tagger", "acquire", 1.5)
    assert data.gpus == (0, 1)
    assert (data.start_wall, data.end_wall) == (T0, T0 + 4)
    assert data.totals.handoffs == 3 and data.totals.cut_short == 0


def test_a_holder_without_release_is_cut_short_at_its_cleanup_break_or_the_log_end() -> None:
    events = [
        tk(0, "acquire", 0, 1, "fine", waited_s=0.0),
        tk(1, "release", 0, 1, "fine", held_s=1.0),
        tk(2, "acquire", 0, 2, "crashy", waited_s=0.0),
        tk(3, "cleanup", 0, 2, "crashy", holding=True, reason="owner gone"),
        tk(4, "acquire", 0, 3, "hung", waited_s=0.0),
        tk(5, "kill", 0, 3, "hung", signal="SIGTERM", reason="hung: past its lease"),
        tk(6, "break", 0, 3, "hung", action="killed", reason="hung: past its lease"),
        tk(7, "acquire", 0, 4, "obeyed", waited_s=0.0),
        tk(8, "kill", 0, 4, "obeyed", signal="SIGTERM", reason="forced"),
        tk(8.5, "release", 0, 4, "obeyed", held_s=1.5),
        tk(9, "acquire", 1, 1, "still", waited_s=0.0),
    ]
    holds = by_name(build(events).holds)
    assert not holds["fine"].cut_short
    crashy = holds["crashy"]
    assert (crashy.end, crashy.cut_short, crashy.end_wall) == ("cleanup", True, T0 + 3)
    assert crashy.why == "owner gone"
    hung = holds["hung"]
    assert (hung.end, hung.killed, hung.cut_short, hung.end_wall) == ("break", True, True, T0 + 6)
    obeyed = holds["obeyed"]  # killed, then released by its wrapper: cut short all the same
    assert (obeyed.end, obeyed.killed, obeyed.cut_short) == ("release", True, True)
    assert holds["still"].end == "open" and holds["still"].end_wall == T0 + 9  # the log's end
    later = build(events, now_wall=T0 + 20)  # still holding now: its bar runs until now
    assert by_name(later.holds)["still"].end_wall == T0 + 20
    assert later.end_wall == T0 + 20
    assert later.totals.cut_short == 4
    assert [(m.kind, m.name) for m in later.markers] == [
        ("cleanup", "crashy"),
        ("kill", "hung"),
        ("break", "hung"),
        ("kill", "obeyed"),
    ]


def test_a_release_whose_acquire_is_before_the_log_starts_at_held_s() -> None:
    events = [
        tk(10, "release", 0, 7, "old", held_s=4.0, need_bytes=GIB),
        tk(11, "timeout", 0, 8, "late", waited_s=3.0),
    ]
    data = build(events)
    (hold,) = data.holds
    assert (hold.start_wall, hold.end_wall, hold.need_bytes) == (T0 + 6, T0 + 10, GIB)
    (wait,) = data.waits
    assert (wait.start_wall, wait.end, wait.name) == (T0 + 8, "timeout", "late")
    assert data.start_wall == T0 + 6


def test_queue_length_counts_each_waiter_until_its_acquire_timeout_or_cleanup() -> None:
    events = [
        tk(1, "wait", 0, 1, "a"),
        tk(2, "wait", 0, 2, "b"),
        tk(3, "wait", 0, 3, "c"),
        tk(3.5, "wait", 1, 1, "other-gpu"),
        tk(4, "acquire", 0, 1, "a", waited_s=3.0),
        tk(5, "timeout", 0, 2, "b", waited_s=3.0),
        tk(6, "cleanup", 0, 3, "c", holding=False, reason="owner gone"),
        tk(7, "release", 0, 1, "a", held_s=3.0),
        tk(8, "acquire", 1, 1, "other-gpu", waited_s=4.5),
        tk(9, "release", 1, 1, "other-gpu", held_s=1.0),
    ]
    data = build(events)
    q0, q1 = (s.queue for s in data.series)
    assert rel(q0) == [(1, 1), (2, 2), (3, 3), (4, 2), (5, 1), (6, 0)]
    assert rel(q1) == [(1, 0), (3.5, 1), (8, 0)]
    ends = {w.name: w.end for w in data.waits}
    assert ends == {"a": "acquire", "b": "timeout", "c": "cleanup", "other-gpu": "acquire"}
    assert data.totals.waits == 4 and data.totals.timeouts == 1


def test_percentiles_and_holder_statistics() -> None:
    assert percentile([], 50) is None
    assert percentile([5.0], 99) == 5.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([float(i) for i in range(1, 101)], 99) == pytest.approx(99.01)
    events = []
    for i, waited in enumerate([0.1, 0.2, 0.3, 0.4], start=1):
        events.append(tk(10 * i, "acquire", 0, i, "batch", waited_s=waited))
        events.append(tk(10 * i + 2, "release", 0, i, "batch", held_s=2.0))
    events.append(tk(60, "wait", 0, 9, "shy"))
    events.append(tk(61, "timeout", 0, 9, "shy", waited_s=1.0))
    data = build(events)
    stats = {h.name: h for h in data.holders}
    batch = stats["batch"]
    assert (batch.runs, batch.timeouts, batch.held_s, batch.cut_short) == (4, 0, 8.0, 0)
    assert batch.waits_p50_s == pytest.approx(0.25)
    assert batch.waits_p99_s == pytest.approx(0.397)
    shy = stats["shy"]
    assert (shy.runs, shy.timeouts, shy.waits_p50_s) == (0, 1, None)
    assert data.totals.waits_p50_s == pytest.approx(0.25)


def test_vram_series_from_needs_residents_and_the_governors_evidence() -> None:
    events = [
        tk(0, "acquire", 0, 1, "a", need_bytes=4 * GIB, waited_s=0.0),
        tk(1, "acquire", 0, 2, "b", need_bytes=6 * GIB, waited_s=0.0),
        ev(2, "resident", resident="r1", name="qwen", gpu=0, pid=9, declared_bytes=5 * GIB),
        tk(3, "release", 0, 1, "a", held_s=3.0),
        ev(4, "escalate", level="reduce", from_level="normal", evidence={"vram.gpu0": 0.91}),
        ev(5, "evict", resident="r1", name="qwen", gpu=0, pid=9, outcome="freed", reason="x"),
        tk(6, "release", 0, 2, "b", held_s=5.0),
        tk(7, "acquire", 0, 3, "whole", waited_s=0.0),  # no need: exclusive
        tk(8, "release", 0, 3, "whole", held_s=1.0),
    ]
    (s,) = build(events).series
    assert rel(s.held_bytes) == [(0, 4 * GIB), (1, 10 * GIB), (3, 6 * GIB), (6, 0)]
    assert rel(s.resident_bytes) == [(0, 0), (2, 5 * GIB), (5, 0)]
    assert rel(s.used_fraction) == [(4, 0.91)]
    assert [(a - T0, b - T0) for a, b in s.exclusive] == [(7, 8)]
    page = render_html(build(events))
    assert "VRAM claimed (peak 11.0 GiB)" not in page  # needs and residents are separate lines
    assert "VRAM claimed (peak 10.0 GiB)" in page
    assert "as the governor measured it" in page
    assert "no VRAM data in this log" not in page
    only_routes = build([ev(0, "route", task="t", agent="a", tier="cpu", model="m")])
    assert "no VRAM data in this log" in render_html(only_routes)


def test_governor_levels_evictions_and_the_plain_summary() -> None:
    events = [
        tk(0, "acquire", 0, 1, "a", waited_s=0.0),
        ev(1, "escalate", level="reduce", from_level="normal", reason="vram", evidence={}),
        ev(2, "escalate", level="evict-idle", from_level="reduce", reason="vram"),
        ev(3, "evict", resident="r1", name="m", gpu=0, pid=5, outcome="freed", reason="idle"),
        ev(3.1, "governor", action="evict", level="evict-idle", outcome="freed"),  # no change
        ev(4, "evict", resident="r2", name="n", gpu=0, pid=6, outcome="busy", reason="idle"),
        ev(5, "deescalate", level="reduce", from_level="evict-idle", reason="clear"),
        tk(6, "release", 0, 1, "a", held_s=6.0),
    ]
    data = build(events)
    t = data.totals
    assert (t.level_changes, t.level_now, t.evictions, t.evictions_freed) == (3, "reduce", 2, 1)
    assert [(lv.level, lv.start_wall - T0, lv.end_wall - T0) for lv in data.levels] == [
        ("normal", 0, 1),
        ("reduce", 1, 2),
        ("evict-idle", 2, 5),
        ("reduce", 5, 6),
    ]
    lines = summary_lines(data)
    assert "evictions: 2 (1 freed memory)" in lines
    assert "governor level changes: 3 (highest evict-idle, now reduce)" in lines
    assert "GPU handoffs: 1 (0 cut short), held 6.0 s in all" in lines
    assert "route choices by tier: none logged" in lines
    # Seen from a window that opens at 2.5 s: what was in force then still shows.
    late = build(events, since_wall=T0 + 2.5)
    assert late.totals.level_changes == 1 and late.totals.evictions == 2
    assert late.levels[0] == report.LevelSpan("evict-idle", T0 + 2.5, T0 + 5)
    (hold,) = late.holds
    assert hold.start_wall == T0 and late.start_wall == T0 + 2.5  # drawn from the window's start
    assert late.totals.handoffs == 0 and late.totals.held_s == pytest.approx(3.5)


def test_route_call_and_agent_tables() -> None:
    events = [
        ev(0, "route", task="summarize", agent="digest", tier="cpu", model="qwen-0.5b"),
        ev(1, "route", task="summarize", agent="digest", tier="cpu", model="qwen-0.5b"),
        ev(2, "route", task="draft", agent="writer", tier="cloud", model="gpt-x"),
        ev(2.5, "route", task="draft", agent="writer", tier=None, model=None, reason="none fit"),
        ev(3, "call", task="summarize", agent="digest", tier="cpu", model="qwen-0.5b",
           ok=True, tokens_in=100, tokens_out=20, latency_s=1.0, cost_usd=0.0),
        ev(4, "call", task="draft", agent="writer", tier="cloud", model="gpt-x",
           ok=True, tokens_in=300, tokens_out=80, latency_s=2.0, cost_usd=0.0125),
        ev(4.5, "call", task="draft", agent="writer", tier="cloud", model="gpt-x",
           ok=False, error="timeout", tokens_in=0, tokens_out=0, latency_s=30.0, cost_usd=0.0),
        ev(5, "agent", agent="digest", outcome="ok", reason="", duration_s=3.0),
        ev(6, "agent", agent="digest", outcome="skip", reason="gpu busy", duration_s=0.5),
        ev(7, "agent", agent="writer", outcome="error", reason="boom", duration_s=1.0),
        ev(8, "agent", agent="writer", outcome="stop", reason="SIGTERM", duration_s=2.0),
    ]  # fmt: skip
    data = build(events)
    tiers = {x.tier: x for x in data.tiers}
    assert (tiers["cpu"].routes, tiers["cpu"].calls, tiers["cpu"].tokens_in) == (2, 1, 100)
    assert (tiers["cloud"].routes, tiers["cloud"].calls, tiers["cloud"].failed) == (1, 2, 1)
    assert tiers["cloud"].cost_usd == 0.0125
    assert (tiers["none"].routes, tiers["none"].calls) == (1, 0)  # no model was available
    models = {x.model: x for x in data.models}
    assert models["gpt-x"].latency_p50_s == 16.0 and models["gpt-x"].tokens_out == 80
    agents = {a.agent: a for a in data.agents}
    assert (agents["digest"].runs, agents["digest"].ok, agents["digest"].skip) == (2, 1, 1)
    assert agents["digest"].last_reason == "gpu busy"
    assert (agents["writer"].error, agents["writer"].other) == (1, 1)
    assert agents["writer"].last_reason == "SIGTERM"
    lines = summary_lines(data)
    assert "runs: 4 (ok 1, skips 1, errors 1, killed or stopped 1)" in lines
    assert "route choices by tier: cpu 2, cloud 1, none 1" in lines
    assert "model calls: 3 (1 failed), 400 tokens in, 100 out, $0.0125" in lines
    js = summary(data)
    assert js["totals"]["route_choices"] == 4 and js["totals"]["calls"] == 3
    assert {m["model"] for m in js["models"]} == {"qwen-0.5b", "gpt-x"}
    page = render_html(data)
    assert "gpu busy" in page and "qwen-0.5b" in page


def test_a_run_the_fleet_saw_killed_counts_though_it_wrote_no_agent_event() -> None:
    # SIGKILL (or the OOM killer) leaves no 'agent' event; the fleet's 'fleet-run' says it.
    events = [
        ev(1, "agent", agent="tts", outcome="ok", reason="", duration_s=1.0, pid=10),
        ev(1, "fleet-run", agent="tts", pid=10, exit=0, duration_s=1.0, outcome="ok"),
        ev(2, "fleet-run", agent="tts", pid=11, exit=137, duration_s=0.4, outcome="killed"),
        ev(3, "agent", agent="tts", outcome="killed", reason="SIGTERM", duration_s=1, pid=12),
        ev(3, "fleet-run", agent="tts", pid=12, exit=143, duration_s=1.0, outcome="killed"),
    ]  # fmt: skip
    (tts,) = build(events).agents
    assert (tts.runs, tts.ok, tts.other) == (3, 1, 2)  # pid 12 is not counted twice
    assert "runs: 3 (ok 1, skips 0, errors 0, killed or stopped 2)" in summary_lines(build(events))


# --- robustness and escaping ------------------------------------------------------------------


GARBAGE: list[Any] = [
    None,
    5,
    "acquire",
    [],
    {},
    {"event": 3, "ts": T0},
    {"event": "acquire", "ts": "yesterday"},
    {"event": "acquire", "ts": math.nan},
    {"event": "acquire", "ts": True},
    {"event": "acquire", "ts": T0 + 1, "gpu": "zero", "ticket": [1], "name": {"x": 1}},
    {"event": "release", "ts": T0 + 2, "gpu": 0, "ticket": 5, "held_s": "long"},
    {"event": "wait", "ts": T0 + 2},
    {"event": "timeout", "ts": T0 + 3, "waited_s": -4},
    {"event": "escalate", "ts": T0 + 3, "level": 7, "evidence": [1, 2]},
    {"event": "governor", "ts": T0 + 3, "level": "", "evidence": {"vram.gpu0": "full"}},
    {"event": "evict", "ts": T0 + 4, "resident": None, "outcome": 12},
    {"event": "resident", "ts": T0 + 4, "resident": "r", "declared_bytes": "6GiB"},
    {"event": "call", "ts": T0 + 5, "tokens_in": "many", "cost_usd": math.inf, "tier": None},
    {"event": "agent", "ts": T0 + 5, "outcome": ["ok"], "duration_s": None},
    {"event": "from-the-future", "ts": T0 + 6, "whatever": {"deep": [1, {"x": None}]}},
    {"event": "acquire", "ts": 10**400},
    {"event": "acquire", "ts": -5.0},
    {"event": "acquire", "ts": 1e300},
    {"event": "acquire", "ts": T0 + 7, "gpu": 0, "ticket": 9, "need_bytes": 2**70},
    {"event": "release", "ts": T0 + 8, "gpu": 0, "ticket": 10, "held_s": 1e300},
    {"event": "call", "ts": T0 + 9, "tokens_in": 10**400, "latency_s": 10**400},
    # Finite, but past what milliseconds (x 1000) or a percentile's interpolation can hold.
    {"event": "call", "ts": T0 + 9, "tier": "cpu", "model": "m", "latency_s": 1e308},
    {"event": "call", "ts": T0 + 9, "tier": "cpu", "model": "m", "latency_s": -1e308},
    {"event": "timeout", "ts": T0 + 3, "gpu": 0, "ticket": 11, "waited_s": 1e308},
    {"event": "agent", "ts": T0 + 5, "agent": "a", "outcome": "ok", "duration_s": 1e308},
    # A pid that is a list cannot be looked up in a set.
    {"event": "agent", "ts": T0 + 5, "agent": "a", "outcome": "ok", "pid": [1]},
    {"event": "fleet-run", "ts": T0 + 5, "agent": "a", "outcome": "killed", "pid": [2]},
]


def test_the_summary_counts_the_fires_the_fleet_dropped() -> None:
    events = [
        ev(1, "fleet-run", agent="a", outcome="ok"),
        ev(2, "fleet-missed", agent="a", reason="late", scheduled_wall=1.5),
        ev(3, "fleet-missed", agent="b", reason="late", scheduled_wall=2.5),
        ev(4, "fleet-missed", agent="a", reason="running", scheduled_wall=3.5),
    ]
    data = build(events)
    assert data.totals.missed_fires == 3 and data.totals.missed_late == 2
    line = next(x for x in summary_lines(data) if x.startswith("missed fires:"))
    assert "missed fires: 3" in line and "2 could not start" in line and "1 came while" in line
    assert not any(x.startswith("missed") for x in summary_lines(build(events[:1])))


def test_garbage_missing_fields_and_unknown_events_never_raise() -> None:
    data = build(GARBAGE)
    assert data.ignored == 12
    assert data.events == len(GARBAGE) - 12
    assert (data.start_wall, data.end_wall) == (T0 + 1, T0 + 9)  # no absurd time stretched it
    page = render_html(data)
    assert page.startswith("<!doctype html>") and page.endswith("</html>")
    json.dumps(summary(data), allow_nan=False)  # valid JSON, no NaN/Infinity
    assert summary_lines(data)


def test_random_logs_never_raise() -> None:
    rng = random.Random(11)
    kinds = ["wait", "acquire", "release", "timeout", "cleanup", "break", "kill", "stale",
             "resident", "evict", "unload", "oom", "escalate", "deescalate", "governor",
             "governor-error", "route", "call", "agent", "other"]  # fmt: skip
    values: list[Any] = [None, True, 0, -1, 3, 2**70, 10**400, 1e300, -1e300, math.inf,
                         math.nan, "", EVIL, [], {}, {"vram.gpu0": 2}, 0.5, "freeze"]  # fmt: skip
    keys = ["gpu", "ticket", "name", "need_bytes", "waited_s", "held_s", "resident",
            "declared_bytes", "outcome", "reason", "level", "from_level", "evidence", "tier",
            "model", "agent", "tokens_in", "latency_s", "cost_usd", "duration_s"]  # fmt: skip
    for _ in range(300):
        events = []
        for _ in range(rng.randint(0, 30)):
            e = {"event": rng.choice(kinds), "ts": T0 + rng.random() * 100}
            if rng.random() < 0.1:
                e["ts"] = rng.choice(values)
            for k in rng.sample(keys, rng.randint(0, 8)):
                e[k] = rng.choice([*values, rng.randint(0, 3)])
            events.append(e)
        data = build(events, now_wall=rng.choice([None, T0 + 200]), since_wall=T0 + 30)
        assert render_html(data).endswith("</html>")
        json.dumps(summary(data), allow_nan=False)
        summary_lines(data)


def test_an_empty_log_says_so() -> None:
    data = build([])
    assert data.start_wall is None and data.events == 0
    page = render_html(data)
    assert "The event log is empty" in page
    assert summary_lines(data) == ["log: empty (no events)"]
    assert summary(data)["totals"]["handoffs"] == 0
    window = build([ev(0, "acquire", gpu=0, ticket=1, name="a")], since_wall=T0 + 10)
    assert window.start_wall is None and "since" in summary_lines(window)[0]


def test_every_string_from_the_log_is_escaped() -> None:
    hostile = '"><img src=x onerror=alert(2)>'
    events = [
        tk(0, "acquire", 0, 1, EVIL, waited_s=0.0),
        tk(1, "cleanup", 0, 1, EVIL, holding=True, reason=hostile),
        tk(1.5, "wait", 0, 2, hostile),
        tk(2, "timeout", 0, 2, hostile, waited_s=0.5),
        ev(2, "resident", resident=hostile, name=EVIL, gpu=0, declared_bytes=GIB),
        ev(3, "evict", resident=hostile, name=EVIL, gpu=0, outcome=hostile, reason=EVIL),
        ev(3, "escalate", level=EVIL, from_level=hostile, reason=EVIL),
        ev(4, "route", tier=EVIL, model=hostile, agent=EVIL),
        ev(4, "call", tier=EVIL, model=EVIL, tokens_in=1, tokens_out=1, latency_s=1.0),
        ev(5, "agent", agent=EVIL, outcome="error", reason=hostile, duration_s=1.0),
        ev(5, EVIL),
    ]
    page = render_html(build(events), source=EVIL)
    assert EVIL not in page and "<img" not in page
    assert page.count("<script") == 1  # the page's own
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_100k_events_build_and_render_a_bounded_page() -> None:
    rng = random.Random(3)
    names = [f"agent-{i}" for i in range(30)]
    events: list[dict[str, Any]] = []
    t, seq = 0.0, 0
    while len(events) < 100_000:
        seq += 1
        gpu, name, need = seq % 2, rng.choice(names), rng.choice([None, 2 * GIB])
        events.append(tk(t, "wait", gpu, seq, name, need_bytes=need))
        t += rng.random()
        events.append(tk(t, "acquire", gpu, seq, name, need_bytes=need, waited_s=1.0))
        t += rng.random()
        events.append(tk(t, "release", gpu, seq, name, need_bytes=need, held_s=1.0))
        if seq % 50 == 0:
            events.append(ev(t, "escalate", level="reduce", from_level="normal"))
            events.append(ev(t + 0.5, "deescalate", level="normal", from_level="reduce"))
    data = build(events)  # how fast: a benchmark's business, not a loaded test machine's
    page = render_html(data)
    assert data.totals.handoffs == seq
    assert len(page) < 12_000_000
    assert 'class="hold merged"' in page  # bars closer than a few pixels were merged


# --- the command, on a state folder written by real lock use ---------------------------------


def hold_rects(page: str) -> dict[int, str]:
    """Ticket -> class of each hold's rect in the page."""
    found = re.findall(r'<rect class="(hold(?: cut)?)" data-gpu="0" data-ticket="(\d+)"', page)
    return {int(t): cls for cls, t in found}


def test_report_of_real_lock_use(cli: Cli) -> None:
    first = cli.hold("first")
    second = cli.start_run("second", cmd=["true"])
    cli.wait_event("wait", name="second")
    impatient = cli.start_run("impatient", "--timeout", "0.3", cmd=["true"])
    assert impatient.wait() == 75
    first.release()
    assert first.wait() == 0 and second.wait() == 0
    crashy = cli.hold("crashy")
    os.killpg(crashy.pid, signal.SIGKILL)  # dies holding the GPU: no release
    crashy.wait()
    after = cli.run("run", "--name", "after", "--", "true")
    assert after.code == 0, after.describe()
    cli.wait_event("cleanup", name="crashy")

    out = cli.root / "out" / "gpu.html"
    out.parent.mkdir()
    r = cli.run("report", "--out", str(out))
    assert r.code == 0, r.describe()
    assert r.stderr == ""
    assert f"wrote {out}" in r.stdout
    assert "GPU handoffs: 4 (1 cut short)" in r.stdout, r.stdout
    assert "skips: 1 (timed out waiting)" in r.stdout, r.stdout
    assert os.listdir(out.parent) == ["gpu.html"]  # written by rename: no temporary left
    page = out.read_text()
    with open(out) as reader:  # a reader of the old page keeps it whole: a rename, not a rewrite
        assert cli.run("report", "--out", str(out)).code == 0
        assert os.fstat(reader.fileno()).st_ino != out.stat().st_ino
        assert reader.read() == page
    acquires = {e["ticket"]: e["name"] for e in cli.events("acquire")}
    rects = hold_rects(page)
    assert set(rects) == set(acquires)
    (crashy_ticket,) = [t for t, n in acquires.items() if n == "crashy"]
    assert {t for t, c in rects.items() if c == "hold cut"} == {crashy_ticket}
    assert "https://" not in page and "http://" not in page and "<link" not in page

    js = cli.run("report", "--json").json()
    assert js["format"] == "gpulock-report/1"
    assert js["totals"]["handoffs"] == 4 and js["totals"]["timeouts"] == 1
    assert js["totals"]["cut_short"] == 1 and js["kinds"]["cleanup"] == 1
    holders = {h["name"]: h for h in js["holders"]}
    assert holders["impatient"]["timeouts"] == 1 and holders["impatient"]["runs"] == 0
    assert holders["second"]["waits_p50_s"] > 0

    stdout = cli.run("report", "--out", "-")
    assert stdout.code == 0 and stdout.stdout.startswith("<!doctype html>")
    assert hold_rects(stdout.stdout) == rects
    future = cli.run("report", "--json", "--since", str(int(time.time()) + 3600))
    assert future.json()["events"] == 0
    recent = cli.run("report", "--json", "--since", "1h")
    assert recent.json()["totals"]["handoffs"] == 4


def test_report_on_a_missing_log_and_a_garbled_one(cli: Cli) -> None:
    cli.state.mkdir(mode=0o700)  # a state folder without a log (none at all is an error)
    out = cli.root / "empty.html"
    r = cli.run("report", "--out", str(out))
    assert r.code == 0, r.describe()
    assert "The event log is empty" in out.read_text()
    assert "log: empty" in r.stdout
    lines = [json.dumps(g, allow_nan=True) for g in GARBAGE]
    lines += ["{not json", "\x00\xff binary", '{"ts": 1, "event": "acquire"']
    (cli.state / "events.jsonl").write_text("\n".join(lines) + "\n")
    r = cli.run("report", "--out", str(out))
    assert r.code == 0 and "Traceback" not in r.stderr, r.describe()
    assert out.read_text().endswith("</html>")


def test_a_hold_across_the_logs_rotation_is_one_hold(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    older = [tk(0, "wait", 0, 1, "long"), tk(1, "acquire", 0, 1, "long", waited_s=1.0)]
    newer = [tk(5, "release", 0, 1, "long", held_s=4.0)]
    (state / "events.jsonl.1").write_text("".join(json.dumps(e) + "\n" for e in older))
    (state / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in newer))
    data = report.write_report(state, tmp_path / "r.html", now_wall=T0 + 9)
    (hold,) = data.holds
    assert (hold.start_wall, hold.end_wall, hold.end) == (T0 + 1, T0 + 5, "release")
    assert data.waits[0].end == "acquire" and data.events == 3


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ([], "--out"),
        (["--out", "-", "--json"], "--json"),
        (["--out", "x.html", "--since", "banana"], "banana"),
        (["--bogus"], "--bogus"),
    ],
)
def test_usage_errors_exit_2(cli: Cli, args: list[str], says: str) -> None:
    r = cli.run("report", *args)
    if "--json" in args:  # with --json, the error is JSON too
        assert (r.code, r.stderr) == (2, ""), r.describe()
        assert says in json.loads(r.stdout)["error"]["message"], r.describe()
    else:
        assert_clean_error(r, 2)
        assert says in error_lines(r.stderr)[0], r.describe()
    assert not (cli.root / "x.html").exists()


@pytest.mark.parametrize("where", ["a-file/report.html", "a-folder"])
def test_an_unwritable_out_is_an_error(cli: Cli, where: str) -> None:
    cli.state.mkdir(mode=0o700)
    (cli.root / "a-file").write_text("not a folder")
    (cli.root / "a-folder").mkdir()
    r = cli.run("report", "--out", str(cli.root / where))
    assert_clean_error(r, 1)
    assert "cannot write" in error_lines(r.stderr)[0]
    assert os.listdir(cli.root / "a-folder") == []


def test_help(cli: Cli) -> None:
    r = cli.run("report", "--help")
    assert r.code == 0, r.describe()
    for word in ("--out", "--since", "--json", "--state-dir", "timeline", "exit codes"):
        assert word in r.stdout


# --- the page in a real browser ---------------------------------------------------------------


def chromium(args: list[str], home: Path, timeout_s: float = 60.0) -> str:
    """Run headless Chromium; its stdout.  Its whole process group is killed afterwards."""
    argv = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", f"--user-data-dir={home / 'profile'}", *args,
    ]  # fmt: skip
    env = {**os.environ, "HOME": str(home)}
    p = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    try:
        out, _ = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"chromium still running after {timeout_s:g} s") from None
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # its renderer and helper processes too
        except ProcessLookupError:
            pass
        p.wait()
    assert p.returncode == 0, f"chromium exited {p.returncode}"
    return out.decode(errors="replace")


def test_the_page_renders_in_chromium(tmp_path: Path) -> None:
    if shutil.which(CHROMIUM) is None:
        pytest.skip(f"{CHROMIUM} is not installed (the Makefile installs it on CI)")
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    events = [
        tk(0, "acquire", 0, 1, "digest", waited_s=0.0),
        tk(0.2, "wait", 0, 2, EVIL, need_bytes=4 * GIB),
        tk(1, "release", 0, 1, "digest", held_s=1.0),
        tk(1, "acquire", 0, 2, EVIL, need_bytes=4 * GIB, waited_s=0.8),
        tk(1.5, "wait", 0, 3, "crashy"),
        tk(2, "release", 0, 2, EVIL, held_s=1.0),
        tk(2, "acquire", 0, 3, "crashy", waited_s=0.5),
        tk(2.5, "cleanup", 0, 3, "crashy", holding=True, reason="owner gone"),
        tk(2.6, "wait", 0, 4, "late"),
        tk(3, "timeout", 0, 4, "late", waited_s=0.4),
        ev(3, "resident", resident="r1", name="qwen", gpu=0, declared_bytes=6 * GIB),
        ev(3.5, "escalate", level="reduce", from_level="normal", evidence={"vram.gpu0": 0.9}),
        ev(4, "evict", resident="r1", name="qwen", gpu=0, outcome="freed", reason="idle"),
        ev(4, "route", task="t", agent="a", tier="cpu", model="qwen-0.5b"),
    ]
    (state / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    page = tmp_path / "report.html"
    data = report.write_report(state, page, now_wall=T0 + 5)
    assert len(data.holds) == 3
    dom = chromium(["--dump-dom", page.as_uri()], tmp_path)
    assert 'data-js="ready"' in dom  # the page's script ran
    assert dom.count("<script") == 1  # the hostile name stayed text
    bars = re.findall(r'<rect class="hold( cut)?" data-gpu="0" data-ticket="(\d+)"', dom)
    assert sorted(int(t) for _, t in bars) == [1, 2, 3]
    assert [int(t) for cut, t in bars if cut] == [3]
    assert len(re.findall(r'<rect class="wait"', dom)) == 3
    assert 'class="mark timeout"' in dom and 'class="mark evict"' in dom
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in dom
