"""The cron-safe agent runtime, driven as cron drives it: ``python -m gpulock.agents run NAME``.

Every run is a real process in a private state folder; the test agents live in
``tests/agent_fixtures.py`` and are loaded with ``--module``.  The pure parts (declaring,
schedules, checkpoint records, the progress line, how an ending is classified) are table tests.
"""

from __future__ import annotations

import io
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import Cli, assert_clean_error, error_lines, wait_until

from gpulock.agents import AgentSpec, agent, checkpoint, progress
from gpulock.agents.runtime import Stopped, agent_dir, classify, skip_reason
from gpulock.agents.spec import check_schedule, get
from gpulock.core.config import Config
from gpulock.core.errors import LockTimeout
from gpulock.core.settings import load

AGENTS = (sys.executable, "-m", "gpulock.agents")
FIXTURES = str(Path(__file__).resolve().parent / "agent_fixtures.py")


def run(cli: Cli, *args: str, **kw: Any) -> Any:
    """``python -m gpulock.agents ARGS --module <fixtures>`` to completion."""
    return cli.run(*args, "--module", FIXTURES, argv0=AGENTS, **kw)


def start(cli: Cli, name: str, *args: str) -> Any:
    """``python -m gpulock.agents ARGS --module <fixtures>``, not waited for."""
    return cli.start([*AGENTS, *args, "--module", FIXTURES], name)


def log_of(cli: Cli, name: str) -> list[dict[str, Any]]:
    path = cli.state / "agents" / name / "log.jsonl"
    try:
        return [json.loads(line) for line in path.read_text().splitlines()]
    except FileNotFoundError:
        return []


def ends(cli: Cli, name: str) -> list[dict[str, Any]]:
    return [r for r in log_of(cli, name) if r.get("event") == "end"]


def folder_of(cli: Cli, name: str) -> Path:
    """The agent's state folder, made as the runtime makes it (to plant files in)."""
    return agent_dir(load(Config(), cli.state), name)


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


# --- running, end to end -----------------------------------------------------------------------


def test_run_ok_logs_start_and_end_and_emits_one_agent_event(cli: Cli) -> None:
    out = cli.root / "hello.txt"
    r = run(cli, "run", "t-hello", "a", "b", "--out", str(out))
    assert (r.code, r.stdout, r.stderr) == (0, "", ""), r.describe()
    assert out.read_text() == "hello a b"
    records = log_of(cli, "t-hello")
    for rec in records:
        assert {"ts", "agent", "pid", "level", "msg"} <= rec.keys(), rec
        assert rec["agent"] == "t-hello" and isinstance(rec["ts"], float)
    assert [r.get("event") for r in records] == ["start", None, "end"]
    said = records[1]
    assert (said["msg"], said["level"], said["n"], said["first"]) == ("said hello", "info", 2, "a")
    assert said["name"] == "clash"
    end = records[2]
    assert (end["outcome"], end["reason"], end["exit_code"]) == ("ok", None, 0)
    assert end["duration_s"] >= 0
    (event,) = cli.events("agent")
    assert (event["agent"], event["outcome"], event["pid"]) == ("t-hello", "ok", end["pid"])
    assert {"reason", "duration_s"} <= event.keys()
    folder = cli.state / "agents" / "t-hello"
    assert folder.stat().st_mode & 0o777 == 0o700
    assert (folder / "run.lock").stat().st_mode & 0o777 == 0o600


def test_gpulock_agent_run_is_the_same_command(cli: Cli) -> None:
    out = cli.root / "hello.txt"
    r = cli.run("agent", "run", "t-hello", "x", "--out", str(out), "--module", FIXTURES)
    assert (r.code, r.stderr) == (0, ""), r.describe()
    assert out.read_text() == "hello x"
    assert [e["outcome"] for e in cli.events("agent")] == ["ok"]


def test_inputs_may_follow_options(cli: Cli) -> None:
    """``run NAME --module M INPUT``: argparse alone refused INPUT as unrecognized."""
    out = cli.root / "hello.txt"
    r = cli.run("agent", "run", "t-hello", "--module", FIXTURES, "x", "--out", str(out), "y")
    assert (r.code, r.stderr) == (0, ""), r.describe()
    assert out.read_text() == "hello x y"
    bad = cli.run("agent", "run", "t-hello", "--module", FIXTURES, "x", "--bogus")
    assert_clean_error(bad, 2)
    assert error_lines(bad.stderr) == ["error: unrecognized arguments: --bogus"]


