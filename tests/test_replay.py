"""``gpulock replay``: Belady against a brute-force optimum, foresight against LRU on a
periodic fleet, trace files (good and malformed) and a recorded event log, through the CLI."""

from __future__ import annotations

import functools
import itertools
import json
import random
import re
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import REPO, Cli

from gpulock import replay_sim
from gpulock.replay import from_events, parse_trace
from gpulock.replay_bound import bound
from gpulock.replay_sim import Arrival, simulate

GiB = 1024**3


def sequential(models: list[str], size: int = GiB, gap_s: float = 100.0) -> list[Arrival]:
    """One job at a time (each done long before the next), each with its own model."""
    return [Arrival(i * gap_s, f"job{i}", m, size, 1.0, size) for i, m in enumerate(models)]


def optimum_loads(refs: list[str], slots: int) -> int:
    """The fewest loads any eviction choice can give (brute force over every choice)."""

    @functools.cache
    def best(i: int, cache: frozenset[str]) -> int:
        if i == len(refs):
            return 0
        m = refs[i]
        if m in cache:
            return best(i + 1, cache)
        if len(cache) < slots:
            return 1 + best(i + 1, cache | {m})
        return 1 + min(best(i + 1, (cache - {v}) | {m}) for v in cache)

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(12))
def test_belady_matches_the_brute_force_optimum_on_equal_sizes(seed: int) -> None:
    rng = random.Random(seed)
    slots = rng.choice([2, 3])
    refs = [rng.choice("ABCDE"[: slots + 2]) for _ in range(14)]
    row = simulate(sequential(refs), slots * GiB, "belady")
    assert row.loads == optimum_loads(refs, slots), refs
    for policy in ("lru", "foresight", "keepalive"):  # nobody beats the bound
        assert simulate(sequential(refs), slots * GiB, policy).loads >= row.loads


def optimum_seconds(
    refs: list[str], size: dict[str, int], cost: dict[str, float], cap: int
) -> float:
    """The fewest reload seconds any eviction choice can give, models of any size (brute force:
    after each load, keep any subset of what was there that fits beside the new model)."""

    @functools.cache
    def best(i: int, cache: frozenset[str]) -> float:
        if i == len(refs):
            return 0.0
        m = refs[i]
        if m in cache:
            return best(i + 1, cache)
        others = sorted(cache)
        options = []
        for r in range(len(others) + 1):
            for keep in itertools.combinations(others, r):
                if sum(size[k] for k in keep) + size[m] <= cap:
                    options.append(best(i + 1, frozenset(keep) | {m}))
        return cost[m] + min(options)

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(12))
def test_the_cost_aware_bound_matches_the_brute_force_optimum(seed: int) -> None:
    rng = random.Random(seed)
    names = "ABCDE"
    size = {m: rng.choice([1, 2, 3]) * GiB for m in names}
    cost = {m: rng.choice([1.0, 4.0, 9.0]) for m in names}
    refs = [rng.choice(names) for _ in range(14)]
    trace = [Arrival(i * 100.0, f"job{i}", m, size[m], 1.0, size[m]) for i, m in enumerate(refs)]
    got = bound(trace, 4 * GiB, cost, float(GiB))
    assert got is not None
    assert got.load_s == pytest.approx(optimum_seconds(refs, size, cost, 4 * GiB)), refs
    for policy in replay_sim.POLICIES:  # nobody spends fewer reload seconds than the bound
        row = simulate(trace, 4 * GiB, policy, load_s_of=cost)
        assert row.load_s >= got.load_s - 1e-9, (policy, refs)


def test_on_equal_sizes_and_costs_the_bound_is_belady() -> None:
    refs = [random.Random(3).choice("ABCDE") for _ in range(40)]
    trace = sequential(refs)
    got = bound(trace, 3 * GiB, {}, float(GiB))
    assert got is not None and got.loads == simulate(trace, 3 * GiB, "belady").loads


