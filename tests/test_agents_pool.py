"""``@agent(..., workers="auto", need=...)``: an agent's batch split between a pool's workers.

Real runs of ``python -m gpulock.agents run`` on a simulated 24 GiB GPU: the run leads a ``gpulock
pool`` whose workers are the same command line, and ``ctx.batch()`` gives each item to one of
them.  A worker SIGKILLs itself in the middle of an item: the item must be done again by
another worker, and every item exactly once in the batch's output.
"""

from __future__ import annotations

import grp
import json
import os
import signal
import stat
import sys
from pathlib import Path

import pytest
from cli_helpers import Cli, pid_alive, wait_until

from gpulock.agents import agent

AGENTS = (sys.executable, "-m", "gpulock.agents")

# The agent: argv [COUNT]; appends "<item> <pid>" to OUT once an item's work is over.  With
# the file KILL present, the first worker to reach item 3 removes it and SIGKILLs itself in
# the middle of that item.
AGENT_PY = """\
import os, signal, time
from gpulock.agents import agent

OUT = {out!r}
KILL = {kill!r}
PAIR = {pair!r}  # a folder: each worker's first item waits there until two workers have begun

@agent("tts", workers={workers!r}, need="8.9GiB", timeout="60s")
def tts(ctx):
    count = int(ctx.args[0]) if ctx.args else 8
    seen = 0
    for item in ctx.batch(range(count)):
        if PAIR and not seen:
            open(os.path.join(PAIR, str(os.getpid())), "w").close()
            deadline = time.monotonic() + 60
            while len(os.listdir(PAIR)) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
        seen += 1
        if item == 3:
            try:
                os.unlink(KILL)
            except FileNotFoundError:
                pass
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.02)  # the item's work: long enough for the other worker to take some
        fd = os.open(OUT, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, f"{{item}} {{os.getpid()}} {{os.environ['GPULOCK_POOL_WORKER']}}\\n".encode())
        os.close(fd)
"""


def write_agent(
    cli: Cli, workers: object = "auto", pair: Path | None = None
) -> tuple[Path, Path, Path]:
    out = cli.root / "out.txt"
    kill = cli.root / "kill"
    module = cli.root / "tts_agent.py"
    text = AGENT_PY.format(
        out=str(out), kill=str(kill), workers=workers, pair=None if pair is None else str(pair)
    )
    module.write_text(text)
    return module, out, kill


def done(out: Path) -> list[tuple[int, int, int]]:
    if not out.exists():
        return []
    return [tuple(map(int, line.split())) for line in out.read_text().splitlines()]  # type: ignore[misc]


def test_the_batch_is_split_between_workers_each_item_once(cli: Cli) -> None:
    pair = cli.root / "pair"  # the first worker waits for the second: no race on who is quick
    pair.mkdir()
    module, out, _ = write_agent(cli, pair=pair)
    r = cli.run("run", "tts", "12", "--module", str(module), argv0=AGENTS, timeout_s=60)
    assert r.code == 0, r.describe()
    items = sorted(i for i, _, _ in done(out))
    assert items == list(range(12)), out.read_text()
    starts = cli.events("pool-worker", action="start")
    assert len(starts) == 2, cli.describe()  # 24 GiB holds two of 8.9 GiB
    folder = cli.state / "agents" / "tts"
    assert not (folder / "checkpoint.json").exists() and not (folder / "claims").exists()


def test_a_worker_killed_mid_item_leaves_it_to_another_and_nothing_is_done_twice(
    cli: Cli,
) -> None:
    module, out, kill = write_agent(cli)
    kill.touch()
    r = cli.run("run", "tts", "10", "--module", str(module), argv0=AGENTS, timeout_s=60)
    assert r.code == 0, r.describe()
    assert not kill.exists()  # a worker did die at item 3
    items = [i for i, _, _ in done(out)]
    assert sorted(items) == list(range(10)), out.read_text()  # each exactly once, 3 included
    exits = cli.events("pool-worker", action="exit")
    assert "killed by SIGKILL" in [e["reason"] for e in exits], cli.describe()
    killed = next(e for e in exits if e["reason"] == "killed by SIGKILL")
    assert all(pid != killed["worker_pid"] for i, pid, _ in done(out) if i == 3)


def test_a_fixed_number_of_workers(cli: Cli) -> None:
    module, out, _ = write_agent(cli, workers=1)
    r = cli.run("run", "tts", "4", "--module", str(module), argv0=AGENTS, timeout_s=60)
    assert r.code == 0, r.describe()
    assert sorted(i for i, _, _ in done(out)) == [0, 1, 2, 3]
    assert len(cli.events("pool-worker", action="start")) == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"workers": "auto"}, "workers: needs need="),
        ({"workers": 0, "need": "1GiB"}, "workers: expected 'auto' or a whole number"),
        ({"workers": "many", "need": "1GiB"}, "workers: expected 'auto'"),
    ],
)
def test_bad_workers_name_the_field(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        agent("bad-workers", **kwargs)  # type: ignore[arg-type]


def test_sigterm_to_the_leader_stops_every_worker_and_keeps_the_checkpoint(
    cli: Cli,
) -> None:
    module, _, _ = write_agent(cli)
    block = cli.root / "block"
    module.write_text(
        module.read_text().replace(
            "        time.sleep(0.02)",
            f"        while item == 5 and not os.path.exists({str(cli.root / 'never')!r}):\n"
            f"            open({str(block)!r}, 'a').close()\n"
            "            time.sleep(0.01)\n"
            "        time.sleep(0.02)",
        )
    )
    leader = cli.start([*AGENTS, "run", "tts", "10", "--module", str(module)], "leader")
    wait_until(block.exists, lambda: f"a worker at item 5\n{leader.output()}")
    workers = [e["worker_pid"] for e in cli.events("pool-worker", action="start")]
    os.kill(leader.pid, signal.SIGTERM)
    assert leader.wait() == 128 + signal.SIGTERM, leader.output()
    wait_until(lambda: not any(pid_alive(p) for p in workers), "the workers to end")
    folder = cli.state / "agents" / "tts"
    assert (folder / "checkpoint.json").exists()  # the next run resumes
    assert [f for f in cli.queue_files() if f.endswith(".ticket")] == []
    ends = [
        json.loads(line)
        for line in (folder / "log.jsonl").read_text().splitlines()
        if '"end"' in line
    ]
    assert ends[-1]["outcome"] == "killed" and ends[-1]["reason"] == "SIGTERM", ends


def test_a_shared_state_folder_gets_claims_its_group_can_write(tmp_path: Path) -> None:
    """With ``group`` set, the claims folder is made like the state folder's own (2770, the
    group's), whatever the umask: another member's worker must be able to claim items."""
    from gpulock.agents import poolbatch
    from gpulock.core.state import ensure_state_dir, ensure_subdir, file_mode

    group = grp.getgrgid(os.getgid()).gr_name
    state = ensure_state_dir(tmp_path / "state", group=group)
    folder = ensure_subdir(state, "tts", group=group)
    path = folder / "checkpoint.json"
    old = os.umask(0o077)
    try:
        items = poolbatch.pooled(
            ["a", "b"], ["a", "b"], set(), path=path, mode=file_mode(group), group=group,
            finished=lambda _n: None,
        )  # fmt: skip
        got = list(items)
    finally:
        os.umask(old)
    assert got == ["a", "b"]
    st = os.stat(poolbatch.claims_dir(path))
    assert stat.S_IMODE(st.st_mode) == 0o2770 and st.st_gid == os.getgid()
