"""The append-only JSONL event log in the state folder, rotated by size.

Each line is one JSON object: ``{"ts": <epoch s>, "event": "<kind>", ...fields}``.  Kinds the
lock writes: ``wait``, ``acquire``, ``release``, ``timeout``, ``stale``, ``cleanup``, ``break``,
``kill``, ``exit-wait``, ``exit-wait-timeout``; later packages add their own (``evict``,
``escalate``...).  A line is written with one ``write()`` on an ``O_APPEND`` descriptor, so
lines from many processes never interleave.  When the file passes ``max_bytes`` it is renamed
to ``events.jsonl.1`` (one generation kept) under a short ``flock``, so two processes never
rotate at once.  Readers skip lines they cannot parse.

Never put secrets in an event: API keys are read from the environment by the code that needs
them and are not passed here.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpulock import state
from gpulock.errors import StateDirError

LOG_NAME = "events.jsonl"
DEFAULT_MAX_BYTES = 10 * 1024 * 1024


def log_path(state_dir: Path) -> Path:
    return state_dir / LOG_NAME


def emit(
    state_dir: Path,
    event: str,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    mode: int = 0o600,
    now_wall: float | None = None,
    **fields: Any,
) -> None:
    """Append one event.  Never raises for I/O trouble: the log must not break the lock."""
    record: dict[str, Any] = {"ts": round(time.time() if now_wall is None else now_wall, 6)}
    record["event"] = event
    record.update(fields)
    line = (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode()
    path = log_path(state_dir)
    try:
        # Never through a symlink, never stuck on a FIFO put in its place, and exactly ``mode``
        # (0660 in a group-shared folder) whatever the umask.
        fd = state.open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, mode)
    except (OSError, StateDirError):
        return
    try:
        os.write(fd, line)
        size = os.fstat(fd).st_size
    except OSError:
        return
    finally:
        os.close(fd)
    if size > max_bytes:
        _rotate(path, max_bytes, mode)


def _rotate(path: Path, max_bytes: int, mode: int) -> None:
    lock = path.with_name(".events.lock")
    try:
        lfd = state.open_regular(lock, os.O_RDWR | os.O_CREAT, mode)
    except (OSError, StateDirError):
        return
    try:
        fcntl.flock(lfd, fcntl.LOCK_EX)
        try:
            if os.stat(path).st_size > max_bytes:  # someone else may have rotated already
                os.replace(path, path.with_name(LOG_NAME + ".1"))
        except OSError:
            pass
    finally:
        os.close(lfd)  # closing drops the flock


def read(state_dir: Path, *, since_wall: float | None = None) -> Iterator[dict[str, Any]]:
    """Events in the log (the rotated generation first), oldest first; bad lines skipped."""
    for path in (state_dir / (LOG_NAME + ".1"), log_path(state_dir)):
        try:
            # Closed below, after the generator drains.
            f = os.fdopen(state.open_regular(path, os.O_RDONLY), "rb")
        except (OSError, StateDirError):
            continue
        with f:
            for raw in f:
                try:
                    rec = json.loads(raw)
                except (ValueError, RecursionError):
                    continue
                if not isinstance(rec, dict) or not isinstance(rec.get("event"), str):
                    continue
                ts = rec.get("ts")
                if not isinstance(ts, int | float):
                    continue
                if since_wall is not None and ts < since_wall:
                    continue
                yield rec
