"""An agent's batch split between the worker processes of a ``gpulock pool``.

``@agent(..., workers="auto", need="8.9GiB")``: the run started by cron becomes the pool's
leader (``gpulock.agents.runtime``), and each worker runs the agent's function with ``ctx.batch()``
going through ``pooled()`` here, so that each item is done once between them:

* **claimed before it is started**: ``<agent>/claims/<sha1 of key>``, a file a worker opens and
  ``flock``s for as long as it works on the item.  The kernel drops the lock when the worker
  dies, however it dies (SIGKILL, OOM kill), so a claim never outlives its worker;
* **journaled when done**: the key is appended to the checkpoint journal (one ``write`` on an
  ``O_APPEND`` descriptor, as ``gpulock.agents.checkpoint`` does), then the claim file is marked
  done (its first bytes) before its lock is dropped.

A worker takes the items in order, skipping those done (the checkpoint and its journal as it
starts, a claim marked done after) and those another worker holds; then it goes back to the
ones it skipped as held and waits for each claim: a finished item is marked done, and one whose
worker died is free and not done, so it is done again here.  So no worker exits (which tells
the pool the batch is over) while an item is unfinished.  Only a worker killed in the
microseconds between the journal's write and the mark leaves an item done and unmarked: that
one is done twice.

The leader writes the checkpoint's snapshot before the workers start (the journal counts only
on top of one) and, once the pool ended well, removes the checkpoint and the claims; a pool
that failed or was stopped leaves them, and the next run resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Final, TypeVar

from gpulock.agents import checkpoint
from gpulock.core.errors import StateDirError
from gpulock.core.state import ensure_subdir
from gpulock.core.statefile import open_locked, open_regular

T = TypeVar("T")

CLAIMS_DIR: Final = "claims"
DONE_MARK: Final = b"done\n"


def claims_dir(checkpoint_path: Path) -> Path:
    return checkpoint_path.with_name(CLAIMS_DIR)


def prepare(checkpoint_path: Path, agent: str, *, mode: int) -> None:
    """The leader, before the workers start: a snapshot for the journal to count on."""
    if checkpoint.load(checkpoint_path) is None:
        checkpoint.save(checkpoint_path, agent, [], 0, mode=mode)


def finish(checkpoint_path: Path) -> None:
    """The leader, once every worker is done: the batch is over, nothing to resume."""
    checkpoint.remove(checkpoint_path)
    shutil.rmtree(claims_dir(checkpoint_path), ignore_errors=True)


def pooled(
    items: Sequence[T],
    keys: Sequence[str],
    done: set[str],
    *,
    path: Path,
    mode: int,
    group: str | None,
    finished: Callable[[int], None],
) -> Iterator[T]:
    """Yield the items no other worker has done or is doing (see the module docstring)."""
    folder = claims_dir(path)
    ensure_subdir(folder.parent, folder.name, group=group)  # the state folder's mode and group
    journal = checkpoint.journal_path(path)
    jfd = open_regular(journal, os.O_WRONLY | os.O_CREAT | os.O_APPEND, mode)
    count = 0
    try:
        pending = [(item, key) for item, key in zip(items, keys, strict=True) if key not in done]
        for wait in (False, True):  # first the free items, then those others held
            held: list[tuple[T, str]] = []
            for item, key in pending:
                fd = open_locked(folder / _claim_name(key), mode, wait=wait)
                if fd is None:
                    held.append((item, key))
                    continue
                try:
                    if os.fstat(fd).st_size > 0:
                        continue  # done by another worker since we started
                    yield item
                    _append(jfd, journal, key)
                    os.pwrite(fd, DONE_MARK, 0)
                finally:
                    os.close(fd)  # drops the claim: done, or free for another worker
                count += 1
                finished(count)
            pending = held
    finally:
        os.close(jfd)


def _claim_name(key: str) -> str:
    return hashlib.sha1(key.encode(), usedforsecurity=False).hexdigest()


def _append(fd: int, journal: Path, key: str) -> None:
    try:
        os.write(fd, (json.dumps(key) + "\n").encode())
    except OSError as e:
        raise StateDirError(
            str(journal), f"cannot save the batch's progress: {e.strerror or e}"
        ) from None