def test_unknown_agent_names_the_known_ones(cli: Cli) -> None:
    r = run(cli, "run", "nope")
    assert_clean_error(r, 2)
    assert error_lines(r.stderr) == ["error: unknown agent 'nope'"]
    (hint,) = [ln for ln in r.stderr.splitlines() if ln.startswith("hint: known agents: ")]
    known = hint.removeprefix("hint: known agents: ").split(", ")
    assert known == sorted(known)  # the built-in examples may be listed too
    assert {"t-boom", "t-flush", "t-gpu", "t-hello", "t-items", "t-wait"} <= set(known), hint
    assert cli.events("agent") == []


def test_agent_that_raises_exits_1_with_one_error_line_and_the_traceback_in_its_log(
    cli: Cli,
) -> None:
    r = run(cli, "run", "t-boom")
    assert_clean_error(r, 1)
    assert error_lines(r.stderr) == ["error: agent 't-boom' failed: ValueError: boom"]
    (end,) = ends(cli, "t-boom")
    assert (end["outcome"], end["level"], end["exit_code"]) == ("error", "error", 1)
    assert "Traceback" in end["exc"] and 'raise ValueError("boom")' in end["exc"]
    assert [e["outcome"] for e in cli.events("agent")] == ["error"]


def test_model_of_an_agent_without_a_task_is_a_clear_error(cli: Cli) -> None:
    r = run(cli, "run", "t-notask")
    assert_clean_error(r, 1)
    assert "has no task" in error_lines(r.stderr)[0]
    assert "task='summarize'" in r.stderr


def test_a_module_that_cannot_be_imported_is_a_usage_error(cli: Cli) -> None:
    r = cli.run("run", "t-hello", "--module", "no_such_agents_module", argv0=AGENTS)
    assert_clean_error(r, 2)
    assert "no_such_agents_module" in error_lines(r.stderr)[0]


def test_an_agent_that_exits_75_itself_is_a_quiet_skip(cli: Cli) -> None:
    module = cli.root / "later_agents.py"
    module.write_text(
        "from gpulock.agents import agent\n\n"
        "@agent('t-later')\n"
        "def later(ctx):\n"
        "    raise SystemExit(75)  # EX_TEMPFAIL: nothing to do yet, try again next run\n"
    )
    r = cli.run("run", "t-later", "--module", str(module), argv0=AGENTS)
    assert (r.code, r.stdout, r.stderr) == (75, "", ""), r.describe()  # cron mails nothing
    (end,) = ends(cli, "t-later")
    assert (end["outcome"], end["level"], end["exit_code"]) == ("skip", "warning", 75)
    assert [e["outcome"] for e in cli.events("agent")] == ["skip"]


# --- one instance at a time --------------------------------------------------------------------


def test_second_start_while_one_runs_is_a_quiet_skip(cli: Cli) -> None:
    ready, release = cli.root / "ready", cli.root / "release"
    first = start(cli, "first", "run", "t-wait", str(ready), str(release))
    wait_until(ready.exists, lambda: f"t-wait to start\n{first.output()}")
    r = run(cli, "run", "t-wait", str(cli.root / "r2"), str(release))
    # Under cron stderr is not a terminal: a skip must print nothing (cron mails output).
    assert (r.code, r.stdout, r.stderr) == (75, "", ""), r.describe()
    assert not (cli.root / "r2").exists()  # the second run never called the agent
    release.touch()
    assert first.wait() == 0, first.output()
    outcomes = sorted((e["outcome"], e["reason"]) for e in ends(cli, "t-wait"))
    assert outcomes == [("ok", None), ("skip", f"already running (pid {first.pid})")]
    assert sorted(e["outcome"] for e in cli.events("agent")) == ["ok", "skip"]
    # The lock went with the run: the next start runs.
    r = run(cli, "run", "t-wait", str(cli.root / "r3"), str(release))
    assert r.code == 0, r.describe()


