"""``gpulock pool``: as many workers as the GPU's line admits, on a simulated 24 GiB GPU.

Real ``gpulock pool`` processes with real workers (``WORKER_PY``), driven through files: a
worker says it runs (``ready/<pid>``), works through the batch's items and stays until the
test lets it go (``release``).  Nothing waits on a sleep; every wait has a deadline.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
from typing import Any

import pytest
from cli_helpers import GPULOCK, REPO, Cli, Proc, assert_clean_error, pid_alive, wait_until

from gpulock.pool import policy

# A worker: argv DIR.  Writes ready/<pid> (its index and pool size), then takes the batch's
# items one by one from DIR/todo (claimed by renaming into DIR/doing, so no two workers take
# one; a claim whose worker died goes back to todo when a worker starts), appends one line per
# item done to DIR/out.log, and when no item is left waits for DIR/release (exit 0) or
# DIR/fail (exit 3).  An item named "slow-*" waits for DIR/go before it is done.
WORKER_PY = """\
import os, sys, time
d = sys.argv[1]
me = os.getpid()
for name in os.listdir(os.path.join(d, "doing")):  # claims of dead workers: redo them
    item, _, pid = name.rpartition(".")
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        os.rename(os.path.join(d, "doing", name), os.path.join(d, "todo", item))
with open(os.path.join(d, "ready", str(me)), "w") as f:
    f.write(os.environ["GPULOCK_POOL_WORKER"] + " " + os.environ["GPULOCK_POOL_SIZE"])
deadline = time.monotonic() + 30
def wait_for(path):
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit(99)
        time.sleep(0.01)
