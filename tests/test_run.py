"""``gpulock run`` as cron lines and shell scripts use it: real processes, real signals."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
from cli_helpers import (
    GPULOCK,
    TRAP_PY,
    WAITFILE_PY,
    Cli,
    assert_clean_error,
    error_lines,
    pid_alive,
    wait_until,
)


def no_ticket_taken(cli: Cli) -> None:
    assert cli.queue_files() == [], cli.describe()
    assert cli.events("wait") == [] and cli.events("acquire") == [], cli.describe()


# --- what the command sees, and what it returns ---------------------------------------------


def test_command_runs_on_the_granted_gpu_with_its_ticket(cli: Cli) -> None:
    cli.simulate = "24GiB,24GiB"
    r = cli.run(
        "run", "--gpu", "1", "--", "sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES|$GPULOCK_TICKET"'
    )
    assert r.code == 0, r.describe()
    cuda, ticket = r.stdout.strip().split("|")
    assert cuda == "1"
    acquired = cli.events("acquire")
    assert len(acquired) == 1 and acquired[0]["gpu"] == 1, cli.describe()
    assert ticket == f"1:{acquired[0]['ticket']}"
    # Released on the way out: the queue is empty again.
    assert [e["event"] for e in cli.events()] == ["acquire", "release"]
    assert not [f for f in cli.queue_files(1) if f.endswith(".ticket")]


def test_stdin_stdout_and_stderr_pass_through(cli: Cli) -> None:
    r = cli.run("run", "--", "cat", input="line one\nline two\n")
    assert r.code == 0, r.describe()
    assert r.stdout == "line one\nline two\n"
    r = cli.run("run", "--", "sh", "-c", "echo to-stderr >&2; echo to-stdout")
    assert (r.code, r.stdout, r.stderr) == (0, "to-stdout\n", "to-stderr\n"), r.describe()


@pytest.mark.parametrize("code", [0, 1, 3, 42])
def test_exit_code_of_the_command_is_returned(cli: Cli, code: int) -> None:
    r = cli.run("run", "--", "sh", "-c", f"exit {code}")
    assert r.code == code, r.describe()
    assert r.stderr == "", r.describe()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGUSR1])
def test_command_killed_by_a_signal_gives_128_plus_n(cli: Cli, sig: signal.Signals) -> None:
    r = cli.run("run", "--", "sh", "-c", f"kill -{sig.name[3:]} $$")
    assert r.code == 128 + sig, r.describe()
    assert "Traceback" not in r.stderr


# --- commands that cannot run -----------------------------------------------------------------


def test_missing_command_exits_127_without_queueing(cli: Cli) -> None:
    r = cli.run("run", "--", "no-such-command-gpulock-test", "arg")
    assert_clean_error(r, 127)
    assert "no-such-command-gpulock-test" in error_lines(r.stderr)[0]
    no_ticket_taken(cli)


@pytest.mark.parametrize("where", ["absolute", "relative", "missing-folder"])
def test_a_missing_path_is_no_such_file_not_a_hint_about_path(cli: Cli, where: str) -> None:
    prog = {
        "absolute": str(cli.root / "missing-script.sh"),
        "relative": "./missing-script.sh",
        "missing-folder": str(cli.root / "no-folder" / "job.sh"),
    }[where]
    r = cli.run("run", "--", prog)
    assert_clean_error(r, 127)
    assert error_lines(r.stderr) == [f"error: no such file: {prog}"], r.describe()
    assert "absolute path" not in r.stderr, r.describe()  # it was a path already
    if where == "missing-folder":
        assert f"hint: check the path ({cli.root / 'no-folder'} does not exist)" in r.stderr
    else:
        assert f"hint: check the name (ls {cli.root})" in r.stderr, r.describe()
    no_ticket_taken(cli)


def test_non_executable_file_exits_126_without_queueing(cli: Cli) -> None:
    script = cli.root / "not-executable.sh"
    script.write_text("#!/bin/sh\necho should not run\n")
    script.chmod(0o644)
    r = cli.run("run", "--", str(script))
    assert_clean_error(r, 126)
    assert "should not run" not in r.stdout
    no_ticket_taken(cli)


@pytest.mark.parametrize("args", [["run", "--"], ["run"], ["run", "--name", "x", "--"]])
def test_no_command_at_all_is_a_usage_error(cli: Cli, args: list[str]) -> None:
    r = cli.run(*args)
    assert_clean_error(r, 2)
    no_ticket_taken(cli)


# --- waiting and giving up --------------------------------------------------------------------


def test_timeout_behind_a_holder_exits_75_naming_the_holder(cli: Cli) -> None:
    holder = cli.hold("big-model")
    r = cli.run("run", "--timeout", "0.3", "--name", "late", "--", "true")
    assert_clean_error(r, 75)
    err = error_lines(r.stderr)[0]
    assert f"pid {holder.pid}" in err and "big-model" in err, r.describe()
    # It waited its timeout, then gave up (how promptly is a benchmark's business).
    [timeout] = cli.events("timeout", name="late")
    assert r.wall_s >= 0.3 and timeout["waited_s"] >= 0.3, r.describe()
    # It left the line: only the holder's ticket remains; the holder still holds.
    assert [e["name"] for e in cli.entries()] == ["big-model"]
    assert cli.events("timeout", name="late"), cli.describe()
    holder.release()
    assert holder.wait() == 0, holder.output()


def test_sigterm_while_waiting_exits_143_and_leaves_the_line(cli: Cli) -> None:
    holder = cli.hold("holder")
    holder_files = cli.queue_files()
    waiter = cli.start_run("waiter", cmd=["true"])
    cli.wait_event("wait", name="waiter")  # in line, its SIGTERM handler installed
    assert len(cli.queue_files()) == len(holder_files) + 2
    os.kill(waiter.pid, signal.SIGTERM)
    assert waiter.wait() == 128 + signal.SIGTERM, waiter.output()
    assert cli.queue_files() == holder_files, cli.describe()
    assert not cli.events("acquire", name="waiter")
    holder.release()
    assert holder.wait() == 0, holder.output()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_waiting_logs_a_leave_that_ends_the_wait(
    cli: Cli, sig: signal.Signals
) -> None:
    from gpulock.core import events
    from gpulock.report.builder import build

    holder = cli.hold("holder")
    waiter = cli.start_run("waiter", cmd=["true"])
    cli.wait_event("wait", name="waiter")
    os.kill(waiter.pid, sig)  # Ctrl-C sends SIGINT
    assert waiter.wait() == 128 + sig, waiter.output()
    leave = cli.wait_event("leave", name="waiter")
    assert leave["signal"] == sig.name and leave["waited_s"] > 0, leave
    assert leave["ticket"] == cli.events("wait", name="waiter")[0]["ticket"], cli.describe()
    r = cli.run("history", "--event", "leave")
    assert r.code == 0 and f"signal={sig.name}" in r.stdout and "waiter" in r.stdout, r.describe()
    data = build(events.read(cli.state), now_wall=leave["ts"] + 60)
    [wait] = [w for w in data.waits if w.name == "waiter"]
    assert wait.end == "leave" and wait.end_wall == leave["ts"], wait  # not left open
    holder.release()
    assert holder.wait() == 0, holder.output()


def test_sigterm_right_after_the_grant_ends_the_command_under_cpu_load(cli: Cli) -> None:
    """Whenever SIGTERM comes after the grant, `gpulock run` exits 143 and leaves nothing
    running: it either does not start CMD or forwards the signal and waits for it.

    The windows are a few milliseconds wide (before the command starts; just before the
    wait for it, where a plain ``waitpid`` would sleep through a signal whose handler had
    not run yet, until ``sleep 10`` ended by itself), so this sweeps the delay after the
    grant over 40 tries while two busy children load the CPU, the way cron's minute
    boundary does.  The busy children make a preemption inside a window likely; the test
    asserts what happened to every try, never how long anything took.
    """
    busy = [cli.start([sys.executable, "-c", "while True: pass"], f"busy{k}") for k in range(2)]
    failures = []
    for i in range(40):
        state = cli.root / f"race{i}"
        log = state / "events.jsonl"
        proc = cli.start(
            [*GPULOCK, "run", "--name", f"race{i}", "--", "sleep", "10"],
            f"race{i}",
            env=cli.env(GPULOCK_STATE_DIR=str(state)),
        )
        deadline = time.monotonic() + 30
        while not (log.exists() and log.stat().st_size > 0):  # the first event: acquire
            assert time.monotonic() < deadline, f"race{i} never got the GPU\n{proc.output()}"
            time.sleep(0.0002)
        delay = 0.0005 * (i % 20)
        if delay:
            time.sleep(delay)  # where in the window to strike, not a wait for anything
        os.kill(proc.pid, signal.SIGTERM)
        code = proc.wait()
        try:
            os.killpg(proc.pid, 0)
            left = True
            proc.kill_group()
        except ProcessLookupError:
            left = False
        if code != 128 + signal.SIGTERM or left:
            files = sorted(os.listdir(state / "gpu0"))
            failures.append(
                f"try {i} (SIGTERM {delay * 1000:.1f} ms after the grant): exit {code}, "
                f"command still running: {left}, queue folder: {files}"
            )
    for b in busy:
        b.kill_group()
    assert not failures, "\n".join(failures)


# --- the claim outlives `gpulock run` itself, and covers the whole process tree ---------------


def test_sigkill_of_gpulock_run_alone_keeps_the_gpu_claimed_while_its_command_runs(
    cli: Cli,
) -> None:
    holder = cli.hold("orphaned")
    child_pid = wait_until(
        lambda: (cli.entry("orphaned") or {}).get("child_pid"), "the holder's child_pid"
    )
    os.kill(holder.pid, signal.SIGKILL)  # gpulock run alone, not its process group
    assert holder.wait() == -signal.SIGKILL
    assert pid_alive(child_pid)

    r = cli.run("run", "--timeout", "0.5", "--name", "second", "--", "true")
    assert_clean_error(r, 75)
    assert pid_alive(child_pid), "the command should still run"

    holder.release()  # the command reads EOF and exits: nothing holds the claim any more
    wait_until(lambda: not pid_alive(child_pid), f"the command (pid {child_pid}) to exit")
    r = cli.run("run", "--timeout", "5", "--name", "third", "--", "true")
    assert r.code == 0, r.describe()
    third = cli.events("acquire", name="third")
    assert len(third) == 1 and not cli.events("wait", name="third"), cli.describe()  # at once
    # The dead holder's ticket was cleaned up on the way.
    assert [f for f in cli.queue_files() if f.endswith(".ticket")] == []


def test_sigterm_is_forwarded_to_the_command_and_its_exit_code_returned(cli: Cli) -> None:
    script = cli.script("trap.py", TRAP_PY)
    ready, out = cli.root / "trap.ready", cli.root / "trap.out"
    proc = cli.start_run("trapper", cmd=[sys.executable, str(script), str(ready), str(out)])
    cli.wait_ready(proc, ready)
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait() == 7, proc.output()
    assert out.read_text() == f"signal {int(signal.SIGTERM)}"
    assert cli.events("release", name="trapper"), cli.describe()
    assert [f for f in cli.queue_files() if f.endswith(".ticket")] == []


def test_grandchildren_that_outlive_the_command_keep_the_gpu_claimed(cli: Cli) -> None:
    waitfile = cli.script("waitfile.py", WAITFILE_PY)
    ready, release = cli.root / "grandchild.ready", cli.root / "grandchild.release"
    # CMD starts a grandchild in the background and exits at once.
    cmd = ["sh", "-c", '"$0" "$1" "$2" "$3" & exit 0', sys.executable, str(waitfile)]
    proc = cli.start_run("parent", cmd=[*cmd, str(ready), str(release)])
    cli.wait_ready(proc, ready)
    child_pid = wait_until(
        lambda: (cli.entry("parent") or {}).get("child_pid"), "the holder's child_pid"
    )
    wait_until(lambda: not pid_alive(child_pid), "the command itself to exit")

    assert proc.popen.poll() is None, "gpulock run should wait for the orphaned grandchild"
    r = cli.run("run", "--timeout", "0.5", "--name", "blocked", "--", "true")
    assert_clean_error(r, 75)

    release.touch()
    assert proc.wait() == 0, proc.output()
    r = cli.run("run", "--timeout", "5", "--name", "after", "--", "true")
    assert r.code == 0, r.describe()


# --- nested use -------------------------------------------------------------------------------


def test_nested_gpulock_run_on_the_same_gpu_runs_at_once(cli: Cli) -> None:
    inner = [*GPULOCK, "run", "--name", "inner", "--timeout", "5", "--"]
    r = cli.run("run", "--name", "outer", "--", *inner, "sh", "-c", "echo inner ran")
    assert "Traceback" not in r.stderr, r.describe()
    assert r.code == 0, r.describe()
    assert r.stdout == "inner ran\n"
    # One grant only: the inner run was covered by the outer lease, and did not queue.
    assert [e["name"] for e in cli.events("acquire")] == ["outer"], cli.describe()
    assert not cli.events("wait"), cli.describe()


def test_python_acquire_inside_gpulock_run_is_granted_at_once(cli: Cli) -> None:
    code = (
        "import os, time, gpulock\n"
        "t = time.monotonic()\n"
        "lease = gpulock.acquire(gpu=0, timeout=2)\n"
        "took = time.monotonic() - t\n"
        "print(lease.inherited, lease.ticket, round(took, 3))\n"
        "path = lease.path\n"
        "lease.release()\n"
        "print(path.exists())\n"
    )
    r = cli.run("run", "--name", "outer", "--", sys.executable, "-c", code)
    assert r.code == 0, r.describe()
    first, second = r.stdout.splitlines()
    inherited, ticket, took = first.split()
    outer = cli.events("acquire", name="outer")
    assert len(outer) == 1, cli.describe()
    assert inherited == "True" and int(ticket) == outer[0]["ticket"], r.describe()
    assert float(took) >= 0 and not cli.events("wait"), cli.describe()  # no queueing
    # Releasing the inherited lease does not give back the outer run's GPU.
    assert second == "True", r.describe()
    assert len(cli.events("acquire")) == 1 and not cli.events("wait"), cli.describe()


# The main thread blocks SIGTERM, so the kernel hands it to a helper thread: its C-level
# handler runs there and the main thread is never interrupted.  That is the general form of
# the lost-signal race (a handler that has not run when the wait for the command begins): a
# wait that sleeps in waitpid() hears of it only when the command ends by itself.
DEFERRED_PY = """\
import signal, sys, threading
from gpulock import runner
from gpulock.core.settings import load
threading.Thread(target=threading.Event().wait, daemon=True).start()  # SIGTERM unblocked
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])  # in the main thread only
sys.exit(runner.run(load(None, sys.argv[1]), sys.argv[2:], name="deferred"))
"""

# The command: unblock SIGTERM (inherited blocked), say it runs, then sleep.
SLEEPER_PY = """\
import signal, sys, time
signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])
open(sys.argv[1], "w").close()
time.sleep(60)
"""


def test_a_signal_whose_handler_runs_late_still_ends_the_command(cli: Cli) -> None:
    driver = cli.script("deferred.py", DEFERRED_PY)
    sleeper = cli.script("sleeper.py", SLEEPER_PY)
    ready = cli.root / "sleeper.ready"
    proc = cli.start(
        [sys.executable, str(driver), str(cli.root / "state"), sys.executable, str(sleeper),
         str(ready)],
        "deferred",
    )  # fmt: skip
    cli.wait_ready(proc, ready)
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait() == 128 + signal.SIGTERM, proc.output()


# A SIGTERM whose handler runs inside a finalizer right after the grant.  CPython runs a
# handler at whatever bytecode comes next; inside a ``__del__`` (or a weakref callback, such
# as the one importlib runs at the end of every import: the reported loss during the
# ``import ctypes`` that used to follow the grant) the handler's exception is printed as
# "Exception ignored" and dropped.  The driver makes that happen every time: the finalizer
# signals its own process and then runs bytecode.
SWALLOWED_PY = """\
import os, signal, sys
from gpulock import runner
from gpulock.core.settings import load

class Finalizer:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):  # the handler runs here, inside __del__
            pass

real_acquire = runner.acquire

def acquire(*args, **kwargs):
    lease = real_acquire(*args, **kwargs)
    Finalizer()  # freed at once, as gc frees garbage whenever it runs
    return lease

runner.acquire = acquire
sys.exit(runner.run(load(None, sys.argv[1]), sys.argv[2:], name="swallowed"))
"""


def test_a_sigterm_whose_exception_a_finalizer_swallows_still_stops_the_command(
    cli: Cli,
) -> None:
    driver = cli.script("swallowed.py", SWALLOWED_PY)
    marker = cli.root / "command.ran"
    proc = cli.start(
        [sys.executable, str(driver), str(cli.root / "state"), "sh", "-c", ': > "$0"',
         str(marker)],
        "swallowed",
    )  # fmt: skip
    assert proc.wait() == 128 + signal.SIGTERM, proc.output()
    assert not marker.exists(), "the command ran after a SIGTERM that came after the grant"
    assert cli.queue_files() == [], cli.describe()  # the GPU was given back