def test_gpu_held_elsewhere_is_a_skip_after_the_timeout_with_one_log_line(cli: Cli) -> None:
    holder = cli.hold("holder")
    out = cli.root / "gpu.txt"
    r = run(cli, "run", "t-gpu", "--out", str(out))
    assert (r.code, r.stdout, r.stderr) == (75, "", ""), r.describe()
    assert r.wall_s >= 1.0, r.describe()  # waited its 1 s timeout (75: not for ever)
    assert not out.exists()
    records = log_of(cli, "t-gpu")
    assert [rec["msg"] for rec in records if rec.get("event") != "start"] == [records[-1]["msg"]], (
        records
    )
    end = records[-1]
    assert end["msg"].startswith("skipped: gpu0 busy after 1.0 s"), end
    assert (end["outcome"], end["exit_code"]) == ("skip", 75)
    assert "exc" not in end
    (event,) = cli.events("agent")
    assert event["outcome"] == "skip" and "gpu0 busy" in event["reason"]
    # The agent left the queue cleanly: only the holder is in it, and then nobody.
    assert [e["name"] for e in cli.entries()] == ["holder"]
    holder.release()
    holder.wait()
    wait_until(
        lambda: not [f for f in cli.queue_files() if f.endswith(".ticket")],
        lambda: f"an empty queue\n{cli.describe()}",
    )
    # With the GPU free, the same agent gets it.
    r = run(cli, "run", "t-gpu", "--out", str(out))
    assert r.code == 0, r.describe()
    assert out.read_text() == "had the GPU"


# --- batches and checkpoints -------------------------------------------------------------------


def _blocked_run(cli: Cli, name: str, out: Path, count: int, block_at: int) -> Any:
    """Start t-items over ``count`` items; return once it is stuck on item ``block_at``."""
    proc = start(cli, name, "run", "t-items", str(count), str(block_at), "--out", str(out))
    blocked = out.with_name(out.name + ".blocked")
    wait_until(blocked.exists, lambda: f"t-items to reach item {block_at}\n{proc.output()}")
    return proc


def test_run_killed_at_item_k_resumes_at_k(cli: Cli) -> None:
    out = cli.root / "items.txt"
    first = _blocked_run(cli, "first", out, 10, 4)
    first.kill_group()  # SIGKILL: no chance to clean up
    assert lines(out) == [f"item {i}" for i in range(4)]
    saved = checkpoint.load(cli.state / "agents" / "t-items" / "checkpoint.json")
    assert saved is not None and (saved.done, saved.total) == (("0", "1", "2", "3"), 10)
    out.write_text("")
    r = run(cli, "run", "t-items", "10", "--out", str(out))
    assert r.code == 0, r.describe()
    assert lines(out) == [f"item {i}" for i in range(4, 10)]
    resuming = [rec for rec in log_of(cli, "t-items") if rec["msg"].startswith("resuming")]
    assert [(rec["msg"], rec["done"], rec["total"]) for rec in resuming] == [
        ("resuming: 4 of 10 done", 4, 10)
    ]
    assert not (cli.state / "agents" / "t-items" / "checkpoint.json").exists()
    # Completed: the next run starts from the beginning again.
    out.write_text("")
    assert run(cli, "run", "t-items", "3", "--out", str(out)).code == 0
    assert lines(out) == ["item 0", "item 1", "item 2"]


def test_changed_items_count_only_the_keys_still_present(cli: Cli) -> None:
    path = folder_of(cli, "t-items") / "checkpoint.json"
    path.write_bytes(checkpoint.encode("t-items", ["1", "3", "gone", "also-gone"], 12))
    out = cli.root / "items.txt"
    r = run(cli, "run", "t-items", "5", "--out", str(out))
    assert r.code == 0, r.describe()
    assert lines(out) == ["item 0", "item 2", "item 4"]
    assert any(rec["msg"] == "resuming: 2 of 5 done" for rec in log_of(cli, "t-items"))


@pytest.mark.parametrize(
    "garbage", [b"{not json", b'{"format": "other/9", "done": []}', b"[]", b"[" * 100_000]
)
def test_garbage_checkpoint_is_logged_and_ignored(cli: Cli, garbage: bytes) -> None:
    path = folder_of(cli, "t-items") / "checkpoint.json"
    path.write_bytes(garbage)
    out = cli.root / "items.txt"
    r = run(cli, "run", "t-items", "4", "--out", str(out))
    assert (r.code, r.stderr) == (0, ""), r.describe()
    assert lines(out) == [f"item {i}" for i in range(4)]
    warnings = [rec for rec in log_of(cli, "t-items") if rec["level"] == "warning"]
    assert len(warnings) == 1 and "ignoring checkpoint" in warnings[0]["msg"], warnings
    assert not path.exists()


