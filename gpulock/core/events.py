"""The append-only JSONL event log in the state folder, rotated by size.

Each line is one JSON object: ``{"ts": <epoch s>, "event": "<kind>", ...fields}``.  Kinds the
lock writes: ``wait``, ``acquire``, ``release``, ``timeout``, ``leave``, ``stale``, ``cleanup``,
``break``, ``kill``, ``exit-wait``, ``exit-wait-alive``, ``exit-wait-timeout``; the other parts
add their own (``evict``, ``escalate``...): ``KINDS`` lists them all.  A line is written with
one ``write()`` on an ``O_APPEND`` descriptor, so lines from many processes never interleave.
When the file passes ``max_bytes`` it is renamed to ``events.jsonl.1`` (one generation kept)
under a short ``flock``, so two processes never rotate at once.  Readers skip lines they
cannot parse.

Never put secrets in an event: API keys are read from the environment by the code that needs
them and are not passed here.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from gpulock.core import logfile, safejson, statefile
from gpulock.core.errors import StateDirError

# Every kind of event gpulock writes, and the part that writes it: ``gpulock history --event``
# refuses a name outside these (and the log's own), listing them.  tests/test_errors_events.py
# reads every emit in the source and fails on a kind missing here.
KINDS: Mapping[str, str] = MappingProxyType(
    {
        # the line (gpulock.lock)
        "wait": "a ticket has to wait: ahead, reason",
        "acquire": "a ticket is granted: waited_s",
        "release": "a holder gives the GPU back: held_s",
        "timeout": "a waiter gave up at its --timeout: waited_s, the holder",
        "leave": "a waiter left the line before its grant (Ctrl-C, a signal): waited_s, signal",
        "stale": "a holder past its lease, reported",
        "cleanup": "a dead owner's ticket or record removed",
        "break": "gpulock break removed a ticket or ended a holder",
        "kill": "a hung holder or a forced eviction signalled",
        "exit-wait": "a dead holder's processes are still exiting: the next one waits",
        "exit-wait-alive": "the process it would wait for runs on, not exiting: no wait",
        "exit-wait-timeout": "they did not exit within exit_wait: the next one goes on",
        "prefetch": "a waiter's files read into the page cache",
        # residents and tenants (gpulock.residents)
        "resident": "a model registered as resident in VRAM",
        "unload": "a resident model unloaded",
        "flush": "a resident's use counts written",
        "evict": "a resident asked to leave, and whether its memory came back",
        "prewarm": "a model read into the page cache or loaded ahead of its predicted use",
        "oom": "a load ran out of GPU memory",
        # the governor (gpulock.governor)
        "escalate": "the governor climbed a level",
        "deescalate": "the governor came down a level",
        "governor": "an action the governor took, with its evidence",
        "governor-error": "a governor pass failed (it goes on)",
        # the router, serve and the cluster
        "route": "a task routed to a model: why",
        "call": "a model call spent: tokens, cost",
        "fallback": "a model failed and the next candidate was tried",
        "model-load": "a llama.cpp model loaded: load_s",
        "unload-verify": "a llama.cpp model's memory checked after its unload",
        "gateway-request": "an HTTP request to gpulock serve: task, tier, model, outcome",
        "cluster-error": "the cluster's Redis could not be reached",
        "cluster-degraded": "this host works alone on its share",
        "cluster-restored": "the cluster's Redis is back",
        # agents, fleets and pools
        "agent": "an agent's run ended: outcome",
        "fleet-start": "a fleet started",
        "fleet-stop": "a fleet stopped",
        "fleet-run": "a fleet ran an agent: exit, duration_s",
        "fleet-missed": "a fleet skipped an agent's run (still running, or late)",
        "pool-start": "gpulock pool started",
        "pool-worker": "a pool worker started or exited",
        "pool-end": "gpulock pool ended",
    }
)

LOG_NAME = "events.jsonl"
LOCK_NAME = ".events.lock"  # taken only to rotate
DEFAULT_MAX_BYTES = 10 * 1024 * 1024
TS_MAX = 1e10  # year 2286: a later (or negative) time is garbage, not an event


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
    if _batches:
        b = _batches.get(str(state_dir))
        if b is not None:
            b.add(line)
            return
    try:
        # Never through a symlink, never stuck on a FIFO put in its place, and exactly ``mode``
        # (0660 in a group-shared folder) whatever the umask: see gpulock.core.logfile.
        logfile.append(
            log_path(state_dir), line, mode=mode, max_bytes=max_bytes, lock_name=LOCK_NAME
        )
    except (OSError, StateDirError):
        return


class Batch:
    """This process's events for one state folder, gathered and appended in one ``write()``.

    A server answering hundreds of requests a second writes two events a request; one write
    (an open, a write, a close) per event was a large part of its CPU.  While a Batch is
    installed (``batch()``), ``emit`` for its folder only adds the line here; ``flush()``
    appends every line gathered, in order, with one write on the ``O_APPEND`` descriptor (so
    they never interleave with other processes' lines).  ``on_add`` is called with the batch
    when a line arrives in an empty one: the owner schedules the flush (``gpulock serve``
    flushes when no request is in flight, else a few milliseconds later, and when it stops).
    """

    def __init__(
        self,
        state_dir: Path,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        mode: int = 0o600,
        on_add: Callable[[Batch], None] | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.max_bytes = max_bytes
        self.mode = mode
        self.on_add = on_add
        self._lines: list[bytes] = []
        self._lock = threading.Lock()

    def add(self, line: bytes) -> None:
        with self._lock:
            first = not self._lines
            self._lines.append(line)
        if first and self.on_add is not None:
            self.on_add(self)

    def __len__(self) -> int:
        return len(self._lines)

    def flush(self) -> None:
        """Append what was gathered (never raises for I/O trouble, as ``emit``)."""
        with self._lock:
            lines, self._lines = self._lines, []
            if not lines:
                return
            try:
                logfile.append(
                    log_path(self.state_dir),
                    b"".join(lines),
                    mode=self.mode,
                    max_bytes=self.max_bytes,
                    lock_name=LOCK_NAME,
                )
            except (OSError, StateDirError):
                return


_batches: dict[str, Batch] = {}


def batch(b: Batch) -> Batch:
    """Gather this process's events for ``b.state_dir`` in ``b`` until ``unbatch``."""
    _batches[str(b.state_dir)] = b
    return b


def unbatch(b: Batch) -> None:
    """Write what ``b`` gathered, and emit at once again."""
    if _batches.get(str(b.state_dir)) is b:
        del _batches[str(b.state_dir)]
    b.flush()


def read(state_dir: Path, *, since_wall: float | None = None) -> Iterator[dict[str, Any]]:
    """Events in the log (the rotated generation first), oldest first; bad lines skipped."""
    for path in (state_dir / (LOG_NAME + ".1"), log_path(state_dir)):
        try:
            # Closed below, after the generator drains.
            f = os.fdopen(statefile.open_regular(path, os.O_RDONLY), "rb")
        except (OSError, StateDirError):
            continue
        with f:
            for raw in f:
                try:
                    rec = safejson.loads(raw)
                except ValueError:  # not JSON, nested past the bound, NaN or 1e999
                    continue
                if not isinstance(rec, dict) or not isinstance(rec.get("event"), str):
                    continue
                ts = rec.get("ts")
                # A time no clock gives (1e308 would overflow every date conversion) is garbage.
                if not isinstance(ts, int | float) or isinstance(ts, bool) or not 0 <= ts <= TS_MAX:
                    continue
                if since_wall is not None and ts < since_wall:
                    continue
                yield rec