def alternating(jobs: int = 200) -> list[Arrival]:
    """Issue 27's trace: a hot model every other job, three others taking turns between, a
    job a minute, 7 GiB models on a GPU that holds three."""
    out = []
    for i in range(jobs):
        m = "a" if i % 2 == 0 else "bcd"[(i // 2) % 3]
        out.append(Arrival(60.0 * i, f"agent-{m}", m, 7 * GiB, 20.0, 7 * GiB))
    return out


def test_on_the_alternating_trace_foresight_is_within_a_tenth_of_belady() -> None:
    # it loaded 70 against Belady's 52: the hot model's uses, 120 s apart, were one endless
    # session with no next use, so it was evicted first, a minute before it was needed
    rows = {p: simulate(alternating(), 21 * GiB, p) for p in ("lru", "foresight", "belady")}
    assert rows["belady"].loads == 52
    assert rows["foresight"].loads <= 1.1 * rows["belady"].loads
    assert rows["foresight"].loads < rows["lru"].loads
    # on a GPU that holds two, never worse than LRU (a late grant used to split the session)
    two = {p: simulate(alternating(), 16 * GiB, p).loads for p in ("lru", "foresight")}
    assert two["foresight"] <= two["lru"]


def fleet_day(hours: float = 24.0) -> list[Arrival]:
    """Three cron agents, each with its model: the tagger every 10 min, the triage every 15,
    the digest every 45; a GPU that holds two of the three models."""
    out = []
    for name, model, period in (
        ("tagger", "small", 600),
        ("triage", "mid", 900),
        ("digest", "big", 2700),
    ):
        t = {"tagger": 5.0, "triage": 65.0, "digest": 125.0}[name]
        while t < hours * 3600:
            out.append(Arrival(t, name, model, 4 * GiB, 30.0, 4 * GiB))
            t += period
    return out


def test_on_a_periodic_fleet_foresight_loads_less_than_lru_and_near_belady() -> None:
    day = fleet_day()
    rows = {p: simulate(day, 9 * GiB, p) for p in replay_sim.POLICIES}
    assert rows["belady"].loads <= rows["foresight"].loads
    assert rows["foresight"].loads < rows["lru"].loads
    assert rows["foresight"].loads <= rows["belady"].loads * 1.2 + 5
    # a GPU that holds all three: one load each, whatever the policy (keepalive aside)
    big = {p: simulate(day, 16 * GiB, p) for p in ("lru", "foresight", "belady")}
    assert {r.loads for r in big.values()} == {3}


def test_the_lock_rules_hold_in_the_replay() -> None:
    # two jobs that fit together share; an exclusive one waits for both and clears the models
    trace = [
        Arrival(0, "a", "A", GiB, 100, 2 * GiB),
        Arrival(1, "b", "B", GiB, 100, 2 * GiB),
        Arrival(2, "x", "X", GiB, 10, None, deadline_s=50.0),
        Arrival(3, "a2", "A", GiB, 10, 2 * GiB),
    ]
    row = simulate(trace, 8 * GiB, "lru")
    # a, b load at once (share); x waits for both (100 s: a deadline miss) then clears A and B;
    # a2 reloads A after x
    assert row.loads == 4 and row.evictions == 2 and row.deadline_misses == 1
    assert row.wait_s_total == pytest.approx(1 + 1 + (102 + 1 - 2) + (113 + 1 - 3))


def test_a_jobs_working_memory_is_counted_once() -> None:
    # a 2 GiB model with need 6 GiB, then a 6 GiB model with need 10 GiB, one after the other
    # on 16 GiB (14.4 after the reserve): both models stay.  The replay used to count each
    # holder's working memory twice and evict the other model every time.
    trace = []
    for k in range(6):
        trace.append(Arrival(600.0 * k, "tagger", "small", 2 * GiB, 120.0, 6 * GiB))
        trace.append(Arrival(600.0 * k + 5, "digest", "big", 6 * GiB, 120.0, 10 * GiB))
    row = simulate(trace, 16 * GiB, "lru", reserve_bytes=16 * GiB // 10)
    assert row.loads == 2 and row.evictions == 0
    assert row.pairs[0].a == "digest" and row.pairs[0].b == "tagger" and row.pairs[0].times == 6


# --- traces ------------------------------------------------------------------------------------

TRACE = """time_s,name,model,model_bytes,hold_s,need_bytes
0,tagger,small,1073741824,5,1073741824
60,digest,big,4294967296,30,
120,tagger,small,1073741824,5,1073741824
"""


def test_a_trace_parses_into_arrivals() -> None:
    got = parse_trace(TRACE, "t.csv")
    assert got[1] == Arrival(60.0, "digest", "big", 4 * GiB, 30.0, None)
    assert [a.need_bytes for a in got] == [GiB, None, GiB]


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("time,name\n", "t.csv:1: expected the header"),
        (TRACE + "180,x,m,12GiB,5,1\n", "t.csv:5: model_bytes: expected a whole number of bytes"),
        (TRACE + "soon,x,m,1,5,1\n", "t.csv:5: time_s: expected seconds"),
        (TRACE + "1,x,m,1,-5,1\n", "t.csv:5: hold_s: expected seconds >= 0"),
        (TRACE + "1,x,m,1\n", "t.csv:5: expected 6 fields, got 4"),
    ],
)
def test_a_malformed_trace_line_names_the_file_line_and_field(text: str, where: str) -> None:
    from gpulock.replay import TraceError

    with pytest.raises(TraceError) as e:
        parse_trace(text, "t.csv")
    assert str(e.value).startswith(where)


def run(cli: Cli, *args: str) -> tuple[int, str, str]:
    # `python -m gpulock.replay` is `gpulock replay` (an entry point of this checkout's
    # pyproject.toml), run from this checkout also where another copy is installed
    argv0 = (sys.executable, "-m", "gpulock.replay")
    r = cli.run(*args, env=cli.env(PYTHONPATH=str(REPO)), argv0=argv0)
    return r.code, r.stdout, r.stderr


def test_replay_is_a_gpulock_command() -> None:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["gpulock.commands"]["replay"] == "gpulock.replay:main"


def test_replay_a_trace_from_the_cli_json_and_html(cli: Cli, tmp_path: Path) -> None:
    trace = tmp_path / "day.csv"
    trace.write_text(TRACE)
    html = tmp_path / "r.html"
    code, out, err = run(
        cli,
        str(trace),
        "--gpu",
        "2GiB,8GiB",
        "--policy",
        "lru,belady",
        "--json",
        "--html",
        str(html),
    )
    assert code == 0, err
    rows = json.loads(out)
    assert [(r["gpu_bytes"], r["policy"]) for r in rows] == [
        (2 * GiB, "lru"), (2 * GiB, "belady"), (8 * GiB, "lru"), (8 * GiB, "belady"),
    ]  # fmt: skip
    assert set(rows[0]) == {
        "gpu_bytes", "gpus", "policy", "unfit", "loads", "loaded_bytes", "load_s",
        "wait_s_total", "wait_s_p90", "deadline_misses", "evictions",
    }  # fmt: skip
    assert rows[0]["gpus"] == 1
    assert rows[0]["unfit"] == 1  # the 4 GiB digest cannot fit 2 GiB
    assert f"wrote {html.resolve()}" in err
    # the digest is exclusive: it clears "small", which the tagger then reloads
    assert rows[2]["loads"] == 3 and rows[2]["loaded_bytes"] == 6 * GiB
    page = html.read_text()
    assert page.count("<svg") == 3 and ">foresight<" not in page and ">belady<" in page
    code, out, _ = run(cli, str(trace), "--gpu", "8GiB")
    assert code == 0 and out.splitlines()[0].split()[:2] == ["gpu", "policy"]
    assert "3 arrivals replayed" in out


BIG_JOB = """time_s,name,model,model_bytes,hold_s,need_bytes
0,tagger,small,1073741824,5,2147483648
600,tagger,small,1073741824,5,2147483648
900,finetune,llama-70b,42949672960,1800,
1200,tagger,small,1073741824,5,2147483648
"""


def test_a_job_that_cannot_fit_is_unfit_named_and_left_out(cli: Cli, tmp_path: Path) -> None:
    # `--gpu 6GiB` used to replay a 40 GiB job as if it fitted: the 6 GiB rows equalled the
    # 48 GiB rows, waits included
    trace = tmp_path / "day.csv"
    trace.write_text(BIG_JOB)
    code, out, err = run(cli, str(trace), "--gpu", "6GiB,48GiB", "--json")
    assert code == 0, err
    rows = {(r["gpu_bytes"], r["policy"]): r for r in json.loads(out)}
    small, big = rows[(6 * GiB, "lru")], rows[(48 * GiB, "lru")]
    assert small["unfit"] == 1 and big["unfit"] == 0
    assert small["wait_s_total"] < big["wait_s_total"]  # the tagger no longer waits 30 min
    assert small["loaded_bytes"] == GiB
    assert big["loaded_bytes"] == 2 * GiB + 40 * GiB  # the exclusive job clears the tagger's
    assert "6GiB, 5.4 GiB after the 614 MiB reserve: 1 job(s) cannot fit" in err
    assert "finetune x1 (model llama-70b 40.0 GiB, exclusive)" in err
    assert "48GiB" not in err
    # the bound's row: fewest reload seconds, no waits
    bound_row = rows[(48 * GiB, "bound")]
    assert bound_row["loads"] == 3 and bound_row["wait_s_p90"] is None
    code, out, _ = run(cli, str(trace), "--gpu", "6GiB,48GiB")
    assert "belady: a next-use oracle that ignores sizes and reload cost" in out
    assert "bound: the fewest reload seconds" in out


CRONTAB_STANDIN = """#!/bin/sh
# A stand-in for cron's crontab(1), which this machine does not have: `crontab -l` prints the
# user's table as written (cronie 1.7 and Debian's cron 3.0 alike).
[ "$1" = "-l" ] || exit 1
cat <<'TABLE'
# m h dom mon dow command
*/10 * * * * gpulock run --name tagger --need 6GiB -- python tag.py
5-59/10 * * * * gpulock agent run digest
TABLE
"""


def colliding_day() -> str:
    """The tagger (need 6 GiB) and the digest (need 10 GiB) fire 5 s apart every 10 minutes
    for 2 minutes each: on 16 GiB the digest waits for the tagger every time; the backup
    runs alone at :07."""
    lines = ["time_s,name,model,model_bytes,hold_s,need_bytes"]
    for k in range(6):
        t = 600 * k
        lines.append(f"{t},tagger,small,{2 * GiB},120,{6 * GiB}")
        lines.append(f"{t + 5},digest,big,{6 * GiB},120,{10 * GiB}")
        lines.append(f"{t + 420},backup,,0,30,{GiB}")
    return "\n".join(lines) + "\n"


def test_target_wait_names_the_smallest_gpu_and_who_is_in_whose_way(
    cli: Cli, tmp_path: Path
) -> None:
    trace = tmp_path / "day.csv"
    trace.write_text(colliding_day())
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "crontab").write_text(CRONTAB_STANDIN)
    (bin_dir / "crontab").chmod(0o755)
    env = cli.env(PYTHONPATH=str(REPO))
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    argv0 = (sys.executable, "-m", "gpulock.replay")
    args = (str(trace), "--gpu", "8GiB,16GiB,32GiB", "--target-wait", "60s")
    r = cli.run(*args, env=env, argv0=argv0)
    assert r.code == 0, r.stderr
    assert "p90 wait <= 60 s: the smallest GPU of those given" in r.stdout
    assert re.search(r"foresight +32GiB \(p90 \d", r.stdout), r.stdout
    assert "agents that wait on each other most (foresight at 16.0 GiB" in r.stdout
    assert "digest <-> tagger: 6 times" in r.stdout
    assert "tagger: */10 * * * * gpulock run --name tagger --need 6GiB -- python tag.py" in r.stdout
    assert "digest: 5-59/10 * * * * gpulock agent run digest" in r.stdout
    assert "backup" not in r.stdout.split("agents that wait")[1]
    r = cli.run(*args, "--json", env=env, argv0=argv0)
    doc = json.loads(r.stdout)
    assert doc["target_wait_s"] == 60.0 and len(doc["rows"]) == 3 * 5
    by = {a["policy"]: a for a in doc["smallest_gpu"]}
    assert by["foresight"]["gpu"] == "32GiB" and by["foresight"]["gpu_bytes"] == 32 * GiB
    way = doc["in_each_others_way"]
    assert way["policy"] == "foresight" and way["gpu_bytes"] == 16 * GiB
    assert way["pairs"][0]["agents"] == ["digest", "tagger"] and way["pairs"][0]["times"] == 6
    assert way["pairs"][0]["cron"]["digest"] == ["5-59/10 * * * * gpulock agent run digest"]
    r = cli.run(str(trace), "--target-wait", "soon", env=env, argv0=argv0)
    assert r.code == 2 and "--target-wait" in r.stderr and "Traceback" not in r.stderr