def test_a_folder_in_place_of_the_checkpoint_stops_the_run_before_the_first_item(
    cli: Cli,
) -> None:
    path = folder_of(cli, "t-items") / "checkpoint.json"
    path.mkdir()  # nothing can replace it: item 0 would be done, and never recorded as done
    out = cli.root / "items.txt"
    r = run(cli, "run", "t-items", "3", "--out", str(out))
    assert_clean_error(r, 1)
    assert "checkpoint.json: is a folder" in error_lines(r.stderr)[0], r.describe()
    assert f"hint: move it away (mv {path} {path}.bad)" in r.stderr
    assert lines(out) == []
    assert ends(cli, "t-items")[0]["outcome"] == "error"


def test_flush_every_n_items(cli: Cli) -> None:
    out = cli.root / "flush.txt"
    r = run(cli, "run", "t-flush", "7", "--out", str(out))
    assert r.code == 0, r.describe()
    assert lines(out) == [
        *("item 0", "item 1", "item 2", "flush"),
        *("item 3", "item 4", "item 5", "flush"),
        "item 6",
    ]


def test_flush_every_unloads_the_routers_model_and_the_next_call_reloads_it(cli: Cli) -> None:
    from gpulock.router.tiny_model import ensure_tiny_llama

    gguf = ensure_tiny_llama(cli.root / "models")
    config = cli.root / "gpulock.yaml"
    config.write_text(
        "routes:\n  summarize:\n"
        f"    - {{tier: cpu, backend: llama_cpp, model: {gguf}, n_ctx: 256}}\n"
    )
    out = cli.root / "model.txt"
    r = run(cli, "run", "t-model", "5", "--out", str(out), "--config", str(config))
    assert (r.code, r.stderr) == (0, ""), r.describe()
    assert lines(out) == [f"{i} True" for i in range(5)]
    # Loaded for item 0, unloaded after items 1 and 3 (flush_every=2), reloaded for 2 and 4.
    assert len(cli.events("model-load")) == 3, cli.describe()
    assert [(e["agent"], e["tier"]) for e in cli.events("route")] == [("t-model", "cpu")]


def test_sigterm_stops_the_run_keeps_the_checkpoint_and_exits_143(cli: Cli) -> None:
    out = cli.root / "items.txt"
    proc = _blocked_run(cli, "victim", out, 6, 2)
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait() == 128 + signal.SIGTERM, proc.output()
    assert proc.err.read_text() == ""  # not a terminal: quiet
    saved = checkpoint.load(cli.state / "agents" / "t-items" / "checkpoint.json")
    assert saved is not None and saved.done == ("0", "1")
    (end,) = ends(cli, "t-items")
    assert (end["outcome"], end["reason"], end["exit_code"]) == ("killed", "SIGTERM", 143)
    assert [e["outcome"] for e in cli.events("agent")] == ["killed"]
    shown = run(cli, "show", "t-items", "--json").json()
    assert shown["checkpoint"] == {"done": 2, "total": 6}
    assert shown["last_run"]["outcome"] == "killed"
    assert (shown["name"], shown["task"]) == ("t-items", "summarize")


def test_show_tells_a_running_run_and_one_that_died_without_an_end_record(cli: Cli) -> None:
    out = cli.root / "items.txt"
    assert run(cli, "run", "t-items", "2", "--out", str(out)).code == 0  # an earlier good run
    proc = _blocked_run(cli, "victim", out, 6, 3)
    shown = run(cli, "show", "t-items", "--json").json()["last_run"]
    assert (shown["outcome"], shown["pid"], shown["exit_code"]) == ("running", proc.pid, None)
    proc.kill_group()  # SIGKILL: the run never writes its end record
    shown = run(cli, "show", "t-items", "--json").json()
    # Not the good run before it: the newest run died, and its checkpoint waits.
    assert (shown["last_run"]["outcome"], shown["last_run"]["pid"]) == ("died", proc.pid)
    assert "no end record" in shown["last_run"]["reason"]
    assert shown["checkpoint"] == {"done": 3, "total": 6}
    text = run(cli, "show", "t-items")
    assert (text.code, text.stderr) == (0, ""), text.describe()
    assert "last run: died (started " in text.stdout and f"pid {proc.pid}\n" in text.stdout