while True:
    items = sorted(os.listdir(os.path.join(d, "todo")))
    if not items:
        break
    claim = os.path.join(d, "doing", items[0] + "." + str(me))
    try:
        os.rename(os.path.join(d, "todo", items[0]), claim)
    except FileNotFoundError:
        continue  # another worker took it first
    if items[0].startswith("slow-"):
        wait_for(os.path.join(d, "go"))
    fd = os.open(os.path.join(d, "out.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, (items[0] + "\\n").encode())
    os.close(fd)
    os.unlink(claim)
while True:
    if os.path.exists(os.path.join(d, "fail")):
        sys.exit(3)
    if os.path.exists(os.path.join(d, "release")):
        sys.exit(0)
    if time.monotonic() > deadline:
        sys.exit(99)
    time.sleep(0.01)
"""


@pytest.fixture
def pool_cli(cli: Cli) -> Cli:
    """``cli``, running this checkout's gpulock (the venv's may be another's)."""
    cli.env = functools.partial(Cli.env, cli, PYTHONPATH=str(REPO))  # type: ignore[method-assign]
    return cli


class Batch:
    def __init__(self, cli: Cli, items: int = 0, slow: int = 0) -> None:
        self.cli = cli
        self.dir = cli.root / "batch"
        for sub in ("todo", "doing", "ready"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        for i in range(items):
            (self.dir / "todo" / f"item-{i:03d}").touch()
        for i in range(slow):
            (self.dir / "todo" / f"slow-{i:03d}").touch()
        self.script = cli.script("worker.py", WORKER_PY)

    def start(self, *pool_args: str, name: str = "tts") -> Proc:
        argv = [*GPULOCK, "pool", "--name", name, *pool_args]
        return self.cli.start([*argv, "--", sys.executable, str(self.script), str(self.dir)], name)

    def ready(self) -> dict[int, tuple[int, int]]:
        """pid -> (index, size) of every worker that ever started."""
        out = {}
        for p in (self.dir / "ready").iterdir():
            text = p.read_text().split()
            if len(text) == 2:
                out[int(p.name)] = (int(text[0]), int(text[1]))
        return out

    def running(self) -> list[int]:
        return [pid for pid in self.ready() if pid_alive(pid)]

    def wait_running(self, n: int) -> list[int]:
        return wait_until(
            lambda: r if len(r := self.running()) == n else None,
            lambda: f"{n} workers running (have {self.running()})\n{self.cli.describe()}",
        )

    def touch(self, name: str) -> None:
        (self.dir / name).touch()

    def done_items(self) -> list[str]:
        path = self.dir / "out.log"
        return path.read_text().split() if path.exists() else []


def pool_tickets(cli: Cli) -> list[dict[str, Any]]:
    return [e for e in cli.entries() if e["pool"] is not None]


def holding(entries: list[dict[str, Any]]) -> int:
    return sum(1 for e in entries if e["state"] == "holding")


# --- the rules (pure) --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("running", "held", "asking", "finishing", "backoff_until", "expected"),
    [
        (0, 0, False, False, 0.0, True),  # nothing yet: ask
        (2, 0, False, False, 0.0, True),  # below max: one more waits in line
        (2, 0, True, False, 0.0, False),  # never a second waiting ticket
        (4, 0, False, False, 0.0, False),  # at max
        (3, 1, False, False, 0.0, False),  # granted-but-not-started count too
        (1, 0, False, True, 0.0, False),  # a worker finished: no new one
        (1, 0, False, False, 20.0, False),  # backing off
    ],
)
def test_may_ask(
    running: int, held: int, asking: bool, finishing: bool, backoff_until: float, expected: bool
) -> None:
    got = policy.may_ask(
        running=running,
        held=held,
        max_workers=4,
        asking=asking,
        finishing=finishing,
        backoff_until=backoff_until,
        now=10.0,
    )
    assert got is expected


def test_backoff_doubles_and_a_healthy_run_starts_a_new_row() -> None:
    assert [policy.backoff_s(n) for n in (1, 2, 3)] == [0.5, 1.0, 2.0]
    assert policy.backoff_s(50) == policy.BACKOFF_MAX_S
    assert policy.next_streak(2, 1.0) == 3
    assert policy.next_streak(2, policy.HEALTHY_S) == 1
    assert not policy.gives_up(3, retries=3) and policy.gives_up(4, retries=3)
    assert policy.gives_up(1, retries=0)


def test_exit_reasons_and_codes() -> None:
    assert policy.exit_reason(0) == "done"
    assert policy.exit_reason(3) == "exit 3"
    assert policy.exit_reason(-9) == "killed by SIGKILL"
    assert policy.exit_code(-9) == 137 and policy.exit_code(3) == 3
    gib = 1 << 30
    budget = 24 * gib - int(2.4 * gib)
    assert policy.default_max(budget, int(8.9 * gib)) == 2
    assert policy.default_max(None, gib) == 1


# --- how many run at once ----------------------------------------------------------------------


def test_runs_as_many_workers_as_fit_and_keeps_one_ticket_waiting(pool_cli: Cli) -> None:
    cli = pool_cli
    batch = Batch(cli)
    pool = batch.start("--need", "8.9GiB", "--max", "4")
    batch.wait_running(2)  # 24 GiB less the 10 % reserve holds two of 8.9 GiB, not three
    entries = wait_until(
        lambda: t if len(t := pool_tickets(cli)) == 3 else None,
        lambda: f"two holders and one waiter of the pool\n{cli.describe()}",
    )
    assert holding(entries) == 2
    assert [e["state"] for e in entries] == ["holding", "holding", "waiting"]
    assert sorted(e["pool"]["worker"] for e in entries if e["state"] == "holding") == [0, 1]
    assert entries[0]["pool"]["workers"] == 2 and entries[0]["pool"]["max"] == 4
    assert sorted(batch.ready().values()) == [(0, 1), (1, 2)]
    text = cli.run("status")
    assert "pool tts (2 workers, max 4, need 8.9 GiB)" in text.stdout, text.describe()
    batch.touch("release")
    assert pool.wait() == 0, pool.output()
    assert len(batch.ready()) == 2  # no worker started after the first finished its share
    assert [f for f in cli.queue_files() if f.endswith(".ticket")] == []
    assert not (cli.state / "pools" / f"{pool.pid}.json").exists()
    starts = cli.events("pool-worker", action="start")
    exits = cli.events("pool-worker", action="exit")
    assert len(starts) == 2 and {e["reason"] for e in exits} == {"done"}
    assert len(cli.events("pool-start")) == 1 and cli.events("pool-end")[0]["rc"] == 0


def test_another_job_leaves_room_for_one_then_two_again(pool_cli: Cli) -> None:
    cli = pool_cli
    other = cli.hold("other", "--need", "6GiB")
    batch = Batch(cli)
    pool = batch.start("--need", "8.9GiB", "--max", "4")
    batch.wait_running(1)
    wait_until(
        lambda: [e["state"] for e in pool_tickets(cli)] == ["holding", "waiting"],
        lambda: f"one worker and one waiting ticket\n{cli.describe()}",
    )
    assert len(batch.running()) == 1
    other.release()
    assert other.wait() == 0
    batch.wait_running(2)
    batch.touch("release")
    assert pool.wait() == 0, pool.output()
    assert len(batch.ready()) == 2


def test_an_exclusive_job_behind_the_pool_gets_the_gpu_when_the_workers_end(
    pool_cli: Cli,
) -> None:
    cli = pool_cli
    batch = Batch(cli)
    pool = batch.start("--need", "8.9GiB", "--max", "4")
    batch.wait_running(2)
    wait_until(lambda: len(pool_tickets(cli)) == 3, lambda: f"the pool's waiter\n{cli.describe()}")
    ready = cli.root / "exclusive.ready"
    excl = cli.start_run("exclusive", cmd=["sh", "-c", f': > "{ready}"'])
    wait_until(
        lambda: cli.entry("exclusive") is not None, lambda: f"exclusive waits\n{cli.describe()}"
    )
    assert not ready.exists()
    batch.touch("release")
    assert excl.wait() == 0, excl.output()
    assert pool.wait() == 0, pool.output()
    assert len(batch.ready()) == 2  # no new worker jumped ahead of it
    granted = cli.events("acquire", name="exclusive")[0]["ts"]
    last_exit = max(e["ts"] for e in cli.events("pool-worker", action="exit"))
    assert granted >= last_exit


# --- failures -----------------------------------------------------------------------------------


def test_a_worker_killed_mid_item_is_replaced_and_the_item_done_once(pool_cli: Cli) -> None:
    cli = pool_cli
    batch = Batch(cli, items=5, slow=1)
    pool = batch.start("--need", "8.9GiB", "--max", "1")
    claim = wait_until(
        lambda: next(iter((batch.dir / "doing").glob("slow-000.*")), None),
        lambda: f"the slow item claimed\n{cli.describe()}",
    )
    victim = int(claim.name.rpartition(".")[2])
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: len(batch.ready()) == 2, lambda: f"a replacement worker\n{cli.describe()}")
    batch.touch("go")
    wait_until(lambda: len(batch.done_items()) == 6, lambda: f"every item done\n{cli.describe()}")
    batch.touch("release")
    assert pool.wait() == 0, pool.output()
    done = batch.done_items()
    assert sorted(done) == sorted(set(done)), done  # every item exactly once
    assert "slow-000" in done
    exits = cli.events("pool-worker", action="exit")
    assert exits[0]["reason"] == "killed by SIGKILL" and exits[0]["worker_pid"] == victim
    assert sorted(v for v in batch.ready().values()) == [(0, 1), (0, 1)]  # same index again


def test_retries_exhausted_stops_the_pool_naming_the_worker(pool_cli: Cli) -> None:
    cli = pool_cli
    batch = Batch(cli)
    batch.touch("fail")
    r = cli.run(
        "pool", "--need", "8.9GiB", "--max", "1", "--retries", "2", "--name", "tts", "--",
        sys.executable, str(batch.script), str(batch.dir),
    )  # fmt: skip
    assert_clean_error(r, 3)
    assert "worker 0 failed (exit 3); 3 failure(s) in a row" in r.stderr, r.describe()
    assert len(batch.ready()) == 3  # the first and two replacements
    assert [f for f in cli.queue_files() if f.endswith(".ticket")] == []
    assert cli.events("pool-end")[0]["rc"] is None


def test_sigterm_reaches_every_worker_and_leaves_nothing(pool_cli: Cli) -> None:
    cli = pool_cli
    batch = Batch(cli)
    pool = batch.start("--need", "8.9GiB", "--max", "4")
    workers = batch.wait_running(2)
    wait_until(lambda: len(pool_tickets(cli)) == 3, lambda: f"the pool's waiter\n{cli.describe()}")
    os.kill(pool.pid, signal.SIGTERM)
    assert pool.wait() == 128 + signal.SIGTERM, pool.output()
    wait_until(lambda: not any(pid_alive(p) for p in workers), "the workers to end")
    assert [f for f in cli.queue_files() if not f.startswith(".")] == []
    assert list((cli.state / "pools").iterdir()) == []


def test_timeout_without_a_worker_exits_75_and_leaves_the_line(pool_cli: Cli) -> None:
    cli = pool_cli
    other = cli.hold("other")  # exclusive
    batch = Batch(cli)
    r = cli.run(
        "pool", "--need", "8.9GiB", "--timeout", "0.3", "--",
        sys.executable, str(batch.script), str(batch.dir),
    )  # fmt: skip
    assert_clean_error(r, 75)
    assert batch.ready() == {}
    assert [e["name"] for e in cli.entries()] == ["other"]
    other.release()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--", "true"], "--need is required"),
        (["--need", "8.9GiB"], "missing command"),
        (["--need", "8GiB", "--max", "0", "--", "true"], "--max"),
        (["--need", "8GiB", "--min", "3", "--max", "2", "--", "true"], "--min 3 is above --max 2"),
        (["--need", "8.9GiB", "--min", "3", "--", "true"], "workers of 8.9 GiB fit"),
    ],
)
def test_usage_errors_are_clean(pool_cli: Cli, args: list[str], message: str) -> None:
    r = pool_cli.run("pool", *args)
    assert_clean_error(r, 2)
    assert message in r.stderr, r.describe()
    assert pool_cli.queue_files() == []


