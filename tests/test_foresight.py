"""Foresight's table tests: next use from the line, the schedules and the past; reload costs;
the victim order they give (``gpulock.core.foresight``, pure)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from gpulock.core import foresight as fs
from gpulock.core.config import parse_config
from gpulock.core.errors import ConfigError

GiB = 1024**3
DAY = 86400.0
NOW = 20 * DAY + 6 * 3600.0  # a day at 06:00 UTC


def one(
    model: str,
    planned: Sequence[fs.Planned] = (),
    history: Sequence[fs.Use] = (),
    now: float = NOW,
    **kw: float,
) -> fs.NextUse:
    return fs.next_uses([model], planned, history, now, **kw)[model]


def uses(model: str, *times: float) -> list[fs.Use]:
    return [fs.Use(model, t) for t in times]


# --- next use ----------------------------------------------------------------------------------


def test_a_periodic_model_is_next_needed_one_period_after_its_last_use() -> None:
    # the tagger every 15 minutes, last at 05:55
    past = uses("tagger", *(NOW - 300 - 900 * k for k in range(8)))
    nu = one("tagger", history=past)
    assert nu.source == "rhythm"
    assert nu.at_wall == pytest.approx(NOW + 600)
    assert nu.confidence >= 0.8


def test_a_burst_of_calls_is_one_session() -> None:
    past = [u for k in range(5) for u in uses("m", *(NOW - 3600 * (k + 1) + s for s in (0, 5, 9)))]
    nu = one("m", history=past)
    assert nu.source == "rhythm"
    assert nu.at_wall == pytest.approx(NOW)  # last session 1 h ago, period 1 h


def test_a_late_rhythm_is_due_now_and_a_long_gone_one_moves_to_its_next_beat() -> None:
    past = uses("m", *(NOW - 850 - 600 * k for k in range(6)))  # period 10 min, 250 s late
    assert one("m", history=past).at_wall == pytest.approx(NOW)
    past = uses("m", *(NOW - 3500 - 600 * k for k in range(6)))  # 4.8 periods ago
    assert one("m", history=past).at_wall == pytest.approx(NOW - 3500 + 600 * 6)


def test_a_model_used_every_two_minutes_is_a_session_still_going() -> None:
    # every 120 s: never more than two minutes apart, so one endless session; it used to have
    # no rhythm and no mean gap, and be evicted first a minute before its next use
    past = uses("hot", *(NOW - 60 - 120 * k for k in range(20)))
    nu = one("hot", history=past)
    assert nu.source == "session"
    assert nu.at_wall == pytest.approx(NOW + 60)
    assert nu.confidence >= 0.8


def test_a_late_grant_does_not_end_a_session_and_an_ended_one_predicts_nothing() -> None:
    gaps = [120.0, 120.0, 126.0, 120.0, 121.0, 120.0, 120.0]  # granted late behind a load
    times = [NOW - 30 - sum(gaps[:k]) for k in range(len(gaps) + 1)]
    nu = one("hot", history=uses("hot", *times))
    assert nu.source == "session" and nu.at_wall == pytest.approx(NOW + 90)
    # a batch of calls that ended long ago is no session going on
    past = uses("m", NOW - 3000, NOW - 2995, NOW - 2990, NOW - 2985)
    assert one("m", history=past).source != "session"


def test_a_time_of_day_window_predicts_the_next_morning() -> None:
    # the digest at 07:00 on three irregular days (no rhythm: gaps of 1 and 2 days)
    seven = 7 * 3600.0
    past = uses("digest", 17 * DAY + seven, 18 * DAY + seven + 60, 19 * DAY + seven + 200)
    past += uses("digest", 12 * DAY + seven)  # gaps 5d, 1d, 1d
    nu = one("digest", history=past)
    assert nu.source in ("time-of-day", "rhythm")
    past = uses("digest", 15 * DAY + seven, 17 * DAY + seven, 18 * DAY + seven)
    nu = one("digest", history=past)
    assert nu.source == "time-of-day"
    assert nu.at_wall == pytest.approx(20 * DAY + seven)  # today, an hour from now
    assert nu.confidence == pytest.approx(0.6)


def test_time_of_day_reads_local_time() -> None:
    # 07:00 local at UTC+2 is 05:00 UTC: today's has passed at 06:00 UTC, so tomorrow's
    past = uses("digest", *(d * DAY + 5 * 3600.0 for d in (15, 17, 18)))
    nu = one("digest", history=past, utc_offset_s=2 * 3600.0)
    assert nu.source == "time-of-day"
    assert nu.at_wall == pytest.approx(21 * DAY + 5 * 3600.0)


@pytest.mark.parametrize("utc_offset_h", [0, 2])
def test_a_rhythm_that_runs_across_midnight_is_not_a_time_of_day(utc_offset_h: int) -> None:
    # every 15 minutes for two hours, the last a minute before 00:13 local: the sessions fall
    # on two calendar dates, minutes apart, which says nothing about tomorrow's time of day
    off = utc_offset_h * 3600.0
    now = 20 * DAY + 13 * 60 - off
    past = uses("soon", *(now - 60 - 900 * k for k in range(8)))
    nu = one("soon", history=past, now=now, utc_offset_s=off)
    assert nu.source == "rhythm"
    assert nu.at_wall == pytest.approx(now - 60 + 900)


def test_a_waiter_in_line_needs_its_model_now() -> None:
    past = uses("big", *(NOW - 1000 - 3600 * k for k in range(5)))  # next by rhythm in 43 min
    nu = one("big", planned=[fs.Planned("big", NOW - 5, "waiter", "report")], history=past)
    assert (nu.at_wall, nu.source, nu.label, nu.confidence) == (NOW, "waiter", "report", 1.0)


def test_a_cron_fire_beats_a_weaker_guess_and_an_earlier_rhythm_beats_a_later_fire() -> None:
    fire = fs.Planned("m", NOW + 7200, "cron", "digest", 0.9)
    past = uses("m", NOW - 100, NOW - 50000)  # two sessions: only a weak guess
    assert one("m", planned=[fire], history=past).source == "cron"
    past = uses("m", *(NOW - 300 - 900 * k for k in range(6)))
    nu = one("m", planned=[fire], history=past)
    assert nu.source == "rhythm" and nu.at_wall == pytest.approx(NOW + 600)


def test_past_fires_and_future_uses_are_ignored() -> None:
    nu = one("m", planned=[fs.Planned("m", NOW - 3600, "cron")], history=uses("m", NOW + 60))
    assert (nu.at_wall, nu.source, nu.confidence) == (None, "unknown", 0.0)


def test_the_unknown_future_is_unknown() -> None:
    nu = one("m", history=uses("m", NOW - 5000))  # one session says nothing of the next
    assert nu.at_wall is None and nu.source == "unknown"
    assert nu.describe(NOW) == "unknown"


def test_a_tenant_model_is_a_model_like_any_other() -> None:
    name = "ollama/llama3.1:8b"
    got = fs.next_uses([name, "lib"], [fs.Planned(name, NOW + 120, "fleet", "triage")], [], NOW)
    assert got[name].source == "fleet" and got[name].in_s(NOW) == pytest.approx(120)
    assert got[name].describe(NOW) == "in 2m (triage, fleet)"
    assert got["lib"].at_wall is None


# --- reload cost -------------------------------------------------------------------------------


def test_reload_costs_measured_then_throughput_then_size_then_unknown() -> None:
    loads = [fs.Load("a", 4.0, 4 * GiB), fs.Load("a", 6.0, 4 * GiB), fs.Load("b", 2.0, 4 * GiB)]
    got = fs.reload_costs({"a": 4 * GiB, "b": None, "c": 8 * GiB, "d": None}, loads)
    assert got["a"] == fs.ReloadCost(5.0, "measured")
    assert got["b"] == fs.ReloadCost(2.0, "measured")
    # median throughput of 1, 1.5 and 2 GiB/s
    assert got["c"].source == "throughput" and got["c"].seconds == pytest.approx(8 / 1.0)
    assert got["d"] == fs.ReloadCost(fs.DEFAULT_RELOAD_S, "unknown")
    cold = fs.reload_costs({"c": 8 * GiB}, [])["c"]
    hot = fs.reload_costs({"c": 8 * GiB}, [], cached={"c": 1.0})["c"]
    assert cold.source == "size" and hot.seconds < cold.seconds


# --- victim order ------------------------------------------------------------------------------


@dataclass(frozen=True)
class R:
    model: str
    last_used: float = 0.0
    pinned: bool = False
    in_use: bool = False


def victims(items: list[R], fc: fs.Forecast | None, policy: str = "foresight") -> list[str]:
    got = fs.order(
        items,
        model=lambda r: r.model,
        today=lambda r: r.last_used,
        forecast=fc,
        policy=policy,
        pinned=lambda r: r.pinned,
        in_use=lambda r: r.in_use,
    )
    return [r.model for r in got]


def fc_of(
    at: dict[str, float | None], reload_s: dict[str, float], conf: float = 1.0
) -> fs.Forecast:
    nxt = {
        m: fs.NextUse(m, None if t is None else NOW + t, 0.0 if t is None else conf, "cron")
        for m, t in at.items()
    }
    return fs.Forecast(NOW, nxt, {m: fs.ReloadCost(s, "measured") for m, s in reload_s.items()})


@pytest.mark.parametrize(
    ("at", "reload_s", "first"),
    [
        # Belady: equal costs, the furthest next use goes first
        ({"a": 60, "b": 3600, "c": 600}, {"a": 5, "b": 5, "c": 5}, ["b", "c", "a"]),
        # a large model needed in 2 minutes stays over a small one needed in an hour
        ({"big": 120, "small": 3600}, {"big": 60, "small": 2}, ["small", "big"]),
        # never expected again goes first, whatever its cost
        ({"x": None, "y": 99999}, {"x": 600, "y": 1}, ["x", "y"]),
    ],
)
def test_order_by_next_use_weighted_by_reload_cost(
    at: dict[str, float | None], reload_s: dict[str, float], first: list[str]
) -> None:
    items = [R(m, last_used=i) for i, m in enumerate(sorted(at))]
    assert victims(items, fc_of(at, reload_s)) == first


def test_the_score_is_per_byte_so_a_small_model_needed_sooner_stays() -> None:
    # 2 GiB needed in 7 minutes, 3 GiB in 8, both loading at the usual speed: Belady evicts
    # the one needed last; dividing by the reload seconds used to evict the small one
    nxt = {
        "q0": fs.NextUse("q0", NOW + 420, 0.9, "rhythm"),
        "q5": fs.NextUse("q5", NOW + 480, 0.9, "rhythm"),
    }
    reload = {"q0": fs.ReloadCost(2.0, "size"), "q5": fs.ReloadCost(3.0, "size")}
    fc = fs.Forecast(NOW, nxt, reload, {"q0": 2 * GiB, "q5": 3 * GiB})
    assert victims([R("q0"), R("q5")], fc) == ["q5", "q0"]
    # a model slower to load than its size says (a server that starts a process) stays
    slow = fs.Forecast(NOW, nxt, {**reload, "q5": fs.ReloadCost(30.0, "measured")}, fc.bytes)
    assert victims([R("q0"), R("q5")], slow) == ["q0", "q5"]


def test_room_for_a_need_goes_to_the_cheapest_set_not_the_furthest_model() -> None:
    nxt = {
        "big": fs.NextUse("big", NOW + 1200, 0.9, "rhythm"),
        "tiny": fs.NextUse("tiny", NOW + 900, 0.9, "rhythm"),
        "mid": fs.NextUse("mid", NOW + 600, 0.9, "rhythm"),
    }
    size = {"big": 14 * GiB, "tiny": GiB, "mid": 4 * GiB}
    fc = fs.Forecast(NOW, nxt, {m: fs.ReloadCost(b / GiB, "size") for m, b in size.items()}, size)
    items = [R(m) for m in size]

    def room(n: int) -> list[str]:
        got = fs.order(items, model=lambda r: r.model, today=lambda r: r.last_used, forecast=fc,
                       room_bytes=n, size=lambda r: size[r.model])  # fmt: skip
        return [r.model for r in got]

    assert victims(items, fc) == ["big", "tiny", "mid"]  # Belady, per byte
    assert room(GiB) == ["tiny", "big", "mid"]  # 1 GiB: the 1 GiB model, not all 14 GiB
    assert room(12 * GiB)[0] == "big"  # only the big one frees that much
    lru = fs.order(items, model=lambda r: r.model, today=lambda r: r.last_used, forecast=fc,
                   policy="lru", room_bytes=GiB, size=lambda r: size[r.model])  # fmt: skip
    assert lru == items


def test_ties_keep_todays_order_and_lru_is_todays_order() -> None:
    items = [R("a", 30), R("b", 10), R("c", 20)]
    fc = fc_of({"a": None, "b": None, "c": None}, {})
    assert victims(items, fc) == ["b", "c", "a"]
    fc = fc_of({"a": 3600, "b": 60, "c": 600}, {"a": 5, "b": 5, "c": 5})
    assert victims(items, fc, policy="lru") == ["b", "c", "a"]
    assert victims(items, None) == ["b", "c", "a"]


def test_pinned_and_in_use_models_are_never_victims() -> None:
    items = [R("p", pinned=True), R("u", in_use=True), R("ok")]
    fc = fc_of({"p": None, "u": None, "ok": 10}, {})
    assert victims(items, fc) == ["ok"]
    assert victims(items, fc, policy="lru") == ["ok"]


def test_an_unsure_prediction_counts_as_further_away() -> None:
    sure = fs.Forecast(NOW, {"m": fs.NextUse("m", NOW + 600, 1.0, "cron")}, {})
    unsure = fs.Forecast(NOW, {"m": fs.NextUse("m", NOW + 600, 0.2, "history")}, {})
    assert unsure.score("m") > sure.score("m")
    assert sure.why("m") == {"next_use_s": 600.0, "next_use_source": "cron", "reload_s": None}


def test_forecast_gathers_both() -> None:
    past = uses("m", *(NOW - 300 - 900 * k for k in range(6)))
    fc = fs.forecast({"m": 2 * GiB}, [], past, [fs.Load("m", 3.0, 2 * GiB)], NOW)
    assert fc.next["m"].source == "rhythm" and fc.reload["m"].seconds == 3.0


# --- config ------------------------------------------------------------------------------------


def test_eviction_policy_default_and_choices() -> None:
    assert fs.policy_of(parse_config("", "c.yaml")) == "foresight"
    assert fs.policy_of(parse_config("eviction:\n  policy: lru\n", "c.yaml")) == "lru"


@pytest.mark.parametrize(
    ("text", "key", "words"),
    [
        ("eviction:\n  policy: belady\n", "eviction.policy", "foresight, lru"),
        ("eviction:\n  policy: 3\n", "eviction.policy", "got 3"),
        ("eviction:\n  polcy: lru\n", "eviction.polcy", "unknown key"),
        ("eviction: lru\n", "eviction", "expected a mapping"),
    ],
)
def test_a_bad_eviction_policy_names_the_file_line_and_key(text: str, key: str, words: str) -> None:
    with pytest.raises(ConfigError) as e:
        fs.policy_of(parse_config(text, "/etc/gpulock/config.yaml"))
    assert e.value.key == key
    assert e.value.line in (1, 2)
    assert words in str(e.value) and "config.yaml" in str(e.value)


def test_each_agent_keeps_its_own_rhythm_on_a_shared_model() -> None:
    # the tagger every 15 minutes (last 10 min ago), the digest every 50 (last 47 min ago)
    past = [fs.Use("m", NOW - 600 - 900 * k, "tagger") for k in range(6)]
    past += [fs.Use("m", NOW - 2820 - 3000 * k, "digest") for k in range(4)]
    nu = one("m", history=past)
    assert (nu.source, nu.label) == ("rhythm", "digest")  # due in 3 min, the tagger in 5
    assert nu.at_wall == pytest.approx(NOW + 180)
    merged = one("m", history=[fs.Use(u.model, u.at_wall) for u in past])
    assert merged.source != "rhythm"  # together they have none


# --- crontab schedules ----------------------------------------------------------------------


def local(y: int, mo: int, d: int, h: int, mi: int) -> float:
    import time

    return time.mktime((y, mo, d, h, mi, 0, 0, 0, -1))


@pytest.mark.parametrize(
    ("expr", "after", "fire"),
    [
        ("*/15 * * * *", (2026, 3, 2, 6, 50), (2026, 3, 2, 7, 0)),
        ("0 7 * * *", (2026, 3, 2, 7, 0), (2026, 3, 3, 7, 0)),  # strictly after
        ("30 2 * * 1-5", (2026, 3, 6, 3, 0), (2026, 3, 9, 2, 30)),  # Friday -> Monday
        ("0 9 1 * mon", (2026, 3, 2, 10, 0), (2026, 3, 9, 9, 0)),  # day OR weekday
        ("0 9 */2 * mon", (2026, 3, 2, 10, 0), (2026, 3, 9, 9, 0)),  # '*/2' is '*' to cron: AND
        ("@daily", (2026, 12, 31, 23, 59), (2027, 1, 1, 0, 0)),
        ("0 0 29 feb *", (2026, 3, 1, 0, 0), (2028, 2, 29, 0, 0)),
        ("0 12 * * 7", (2026, 3, 2, 0, 0), (2026, 3, 8, 12, 0)),  # 7 is Sunday too
    ],
)
def test_cron_next_fire(expr: str, after: tuple[int, ...], fire: tuple[int, ...]) -> None:
    from gpulock.core import cronexpr

    got = cronexpr.parse(expr).next_fire(local(*after))
    if fire[0] == 2028:
        assert got is None  # beyond a year: as good as never
    else:
        assert got == local(*fire)


@pytest.mark.parametrize(
    ("expr", "words"),
    [("* * * *", "five fields"), ("61 * * * *", "minute"), ("* * * foo *", "month")],
)
def test_a_bad_cron_expression_names_the_field(expr: str, words: str) -> None:
    from gpulock.core import cronexpr

    with pytest.raises(ValueError, match=words):
        cronexpr.parse(expr)
