"""The ``gpulock`` command's surface: usage errors, config and state-folder errors, status,
break, history, heartbeat, help, start-up weight and ``make demo``, through real processes."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import datetime

import pytest
from cli_helpers import Cli, Result, assert_clean_error, error_lines, wait_until


def hint_lines(r: Result) -> list[str]:
    return [line for line in r.stderr.splitlines() if line.startswith("hint:")]


def ticket_files(cli: Cli, gpu: int = 0) -> list[str]:
    return [f for f in cli.queue_files(gpu) if f.endswith(".ticket")]


# --- usage errors: exit 2, one error line, never a traceback ---------------------------------


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["run", "--need", "banana", "--", "true"], "banana"),
        (["run", "--timeout", "soon", "--", "true"], "soon"),
        (["run", "--gpu", "x", "--", "true"], "--gpu"),
        (["break"], "TICKET"),
        (["break", "3", "--stale"], "TICKET"),
        (["break", "--stale", "--force"], "--force"),
        (["history", "--since", "yesterdayish"], "yesterdayish"),
        (["status", "--no-such-flag"], "--no-such-flag"),
    ],
)
def test_usage_errors_exit_2(cli: Cli, args: list[str], says: str) -> None:
    r = cli.run(*args)
    assert_clean_error(r, 2)
    assert says in error_lines(r.stderr)[0], r.describe()
    assert r.stdout == ""
    assert not (cli.state / "gpu0").exists()  # nothing queued


def test_unknown_command_lists_the_known_ones(cli: Cli) -> None:
    r = cli.run("frobnicate")
    assert_clean_error(r, 2)
    assert "frobnicate" in error_lines(r.stderr)[0]
    (hint,) = hint_lines(r)
    for command in ("run", "status", "break", "history", "heartbeat", "help"):
        assert command in hint, r.describe()


@pytest.mark.parametrize(("typo", "meant"), [("stats", "status"), ("histroy", "history")])
def test_a_mistyped_command_gets_a_guess(cli: Cli, typo: str, meant: str) -> None:
    r = cli.run(typo)
    assert_clean_error(r, 2)
    (hint,) = hint_lines(r)
    assert hint.startswith(f"hint: did you mean {meant!r}? commands: "), r.describe()


# --- config and state-folder errors: exit 1 ---------------------------------------------------


@pytest.mark.parametrize("args", [["status"], ["run", "--", "true"]])
def test_malformed_config_names_file_line_and_key(cli: Cli, args: list[str]) -> None:
    config = cli.root / "bad.yaml"
    config.write_text("# gpulock settings\ndefault_gpu: 0\non_hung: kil\nhung_grace: 5s\n")
    r = cli.run(*args[:1], "--config", str(config), *args[1:])
    assert_clean_error(r, 1)
    err = error_lines(r.stderr)[0]
    assert f"{config}:3:" in err and "on_hung" in err and "kil" in err, r.describe()
    assert ticket_files(cli) == []


def test_missing_config_file_is_an_error(cli: Cli) -> None:
    missing = cli.root / "nowhere.yaml"
    r = cli.run("status", "--config", str(missing))
    assert_clean_error(r, 1)
    assert str(missing) in error_lines(r.stderr)[0]


@pytest.mark.parametrize("how", ["env", "flag"])
def test_symlinked_state_folder_is_refused(cli: Cli, how: str) -> None:
    real = cli.root / "real-state"
    real.mkdir(mode=0o700)
    link = cli.root / "link-state"
    link.symlink_to(real)
    if how == "env":
        r = cli.run("status", env=cli.env(GPULOCK_STATE_DIR=str(link)))
    else:
        r = cli.run("run", "--state-dir", str(link), "--", "true")
    assert_clean_error(r, 1)
    err = error_lines(r.stderr)[0]
    assert err.startswith(f"error: state folder {link}") and "symlink" in err, r.describe()
    assert os.listdir(real) == []


def test_world_writable_state_folder_is_refused(cli: Cli) -> None:
    cli.state.mkdir()
    cli.state.chmod(0o777)
    for args in (["status"], ["run", "--", "true"]):
        r = cli.run(*args)
        assert_clean_error(r, 1)
        err = error_lines(r.stderr)[0]
        assert err.startswith(f"error: state folder {cli.state}"), r.describe()
        assert "world-writable" in err, r.describe()
    assert os.listdir(cli.state) == []


def test_gpu_that_does_not_exist_is_an_error(cli: Cli) -> None:
    r = cli.run("run", "--gpu", "3", "--", "true")
    assert_clean_error(r, 2)  # a bad --gpu is a usage error
    assert "gpu3 does not exist" in error_lines(r.stderr)[0], r.describe()
    assert ticket_files(cli, 3) == [] and not cli.events("acquire")


def test_refused_gpu_leaves_no_phantom_queue_in_status(cli: Cli) -> None:
    assert cli.run("run", "--gpu", "3", "--", "true").code == 2
    assert [g["gpu"] for g in cli.status()["gpus"]] == [0]


# --- status -----------------------------------------------------------------------------------


def test_status_json_on_an_empty_state(cli: Cli) -> None:
    cli.state.mkdir(mode=0o700)  # an empty one: a missing one is an error (test_state_readers)
    snap = cli.status()
    assert snap["version"] == 1
    assert isinstance(snap["gpus"], list)
    for g in snap["gpus"]:
        assert g["holders"] == [] and g["waiters"] == [] and g["ignored"] == []
    r = cli.run("status")
    assert r.code == 0 and "Traceback" not in r.stderr, r.describe()


def test_status_lists_holder_and_waiters_in_queue_order(cli: Cli) -> None:
    holder = cli.hold("holder-a")
    waiters = []
    for name in ("waiter-b", "waiter-c"):
        waiters.append(cli.start_run(name, cmd=["true"]))
        cli.wait_event("wait", name=name)  # arrival order is fixed before the next starts

    entries = cli.entries()
    got = [(e["name"], e["state"], e["position"], e["pid"]) for e in entries]
    assert got == [
        ("holder-a", "holding", 0, holder.pid),
        ("waiter-b", "waiting", 1, waiters[0].pid),
        ("waiter-c", "waiting", 2, waiters[1].pid),
    ], json.dumps(entries, indent=1)
    tickets = [e["ticket"] for e in entries]
    assert tickets == sorted(tickets) and len(set(tickets)) == 3
    assert all(e["stale"] is False for e in entries)

    r = cli.run("status")
    assert r.code == 0, r.describe()
    lines = r.stdout.splitlines()
    assert any("1 holding, 2 waiting" in ln for ln in lines), r.stdout
    rows = [next(i for i, ln in enumerate(lines) if f" {n} " in ln) for n, *_ in got]
    assert rows == sorted(rows), r.stdout
    for (_, state, *_), row in zip(got, rows, strict=True):
        assert state in lines[row].split(), r.stdout

    holder.release()
    assert [p.wait() for p in (holder, *waiters)] == [0, 0, 0]
    order = [e["name"] for e in cli.events("acquire")]
    assert order == ["holder-a", "waiter-b", "waiter-c"], cli.describe()


VICTIM_PY = """\
import os, sys, gpulock
lease = gpulock.acquire(gpu=0, name="victim")
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(lease.ticket))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
sys.stdin.read()
"""


def test_dead_ticket_shows_dead_and_break_stale_removes_it(cli: Cli) -> None:
    seq_file = cli.root / "victim.seq"
    victim = cli.start([sys.executable, "-c", VICTIM_PY, str(seq_file)], "victim")
    cli.wait_ready(victim, seq_file)
    seq = int(seq_file.read_text())
    os.kill(victim.pid, signal.SIGKILL)  # holding, and nobody waits to clean up after it
    assert victim.wait() == -signal.SIGKILL

    (entry,) = cli.entries()
    assert (entry["ticket"], entry["state"], entry["stale"]) == (seq, "dead", True), entry
    r = cli.run("status")
    assert r.code == 0 and "dead" in r.stdout and "victim" in r.stdout, r.describe()

    r = cli.run("break", "--stale")
    assert r.code == 0, r.describe()
    assert f"ticket {seq} (gpu0): removed" in r.stdout, r.describe()
    assert str(victim.pid) in r.stdout
    assert cli.queue_files() == [], cli.describe()
    assert cli.entries() == []
    assert cli.events("break", ticket=seq, action="removed"), cli.describe()

    r = cli.run("break", "--stale")
    assert (r.code, r.stdout.strip()) == (0, "nothing stale"), r.describe()


def test_break_refuses_a_healthy_holder_unless_forced(cli: Cli) -> None:
    holder = cli.hold("healthy")
    entry = cli.entry("healthy")
    assert entry is not None
    seq = entry["ticket"]

    r = cli.run("break", str(seq))
    assert_clean_error(r, 1)
    assert f"ticket {seq}" in error_lines(r.stderr)[0], r.describe()
    assert any("--force" in h for h in hint_lines(r)), r.describe()
    assert holder.popen.poll() is None
    assert (cli.entry("healthy") or {}).get("state") == "holding"

    r = cli.run("break", "--force", "--grace", "5", str(seq))
    assert r.code == 0, r.describe()
    assert f"ticket {seq} (gpu0): killed" in r.stdout, r.describe()
    # break signals the command, then `gpulock run`: that one exits 143 after forwarding,
    # or dies of the second SIGTERM once it has released (a shell sees 143 either way).
    assert holder.wait() in (128 + signal.SIGTERM, -signal.SIGTERM), holder.output()
    assert ticket_files(cli) == [], cli.describe()
    assert cli.events("kill", ticket=seq) and cli.events("break", ticket=seq), cli.describe()


def test_break_of_an_unknown_ticket_is_an_error(cli: Cli) -> None:
    assert cli.run("run", "--", "true").code == 0
    r = cli.run("break", "999")
    assert_clean_error(r, 1)
    assert "999" in error_lines(r.stderr)[0]


BULK_PY = """\
import sys, time
from gpulock.core import identity
from gpulock.lock.queuedir import QueueDir
from gpulock.core.settings import load
from gpulock.lock.ticket import Ticket

