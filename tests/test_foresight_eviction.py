"""Live eviction by foresight: real owner processes on a simulated GPU, a real ``gpulock run``
that needs room, and the event log's history telling which model is needed soon."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from cli_helpers import REPO, Cli, Result
from procs import World
from test_residents import GiB, Lab

from gpulock.core import foresight as fs
from gpulock.residents import foresight_cron as fc
from gpulock.residents import foresight_past as fp


@pytest.fixture
def lab(world: World, cli: Cli, monkeypatch: pytest.MonkeyPatch) -> Lab:
    return Lab(world, cli, monkeypatch)


# Registered in this order: "soon" is the least recently used, so LRU evicts it first.
TWO = (
    {"name": "soon", "bytes": "8GiB", "policy": "persistent"},
    {"name": "later", "bytes": "8GiB", "policy": "persistent"},
)


def write_history(lab: Lab) -> None:
    """The tagger called "soon" every 15 minutes for two hours; "later" was never called."""
    now = time.time()
    lines = [
        {"ts": now - 60 - 900 * k, "event": "call", "agent": "tagger", "model": "soon"}
        for k in range(8)
    ]
    lab.world.state.mkdir(parents=True, exist_ok=True)
    with open(lab.world.state / "events.jsonl", "a") as f:
        f.writelines(json.dumps(e) + "\n" for e in sorted(lines, key=lambda e: e["ts"]))


@pytest.mark.parametrize(("policy", "victim"), [("foresight", "later"), ("lru", "soon")])
def test_room_for_a_waiter_evicts_the_model_needed_last(lab: Lab, policy: str, victim: str) -> None:
    lab.world.config.write_text(f"eviction:\n  policy: {policy}\n")
    lab.simulate("24GiB")
    write_history(lab)
    o = lab.owner("owner", *TWO)
    assert lab.used() == 16 * GiB

    r = run(lab, "run", "--need", "12GiB", "--name", "job", "--", "true")

    assert r.code == 0, r.describe()
    (e,) = lab.events("evict")  # 8 GiB free, 12 needed: one model leaves
    assert e["name"] == victim and e["outcome"] == "freed", e
    assert e["policy"] == policy
    assert e["runner_up"] is not None
    if policy == "foresight":
        assert e["next_use_source"] == "unknown" and e["next_use_s"] is None
        assert e["reload_s"] == pytest.approx(8.0)  # 8 GiB at 1 GiB/s: nothing measured
    assert o.has("unloaded", victim)


def test_a_bad_eviction_policy_is_a_clear_error_not_a_traceback(lab: Lab) -> None:
    lab.world.config.write_text("eviction:\n  policy: belady\n")
    r = run(lab, "run", "--need", "12GiB", "--name", "job", "--", "true")
    assert r.code == 1
    assert "eviction.policy" in r.stderr and "foresight, lru" in r.stderr
    assert "gpulock.yaml:2" in r.stderr and "Traceback" not in r.stderr


def run(lab: Lab, *args: str) -> Result:
    # this checkout's gpulock, also where the shared environment installed another
    return lab.cli.run(*args, env=lab.cli.env(PYTHONPATH=str(REPO)))


# --- gathering ---------------------------------------------------------------------------------


def test_the_past_maps_agents_to_models_and_reads_load_times() -> None:
    past = fp.past_of(
        [
            {"ts": 10, "event": "call", "agent": "digest", "model": "qwen", "tier": "gpu"},
            {"ts": 11, "event": "call", "agent": "digest", "model": "gpt", "tier": "cloud"},
            {"ts": 12, "event": "model-load", "model": "qwen", "load_s": 4.5, "need_bytes": 9},
            {"ts": 13, "event": "resident", "name": "tts"},
            {"ts": "x", "event": "call", "model": "bad"},
        ]
    )
    assert past.models_of == {"digest": {"qwen"}}
    assert [u.model for u in past.uses] == ["qwen", "qwen", "tts"]
    assert past.loads == [fs.Load("qwen", 4.5, 9)]


CRONTAB = r"""
SHELL=/bin/sh
# m h dom mon dow command
*/15 * * * * /opt/gpulock/.venv/bin/gpulock agent run tagger >> /tmp/t.log 2>&1
0 7 * * * /opt/gpulock/.venv/bin/gpulock run --name digest --need 6GiB -- python digest.py
30 2 * * * gpulock run --timeout 1h -- /usr/local/bin/backup-embeddings
@hourly gpulock run --name=hourly -- true
0 3 * * * echo not ours
bad line gpulock
"""


def test_crontab_lines_that_call_gpulock_name_their_agents() -> None:
    jobs = fc.crontab_jobs(CRONTAB)
    assert [name for name, _ in jobs] == ["tagger", "digest", "backup-embeddings", "hourly"]
    system = "0 7 * * * alice gpulock agent run digest\n"
    assert [n for n, _ in fc.crontab_jobs(system, system=True)] == ["digest"]


def test_cron_plans_map_the_next_fire_to_the_agents_models() -> None:
    fc._entries_cache["jobs"] = (1e18, fc.crontab_entries(CRONTAB))  # no `crontab -l` here
    try:
        now = time.mktime((2026, 3, 2, 6, 50, 0, 0, 0, -1))
        plans = fc.cron_plans({"digest": {"qwen"}, "tagger": {"small"}}, now)
        lines = fc.cron_lines(now)
    finally:
        fc._entries_cache.clear()
    assert lines["digest"] == [
        "0 7 * * * /opt/gpulock/.venv/bin/gpulock run --name digest --need 6GiB -- python digest.py"
    ]
    got = {(p.model, p.label): p.at_wall - now for p in plans}
    assert got == {("qwen", "digest"): 600.0, ("small", "tagger"): 600.0}
    assert {p.source for p in plans} == {"cron"}


def test_status_shows_each_residents_predicted_next_use(lab: Lab) -> None:
    lab.simulate("24GiB")
    write_history(lab)
    lab.owner("owner", *TWO)
    r = run(lab, "status", "--json")
    assert r.code == 0, r.describe()
    got = {x["name"]: x for x in json.loads(r.stdout)["residents"]}
    assert got["soon"]["next_use_source"] == "rhythm" and got["soon"]["next_use_by"] == "tagger"
    assert got["soon"]["next_use"] > time.time()
    assert got["later"]["next_use"] is None and got["later"]["next_use_source"] == "unknown"
    r = run(lab, "status")
    assert r.code == 0, r.describe()
    line = next(ln for ln in r.stdout.splitlines() if ln.strip().startswith("soon"))
    assert line.endswith("(tagger, rhythm)") and " ~" in line
    assert "NEXT USE" in r.stdout


def call(ts: float, model: str, agent: str = "tagger") -> bytes:
    return (json.dumps({"ts": ts, "event": "call", "agent": agent, "model": model}) + "\n").encode()


def test_the_past_is_read_once_and_kept_in_a_digest(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    log.write_bytes(call(100, "a") + call(200, "a") + b'{"ts": 250, "event": "call", "mo')
    past = fp.read_past(tmp_path)
    assert [u.at_wall for u in past.uses] == [100, 200]  # the half-written line waits
    assert (tmp_path / fp.DIGEST_NAME).exists()
    # Only what was written since is parsed: garbage in place of the old lines changes nothing
    old = log.read_bytes()
    cut = old.rfind(b"\n") + 1
    log.write_bytes(b"x" * (cut - 1) + b"\n" + old[cut:] + b'del": "a"}\n' + call(300, "b"))
    past = fp.read_past(tmp_path)
    assert sorted((u.model, u.at_wall) for u in past.uses) == [
        ("a", 100), ("a", 200), ("a", 250), ("b", 300),
    ]  # fmt: skip
    assert past.models_of == {"tagger": {"a", "b"}}
    # the log rotates: the rest of the old generation, then the new one
    with open(log, "ab") as f:
        f.write(call(400, "b"))
    log.rename(tmp_path / "events.jsonl.1")
    log.write_bytes(call(500, "c"))
    past = fp.read_past(tmp_path)
    assert sorted(u.at_wall for u in past.uses) == [100, 200, 250, 300, 400, 500]


def test_a_broken_digest_is_rebuilt_from_the_log(tmp_path: Path) -> None:
    (tmp_path / "events.jsonl").write_bytes(call(100, "a") + call(200, "a"))
    (tmp_path / fp.DIGEST_NAME).write_text('{"format": "gpulock.foresight-past/1", "uses": 3}')
    assert len(fp.read_past(tmp_path).uses) == 2
    assert len(fp.read_past(tmp_path).uses) == 2  # and again, from the rewritten digest


def test_only_the_recent_past_is_kept_per_model_and_agent(tmp_path: Path) -> None:
    (tmp_path / "events.jsonl").write_bytes(b"".join(call(t, "a") for t in range(500)))
    past = fp.read_past(tmp_path)
    assert [u.at_wall for u in past.uses] == list(range(500 - fp.KEEP_PER_USER, 500))


def test_a_forged_digest_is_refused_under_python_O_too(tmp_path: Path) -> None:
    """The digest's checks are code, not ``assert``: ``python -O`` strips asserts, and an
    offset that is text would then reach the arithmetic of ``read_past``."""
    import subprocess
    import sys

    (tmp_path / fp.DIGEST_NAME).write_text(
        '{"format": "gpulock.foresight-past/1", "inode": 1, "offset": "7",'
        ' "uses": {}, "loads": [], "models_of": {}, "fleets": {}}'
    )
    code = "from gpulock.residents import foresight_past as fp; "
    code += f"print(fp._load_digest(fp.Path({str(tmp_path / fp.DIGEST_NAME)!r})))"
    out = subprocess.run(
        [sys.executable, "-O", "-c", code], capture_output=True, text=True, check=False, cwd=REPO
    )
    assert (out.returncode, out.stdout.strip()) == (0, "None"), out.stderr


@pytest.mark.parametrize("garbage", ["fifo", "folder", "deep", "symlink"])
def test_garbage_in_place_of_the_digest_hangs_and_breaks_nothing(
    tmp_path: Path, garbage: str
) -> None:
    import os

    (tmp_path / "events.jsonl").write_bytes(call(100, "a") + call(200, "a"))
    digest = tmp_path / fp.DIGEST_NAME
    if garbage == "fifo":
        os.mkfifo(digest)
    elif garbage == "folder":
        digest.mkdir()
    elif garbage == "deep":
        digest.write_text("[" * 100_000)
    else:
        (tmp_path / "elsewhere").write_text("{}")
        digest.symlink_to(tmp_path / "elsewhere")
    assert len(fp.read_past(tmp_path).uses) == 2
    if garbage == "symlink":
        assert (tmp_path / "elsewhere").read_text() == "{}"  # never written through the link


FLEET = """
fleet: {jitter: 10s}
agents:
  - {name: digest, schedule: "*/30 * * * *", args: [~/notes]}
  - {name: tagger, schedule: "0 17 * * * *"}     # seconds in front
  - {name: pulse, every: 2m}                       # a rhythm: the history's business
  - {name: off, schedule: "* * * * *", enabled: false}