def test_the_agent_env_names_the_run_for_the_routers_accounting(cli: Cli) -> None:
    from gpulock.router.tiny_model import ensure_tiny_llama

    gguf = ensure_tiny_llama(cli.root / "models")
    # ./gpulock.yaml: what the router finds on its own, without the run's --config.
    (cli.root / "gpulock.yaml").write_text(
        "routes:\n  summarize:\n"
        f"    - {{tier: cpu, backend: llama_cpp, model: {gguf}, n_ctx: 256}}\n"
    )
    module = cli.root / "direct_agents.py"
    module.write_text(
        "import os, subprocess, sys\n"
        "from gpulock import router\n"
        "from gpulock.agents import agent\n"
        "\n"
        "@agent('t-direct')\n"
        "def direct(ctx):\n"
        "    model = router.get_model('summarize')  # not ctx.model(): no agent= given\n"
        "    model.complete('hello', max_tokens=2)\n"
        "    model.unload()\n"
        "    code = 'import os; print(os.environ[\"GPULOCK_AGENT\"])'\n"
        "    child = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)\n"
        "    ctx.out.write_text(child.stdout)\n"
    )
    out = cli.root / "child.txt"
    r = cli.run("run", "t-direct", "--out", str(out), "--module", str(module), argv0=AGENTS)
    assert (r.code, r.stderr) == (0, ""), r.describe()
    assert out.read_text() == "t-direct\n"  # a program the agent starts is counted as it too
    assert [(e["agent"], e["ok"]) for e in cli.events("call")] == [("t-direct", True)]


# --- the progress bar --------------------------------------------------------------------------


def _run_on_tty(cli: Cli, env: dict[str, str], *args: str) -> tuple[int, str]:
    """Run with stderr on a pseudo-terminal; return the exit code and what the terminal got."""
    master, slave = os.openpty()
    proc = subprocess.Popen(
        [*AGENTS, *args, "--module", FIXTURES],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=slave,
        env=env,
        cwd=cli.root,
        start_new_session=True,
    )
    os.close(slave)
    got = b""
    deadline = time.monotonic() + 20
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if not ready:
                continue
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: every writer of the terminal has closed it
                break
            if not chunk:
                break
            got += chunk
        code = proc.wait(5)
    finally:
        os.close(master)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return code, got.decode(errors="replace")


def test_progress_bar_is_drawn_on_a_terminal(cli: Cli) -> None:
    out = cli.root / "items.txt"
    env = cli.env(TERM="xterm", GPULOCK_NO_PROGRESS=None)
    code, shown = _run_on_tty(cli, env, "run", "t-items", "5", "--out", str(out))
    assert code == 0, shown
    assert "\r" in shown and "t-items [" in shown and "5/5 100%" in shown, repr(shown)
    assert shown.endswith("\n"), repr(shown)


@pytest.mark.parametrize(
    "env_change", [{"GPULOCK_NO_PROGRESS": "1", "TERM": "xterm"}, {"TERM": "dumb"}]
)
def test_progress_bar_can_be_turned_off_on_a_terminal(cli: Cli, env_change: dict[str, str]) -> None:
    out = cli.root / "items.txt"
    code, shown = _run_on_tty(cli, cli.env(**env_change), "run", "t-items", "5", "--out", str(out))
    assert (code, shown) == (0, "")
    assert len(lines(out)) == 5


# --- logs, config, listing ---------------------------------------------------------------------

CUT_S = 10.0  # a run still going after this hangs: before the fix, for ever


@pytest.mark.parametrize("what", ["folder", "symlink", "fifo"])
def test_a_run_lock_that_is_not_a_file_is_an_error_with_an_end_record(cli: Cli, what: str) -> None:
    lock = folder_of(cli, "t-hello") / "run.lock"
    outside = cli.root / "outside"
    if what == "folder":
        lock.mkdir()
    elif what == "symlink":
        lock.symlink_to(outside)
    else:
        os.mkfifo(lock)
    out = cli.root / "hello.txt"
    r = run(cli, "run", "t-hello", "a", "--out", str(out), timeout_s=CUT_S)
    assert_clean_error(r, 1)
    assert f"{lock}: " in error_lines(r.stderr)[0] and "hint: " in r.stderr, r.describe()
    assert not out.exists() and not outside.exists()
    # An end record: without it `show` took the run for one killed by SIGKILL.
    (end,) = ends(cli, "t-hello")
    assert (end["outcome"], end["exit_code"]) == ("error", 1)
    assert run(cli, "show", "t-hello", "--json").json()["last_run"]["outcome"] == "error"


