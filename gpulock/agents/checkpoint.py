"""A batch's progress on disk, so that a run killed at item 300 of 600 resumes at 300.

Two files in ``<state>/agents/<name>/``: the snapshot ``checkpoint.json``, written atomically
once when a batch starts (with the keys an earlier run finished)::

    {"format": "gpulock.checkpoint/1", "agent": "digest", "total": 600,
     "done": ["a.txt", "b.txt", ...], "updated_wall": 1763683200.5}

and the journal ``checkpoint.journal``, to which each finished item appends one line, its key
as a JSON string (``"c.txt"``), with one ``write()``.  Rewriting the snapshot after every item
made a batch quadratic (20,000 items: 38 s and gigabytes written); an append is O(1), and once
``write()`` returns the line survives the process being SIGKILLed.  The next run reads both,
compacts them into a new snapshot and starts an empty journal; a loop that ends normally removes
both.  A torn last line (a kill in the middle of a write, a full disk) is skipped: that item is
simply done again.

``done`` holds the keys of the items finished so far (``key(item)``, default ``str(item)``).
Readers ignore unknown keys.  A file that cannot be read as such a record is garbage: the
runtime logs it and starts the batch over, it never crashes on it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TypeVar

from gpulock.core.errors import StateDirError
from gpulock.core.statefile import atomic_write, open_regular, read_small

__all__ = [
    "CHECKPOINT_NAME",
    "FORMAT",
    "JOURNAL_NAME",
    "Checkpoint",
    "CheckpointError",
    "checkpointed",
    "decode",
    "encode",
    "resumed",
]

T = TypeVar("T")

FORMAT: Final = "gpulock.checkpoint/1"
CHECKPOINT_NAME: Final = "checkpoint.json"
JOURNAL_NAME: Final = "checkpoint.journal"
# A checkpoint holds every key done; a million short keys is tens of MiB.  Past this it is
# refused as garbage rather than read into memory.
MAX_BYTES: Final = 256 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint file that is not a readable ``gpulock.checkpoint/1`` record."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    done: tuple[str, ...]
    total: int
    updated_wall: float | None = None


def encode(agent: str, done: Iterable[str], total: int, now_wall: float | None = None) -> bytes:
    record = {
        "format": FORMAT,
        "agent": agent,
        "total": total,
        "done": list(done),
        "updated_wall": round(time.time() if now_wall is None else now_wall, 6),
    }
    return json.dumps(record, separators=(",", ":")).encode()


def decode(data: bytes) -> Checkpoint:
    """Parse a checkpoint; CheckpointError says what is wrong with it."""
    try:
        record = json.loads(data)
    except (ValueError, RecursionError):  # RecursionError: thousands of nested brackets
        raise CheckpointError("not JSON") from None
    if not isinstance(record, dict):
        raise CheckpointError("not a JSON object")
    if record.get("format") != FORMAT:
        raise CheckpointError(f"format is {record.get('format')!r}, expected {FORMAT!r}")
    done = record.get("done")
    if not isinstance(done, list) or not all(isinstance(k, str) for k in done):
        raise CheckpointError("'done' is not a list of keys")
    total = record.get("total")
    if isinstance(total, bool) or not isinstance(total, int) or total < 0:
        raise CheckpointError("'total' is not a count")
    updated = record.get("updated_wall")
    updated_wall = float(updated) if isinstance(updated, int | float) else None
    return Checkpoint(tuple(done), total, updated_wall)


def journal_path(path: Path) -> Path:
    return path.with_name(JOURNAL_NAME)


def load(path: Path) -> Checkpoint | None:
    """The checkpoint at ``path`` with its journal; None when there is none.  CheckpointError
    for garbage (a journal's torn or foreign lines are skipped, not garbage)."""
    try:
        data = read_small(path, MAX_BYTES)
        journal = read_small(journal_path(path), MAX_BYTES)
    except (StateDirError, OSError) as e:
        raise CheckpointError(str(e)) from None
    if data is None:
        return None  # the journal counts only on top of the snapshot a run starts with
    base = decode(data)
    if not journal:
        return base
    seen = set(base.done)
    done = list(base.done)
    for key in _journal_keys(journal):
        if key not in seen:
            seen.add(key)
            done.append(key)
    return Checkpoint(tuple(done), base.total, base.updated_wall)


def _journal_keys(data: bytes) -> Iterator[str]:
    lines = data.split(b"\n")[:-1]  # the last piece has no newline: empty, or torn by a kill
    try:  # the usual journal, parsed as one array: a JSON call per line costs 10x more
        keys = json.loads(b"[" + b",".join(lines) + b"]")
    except (ValueError, RecursionError):
        keys = None
    if isinstance(keys, list) and all(isinstance(k, str) for k in keys):
        yield from keys
        return
    for line in lines:  # something odd in it: line by line, skipping what is not a key
        try:
            key = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(key, str):
            yield key


def save(path: Path, agent: str, done: Sequence[str], total: int, *, mode: int = 0o600) -> None:
    """Write the checkpoint at once; StateDirError (with a hint) when it cannot be written."""
    try:
        atomic_write(path, encode(agent, done, total), mode=mode)
    except OSError as e:
        raise StateDirError(
            str(path),
            f"cannot save the batch's checkpoint: {e.strerror or e}",
            hint=f"free some space, or move {path} away if it is not a file",
        ) from None


def remove(path: Path) -> None:
    for p in (journal_path(path), path):  # the journal first: it means nothing without the base
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def resumed(path: Path, keys: Iterable[str]) -> set[str]:
    """The keys among ``keys`` that the checkpoint at ``path`` has done (CheckpointError).

    Keys of items no longer in the batch are simply not counted.
    """
    found = load(path)
    return set() if found is None else set(found.done).intersection(keys)


def checkpointed(
    items: Sequence[T],
    keys: Sequence[str],
    skip: set[str],
    *,
    path: Path,
    agent: str,
    mode: int,
    finished: Callable[[int], None],
    ended: Callable[[], None],
) -> Iterator[T]:
    """Yield the items whose key is not in ``skip``, journalling each one as it is done.

    Before the first item the snapshot is written with the keys in ``skip`` and the journal
    emptied (a compaction of what an earlier run left).  An item is done when the loop asks for
    the next one: then its key is appended to the journal and ``finished(n)`` is called with
    the number done in this run (progress, flush).  When the loop ends normally both files are
    removed and ``ended()`` called; a loop left by an exception or a signal leaves them for the
    next run.
    """
    save(path, agent, [k for k in keys if k in skip], len(items), mode=mode)
    fd = _open_journal(path, mode)
    try:
        count = 0
        for item, key in zip(items, keys, strict=True):
            if key in skip:
                continue
            yield item
            _append(fd, journal_path(path), key)
            count += 1
            finished(count)
    finally:
        os.close(fd)
    remove(path)
    ended()


def _open_journal(path: Path, mode: int) -> int:
    journal = journal_path(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    try:
        return open_regular(journal, flags, mode)
    except (OSError, StateDirError) as e:
        why = e.reason if isinstance(e, StateDirError) else (e.strerror or str(e))
        raise StateDirError(
            str(journal),
            f"cannot keep the batch's progress: {why}",
            hint=f"move {journal} away if it is not a file",
        ) from None


def _append(fd: int, journal: Path, key: str) -> None:
    line = (json.dumps(key) + "\n").encode()
    try:
        os.write(fd, line)  # one write on O_APPEND: a line is whole or torn, never interleaved
    except OSError as e:
        raise StateDirError(
            str(journal),
            f"cannot save the batch's progress: {e.strerror or e}",
            hint="free some space",
        ) from None
