"""What a holder or waiter cut short leaves behind is shown, cleaned, and logged."""

from __future__ import annotations

import fcntl
import os
import signal

from cli_helpers import Cli, assert_clean_error, pid_alive, wait_until


def orphan_a_fifo(cli: Cli) -> str:
    """A holder SIGKILLed inside ``Lease.release()`` after its ticket went, before its FIFO:
    the ticket is removed here as release would, then the whole holder is SIGKILLed."""
    holder = cli.hold("holder")
    child_pid = wait_until(
        lambda: (cli.entry("holder") or {}).get("child_pid"), "the holder's child_pid"
    )
    ticket = next(f for f in cli.queue_files() if f.endswith(".ticket"))
    os.unlink(cli.gpu_dir() / ticket)
    os.killpg(holder.pid, signal.SIGKILL)
    holder.wait()
    wait_until(lambda: not pid_alive(child_pid), "the holder's command to die")
    fifo = ticket.replace(".ticket", ".fifo")
    assert cli.queue_files() == [fifo]
    return fifo


def test_status_shows_an_orphan_fifo_and_the_next_ticket_cleans_it(cli: Cli) -> None:
    fifo = orphan_a_fifo(cli)
    snap = cli.status()
    assert snap["gpus"][0]["orphan_fifos"] == [fifo]
    r = cli.run("status")
    assert r.code == 0 and f"orphan {fifo}" in r.stdout and "break --stale" in r.stdout, (
        r.describe()
    )

    r = cli.run("run", "--name", "next", "--", "true")
    assert r.code == 0, r.describe()
    assert cli.queue_files() == [], cli.describe()
    cleaned = cli.events("cleanup", file=fifo)
    assert len(cleaned) == 1 and "orphan" in cleaned[0]["reason"], cli.describe()
    assert cli.status()["gpus"][0]["orphan_fifos"] == []


def test_break_stale_removes_an_orphan_fifo(cli: Cli) -> None:
    fifo = orphan_a_fifo(cli)
    r = cli.run("break", "--stale", "--json")
    assert r.code == 0, r.describe()
    [result] = r.json()["results"]
    assert result["action"] == "removed" and "orphan" in result["detail"], r.stdout
    assert cli.queue_files() == [], cli.describe()
    assert cli.events("cleanup", file=fifo), cli.describe()


def test_a_live_holder_fifo_is_never_taken_for_an_orphan(cli: Cli) -> None:
    holder = cli.hold("holder")
    before = cli.queue_files()
    r = cli.run("break", "--stale", "--json")
    assert r.code == 0 and r.json()["results"] == [], r.describe()
    assert cli.queue_files() == before
    assert cli.status()["gpus"][0]["orphan_fifos"] == []
    holder.release()
    assert holder.wait() == 0


def test_timeout_before_a_ticket_could_be_taken_is_a_timeout_event(cli: Cli) -> None:
    cli.state.mkdir(mode=0o700)
    fd = os.open(cli.state / ".seq", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # the sequence mutex, held as a stopped process would
        r = cli.run("run", "--timeout", "0.5", "--name", "late", "--", "true")
    finally:
        os.close(fd)
    assert_clean_error(r, 75)
    [timeout] = cli.events("timeout", name="late")
    assert timeout["ticket"] is None and timeout["gpu"] == 0, timeout
    assert timeout["waited_s"] >= 0.5 and "sequence mutex" in timeout["reason"], timeout