def test_a_malformed_trace_is_an_error_and_nothing_is_replayed(cli: Cli, tmp_path: Path) -> None:
    trace = tmp_path / "bad.csv"
    trace.write_text(TRACE + "180,x,m,lots,5,1\n")
    code, out, err = run(cli, str(trace))
    assert code == 1 and out == ""
    assert err.startswith(f"error: {trace}:5: model_bytes:") and "Traceback" not in err
    code, out, _ = run(cli, str(trace), "--json")
    assert code == 1 and json.loads(out)["error"]["message"].startswith(f"{trace}:5: model_bytes")
    code, _, err = run(cli, str(trace), "--policy", "fifo")
    assert code == 2 and "known: lru, keepalive, foresight, belady" in err


def test_replay_a_recorded_day_from_the_event_log(cli: Cli) -> None:
    now = time.time() - 3600
    ev = []
    for k in range(6):  # the tagger every 10 minutes, loading "small" the first time
        t = now + 600 * k
        ev.append({"ts": t, "event": "acquire", "gpu": 0, "ticket": k + 1, "name": "tagger",
                   "need_bytes": GiB, "waited_s": 0.5})  # fmt: skip
        if k == 0:
            ev.append({"ts": t + 0.1, "event": "model-load", "model": "small", "task": "tag",
                       "need_bytes": GiB, "load_s": 2.0})  # fmt: skip
        ev.append({"ts": t + 0.2, "event": "call", "agent": "tagger", "model": "small"})
        ev.append({"ts": t + 5, "event": "release", "gpu": 0, "ticket": k + 1, "held_s": 5})
    arrivals, load_s = from_events(ev)
    assert load_s == {"small": 2.0}
    assert [a.model for a in arrivals] == ["small"] * 6
    assert arrivals[0].hold_s == pytest.approx(3.0) and arrivals[1].hold_s == pytest.approx(5.0)
    assert arrivals[1].time_s - arrivals[0].time_s == pytest.approx(600)
    cli.state.mkdir(parents=True, exist_ok=True)
    (cli.state / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ev))
    code, out, err = run(cli, "--since", "2h", "--gpu", "4GiB", "--json")
    assert code == 0, err
    rows = {r["policy"]: r for r in json.loads(out)}
    assert rows["lru"]["loads"] == 1 and rows["lru"]["load_s"] == pytest.approx(2.0)
    assert rows["keepalive"]["loads"] == 6  # unloaded after 5 idle minutes, every time