def test_a_fifo_in_place_of_the_log_hangs_neither_the_run_nor_show(cli: Cli) -> None:
    folder = folder_of(cli, "t-hello")
    os.mkfifo(folder / "log.jsonl")
    os.mkfifo(folder / "log.jsonl.1")
    out = cli.root / "hello.txt"
    r = run(cli, "run", "t-hello", "a", "--out", str(out), timeout_s=CUT_S)
    assert (r.code, r.stderr) == (0, ""), r.describe()  # the log is lost, the work is not
    assert out.read_text() == "hello a"
    shown = run(cli, "show", "t-hello", "--json", timeout_s=CUT_S)
    assert shown.code == 0 and shown.json()["last_run"] is None, shown.describe()


def test_the_rotation_lock_is_not_followed_out_of_the_state_folder(cli: Cli) -> None:
    folder = folder_of(cli, "t-hello")
    (folder / "log.jsonl").write_bytes(b'{"msg": "old"}\n' * (1024 * 1024 // 15 + 1))
    outside = cli.root / "outside"
    (folder / ".log.lock").symlink_to(outside)
    r = run(cli, "run", "t-hello", "a", "--out", str(cli.root / "o"))
    assert r.code == 0, r.describe()
    assert not outside.exists()


def test_show_reads_past_garbage_in_the_log(cli: Cli) -> None:
    garbage = [
        '{"event": "end", "pid": [1], "outcome": "ok"}',  # a list: unhashable
        '{"event": "start", "pid": 5, "ts": 1e300}',  # no clock can show it
        '{"event": "start", "pid": 6, "ts": NaN}',
        "[" * 100_000,
    ]
    for line in garbage:
        (folder_of(cli, "t-hello") / "log.jsonl").write_text(line + "\n")
        shown = run(cli, "show", "t-hello")
        assert (shown.code, shown.stderr) == (0, ""), shown.describe()
        assert run(cli, "show", "t-hello", "--json").code == 0


def test_run_lock_and_log_are_shared_with_the_group(cli: Cli) -> None:
    import grp

    config = cli.root / "shared.yaml"
    config.write_text(f"group: {grp.getgrgid(os.getgid()).gr_name}\n")
    env = cli.env(GPULOCK_CONFIG=str(config))
    old = os.umask(0o077)  # inherited by the run: every file 0600 unless set explicitly
    try:
        r = run(cli, "run", "t-hello", "a", "--out", str(cli.root / "o"), env=env)
    finally:
        os.umask(old)
    assert r.code == 0, r.describe()
    folder = cli.state / "agents" / "t-hello"
    assert folder.stat().st_mode & 0o7777 == 0o2770
    for name in ("run.lock", "log.jsonl"):
        assert (folder / name).stat().st_mode & 0o777 == 0o660, name


def test_the_runtime_writes_no_environment_into_logs_or_events(cli: Cli) -> None:
    secret = "sk-test-0123456789abcdef"  # noqa: S105
    env = cli.env(GPULOCK_TEST_API_KEY=secret, OPENAI_API_KEY=secret)
    outputs = []
    for name in ("t-hello", "t-boom"):
        r = run(cli, "run", name, "a", "--out", str(cli.root / "o"), env=env)
        outputs += [r.stdout, r.stderr]
    written = [p.read_text() for p in cli.state.rglob("*") if p.is_file()]
    assert ends(cli, "t-boom") and cli.events("agent")  # there was something to look in
    assert not [text for text in written + outputs if secret in text]


def test_log_is_rotated_past_1_mib(cli: Cli) -> None:
    folder = folder_of(cli, "t-hello")
    old = b'{"msg": "old"}\n' * (1024 * 1024 // 15 + 1)
    (folder / "log.jsonl").write_bytes(old)
    r = run(cli, "run", "t-hello", "a", "--out", str(cli.root / "o"))
    assert r.code == 0, r.describe()
    assert (folder / "log.jsonl.1").read_bytes().startswith(old)
    assert (folder / "log.jsonl").stat().st_size < 4096
    assert ends(cli, "t-hello")[0]["outcome"] == "ok"


def test_modules_from_the_config_and_the_environment(cli: Cli) -> None:
    config = cli.root / "gpulock.yaml"
    fixtures = Path(FIXTURES)
    # A relative path in the config is relative to the config file's folder.
    config.write_text(f"agents:\n  modules: [{os.path.relpath(fixtures, cli.root)}]\n")
    r = cli.run("list", "--json", "--config", str(config), argv0=AGENTS)
    assert r.code == 0, r.describe()
    found = {a["name"]: a for a in r.json()["agents"]}
    assert found["t-gpu"] == {
        "name": "t-gpu",
        "task": None,
        "schedule": None,
        "timeout_s": 1.0,
        "need_bytes": 1 << 30,
        "gpu": None,
        "flush_every": None,
        "workers": None,
        "description": "",
        "module": str(fixtures),
    }
    assert found["t-wait"]["description"] == "Creates INPUT 1, then waits for INPUT 2 to appear."
    env = cli.env(GPULOCK_AGENT_MODULES=f" {FIXTURES} ,")
    r = cli.run("list", env=env, argv0=AGENTS)
    assert r.code == 0 and "t-flush" in r.stdout and "*/5 * * * *" in r.stdout, r.describe()


@pytest.mark.parametrize(
    ("text", "line", "key"),
    [
        ("agents:\n  modules: [3]\n", 2, "agents.modules[0]"),
        ("default_gpu: 0\nagents:\n  modulez: []\n", 3, "agents.modulez"),
        ("agents:\n  modules: some.module\n", 2, "agents.modules"),
        ("agents: [a]\n", 1, "agents"),
        ("agents:\n  modules:\n    - no_such_agents_module_x\n", 3, "agents.modules[0]"),
    ],
)
def test_config_section_errors_name_file_line_and_key(
    cli: Cli, text: str, line: int, key: str
) -> None:
    config = cli.root / "gpulock.yaml"
    config.write_text(text)
    r = cli.run("list", "--config", str(config), argv0=AGENTS)
    assert "Traceback" not in r.stderr and r.code in (1, 2), r.describe()
    assert error_lines(r.stderr)[0].startswith(f"error: {config}:{line}: {key}: "), r.describe()


def test_your_agent_replaces_an_example_of_the_same_name(cli: Cli) -> None:
    module = cli.root / "mine.py"
    module.write_text(
        "from gpulock.agents import agent\n\n"
        "@agent('digest')\n"
        "def mine(ctx):\n"
        "    ctx.out.write_text('mine')\n"
    )
    out = cli.root / "mine.txt"
    r = cli.run("run", "digest", "--out", str(out), "--module", str(module), argv0=AGENTS)
    assert (r.code, r.stderr) == (0, ""), r.describe()
    assert out.read_text() == "mine"
    r = cli.run("list", "--json", "--module", str(module), argv0=AGENTS)
    found = {a["name"]: a["module"] for a in r.json()["agents"]}
    assert found["digest"] == str(module), found
    assert "inbox-triage" in found  # the other examples are still there


def test_import_agents_stays_light() -> None:
    heavy = ("apscheduler", "gpulock.router", "llama_cpp", "openai", "torch", "pynvml")
    code = (
        "import sys, gpulock.agents; "
        "print([m for m in sys.modules\n"
        f"       if any(m == h or m.startswith(h + '.') for h in {heavy!r})])"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    assert (r.returncode, r.stdout.strip()) == (0, "[]"), r.stderr


# --- the pure parts ----------------------------------------------------------------------------


def test_agent_registers_a_checked_spec_and_returns_the_function() -> None:
    def job(ctx: Any) -> None:
        """First line.

        More."""

    same = agent("t-inproc", task="summarize", schedule="@daily", timeout="2m", need="6GiB")(job)
    assert same is job
    spec = get("t-inproc")
    assert isinstance(spec, AgentSpec) and spec.func is job
    assert (spec.timeout_s, spec.need_bytes, spec.description) == (120.0, 6 << 30, "First line.")
    # Twice by the user is a mistake, told with both places (a file's module name is made up).
    line = job.__code__.co_firstlineno
    with pytest.raises(ValueError, match=re.escape(f"defined twice: at {__file__}:{line} and at ")):
        agent("t-inproc")(job)
    # An example never displaces a user's agent, whichever registers first.
    example = types.FunctionType(job.__code__, job.__globals__, "example")
    example.__module__ = "gpulock.agents.examples.fake"
    assert agent("t-inproc")(example) is example
    assert get("t-inproc") == spec


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"name": "Bad"}, "name"),
        ({"name": "-x"}, "name"),
        ({"name": "a b"}, "name"),
        ({"schedule": "* * *"}, "schedule"),
        ({"schedule": "61 * * * *"}, "schedule"),
        ({"timeout": "soon"}, "timeout"),
        ({"need": "lots"}, "need"),
        ({"gpu": -1}, "gpu"),
        ({"flush_every": 0}, "flush_every"),
    ],
)
def test_agent_refuses_bad_fields_naming_them(kwargs: dict[str, Any], field: str) -> None:
    name = kwargs.pop("name", "t-never-registered")
    with pytest.raises(ValueError, match=f"^{field}: "):
        agent(name, **kwargs)(lambda ctx: None)
    assert get(name) is None


