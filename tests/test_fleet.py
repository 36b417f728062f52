"""``gpulock fleet``: the fleet file, the plan it turns into, and real fleets running real commands.

Pure parts (schedules, commands, environments, outcomes) are table tests.  The rest starts
``gpulock fleet FILE`` as a user would, in the ``world`` fixture's state folder, with agents that
are small scripts appending ``<kind> <name> <pid> <pgid> <wall time>`` lines to a record file,
and reads the record file, the run logs and the event log.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import Cli, Proc, Result, assert_clean_error, error_lines, wait_until
from procs import World, alive

from gpulock.agents import fleet as fleet_mod
from gpulock.agents import fleetfile
from gpulock.core import events
from gpulock.core.errors import ConfigError

PY = sys.executable

# An agent stand-in: argv OUT NAME WORK_S EXIT [MODE].  Appends "start" (and "end" after WORK_S
# seconds) to OUT, prints a line to its stdout (the run's log), exits EXIT.  MODE ignore-term:
# SIGTERM does nothing; trap-term: SIGTERM appends "term" and exits 0 at once; +orphan: first
# start a grandchild in the same process group that ignores SIGTERM (a "child" line).
RECORDER = """\
import os, signal, subprocess, sys, time
out, name, work_s, code = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
mode = sys.argv[5] if len(sys.argv) > 5 else ""
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"

def line(kind, pid=None):
    fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    pid = pid or os.getpid()
    os.write(fd, f"{kind} {name} {pid} {os.getpgid(0)} {time.time():.6f}\\n".encode())
    os.close(fd)

def on_term(signum, frame):
    line("term")
    os._exit(0)

if "ignore-term" in mode:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
elif "trap-term" in mode:
    signal.signal(signal.SIGTERM, on_term)
if "orphan" in mode:
    line("child", subprocess.Popen([sys.executable, "-c", STUBBORN, out]).pid)
line("start")
print(f"hello from {name}", flush=True)
deadline = time.monotonic() + work_s
while time.monotonic() < deadline:
    time.sleep(min(0.05, max(deadline - time.monotonic(), 0)))
