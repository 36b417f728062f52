"""A waiting ticket's warming progress on disk: ``<queue>/<seq>.prefetch``, for ``gpulock status``.

Written by the waiter's warming thread (``gpulock.lock.prefetch``), atomically, with the state
folder's file mode; removed with the ticket.  Format ``gpulock.prefetch/1``::

    {"format": "gpulock.prefetch/1", "ticket": 12, "pid": 4711, "state": "warming",
     "reason": null, "updated_wall": 1795214087.1,
     "files": [{"path": "/models/m.gguf", "bytes_total": 1031798784, "bytes_done": 402653184,
                "bytes_read": 402653184, "outcome": null}]}

Read like every state file: a reader never follows a symlink, never blocks on a FIFO, reads at
most ``PROGRESS_LIMIT`` bytes and skips anything malformed.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Final

from gpulock.core.errors import GpulockError
from gpulock.core.statefile import read_small
from gpulock.lock.ticket import SEQ_DIGITS

if TYPE_CHECKING:
    from gpulock.lock.queuedir import QueueDir, TicketFile

FORMAT: Final = "gpulock.prefetch/1"
SUFFIX: Final = ".prefetch"
PROGRESS_LIMIT: Final = 64 << 10  # a progress file larger than this is garbage
MAX_SHOWN_PATHS: Final = 64


def progress_name(seq: int) -> str:
    return f"{seq:0{SEQ_DIGITS}d}{SUFFIX}"


def read_progress(qdir: QueueDir, tf: TicketFile) -> dict[str, Any] | None:
    """A waiter's published progress for ``gpulock status``, None when none or garbage.

    Read like every state file: never through a symlink, never blocking on a FIFO, bounded in
    size, and only believed when it names this very ticket and its owner.
    """
    try:
        data = read_small(qdir.path / progress_name(tf.ticket.seq), PROGRESS_LIMIT)
        raw = json.loads(data) if data else None
    except (OSError, ValueError, RecursionError, GpulockError):
        return None
    t = tf.ticket
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        return None
    if raw.get("ticket") != t.seq or raw.get("pid") != t.pid:
        return None
    files = raw.get("files")
    if not isinstance(files, list):
        return None
    paths: list[str] = []
    done = total = read = 0
    try:
        for f in files[:MAX_SHOWN_PATHS]:
            if not isinstance(f, dict) or not isinstance(f.get("path"), str):
                return None
            paths.append(f["path"])
            done += _count(f.get("bytes_done"))
            total += _count(f.get("bytes_total"))
            read += _count(f.get("bytes_read"))
    except (TypeError, ValueError):
        return None
    state = raw.get("state")
    reason = raw.get("reason")
    return {
        "state": state if state in ("waiting", "warming", "done", "skipped") else "unknown",
        "reason": reason if isinstance(reason, str) else None,
        "paths": paths,
        "bytes_done": min(done, total),
        "bytes_total": total,
        "bytes_read": read,
        "updated_wall": raw.get("updated_wall") if _is_num(raw.get("updated_wall")) else None,
    }


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _count(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError("not a byte count")
    return v