@pytest.mark.parametrize(
    "schedule",
    ["*/10 * * * *", "30 7 * * mon-fri", "0 0 1 jan,jul 0", "0-30/5 */2 1-15 * 7", "@hourly"],
)
def test_good_schedules(schedule: str) -> None:
    check_schedule(schedule)


@pytest.mark.parametrize(
    ("schedule", "names"),
    [
        ("* * * * 8", "day of week"),
        ("0 24 * * *", "hour"),
        ("0 0 0 * *", "day of month"),
        ("0 0 * foo *", "month"),
        ("*/0 * * * *", "minute"),
        ("5-1 * * * *", "minute"),
        ("@reboot", "alias"),
    ],
)
def test_bad_schedules_name_the_field(schedule: str, names: str) -> None:
    with pytest.raises(ValueError, match=names):
        check_schedule(schedule)


def test_checkpoint_record_round_trip_and_garbage() -> None:
    data = checkpoint.encode("digest", ["a", "b"], 5, now_wall=12.5)
    assert checkpoint.decode(data) == checkpoint.Checkpoint(("a", "b"), 5, 12.5)
    assert json.loads(data)["format"] == "gpulock.checkpoint/1"
    for bad in (b"", b"null", b'{"format": "gpulock.checkpoint/1", "done": [1], "total": 1}'):
        with pytest.raises(checkpoint.CheckpointError):
            checkpoint.decode(bad)