def test_min_starts_workers_only_together(pool_cli: Cli) -> None:
    cli = pool_cli
    other = cli.hold("other", "--need", "6GiB")
    batch = Batch(cli)
    pool = batch.start("--need", "8.9GiB", "--min", "2")
    wait_until(
        lambda: [e["state"] for e in pool_tickets(cli)] == ["holding", "waiting"],
        lambda: f"one ticket held, one waiting\n{cli.describe()}",
    )
    assert batch.ready() == {}  # one granted is not enough
    other.release()
    batch.wait_running(2)
    batch.touch("release")
    assert pool.wait() == 0, pool.output()


def test_a_need_that_never_fits_is_a_clean_error(pool_cli: Cli) -> None:
    r = pool_cli.run("pool", "--need", "30GiB", "--", "true")
    assert_clean_error(r, 1)
    assert "30" in r.stderr and pool_cli.queue_files() == [], r.describe()


def test_a_pool_inside_gpulock_run_refuses_to_share_one_ticket(pool_cli: Cli) -> None:
    cli = pool_cli
    r = cli.run("run", "--", *GPULOCK, "pool", "--need", "1GiB", "--", "true")
    assert r.code == 1, r.describe()
    assert "error: gpulock pool runs inside a lease on gpu0" in r.stderr, r.describe()
    assert cli.events("pool-worker") == []