line("end")
sys.exit(code)
"""

# The cheapest start record (sh + date, a few ms): for measuring when runs start.
STAMP_SH = 'echo "start $0 $$ $$ $(date +%s.%N)" >> "$1"'


@dataclass(frozen=True)
class Line:
    kind: str
    name: str
    pid: int
    pgid: int
    wall: float


def read_lines(path: Path) -> list[Line]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    out = []
    for raw in text.splitlines():
        kind, name, pid, pgid, wall = raw.split()[:5]
        out.append(Line(kind, name, int(pid), int(pgid), float(wall)))
    return out


class FleetWorld:
    """Writes fleet files, starts ``gpulock fleet`` and ends whatever its runs left behind."""

    def __init__(self, world: World, cli: Cli) -> None:
        self.world = world
        self.cli = cli
        self.root = world.root
        self.record = self.root / "record.log"
        self.recorder = self.root / "recorder.py"
        self.recorder.write_text(RECORDER)

    def env(self) -> dict[str, str]:
        env = self.cli.env()
        env.update({"GPULOCK_STATE_DIR": str(self.world.state), "HOME": str(self.root / "home")})
        return env

    def agent(
        self, name: str, work_s: float = 0.0, code: int = 0, mode: str = "", **entry: Any
    ) -> dict[str, Any]:
        argv = [PY, str(self.recorder), str(self.record), name, str(work_s), str(code)]
        return {"name": name, "command": [*argv, *([mode] if mode else [])], **entry}

    def write(self, agents: list[dict[str, Any]], name: str = "fleet.yaml", **options: Any) -> Path:
        path = self.root / name
        # JSON is YAML: no quoting to get wrong.
        doc: dict[str, Any] = {"agents": agents}
        if options:
            doc = {"fleet": options, **doc}
        path.write_text(json.dumps(doc, indent=2) + "\n")
        return path

    def start(self, path: Path, *args: str, name: str = "fleet") -> Proc:
        argv = [PY, "-m", "gpulock", "fleet", str(path), *args]
        return self.cli.start(argv, name, env=self.env())

    def run(self, *args: str, timeout_s: float = 20.0) -> Result:
        return self.cli.run("fleet", *args, env=self.env(), timeout_s=timeout_s)

    def lines(self, kind: str | None = None, name: str | None = None) -> list[Line]:
        return [
            ln
            for ln in read_lines(self.record)
            if (kind is None or ln.kind == kind) and (name is None or ln.name == name)
        ]

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in events.read(self.world.state) if e["event"] == kind]

    def runs(self, agent: str) -> list[dict[str, Any]]:
        return [e for e in self.events("fleet-run") if e.get("agent") == agent]

    def cleanup(self) -> None:
        # Runs are in sessions of their own: killing the fleet's group does not reach them.
        for ln in read_lines(self.record):
            if alive(ln.pid) and str(self.record) in _cmdline(ln.pid):
                try:
                    os.killpg(ln.pgid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.fixture
def fw(world: World, cli: Cli) -> Iterator[FleetWorld]:
    f = FleetWorld(world, cli)
    try:
        yield f
    finally:
        cli.cleanup()
        f.cleanup()


# --- pure: schedules ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "apscheduler"),
    [
        ("*", "*"),
        ("0", "sun"),
        ("7", "sun"),
        ("1-5", "mon,tue,wed,thu,fri"),
        ("mon-fri", "mon,tue,wed,thu,fri"),
        ("0-6", "*"),
        ("*/2", "sun,tue,thu,sat"),  # APScheduler would read */2 as mon,wed,fri,sun
        ("5-7", "sun,fri,sat"),
        ("sat,sun", "sun,sat"),
        ("1,3,5", "mon,wed,fri"),
    ],
)
def test_cron_weekdays_keep_crons_numbering(field: str, apscheduler: str) -> None:
    assert fleetfile.cron_weekdays(field) == apscheduler


@pytest.mark.parametrize("field", ["8", "5-1", "funday", "*/0", "1-x"])
def test_cron_weekdays_refuse_what_cron_refuses(field: str) -> None:
    with pytest.raises(ValueError, match="day of week"):
        fleetfile.cron_weekdays(field)


def test_parse_schedule_fields_aliases_and_the_day_or_rule() -> None:
    (five,) = fleetfile.parse_schedule("*/5 * * * *")
    assert five.kwargs() == {
        "second": "0",
        "minute": "*/5",
        "hour": "*",
        "day": "*",
        "month": "*",
        "day_of_week": "*",
    }
    (six,) = fleetfile.parse_schedule("*/10 * * * * 1-5")
    assert (six.second, six.minute, six.day_of_week) == ("*/10", "*", "mon,tue,wed,thu,fri")
    assert fleetfile.parse_schedule("@daily") == fleetfile.parse_schedule("0 0 * * *")
    # cron: a restricted day-of-month and day-of-week match either one -> two triggers
    either = fleetfile.parse_schedule("0 9 1 * 0")
    assert [(f.day, f.day_of_week) for f in either] == [("1", "*"), ("*", "sun")]
    for bad in ("* * *", "@reboot", "@fortnightly", "* * * * * * *"):
        with pytest.raises(ValueError):
            fleetfile.parse_schedule(bad)


def test_day_or_rule_fires_on_sundays_and_on_the_first() -> None:
    spec = _plan_one({"name": "a", "schedule": "0 9 1 * 0"})
    trigger = fleet_mod.make_trigger(spec)
    start = datetime(2026, 11, 20, 12, 0).astimezone()  # a Friday
    fires = fleet_mod.next_fires(trigger, start, 4)
    assert [(f.day, f.hour, f.minute) for f in fires] == [
        (22, 9, 0),
        (29, 9, 0),
        (1, 9, 0),
        (6, 9, 0),
    ]
    assert [f.strftime("%a") for f in fires] == ["Sun", "Sun", "Tue", "Sun"]


# --- pure: the plan ----------------------------------------------------------------------------


def _fleet(text: str, file: str = "/srv/fleets/fleet.yaml") -> fleetfile.FleetFile:
    return fleetfile.parse_fleet(text, file)


def _plan_one(agent: dict[str, Any], **options: Any) -> fleetfile.JobSpec:
    doc = {"fleet": options, "agents": [agent]} if options else {"agents": [agent]}
    (spec,) = fleetfile.plan(
        _fleet(json.dumps(doc)),
        state_dir=Path("/st"),
        environ={"HOME": "/home/u", "PATH": "/bin", "GPULOCK_TICKET": "0:12"},
        python="/venv/bin/python",
    )
    return spec


@pytest.mark.parametrize(
    ("agent", "command"),
    [
        (
            {"name": "digest", "every": "5m"},
            ["/venv/bin/python", "-P", "-m", "gpulock.agents", "run", "digest"],
        ),
        (
            {"name": "digest", "every": "5m", "args": ["~/notes", "x", 3], "timeout": "10m"},
            [
                "/venv/bin/python",
                "-P",
                "-m",
                "gpulock.agents",
                "run",
                "digest",
                "/home/u/notes",
                "x",
                "3",
                "--timeout",
                "600s",
            ],
        ),
        (
            {"name": "t", "every": "5m", "timeout": 1.5, "module": "my.agents"},
            [
                "/venv/bin/python",
                "-P",
                "-m",
                "gpulock.agents",
                "run",
                "t",
                "--timeout",
                "1.5s",
                "--module",
                "my.agents",
            ],
        ),
        (
            {"name": "embed", "every": "15m", "command": ["~/bin/embed", "--all"]},
            ["/home/u/bin/embed", "--all"],
        ),
    ],
)
def test_plan_builds_the_command(agent: dict[str, Any], command: list[str]) -> None:
    assert list(_plan_one(agent).command) == command


def test_plan_environment_jitter_and_log_path() -> None:
    spec = _plan_one(
        {"name": "a", "every": "1m", "env": {"B": "agent", "N": 3}, "jitter": "2s"},
        env={"A": "fleet", "B": "fleet"},
        jitter="10s",
    )
    assert spec.env["A"] == "fleet" and spec.env["B"] == "agent" and spec.env["N"] == "3"
    assert spec.env["GPULOCK_STATE_DIR"] == "/st"  # agents queue where the fleet logs
    assert "GPULOCK_TICKET" not in spec.env  # the fleet's parent's lease is not the agent's
    assert spec.env["PATH"] == "/bin"
    assert spec.jitter_s == 2.0
    assert spec.log_path == Path("/st/fleet/a.log")
    assert spec.trigger.every_s == 60.0
    assert _plan_one({"name": "a", "every": "1m"}, jitter="10s").jitter_s == 10.0
    relative = _plan_one({"name": "a", "every": "1m"}, log_dir="logs")
    assert relative.log_path == Path("/srv/fleets/logs/a.log")  # next to the fleet file


def test_a_jobs_repr_shows_no_environment() -> None:
    # The environment carries the runs' API keys: a printed or logged job must not show them.
    secret = "sk-test-0123456789abcdef"  # noqa: S105
    spec = _plan_one({"name": "a", "every": "1m"}, env={"OPENAI_API_KEY": secret})
    assert spec.env["OPENAI_API_KEY"] == secret
    assert secret not in repr(spec) and "/venv/bin/python" in repr(spec)


def test_make_trigger_passes_jitter_and_interval() -> None:
    from apscheduler.triggers.combining import OrTrigger
    from apscheduler.triggers.cron import CronTrigger
    from apscheduler.triggers.interval import IntervalTrigger

    every = fleet_mod.make_trigger(_plan_one({"name": "a", "every": "2s", "jitter": "1s"}))
    assert isinstance(every, IntervalTrigger) and every.jitter == 1.0
    assert every.interval == timedelta(seconds=2)
    cron = fleet_mod.make_trigger(_plan_one({"name": "a", "schedule": "0 3 * * *"}))
    assert isinstance(cron, CronTrigger) and not cron.jitter
    both = fleet_mod.make_trigger(_plan_one({"name": "a", "schedule": "0 3 1 * 1", "jitter": 5}))
    assert isinstance(both, OrTrigger) and both.jitter == 5.0
    no_jitter = fleet_mod.make_trigger(
        _plan_one({"name": "a", "every": "2s", "jitter": "1s"}), jitter=False
    )
    assert not no_jitter.jitter


@pytest.mark.parametrize(
    ("returncode", "stopped", "code", "outcome"),
    [
        (0, False, 0, "ok"),
        (75, False, 75, "skip"),
        (1, False, 1, "error"),
        (127, False, 127, "error"),
        (-9, False, 137, "killed"),
        (-15, False, 143, "killed"),
        (143, False, 143, "killed"),  # a runtime wrapper reporting its agent's signal
        (0, True, 0, "killed"),  # stopped by the fleet, even if it exited cleanly
    ],
)
def test_outcome(returncode: int, stopped: bool, code: int, outcome: str) -> None:
    assert fleet_mod.exit_code(returncode) == code
    assert fleet_mod.outcome(code, stopped=stopped) == outcome


# --- pure: validation --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "line", "key", "says"),
    [
        ('agents:\n  - {name: a, schedule: "* * *"}\n', 2, "agents[0].schedule", "5 crontab"),
        ("agents:\n  - name: a\n    every: soon\n", 3, "agents[0].every", "soon"),
        ("agents:\n  - name: a\n    every: 0s\n", 3, "agents[0].every", "above 0"),
        ("agents:\n  - {name: a, every: 1m, schedule: '@daily'}\n", 2, "agents[0].every", "both"),
        ("agents:\n  - {name: 'a b', every: 1m}\n", 2, "agents[0].name", "letters"),
        ("agents:\n  - {every: 1m}\n", 2, "agents[0]", "missing 'name'"),
        ("agents: []\n", 1, "agents", "list of agents"),
        ("fleet:\n  grace: 1s\n", None, "agents", "no agents"),
        ("fleet:\n  max_parallel: 0\nagents:\n  - {name: a, every: 1m}\n", 2, None, ">= 1"),
        ("fleet:\n  jiter: 1s\nagents:\n  - {name: a, every: 1m}\n", 2, "fleet.jiter", "jitter"),
        (
            "agents:\n  - {name: a, every: 1m, command: [x], args: [y]}\n",
            2,
            "agents[0].args",
            "command",
        ),
        ("agents:\n  - {name: a, every: 1m, env: {A: [1]}}\n", 2, "agents[0].env.A", "text"),
        ("agents:\n  - {name: a, every: 1m, enabled: maybe}\n", 2, "agents[0].enabled", "true"),
    ],
)
def test_validation_errors_name_line_and_key(
    text: str, line: int | None, key: str | None, says: str
) -> None:
    with pytest.raises(ConfigError) as info:
        _fleet(text, "f.yaml")
    e = info.value
    assert e.file == "f.yaml"
    if line is not None:
        assert e.line == line, str(e)
    if key is not None:
        assert e.key == key, str(e)
    assert says in str(e) + str(e.hint), str(e)


# --- the command: errors -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "line", "says", "hint"),
    [
        ('agents:\n  - {name: a, schedule: "61 * * * *"}\n', 2, "agents[0].schedule", "crontab"),
        ("agents:\n  - name: a\n    shedule: '* * * * *'\n", 3, "'shedule'", "'schedule'"),
        (
            "agents:\n  - {name: a, every: 1m}\n  - {name: b, every: 1m}\n"
            "  - {name: a, every: 2m}\n",
            4,
            "duplicate agent name 'a' (first on line 2)",
            "unique",
        ),
        ("agents:\n  - {name: a, args: [x]}\n", 2, "no 'schedule' or 'every'", "every:"),
        ("state_dir: /tmp\nagents:\n  - {name: a, every: 1m}\n", 1, "state_dir", "config"),
    ],
)
def test_bad_fleet_file_is_one_error_line_naming_file_and_line(
    fw: FleetWorld, text: str, line: int, says: str, hint: str
) -> None:
    path = fw.root / "bad.yaml"
    path.write_text(text)
    r = fw.run(str(path))
    assert_clean_error(r, 1)
    (err,) = error_lines(r.stderr)
    assert f"{path}:{line}:" in err, r.describe()
    assert says in err, r.describe()
    assert hint in r.stderr.split("hint:", 1)[1], r.describe()
    assert not fw.events("fleet-start")


def test_missing_fleet_file_and_usage_errors(fw: FleetWorld) -> None:
    r = fw.run(str(fw.root / "nope.yaml"))
    assert_clean_error(r, 1)
    assert f"{fw.root / 'nope.yaml'}: no such fleet file" in r.stderr
    path = fw.write([fw.agent("a", every="1m")])
    for args, says in [
        ([str(path), "--once", "zed"], "no agent 'zed'"),
        ([str(path), "--for", "soon"], "soon"),
        ([str(path), "--once", "a", "--for", "1s"], "not allowed with"),
        ([], "FLEET.yaml"),
    ]:
        r = fw.run(*args)
        assert_clean_error(r, 2)
        assert says in r.stderr, r.describe()
    r = fw.run(str(path), "--json")  # with --json, the error is JSON too
    assert (r.code, r.stderr) == (2, ""), r.describe()
    assert json.loads(r.stdout)["error"]["message"] == "--json goes with --dry-run or --once"


def test_import_stays_light_and_missing_apscheduler_names_the_extra(fw: FleetWorld) -> None:
    path = fw.write([fw.agent("a", every="1m")])
    code = (
        "import sys\n"
        "import gpulock.agents, gpulock.agents.fleet, gpulock.agents.fleetfile\n"
        "assert 'apscheduler' not in sys.modules, 'imported at import time'\n"
        "sys.modules['apscheduler'] = None  # as if it were not installed\n"
        "sys.exit(gpulock.agents.fleet.main(sys.argv[1:]))\n"
    )
    r = fw.cli.run("-c", code, str(path), env=fw.env(), argv0=(PY,))
    assert_clean_error(r, 1)
    assert "APScheduler" in r.stderr and "hint: " in r.stderr, r.describe()
    assert " install -e " in r.stderr and "[scheduler]'" in r.stderr, r.describe()  # a checkout


# --- the command: --dry-run --------------------------------------------------------------------


def test_dry_run_shows_next_fire_times_and_commands(fw: FleetWorld) -> None:
    path = fw.write(
        [
            {"name": "nightly", "schedule": "0 3 * * *", "args": ["~/notes"]},
            fw.agent("fast", every="2s"),
            {"name": "off", "every": "1m", "enabled": False},
        ],
        jitter="10s",
    )
    before = datetime.now().astimezone()
    r = fw.run(str(path), "--dry-run", "--json")
    # "nightly" is no agent anywhere: every fire would exit 2, so the dry run says so (exit 1).
    assert r.code == 1, r.describe()
    doc = r.json()
    assert [a["name"] for a in doc["agents"] if a["unknown_agent"]] == ["nightly"]
    assert doc["file"] == str(path)
    nightly, fast, off = doc["agents"]
    times = [datetime.fromisoformat(t) for t in nightly["next_runs"]]
    assert len(times) == 3
    assert all((t.hour, t.minute, t.second) == (3, 0, 0) for t in times)
    assert [b - a for a, b in itertools.pairwise(times)] == [timedelta(days=1)] * 2
    assert before < times[0] <= before + timedelta(days=1)
    assert nightly["command"] == [
        PY,
        "-P",  # a folder named like a package where the fleet started cannot shadow it
        "-m",
        "gpulock.agents",
        "run",
        "nightly",
        str(fw.root / "home/notes"),
    ]
    assert nightly["jitter_s"] == 10.0 and nightly["trigger"] == "cron 0 3 * * *"
    assert nightly["log"] == str(fw.world.state / "fleet" / "nightly.log")
    fast_times = [datetime.fromisoformat(t) for t in fast["next_runs"]]
    assert [b - a for a, b in itertools.pairwise(fast_times)] == [timedelta(seconds=2)] * 2
    assert off["enabled"] is False and off["next_runs"] == []

    text = fw.run(str(path), "--dry-run")
    assert text.code == 1, text.describe()
    err = text.stderr.splitlines()
    assert err[0] == f"error: {path}: agent 'nightly' is not defined"
    assert err[1].startswith("hint: known agents: digest, ")
    assert "03:00:00" in text.stdout and "(disabled)" in text.stdout
    assert "up to 10 s jitter" in text.stdout
    assert not fw.lines() and not fw.events("fleet-run")  # nothing ran
    assert not (fw.world.state / "fleet").exists()


def test_dry_run_warns_of_input_folders_that_do_not_exist(fw: FleetWorld) -> None:
    example = Path(__file__).resolve().parent.parent / "examples" / "fleet.yaml"
    home = fw.root / "home"
    (home / "notes").mkdir(parents=True, exist_ok=True)  # digest's and report-drafter's input
    r = fw.run(str(example), "--dry-run")
    assert r.code == 0, r.describe()  # a warning: the folders may be made before the first run
    warned = [ln for ln in r.stderr.splitlines() if ln.startswith("warning:")]
    assert warned == [
        f"warning: {example}: agent 'inbox-triage': input {home}/Mail/inbox does not exist: "
        "its runs fail until it does",
        f"warning: {example}: agent 'tagger': input {home}/documents does not exist: "
        "its runs fail until it does",
        f"warning: {example}: agent 'tts-batch': input {home}/tts/queue does not exist: "
        "its runs fail until it does",
    ], r.stderr
    doc = fw.run(str(example), "--dry-run", "--json").json()
    gone = {a["name"]: a["missing_inputs"] for a in doc["agents"]}
    assert gone["digest"] == [] and gone["inbox-triage"] == [f"{home}/Mail/inbox"], gone


def test_example_fleet_file_is_valid(fw: FleetWorld) -> None:
    example = Path(__file__).resolve().parent.parent / "examples" / "fleet.yaml"
    r = fw.run(str(example), "--dry-run", "--json")
    assert r.code == 0, r.describe()
    agents = {a["name"]: a for a in r.json()["agents"]}
    # the same agents as crontab.example, plus a plain command that starts disabled
    assert set(agents) == {
        "digest",
        "inbox-triage",
        "tagger",
        "report-drafter",
        "tts-batch",
        "embed",
    }
    for name, a in agents.items():
        assert len(a["next_runs"]) == (3 if a["enabled"] else 0), name
    assert agents["digest"]["command"][-4:] == [
        "digest",
        str(fw.root / "home" / "notes"),
        "--timeout",
        "600s",
    ]
    assert agents["embed"]["enabled"] is False


# --- the command: a running fleet --------------------------------------------------------------


def test_fleet_runs_each_agent_in_its_own_process_and_records_outcomes(fw: FleetWorld) -> None:
    path = fw.write(
        [
            fw.agent("fast", every="1s"),
            fw.agent("sixfield", schedule="* * * * * *"),  # seconds first: every second
            fw.agent("slow", 2.5, every="1s"),  # longer than its interval
            fw.agent("skipper", code=75, every="1s"),
            fw.agent("failer", code=3, every="1s"),
            {"name": "ghost", "every": "1s", "command": [str(fw.root / "no-such-program")]},
            fw.agent("off", every="1s", enabled=False),
        ]
    )
    fleet = fw.start(path, "--for", "6s")
    code = fleet.wait(20)
    assert code == 0, fleet.output()

    for name in ("fast", "sixfield"):
        starts = fw.lines("start", name)
        assert len(starts) >= 3, fleet.output()
        pids = [s.pid for s in starts]
        assert len(set(pids)) == len(pids)  # one process per run
        assert fleet.pid not in pids
        assert all(s.pgid == s.pid for s in starts)  # each its own process group
        runs = fw.runs(name)
        assert sorted(e["pid"] for e in runs) == sorted(pids)
        assert {(e["exit"], e["outcome"]) for e in runs} == {(0, "ok")}
        assert all(e["duration_s"] >= 0 for e in runs)

    # max_instances=1: the slow agent never overlaps itself, and fires during a run are
    # dropped (recorded as fleet-missed), not queued up to run back to back afterwards.
    starts, ends = fw.lines("start", "slow"), fw.lines("end", "slow")
    assert 1 <= len(starts) <= 3, fw.lines()
    by_pid = {e.pid: e.wall for e in ends}
    intervals = sorted((s.wall, by_pid[s.pid]) for s in starts)  # the fleet waited for each
    for (_, end), (start, _) in itertools.pairwise(intervals):
        assert start >= end, intervals
    missed = [e for e in fw.events("fleet-missed") if e["agent"] == "slow"]
    assert missed and {e["reason"] for e in missed} == {"running"}

    assert {(e["exit"], e["outcome"]) for e in fw.runs("skipper")} == {(75, "skip")}
    assert {(e["exit"], e["outcome"]) for e in fw.runs("failer")} == {(3, "error")}
    ghost = fw.runs("ghost")
    assert ghost and {(e["exit"], e["outcome"], e["pid"]) for e in ghost} == {(127, "error", None)}
    assert "no-such-program" in ghost[0]["error"]
    assert not fw.runs("off") and not fw.lines(name="off")

    log = (fw.world.state / "fleet" / "fast.log").read_text()
    assert log.count("hello from fast") == len(fw.lines("start", "fast"))
    (stop,) = fw.events("fleet-stop")
    assert stop["reason"] == "duration" and stop["pid"] == fleet.pid
    assert not [ln for ln in fw.lines() if alive(ln.pid)]


def test_jitter_spreads_starts_and_one_fleet_per_file(fw: FleetWorld) -> None:
    names = [f"j{i}" for i in range(10)]
    agents = [
        {"name": n, "every": "1s", "command": ["sh", "-c", STAMP_SH, n, str(fw.record)]}
        for n in names
    ]
    path = fw.write(agents, jitter="1s", max_parallel=16)
    fleet = fw.start(path, "--for", "3s")
    wait_until(lambda: fw.events("fleet-start"), lambda: fleet.output())
    second = fw.run(str(path), "--for", "1s")
    assert_clean_error(second, 1)
    assert f"a fleet already runs {path} (pid {fleet.pid})" in second.stderr
    assert fleet.wait(20) == 0, fleet.output()

    firsts = {}
    for ln in fw.lines("start"):
        firsts.setdefault(ln.name, ln.wall)
    assert sorted(firsts) == names, fleet.output()
    # Without jitter all ten fire at the same instant and start within a few ms; with 1 s of
    # jitter, ten draws all within 0.2 s of each other has a chance of about 5e-6.
    spread = max(firsts.values()) - min(firsts.values())
    assert spread >= 0.2, sorted(firsts.values())


def test_sigterm_waits_for_runs_within_grace_then_kills_the_rest(fw: FleetWorld) -> None:
    grace = 2.5
    path = fw.write(
        [
            fw.agent("finisher", 1.5, mode="trap-term", every="1s"),
            fw.agent("polite", 30, mode="trap-term+orphan", every="1s"),
            fw.agent("stubborn", 30, mode="ignore-term", every="1s"),
        ],
        grace=f"{grace}s",
    )
    fleet = fw.start(path)
    names = {"finisher", "polite", "stubborn"}
    wait_until(
        lambda: {ln.name for ln in fw.lines("start")} == names,
        lambda: f"three runs started\n{fleet.output()}\n{fw.lines()}",
    )
    sent = time.time()
    os.kill(fleet.pid, signal.SIGTERM)
    code = fleet.wait(60)  # "eventually": what it did is read from its lines below
    assert code == 0, fleet.output()

    assert len(fw.lines("start")) == 3  # nothing new started once the stop was asked for
    # finisher: waited for, never signalled
    assert fw.lines("end", "finisher") and not fw.lines("term", "finisher")
    assert [(e["exit"], e["outcome"]) for e in fw.runs("finisher")] == [(0, "ok")]
    # polite: SIGTERM after the grace, and it left at once
    (term,) = fw.lines("term", "polite")
    assert term.wall - sent >= grace - 0.1
    assert [e["outcome"] for e in fw.runs("polite")] == ["killed"]
    (orphan,) = fw.lines("child", "polite")  # left in polite's group, ignoring SIGTERM
    assert orphan.pgid == term.pgid
    # stubborn: ignored SIGTERM, so SIGKILL
    assert not fw.lines("end", "stubborn")
    assert [(e["exit"], e["outcome"]) for e in fw.runs("stubborn")] == [(137, "killed")]
    assert not [ln for ln in fw.lines() if alive(ln.pid)]
    (stop,) = fw.events("fleet-stop")
    assert stop["reason"] == "SIGTERM" and stop["killed"] == 2


def test_once_runs_one_agent_now_with_its_exit_code(fw: FleetWorld) -> None:
    path = fw.write(
        [fw.agent("daily", code=3, schedule="0 3 * * *"), fw.agent("other", every="1s")]
    )
    r = fw.run(str(path), "--once", "daily", timeout_s=20)
    assert r.code == 3, r.describe()
    assert "hello from daily" in r.stdout  # on the terminal, not in a log
    assert [ln.name for ln in fw.lines("start")] == ["daily"]
    (run,) = fw.runs("daily")
    assert (run["exit"], run["outcome"]) == (3, "error")
    assert not fw.runs("other")


def test_once_json_prints_the_run_and_sends_its_output_to_stderr(fw: FleetWorld) -> None:
    path = fw.write([fw.agent("daily", code=3, schedule="0 3 * * *")])
    r = fw.run(str(path), "--once", "daily", "--json", timeout_s=20)
    assert r.code == 3, r.describe()
    doc = json.loads(r.stdout)
    assert (doc["agent"], doc["exit_code"], doc["outcome"]) == ("daily", 3, "error")
    assert isinstance(doc["pid"], int) and doc["duration_s"] >= 0
    assert "hello from daily" in r.stderr


def test_fleet_runs_real_agents_through_the_runtime(fw: FleetWorld) -> None:
    module = str(Path(__file__).with_name("fleet_agents.py"))
    path = fw.write(
        [
            {
                "name": "fleet-probe",
                "every": "1s",
                "args": [str(fw.record)],
                "timeout": "45s",
                "module": module,
            },
            {"name": "fleet-busy", "every": "1s", "module": module},
        ]
    )
    fleet = fw.start(path, "--for", "2.5s")
    assert fleet.wait(30) == 0, fleet.output()
    probes = fw.lines("start", "fleet-probe")
    assert probes, fleet.output() + (fw.world.state / "fleet" / "fleet-probe.log").read_text()
    runs = fw.runs("fleet-probe")
    # `python -m gpulock.agents run` ran the agent in the process the fleet started and waited for.
    assert sorted(e["pid"] for e in runs) == sorted(ln.pid for ln in probes)
    assert {(e["exit"], e["outcome"]) for e in runs} == {(0, "ok")}
    timeouts = {raw.split()[5] for raw in fw.record.read_text().splitlines()}
    assert timeouts == {"45.0"}  # the fleet's timeout: reached the runtime as --timeout
    busy = fw.runs("fleet-busy")
    assert busy and {(e["exit"], e["outcome"]) for e in busy} == {(75, "skip")}, fleet.output()


def test_config_given_to_the_fleet_reaches_its_runs(fw: FleetWorld) -> None:
    # An agent must read the same routes as the fleet that started it, not the usual lookup.
    config = fw.root / "other.yaml"
    config.write_text("default_gpu: 0\n")
    show = "import os; print('config=' + os.environ['GPULOCK_CONFIG'])"
    path = fw.write([{"name": "probe", "every": "1h", "command": [PY, "-c", show]}])
    r = fw.run(str(path), "--once", "probe", "--config", str(config), timeout_s=20)
    assert r.code == 0, r.describe()
    assert f"config={config}" in r.stdout.splitlines()


# --- garbage in the fleet's folder, and its modes ----------------------------------------------


def fleet_folder(fw: FleetWorld) -> Path:
    folder = fw.world.state / "fleet"
    folder.mkdir(mode=0o700, parents=True)
    fw.world.state.chmod(0o700)
    return folder


@pytest.mark.parametrize("what", ["folder", "symlink", "fifo"])
def test_a_fleet_lock_that_is_not_a_file_is_one_error_line(fw: FleetWorld, what: str) -> None:
    import hashlib

    path = fw.write([fw.agent("fast", every="1s")])
    digest = hashlib.sha256(str(path.absolute()).encode()).hexdigest()[:12]
    lock = fleet_folder(fw) / f".fleet-{digest}.lock"
    outside = fw.root / "outside"
    if what == "folder":
        lock.mkdir()
    elif what == "symlink":
        lock.symlink_to(outside)
    else:
        os.mkfifo(lock)
    r = fw.run(str(path), "--for", "1s", timeout_s=10)
    assert_clean_error(r, 1)
    assert str(lock) in error_lines(r.stderr)[0] and "hint: " in r.stderr, r.describe()
    assert not outside.exists() and not fw.lines()


def test_a_fifo_in_place_of_a_run_log_stops_neither_the_run_nor_the_fleet(fw: FleetWorld) -> None:
    os.mkfifo(fleet_folder(fw) / "fast.log")
    path = fw.write([fw.agent("fast", every="1s")])
    # The log was opened for writing with the runner's lock held: the fleet hung for good, its
    # SIGTERM and --for included.
    r = fw.run(str(path), "--for", "2s", timeout_s=10)
    assert r.code == 0, r.describe()
    runs = fw.runs("fast")
    assert runs and {(e["outcome"], e["pid"]) for e in runs} == {("error", None)}, runs
    assert "fast.log: is not a regular file" in runs[0]["error"]


def test_the_fleets_lock_and_logs_are_shared_with_the_group(fw: FleetWorld) -> None:
    import grp

    config = fw.root / "shared.yaml"
    config.write_text(f"group: {grp.getgrgid(os.getgid()).gr_name}\n")
    path = fw.write([fw.agent("fast", every="1s")])
    old = os.umask(0o077)  # inherited by the fleet: every file 0600 unless set explicitly
    try:
        r = fw.run(str(path), "--for", "2s", "--config", str(config))
    finally:
        os.umask(old)
    assert r.code == 0, r.describe()
    folder = fw.world.state / "fleet"
    assert folder.stat().st_mode & 0o7777 == 0o2770
    files = [p for p in folder.iterdir() if p.name.endswith((".lock", ".log"))]
    assert {p.suffix for p in files} == {".lock", ".log"}, files
    for p in files:
        assert p.stat().st_mode & 0o777 == 0o660, p