def test_progress_line_and_when_it_is_wanted() -> None:
    text = progress.render("digest", 300, 600, 10.0, 100)
    assert text == "digest [##########..........] 300/600 50% 10.0/s eta 30.0 s"
    assert progress.render("x", 0, 0, 0.0, 0) == "x [####################] 0/0 100%"
    assert not progress.wanted(io.StringIO(), {})  # not a terminal


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (None, ("ok", None, 0)),
        (Stopped(signal.SIGTERM), ("killed", "SIGTERM", 143)),
        (KeyboardInterrupt(), ("killed", "SIGINT", 130)),
        (SystemExit(0), ("ok", None, 0)),
        (SystemExit(3), ("error", "exit 3", 3)),
        (SystemExit(75), ("skip", "the agent exited 75", 75)),
        (ValueError("x"), ("error", "ValueError: x", 1)),
        (LockTimeout(0, 1.0), ("skip", "gpu0 busy after 1.0 s", 75)),
    ],
)
def test_classify_endings(exc: BaseException | None, expected: tuple[Any, ...]) -> None:
    assert classify(exc) == expected


def test_skip_errors_are_matched_by_name_without_importing_them() -> None:
    NoModelAvailable = type(
        "NoModelAvailable", (Exception,), {"__module__": "gpulock.router.errors"}
    )
    assert skip_reason(NoModelAvailable("no model fits")) == "no model fits"
    Other = type("NoModelAvailable", (Exception,), {"__module__": "elsewhere"})
    assert skip_reason(Other("x")) is None


# --- --json ------------------------------------------------------------------------------------


def test_run_json_prints_how_the_run_ended_and_nothing_else_on_stdout(cli: Cli) -> None:
    out = cli.root / "hello.txt"
    r = run(cli, "run", "t-hello", "a", "--out", str(out), "--json")
    assert r.code == 0, r.describe()
    doc = r.json()
    assert doc["agent"] == "t-hello" and doc["outcome"] == "ok" and doc["exit_code"] == 0
    assert doc["reason"] is None and doc["duration_s"] >= 0
    assert doc["log"] == str(cli.state / "agents" / "t-hello" / "log.jsonl")
    r = run(cli, "run", "t-boom", "--json")
    assert r.code == 1
    doc = r.json()
    assert (doc["outcome"], doc["reason"], doc["exit_code"]) == ("error", "ValueError: boom", 1)


def test_with_json_an_unknown_agent_is_a_json_error(cli: Cli) -> None:
    r = run(cli, "run", "t-nobody", "--json")
    assert (r.code, r.stderr) == (2, ""), r.describe()
    err = r.json()["error"]
    assert err["message"] == "unknown agent 't-nobody'" and err["exit_code"] == 2
    assert "t-hello" in err["hint"]