# --- a host of several GPUs (issue 28) ------------------------------------------------------


def _arrival(t: float, name: str, model: str, gib: float, hold: float, gpus: int = 1) -> Arrival:
    return Arrival(t, name, model, int(gib * GiB), hold, int(gib * GiB), gpus=gpus)


def test_two_gpus_place_each_job_where_its_model_is_warm() -> None:
    """Two 14 GiB models taking turns: one 24 GiB GPU reloads at every turn; two of them keep
    one model each, because a job is placed on the GPU where its model is resident."""
    trace = [
        _arrival(60.0 * i, "a" if i % 2 == 0 else "b", "A" if i % 2 == 0 else "B", 14, 10.0)
        for i in range(20)
    ]
    one = simulate(trace, 24 * GiB, "lru")
    two = simulate(trace, 24 * GiB, "lru", gpus=2)
    assert (one.loads, two.loads) == (20, 2)
    assert (one.gpus, two.gpus) == (1, 2)


def test_two_gpus_serve_two_jobs_at_once_and_a_two_gpu_job_fits_only_there() -> None:
    trace = [
        Arrival(0.0, "x", "", 0, 100.0, None),
        Arrival(0.0, "y", "", 0, 100.0, None),
        Arrival(1.0, "tp", "big", 30 * GiB, 50.0, None, gpus=2),  # 15 GiB on each of two
    ]
    one = simulate(trace, 24 * GiB, "lru")
    two = simulate(trace, 24 * GiB, "lru", gpus=2)
    assert one.unfit == 1 and two.unfit == 0  # two GPUs at once: only a host of two has them
    assert one.wait_s_total == pytest.approx(100.0)  # y waits for x on one GPU...
    # ...not on two; the two-GPU job waits for both (99 s) and loads its model (30 s)
    assert two.wait_s_total == pytest.approx(129.0)