def test_a_forged_pool_record_is_skipped_not_a_traceback(pool_cli: Cli) -> None:
    """``<state>/pools/*.json`` is read by every ``gpulock status``: nesting deep enough to
    crash ``json.loads`` is garbage to skip, as for tickets and resident records."""
    cli = pool_cli
    cli.state.mkdir(mode=0o700)
    pools = cli.state / "pools"
    pools.mkdir(mode=0o700)
    (pools / "1.json").write_bytes(b"[" * 60_000)
    r = cli.run("status", "--json")
    assert r.code == 0, r.describe()
    assert "Traceback" not in r.stderr, r.describe()


# --- several GPUs (issue 28) ---------------------------------------------------------------------


def test_a_pool_on_any_gpu_runs_its_workers_on_both_and_earlier_workers_draw_the_next(
    pool_cli: Cli,
) -> None:
    """``--gpu any`` on two simulated 24 GiB GPUs: two 8.9 GiB workers fit each, so four run;
    the second worker goes where the first is (its model is warm there), and only then the
    other GPU fills."""
    cli = pool_cli
    cli.simulate = "24GiB,24GiB"
    batch = Batch(cli)
    pool = batch.start("--need", "8.9GiB", "--max", "4", "--gpu", "any")
    batch.wait_running(4)
    starts = wait_until(
        lambda: s if len(s := cli.events("pool-worker", action="start")) == 4 else None,
        lambda: f"four workers started\n{cli.describe()}",
    )
    where = [tuple(e["worker_gpus"]) for e in starts]
    assert sorted(where) == [(0,), (0,), (1,), (1,)]
    assert where[0] == where[1]  # the second joined the first: preferred, as its model is warm
    grants = cli.events("acquire", name="tts")
    assert grants[1]["granted"] == grants[0]["granted"]
    record = cli.status()
    assert sum(len(g["holders"]) for g in record["gpus"]) == 4
    batch.touch("release")
    assert pool.wait() == 0, pool.output()
    for g in (0, 1):
        assert [f for f in cli.queue_files(g) if f.endswith(".ticket")] == []