count, ready = int(sys.argv[1]), sys.argv[2]
queue = QueueDir(load(), 0)
me = identity.current()
claims = []
for i in range(count):
    def make(seq, i=i):
        now = time.time()
        return Ticket(
            seq=seq, gpu=0, pid=me.pid, uid=me.uid, user=me.user, host=me.host,
            name=f"bulk-{i:03d}", created_wall=now, start_ticks=me.start_ticks,
            boot_id=me.boot_id, pidns=me.pidns, command=("bulk", str(i)),
            granted_wall=now if i == 0 else None,
        )
    claims.append(queue.enqueue(make, None)[1])  # each FIFO's read end stays open here
open(ready, "w").close()
sys.stdin.read()
"""


def test_status_with_100_queued_tickets(cli: Cli) -> None:
    ready = cli.root / "bulk.ready"
    bulk = cli.start([sys.executable, "-c", BULK_PY, "100", str(ready)], "bulk")
    cli.wait_ready(bulk, ready)

    r = cli.run("status", "--json")
    assert r.code == 0, r.describe()  # how fast: bench/, not here
    (g,) = r.json()["gpus"]
    entries = g["holders"] + g["waiters"]
    assert [e["name"] for e in entries] == [f"bulk-{i:03d}" for i in range(100)]
    assert [e["position"] for e in entries] == list(range(100))
    assert [e["state"] for e in entries] == ["holding"] + ["waiting"] * 99
    assert g["ignored"] == []

    r = cli.run("status")
    assert r.code == 0, r.describe()
    assert "1 holding, 99 waiting" in r.stdout
    rows = [ln for ln in r.stdout.splitlines() if " bulk-" in ln]
    assert len(rows) == 100, r.stdout


# --- history ----------------------------------------------------------------------------------


def test_history_json_filters_and_human_lines(cli: Cli) -> None:
    for name in ("first", "second"):
        r = cli.run("run", "--name", name, "--", "true")
        assert r.code == 0, r.describe()

    r = cli.run("history", "--json")
    assert r.code == 0, r.describe()
    events = r.json()["events"]
    got = [(e["event"], e["name"]) for e in events]
    assert got == [
        ("acquire", "first"),
        ("release", "first"),
        ("acquire", "second"),
        ("release", "second"),
    ], r.stdout
    for e in events:
        assert isinstance(e["ts"], float | int) and e["gpu"] == 0 and isinstance(e["ticket"], int)
    assert events[0]["ticket"] == events[1]["ticket"] != events[2]["ticket"]

    r = cli.run("history", "--json", "--event", "acquire")
    assert [(e["event"], e["name"]) for e in r.json()["events"]] == [
        ("acquire", "first"),
        ("acquire", "second"),
    ]
    r = cli.run("history", "--json", "--since", "1h")
    assert r.json()["events"] == events
    future = datetime.fromtimestamp(time.time() + 3600).isoformat(timespec="seconds")
    r = cli.run("history", "--json", "--since", future)
    assert r.json()["events"] == []
    r = cli.run("history", "--json", "--limit", "1")
    assert r.json()["events"] == events[-1:]

    r = cli.run("history")
    assert r.code == 0, r.describe()
    lines = r.stdout.splitlines()
    assert len(lines) == len(events), r.stdout
    for line, e in zip(lines, events, strict=True):
        assert e["event"] in line and e["name"] in line, r.stdout


# --- heartbeat --------------------------------------------------------------------------------


def test_heartbeat_inside_gpulock_run(cli: Cli) -> None:
    r = cli.run("run", "--lease", "5", "--", "sh", "-c", "gpulock heartbeat")
    assert r.code == 0, r.describe()
    assert r.stderr == "", r.describe()


HEARTBEAT_SH = (
    ': > "$0"; read go; gpulock heartbeat; echo $? > "$1.tmp"; mv "$1.tmp" "$1"; '
    "exec cat >/dev/null"
)


def test_heartbeat_renews_the_lease(cli: Cli) -> None:
    ready, done = cli.root / "beat.ready", cli.root / "beat.rc"
    proc = cli.start_run(
        "beater", "--lease", "5", cmd=["sh", "-c", HEARTBEAT_SH, str(ready), str(done)]
    )
    cli.wait_ready(proc, ready)
    (name,) = ticket_files(cli)
    ticket = cli.gpu_dir() / name
    before = ticket.stat().st_mtime
    wait_until(lambda: time.time() > before + 0.05, "the clock to move past the grant")

    assert proc.popen.stdin is not None
    proc.popen.stdin.write(b"go\n")
    proc.popen.stdin.flush()
    wait_until(done.exists, lambda: f"the heartbeat to run\n{proc.output()}")
    assert done.read_text().strip() == "0", proc.output()
    assert ticket.stat().st_mtime > before

    entry = cli.entry("beater")
    assert entry is not None and entry["state"] == "holding", entry
    assert entry["heartbeat_age_s"] < entry["held_s"], entry
    proc.release()
    assert proc.wait() == 0, proc.output()


def test_heartbeat_outside_gpulock_run_is_a_usage_error(cli: Cli) -> None:
    r = cli.run("heartbeat")
    assert_clean_error(r, 2)
    assert hint_lines(r), r.describe()


# --- help -------------------------------------------------------------------------------------


def test_help(cli: Cli) -> None:
    for args in (["--help"], ["help"]):
        r = cli.run(*args)
        assert r.code == 0, r.describe()
        assert "exit codes" in r.stdout and "75" in r.stdout, r.stdout
        for command in ("run", "status", "break", "history", "heartbeat"):
            assert command in r.stdout, r.stdout
    r = cli.run("run", "--help")
    assert r.code == 0, r.describe()
    for option in ("--gpu", "--need", "--timeout", "--name", "--lease", "75"):
        assert option in r.stdout, r.stdout


# --- start-up weight --------------------------------------------------------------------------

HEAVY = ("torch", "pynvml", "llama_cpp", "openai", "apscheduler", "yaml", "psutil")
HEAVY += ("prometheus_client",)  # the metrics extra: only `gpulock metrics` and daemons load it
# `gpulock serve`'s HTTP stack, and asyncio (only acquire_async needs it): none on these paths.
HEAVY += ("starlette", "uvicorn", "httptools", "aiohttp", "httpx", "anyio", "asyncio")
HEAVY += ("gpulock.serve",)
# A name counts with its submodules: 'gpulock.serve' catches gpulock.serve.app too.
LOADED = "sorted(m for m in sys.modules if any(m == h or m.startswith(h + '.') for h in {heavy!r}))"


def python(cli: Cli, code: str, **env: str | None) -> Result:
    return cli.run("-c", code, argv0=[sys.executable], env=cli.env(**env))


def test_import_gpulock_stays_light(cli: Cli) -> None:
    code = f"import json, sys\nimport gpulock\nprint(json.dumps({LOADED.format(heavy=HEAVY)}))"
    r = python(cli, code)
    assert r.code == 0, r.describe()
    assert json.loads(r.stdout) == [], r.stdout


def test_gpulock_run_stays_light(cli: Cli) -> None:
    heavy = tuple(m for m in HEAVY if m != "yaml")
    code = (
        "import json, sys\n"
        "import gpulock.cli\n"
        "rc = gpulock.cli.main(['run', '--', 'true'])\n"
        f"print(json.dumps({{'rc': rc, 'loaded': {LOADED.format(heavy=heavy)}}}))\n"
    )
    r = python(cli, code, GPULOCK_SIMULATE=None)  # the path a machine with a real GPU takes
    assert r.code == 0, r.describe()
    assert json.loads(r.stdout) == {"rc": 0, "loaded": []}, r.stdout
    assert cli.events("release"), cli.describe()
