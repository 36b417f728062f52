"""A batch's progress on disk, so that a run killed at item 300 of 600 resumes at 300.

``<state>/agents/<name>/checkpoint.json``, written atomically after every item::

    {"format": "gpulock.checkpoint/1", "agent": "digest", "total": 600,
     "done": ["a.txt", "b.txt", ...], "updated_wall": 1763683200.5}

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

from gpulock.errors import StateDirError
from gpulock.state import atomic_write, read_small

__all__ = [
    "CHECKPOINT_NAME",
    "FORMAT",
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


def load(path: Path) -> Checkpoint | None:
    """The checkpoint at ``path``; None when there is none.  CheckpointError for garbage."""
    try:
        data = read_small(path, MAX_BYTES)
    except (StateDirError, OSError) as e:
        raise CheckpointError(str(e)) from None
    return None if data is None else decode(data)


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
    try:
        os.unlink(path)
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
    """Yield the items whose key is not in ``skip``, saving the checkpoint after each one.

    An item is done when the loop asks for the next one: then the checkpoint is written and
    ``finished(n)`` is called with the number done in this run (progress, flush).  When the
    loop ends normally the checkpoint is removed and ``ended()`` called; a loop left by an
    exception or a signal leaves the checkpoint for the next run.
    """
    done = [k for k in keys if k in skip]
    seen = set(done)
    count = 0
    for item, key in zip(items, keys, strict=True):
        if key in skip:
            continue
        yield item
        if key not in seen:
            seen.add(key)
            done.append(key)
        save(path, agent, done, len(items), mode=mode)
        count += 1
        finished(count)
    remove(path)
    ended()
