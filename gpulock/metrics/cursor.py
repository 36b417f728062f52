"""The event log read incrementally, and the counters kept across restarts.

Counters must only go up, whichever process serves them and however often it restarts, so
they are not kept in a process: ``<state>/metrics/counters.json`` (format
``gpulock.metrics/1``) holds the tally and a cursor into the log, the log file's device and
inode and the byte offset after the last line counted.  ``EventCounters.current()`` takes
``<state>/metrics/counters.lock`` (an ``flock``: the governor, ``gpulock serve`` and a cron
``gpulock metrics`` may all scrape at once), reads the lines written since the cursor, folds
them in, and replaces the file atomically.

Rotation (``gpulock.core.events``: past ``events_max_bytes`` the log is renamed to
``events.jsonl.1``) is followed by inode: when the current log is another file than the
cursor's, the rest of the cursor's file is read from ``events.jsonl.1`` first, then the new
log from its start.  A log rotated twice between two scrapes loses what lay between
(counters undercount; they never go back).  A log that shrank under the same inode
(truncated by hand) is read again from the start.  Garbage lines are counted and skipped;
a line longer than ``MAX_LINE`` without a newline is skipped whole.

A process that may not write the state folder keeps the cursor and tally in memory instead:
its counters restart with it, which Prometheus reads as a counter reset.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpulock.core import events, state, statefile
from gpulock.core.errors import StateDirError
from gpulock.core.settings import Settings
from gpulock.metrics.tally import KINDS, Tally, fold

FORMAT = "gpulock.metrics/1"
FOLDER = "metrics"
FILE = "counters.json"
LOCK_FILE = "counters.lock"
CHUNK = 1 << 20
MAX_LINE = 1 << 20
MAX_FILE = 64 << 20  # counters.json: a few hundred KiB at the series caps

_EVENT_KEY = b'"event":"'
_KINDS = frozenset(k.encode() for k in KINDS)


@dataclass(frozen=True, slots=True)
class Cursor:
    """Where counting stopped: the log file (device, inode) and the offset after its last line."""

    dev: int | None = None
    inode: int | None = None
    offset: int = 0

    def names(self, st: os.stat_result) -> bool:
        return self.inode == st.st_ino and self.dev == st.st_dev


@dataclass(slots=True)
class _Reader:
    """Feeds complete lines to the tally; counts what it read and what it skipped."""

    tally: Tally
    lines: int = 0
    garbage: int = 0

    def line(self, raw: bytes) -> None:
        if not raw.strip():
            return
        self.lines += 1
        # Cheap first look: events.emit writes compact JSON with "event" right after "ts", so
        # kinds no metric counts are passed over without parsing (a 100 MB log parses slowly).
        i = raw.find(_EVENT_KEY)
        if i < 0:
            self.garbage += 1
            return
        start = i + len(_EVENT_KEY)
        if raw[start : raw.find(b'"', start)] not in _KINDS:
            return
        try:
            rec = json.loads(raw)
        except (ValueError, RecursionError):
            self.garbage += 1
            return
        if not isinstance(rec, dict) or not isinstance(rec.get("event"), str):
            self.garbage += 1
            return
        fold(self.tally, rec)


def _open(path: Path) -> int | None:
    try:
        return statefile.open_regular(path, os.O_RDONLY)
    except (OSError, StateDirError):
        return None  # missing, a symlink, a FIFO: nothing to read there


def _drain(fd: int, start: int, on_line: Callable[[bytes], None]) -> int:
    """Feed the complete lines from ``start``; the offset after the last one."""
    os.lseek(fd, start, os.SEEK_SET)
    pos = start
    partial = b""
    skipping = False  # inside an overlong line: drop it up to its newline
    while True:
        chunk = os.read(fd, CHUNK)
        if not chunk:
            return pos
        lines = (partial + chunk).split(b"\n")
        partial = lines.pop()
        for raw in lines:
            pos += len(raw) + 1
            if skipping:
                skipping = False
                on_line(b"\x00")  # counted once, as garbage
            else:
                on_line(raw)
        if len(partial) > MAX_LINE:
            pos += len(partial)
            partial = b""
            skipping = True


def advance(state_dir: Path, cursor: Cursor, on_line: Callable[[bytes], None]) -> Cursor:
    """Feed every line written since ``cursor``; the new cursor."""
    cur_fd = _open(events.log_path(state_dir))
    old_fd: int | None = None
    try:
        cur = os.fstat(cur_fd) if cur_fd is not None else None
        if cur is not None and cursor.names(cur):
            start = cursor.offset if cursor.offset <= cur.st_size else 0
            assert cur_fd is not None
            return Cursor(cur.st_dev, cur.st_ino, _drain(cur_fd, start, on_line))
        # First look, or the log was rotated: finish the generation the cursor points into.
        result = cursor
        old_fd = _open(state_dir / (events.LOG_NAME + ".1"))
        if old_fd is not None:
            old = os.fstat(old_fd)
            if cursor.inode is None or cursor.names(old):
                start = cursor.offset if cursor.names(old) and cursor.offset <= old.st_size else 0
                result = Cursor(old.st_dev, old.st_ino, _drain(old_fd, start, on_line))
        if cur is not None and cur_fd is not None:
            result = Cursor(cur.st_dev, cur.st_ino, _drain(cur_fd, 0, on_line))
        return result
    finally:
        for fd in (cur_fd, old_fd):
            if fd is not None:
                os.close(fd)


# --- the persisted tally --------------------------------------------------------------------------


def parse(data: bytes | None) -> tuple[Tally, Cursor]:
    """The tally and cursor in ``counters.json``; a damaged file starts from nothing."""
    try:
        obj = json.loads(data) if data else None
    except (ValueError, RecursionError):
        obj = None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        return Tally(), Cursor()
    c = obj.get("cursor")
    cursor = Cursor()
    if isinstance(c, dict) and all(
        isinstance(c.get(k), int) and not isinstance(c.get(k), bool) and c[k] >= 0
        for k in ("dev", "inode", "offset")
    ):
        cursor = Cursor(c["dev"], c["inode"], c["offset"])
    return Tally.from_json(obj), cursor


def encode(tally: Tally, cursor: Cursor) -> bytes:
    obj: dict[str, Any] = {
        "format": FORMAT,
        "cursor": {"dev": cursor.dev, "inode": cursor.inode, "offset": cursor.offset},
        **tally.to_json(),
    }
    return json.dumps(obj, separators=(",", ":")).encode()


class EventCounters:
    """The counters of one state folder, caught up with its event log on each ``current()``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.folder = settings.state_dir / FOLDER
        # Used only when the folder cannot be written (another user's state, read-only).
        self._tally = Tally()
        self._cursor = Cursor()

    def current(self) -> Tally:
        try:
            folder = state.ensure_subdir(self.settings.state_dir, FOLDER, group=self.settings.group)
            fd = statefile.open_regular(
                folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, self.settings.file_mode
            )
        except (OSError, StateDirError):
            return self._in_memory()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                data = statefile.read_small(folder / FILE, MAX_FILE)
            except (OSError, StateDirError):
                data = None
            tally, cursor = parse(data)
            after = self._catch_up(tally, cursor)
            if after != cursor:
                try:
                    statefile.atomic_write(
                        folder / FILE, encode(tally, after), mode=self.settings.file_mode
                    )
                except OSError:
                    pass  # counted all the same; the next scrape counts these lines again
            return tally
        finally:
            os.close(fd)  # drops the flock

    def _in_memory(self) -> Tally:
        self._cursor = self._catch_up(self._tally, self._cursor)
        return self._tally

    def _catch_up(self, tally: Tally, cursor: Cursor) -> Cursor:
        reader = _Reader(tally)
        after = advance(self.settings.state_dir, cursor, reader.line)
        if reader.lines:
            tally.add("gpulock_event_log_lines", (), reader.lines)
        if reader.garbage:
            tally.add("gpulock_event_log_garbage_lines", (), reader.garbage)
        return after