def test_a_host_of_two_from_the_cli(cli: Cli, tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    lines = ["time_s,name,model,model_bytes,hold_s,need_bytes,gpus"]
    for i in range(10):
        m = "A" if i % 2 == 0 else "B"
        lines.append(f"{60 * i},job{m},{m},{14 * GiB},10,{14 * GiB},")
    lines.append(f"700,tp,C,{20 * GiB},10,{10 * GiB},2")
    trace.write_text("\n".join(lines) + "\n")
    code, out, err = run(cli, str(trace), "--gpu", "24GiB,2x24GiB", "--policy", "lru", "--json")
    assert code == 0, err
    rows = json.loads(out)
    assert [(r["gpus"], r["gpu_bytes"], r["unfit"]) for r in rows] == [
        (1, 24 * GiB, 1), (2, 24 * GiB, 0),
    ]  # fmt: skip
    assert rows[1]["loads"] == 3  # A and B once each, each on its GPU; C split over both
    code, out, _ = run(cli, str(trace), "--gpu", "2x24GiB", "--policy", "lru")
    assert code == 0 and "2x24.0 GiB" in out
    for bad in ("0x24GiB", "2xbig"):
        code, _out, err = run(cli, str(trace), "--gpu", bad)
        assert code == 2 and "--gpu" in err, err
