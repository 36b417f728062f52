"""The counters' cursor into the event log: restarts, rotation, garbage, several readers at once.

A real state folder, real ``events.emit`` (rotation included) and, for the concurrent readers,
real ``gpulock metrics`` processes.  "A restart" is a new ``EventCounters`` on the same folder:
everything it knows comes from ``<state>/metrics/``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from cli_helpers import GPULOCK, Cli

from gpulock.core import events
from gpulock.core.settings import Settings, load
from gpulock.metrics.cursor import FILE, FOLDER, MAX_LINE, EventCounters
from gpulock.metrics.tally import Tally

pytest.importorskip("prometheus_client", reason="the 'metrics' extra is not installed")


def settings_for(tmp_path: Path, extra: str = "") -> Settings:
    config = tmp_path / "gpulock.yaml"
    config.write_text("# test\n" + extra)
    return load(str(config), tmp_path / "state")


def grant(s: Settings, n: int = 1, name: str = "job") -> None:
    for _ in range(n):
        s.emit("acquire", gpu=0, ticket=1, pid=1, name=name, waited_s=0.5)


def grants(t: Tally, name: str = "job") -> float:
    return t.counters.get("gpulock_grants", {}).get(("0", name), 0.0)


def test_counts_each_line_once_across_restarts(tmp_path: Path) -> None:
    s = settings_for(tmp_path)
    grant(s, 3)
    assert grants(EventCounters(s).current()) == 3
    grant(s, 2)
    again = EventCounters(s)  # a restarted process: nothing in memory
    assert grants(again.current()) == 5
    assert grants(again.current()) == 5  # nothing new: nothing counted twice
    saved = json.loads((s.state_dir / FOLDER / FILE).read_bytes())
    assert saved["format"] == "gpulock.metrics/1"
    assert saved["cursor"]["offset"] == events.log_path(s.state_dir).stat().st_size


def test_a_rotation_between_scrapes_loses_and_repeats_nothing(tmp_path: Path) -> None:
    s = settings_for(tmp_path, "events_max_bytes: 4KiB\n")
    counters = EventCounters(s)
    total = 0
    for batch in (5, 20, 1, 30, 7):  # ~150 bytes an event: each batch of 20+ rotates once
        grant(s, batch)
        total += batch
        assert grants(counters.current()) == total
    assert (s.state_dir / "events.jsonl.1").exists()


def test_a_log_rotated_twice_between_scrapes_undercounts_but_never_goes_back(
    tmp_path: Path,
) -> None:
    s = settings_for(tmp_path, "events_max_bytes: 4KiB\n")
    counters = EventCounters(s)
    grant(s, 5)
    before = grants(counters.current())
    assert before == 5
    grant(s, 100)  # three generations: the middle one is gone before the next scrape
    after = grants(counters.current())
    assert before < after <= 105


def test_a_truncated_log_is_read_again_from_its_start(tmp_path: Path) -> None:
    s = settings_for(tmp_path)
    grant(s, 10)
    counters = EventCounters(s)
    assert grants(counters.current()) == 10
    os.truncate(events.log_path(s.state_dir), 0)  # same inode, shorter: someone emptied it
    grant(s, 2)
    assert grants(counters.current()) == 12


def test_garbage_lines_are_counted_and_skipped(tmp_path: Path) -> None:
    s = settings_for(tmp_path)
    grant(s, 1)
    with open(events.log_path(s.state_dir), "ab") as f:
        f.write(b"not json at all\n")
        f.write(b'{"ts":1,"event":"acquire","gpu":0,"name":"job"\n')  # cut short
        f.write(b'{"ts":1,"event":"acquire",' + b"[" * 100_000 + b"\n")  # deep nesting
        f.write(b"x" * (3 * MAX_LINE) + b"\n")  # one enormous line
        f.write(b"\xff\xfe\x00\n")
        f.write(b'["event", "acquire"]\n')
    grant(s, 1)
    t = EventCounters(s).current()
    assert grants(t) == 2
    assert t.counters["gpulock_event_log_garbage_lines"][()] == 6
    assert t.counters["gpulock_event_log_lines"][()] == 8


def test_a_line_still_being_written_is_counted_once_complete(tmp_path: Path) -> None:
    s = settings_for(tmp_path)
    grant(s, 1)
    log = events.log_path(s.state_dir)
    line = log.read_bytes()
    with open(log, "ab") as f:
        f.write(line[:20])  # no newline yet
    counters = EventCounters(s)
    assert grants(counters.current()) == 1
    with open(log, "ab") as f:
        f.write(line[20:])
    assert grants(counters.current()) == 2


def test_a_damaged_counters_file_starts_afresh(tmp_path: Path) -> None:
    s = settings_for(tmp_path)
    grant(s, 2)
    EventCounters(s).current()
    saved = s.state_dir / FOLDER / FILE
    for garbage in (b"{", b"[]", b'{"format":"gpulock.metrics/1","cursor":{"offset":-4}}'):
        saved.write_bytes(garbage)
        assert grants(EventCounters(s).current()) == 2  # counted again from the log, once


def test_a_symlink_planted_as_the_counters_file_is_not_followed(tmp_path: Path) -> None:
    s = settings_for(tmp_path)
    grant(s, 2)
    EventCounters(s).current()
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    saved = s.state_dir / FOLDER / FILE
    saved.unlink()
    saved.symlink_to(victim)
    grant(s, 1)
    assert grants(EventCounters(s).current()) == 3
    assert victim.read_text() == "keep me"
    assert not saved.is_symlink()


def test_a_state_folder_it_cannot_write_counts_in_memory(tmp_path: Path) -> None:
    s = settings_for(tmp_path)
    (s.state_dir / FOLDER).write_text("a file where the folder should be")
    grant(s, 2)
    counters = EventCounters(s)
    assert grants(counters.current()) == 2
    grant(s, 1)
    assert grants(counters.current()) == 3


def test_concurrent_readers_count_every_line_exactly_once(cli: Cli) -> None:
    s = load(None, cli.state)
    grant(s, 300)
    procs = [
        subprocess.Popen(
            [*GPULOCK, "metrics"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=cli.env(),
            cwd=cli.root,
        )
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [e.decode() for _, e in outs]
    for out, _ in outs:
        assert 'gpulock_grants_total{gpu="0",owner="job"} 300.0' in out.decode()
    assert grants(EventCounters(s).current()) == 300