"""


def test_a_running_fleets_schedules_are_planned_uses_of_its_agents_models(tmp_path: Path) -> None:
    import os

    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(FLEET)
    start = {"ts": 10, "event": "fleet-start", "pid": os.getpid(), "file": str(fleet)}
    log = tmp_path / "events.jsonl"
    log.write_bytes(
        (json.dumps(start) + "\n").encode()
        + call(20, "qwen", "digest") + call(30, "small", "tagger") + call(40, "x", "off")
    )  # fmt: skip
    past = fp.read_past(tmp_path)
    assert past.fleets == {os.getpid(): str(fleet)}
    now = time.mktime((2026, 3, 2, 6, 50, 0, 0, 0, -1))
    fc._cron_cache.clear()
    plans = {(p.model, p.label, p.source): p.at_wall - now for p in fc.fleet_plans(
        past.fleets, past.models_of, now)}  # fmt: skip
    assert plans == {("qwen", "digest", "fleet"): 600.0, ("small", "tagger", "fleet"): 1620.0}
    # the fleet stops: its schedule is no promise any more
    with open(log, "ab") as f:
        f.write((json.dumps({"ts": 50, "event": "fleet-stop", "pid": os.getpid()}) + "\n").encode())
    assert fp.read_past(tmp_path).fleets == {}
    # a fleet whose process died without a word
    dead = {"ts": 60, "event": "fleet-start", "pid": 2**22 + 12345, "file": str(fleet)}
    with open(log, "ab") as f:
        f.write((json.dumps(dead) + "\n").encode())
    past = fp.read_past(tmp_path)
    assert fc.fleet_plans(past.fleets, past.models_of, now) == []
