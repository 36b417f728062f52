"""Cold-start prefetch: a waiter warms its model files into the page cache (gpulock.lock.prefetch).

Real parts: real files evicted from the page cache with ``POSIX_FADV_DONTNEED`` (after an
fsync), real ``gpulock run`` processes queued behind a real holder, residency read with
``fincore`` (util-linux) when present, else ``mincore``.  No test asserts a speed: how much
warming helps is ``bench/prefetch.py``'s business.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import HOLD_SH, Cli, Proc, assert_clean_error, pid_alive, wait_until

from gpulock.core import pagecache
from gpulock.core.config import parse_config
from gpulock.core.errors import ConfigError
from gpulock.lock import prefetch, prefetch_progress

MiB = 1 << 20
WARM_S = 60.0  # idle-priority reads on a disk other people use: generous


# --- helpers ---------------------------------------------------------------------------------


def resident(path: Path) -> int:
    """Bytes of ``path`` in the page cache, as util-linux's fincore reports them."""
    if shutil.which("fincore"):
        out = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        return int(out.split()[0])
    fd = os.open(path, os.O_RDONLY)
    try:
        got = pagecache.resident_bytes(fd, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    assert got is not None
    return got


def cold_file(folder: Path, name: str, size: int) -> Path:
    """A file of ``size`` random-ish bytes, evicted from the page cache (skip if impossible)."""
    path = folder / name
    block = os.urandom(MiB)
    with open(path, "wb") as f:
        for i in range(size // MiB):
            f.write(block[i % 7 :] + block[: i % 7])  # not all pages alike
    pagecache.drop_from_cache(path)
    if resident(path) > 0:
        pytest.skip(f"POSIX_FADV_DONTNEED does not evict on this filesystem ({folder})")
    return path


def configure(cli: Cli, text: str) -> None:
    """``./gpulock.yaml`` in the folder every gpulock of this test runs in."""
    (cli.root / "gpulock.yaml").write_text(textwrap.dedent(text))


def hold_behind(cli: Cli, name: str, *run_args: str) -> Proc:
    """A ``gpulock run`` that will hold (until ``release()``) once granted; not waited for."""
    ready = cli.root / f"{name}.ready"
    proc = cli.start_run(name, *run_args, cmd=["sh", "-c", HOLD_SH, str(ready)])
    proc.ready = ready
    return proc


def progress_of(cli: Cli, name: str) -> dict[str, Any] | None:
    e = cli.entry(name)
    return None if e is None else e.get("prefetch")


def holders_of(path: Path) -> list[int]:
    """Pids of the processes that have ``path`` open."""
    target = str(path)
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    pids.append(int(pid))
                    break
            except OSError:
                continue
    return pids


# --- the config section ------------------------------------------------------------------------


def test_defaults_without_a_section() -> None:
    opts = prefetch.options(parse_config("default_gpu: 0\n", "/etc/gpulock/config.yaml"))
    assert opts == prefetch.Options(enabled=True, ahead=2, margin=1.5, max_rate_bytes=None)


def test_a_full_section_is_read() -> None:
    cfg = parse_config(
        "prefetch:\n  enabled: false\n  ahead: 3\n  margin: 2\n  max_rate: 200MiB\n", "/x.yaml"
    )
    assert prefetch.options(cfg) == prefetch.Options(False, 3, 2.0, 200 * MiB)


@pytest.mark.parametrize(
    ("body", "key", "says"),
    [
        ("  ahead: 0\n", "prefetch.ahead", "whole number >= 1"),
        ("  ahead: true\n", "prefetch.ahead", "got true"),
        ("  margin: 0.5\n", "prefetch.margin", "number >= 1"),
        ("  margin: lots\n", "prefetch.margin", "'lots'"),
        ("  enabled: yes please\n", "prefetch.enabled", "true or false"),
        ("  max_rate: fast\n", "prefetch.max_rate", "fast"),
        ("  max_rate: 0\n", "prefetch.max_rate", "size per second"),
        ("  marign: 2\n", "prefetch.marign", "unknown key"),
    ],
)
def test_a_bad_value_names_file_line_and_key(body: str, key: str, says: str) -> None:
    cfg = parse_config("default_gpu: 0\nprefetch:\n" + body, "/srv/gpulock.yaml")
    with pytest.raises(ConfigError) as info:
        prefetch.options(cfg)
    e = info.value
    assert (e.file, e.line, e.key) == ("/srv/gpulock.yaml", 3, key)
    assert says in str(e)


def test_a_section_that_is_not_a_mapping_is_an_error() -> None:
    cfg = parse_config("prefetch: 2\n", "/srv/gpulock.yaml")
    with pytest.raises(ConfigError) as info:
        prefetch.options(cfg)
    assert (info.value.line, info.value.key) == (1, "prefetch")


# --- the pure rules ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("available", "size", "margin", "problem"),
    [
        (16 << 30, 4 << 30, 1.5, None),
        (6 << 30, 4 << 30, 1.5, None),
        (5 << 30, 4 << 30, 1.5, "low memory"),
        (None, 1, 1.5, "low memory: MemAvailable unknown"),
    ],
)
def test_memory_rule(available: int | None, size: int, margin: float, problem: str | None) -> None:
    assert prefetch.memory_problem(available, size, margin) == problem


@pytest.mark.parametrize(
    ("before", "now", "ahead", "ring"),
    [
        (None, 1, 2, False),  # the first look: the one behind looks for itself
        (2, 1, 2, True),  # moved up to the head: the one behind is now 2nd
        (3, 2, 2, False),  # the one behind would be 3rd: beyond ahead
        (2, 2, 2, False),  # nothing moved
        (4, 3, 5, True),
    ],
)
def test_who_passes_the_news_on(before: int | None, now: int, ahead: int, ring: bool) -> None:
    assert prefetch.should_forward(before, now, ahead) is ring


# --- real files, real processes ----------------------------------------------------------------


def test_a_queued_run_warms_its_evicted_file_while_it_waits(cli: Cli, tmp_path: Path) -> None:
    model = cold_file(tmp_path, "model.gguf", 48 * MiB)
    holder = cli.hold("holder")
    waiter = cli.start_run("waiter", "--prefetch", str(model), cmd=["true"])
    wait_until(
        lambda: resident(model) == model.stat().st_size, "the model file in the cache", WARM_S
    )
    done = cli.wait_event("prefetch", WARM_S, name="waiter")
    assert (done["outcome"], done["reason"], done["path"]) == ("done", None, str(model))
    assert done["size_bytes"] == done["resident_bytes"] == 48 * MiB
    assert 0 < done["read_bytes"] <= 48 * MiB and done["position"] == 1
    assert cli.events("acquire", name="waiter") == []  # all of it while waiting
    p = wait_until(lambda: progress_of(cli, "waiter"), "the waiter's progress in status")
    assert (p["state"], p["paths"], p["bytes_done"], p["bytes_total"]) == (
        "done",
        [str(model)],
        48 * MiB,
        48 * MiB,
    )
    text = cli.run("status")
    assert "waiting (warm)" in text.stdout, text.describe()
    holder.release()
    assert waiter.wait() == 0
    assert holder.wait() == 0
    assert cli.queue_files() == []  # the progress file left with the ticket


def test_a_cached_file_is_not_read_again(cli: Cli, tmp_path: Path) -> None:
    model = tmp_path / "warm.gguf"
    model.write_bytes(os.urandom(4 * MiB))
    model.read_bytes()  # in the cache now
    holder = cli.hold("holder")
    waiter = cli.start_run("waiter", "--prefetch", str(model), cmd=["true"])
    e = cli.wait_event("prefetch", name="waiter")
    assert (e["outcome"], e["reason"], e["read_bytes"], e["resident_bytes"]) == (
        "skipped",
        "cached",
        0,
        4 * MiB,
    )
    holder.release()
    assert waiter.wait() == 0


def test_too_little_memory_reads_nothing(cli: Cli, tmp_path: Path) -> None:
    configure(cli, "prefetch:\n  margin: 1000000  # no machine has a million times 8 MiB\n")
    model = cold_file(tmp_path, "big.gguf", 8 * MiB)
    holder = cli.hold("holder")
    waiter = cli.start_run("waiter", "--prefetch", str(model), cmd=["true"])
    e = cli.wait_event("prefetch", name="waiter")
    assert (e["outcome"], e["reason"], e["read_bytes"]) == ("skipped", "low memory", 0)
    assert resident(model) == 0
    p = wait_until(lambda: progress_of(cli, "waiter"), "the waiter's progress in status")
    assert (p["state"], p["reason"], p["bytes_done"]) == ("skipped", "low memory", 0)
    assert "not warmed: low memory" in cli.run("status").stdout
    holder.release()
    assert waiter.wait() == 0


def test_warming_stops_at_the_grant(cli: Cli, tmp_path: Path) -> None:
    configure(cli, "prefetch:\n  max_rate: 2MiB\n")  # 64 MiB: half a minute, far past the grant
    model = cold_file(tmp_path, "slow.gguf", 64 * MiB)
    holder = cli.hold("holder")
    waiter = hold_behind(cli, "waiter", "--prefetch", str(model))
    wait_until(
        lambda: (progress_of(cli, "waiter") or {}).get("bytes_done", 0) > 0, "warming under way"
    )
    holder.release()
    cli.wait_ready(waiter)  # granted: its command runs
    e = cli.wait_event("prefetch", name="waiter")
    assert (e["outcome"], e["reason"]) == ("stopped", "granted")
    assert 0 < e["read_bytes"] < 64 * MiB
    assert [n for n in cli.queue_files() if n.endswith(".prefetch")] == []
    waiter.release()
    assert waiter.wait() == 0


def test_warming_stops_when_the_wait_times_out(cli: Cli, tmp_path: Path) -> None:
    configure(cli, "prefetch:\n  max_rate: 2MiB\n")
    model = cold_file(tmp_path, "late.gguf", 64 * MiB)
    holder = cli.hold("holder")
    r = cli.run("run", "--name", "late", "--timeout", "3", "--prefetch", str(model), "--", "true")
    assert r.code == 75, r.describe()
    e = cli.wait_event("prefetch", name="late")
    assert (e["outcome"], e["reason"]) == ("stopped", "left the line")
    assert 0 < e["read_bytes"] < 64 * MiB
    assert holders_of(model) == []
    assert cli.queue_files() == ["000000000001.fifo", "000000000001.ticket"]  # the holder's
    holder.release()
    assert holder.wait() == 0


def test_a_waiter_killed_mid_warming_leaves_nothing_behind(cli: Cli, tmp_path: Path) -> None:
    configure(cli, "prefetch:\n  max_rate: 2MiB\n")
    model = cold_file(tmp_path, "killed.gguf", 64 * MiB)
    holder = cli.hold("holder")
    waiter = cli.start_run("waiter", "--prefetch", str(model), cmd=["true"])
    wait_until(
        lambda: (progress_of(cli, "waiter") or {}).get("state") == "warming", "warming under way"
    )
    assert holders_of(model) == [waiter.pid]
    os.kill(waiter.pid, signal.SIGKILL)
    waiter.wait()
    assert not pid_alive(waiter.pid)
    assert holders_of(model) == []  # no thread, no child kept reading
    holder.release()
    assert holder.wait() == 0
    r = cli.run("run", "--", "true")  # looks at the queue: cleans the dead ticket up
    assert r.code == 0, r.describe()
    assert cli.queue_files() == []  # its progress file went with it


def test_only_the_first_waiters_warm_and_the_news_travels_down_the_line(
    cli: Cli, tmp_path: Path
) -> None:
    first = cold_file(tmp_path, "first.gguf", 8 * MiB)
    third = cold_file(tmp_path, "third.gguf", 8 * MiB)
    holder = cli.hold("holder")
    w1 = hold_behind(cli, "w1")
    cli.wait_event("wait", name="w1")
    w2 = cli.start_run("w2", "--prefetch", str(first), cmd=["true"])
    cli.wait_event("prefetch", name="w2")  # 2nd in line: within ahead (2)
    w3 = cli.start_run("w3", "--prefetch", str(third), cmd=["true"])
    cli.wait_event("wait", name="w3")
    assert resident(third) == 0 and cli.events("prefetch", name="w3") == []  # 3rd: not yet
    holder.release()
    cli.wait_ready(w1)  # w1 holds now, and stays: w3 is 2nd in line, so it warms
    wait_until(
        lambda: resident(third) == third.stat().st_size, "the 3rd waiter's file cached", WARM_S
    )
    assert cli.events("acquire", name="w2") == []  # before w2 (ahead of it) was granted
    w1.release()
    assert (w2.wait(), w3.wait(), w1.wait()) == (0, 0, 0)


def test_a_missing_file_is_a_usage_error_before_queueing(cli: Cli, tmp_path: Path) -> None:
    r = cli.run("run", "--prefetch", str(tmp_path / "nope.gguf"), "--", "true")
    assert_clean_error(r, 2)
    assert "nope.gguf" in r.stderr
    assert cli.queue_files() == []


def test_a_bad_section_is_a_clean_error(cli: Cli, tmp_path: Path) -> None:
    configure(cli, "prefetch:\n  ahead: none\n")
    r = cli.run("run", "--", "true")
    assert_clean_error(r, 1)
    assert "prefetch.ahead" in r.stderr and "gpulock.yaml" in r.stderr


@pytest.mark.parametrize(
    "garbage",
    ["fifo", "symlink", "huge", "not-json", "another-pid", "folder"],
)
def test_status_skips_garbage_progress_files(cli: Cli, tmp_path: Path, garbage: str) -> None:
    holder = cli.hold("holder")
    waiter = cli.start_run("waiter", cmd=["true"])
    cli.wait_event("wait", name="waiter")
    seq = cli.entry("waiter")["ticket"]  # type: ignore[index]
    path = cli.gpu_dir() / prefetch_progress.progress_name(seq)
    if garbage == "fifo":
        os.mkfifo(path)  # a plain open would block status for ever
    elif garbage == "symlink":
        (tmp_path / "elsewhere").write_text("{}")
        path.symlink_to(tmp_path / "elsewhere")
    elif garbage == "huge":
        path.write_bytes(b" " * (prefetch_progress.PROGRESS_LIMIT + 1))
    elif garbage == "not-json":
        path.write_bytes(b"\x00\xff{")
    elif garbage == "another-pid":
        path.write_text(
            f'{{"format":"{prefetch_progress.FORMAT}","ticket":{seq},"pid":1,"state":"done","files":[]}}'
        )
    else:
        path.mkdir()
    assert progress_of(cli, "waiter") is None
    assert cli.run("status").code == 0
    holder.release()
    assert waiter.wait() == 0


def test_acquire_in_python_warms_too(tmp_path: Path, cli: Cli) -> None:
    import gpulock

    model = cold_file(tmp_path, "py.gguf", 8 * MiB)
    holder = cli.hold("holder")
    got: list[Any] = []

    def wait_in_line() -> None:
        with gpulock.acquire(
            name="py", prefetch=[model], state_dir=cli.state, config=str(cli.root / "none.yaml")
        ) as lease:
            got.append(lease.ticket)

    (cli.root / "none.yaml").write_text("simulate: 24GiB\n")
    t = threading.Thread(target=wait_in_line)
    t.start()
    # Done, in its event: the file's last page cached is not yet the warming's end (a grant
    # in between would stop it, on a loaded machine).
    wait_until(
        lambda: [e["outcome"] for e in cli.events("prefetch", name="py")] == ["done"],
        "the file warmed by acquire()",
        WARM_S,
    )
    assert resident(model) == model.stat().st_size
    holder.release()
    t.join(30)
    assert got and not t.is_alive()


def test_acquire_refuses_a_missing_file(tmp_path: Path) -> None:
    import gpulock

    with pytest.raises(gpulock.GpulockError, match="cannot prefetch"):
        gpulock.acquire(prefetch=["/no/such/model.gguf"], timeout=0, state_dir=tmp_path / "s")
    assert not (tmp_path / "s" / "gpu0").exists()


def test_the_warming_thread_alone_runs_at_idle_io_priority_and_nice_19() -> None:
    import ctypes

    nr_get = {"x86_64": 252, "aarch64": 31}.get(os.uname().machine)
    if nr_get is None:
        pytest.skip("ioprio_get's number is not known here for this check")
    libc = ctypes.CDLL(None, use_errno=True)
    seen: dict[str, int] = {}

    def warming_thread() -> None:
        pagecache.be_idle()
        tid = threading.get_native_id()
        seen["ioprio"] = libc.syscall(nr_get, 1, tid)
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, tid)

    main_before = libc.syscall(nr_get, 1, threading.get_native_id())
    t = threading.Thread(target=warming_thread)
    t.start()
    t.join(30)
    assert seen["ioprio"] >> 13 == 3  # IOPRIO_CLASS_IDLE
    assert seen["nice"] == 19
    assert libc.syscall(nr_get, 1, threading.get_native_id()) == main_before
