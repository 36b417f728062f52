"""Cold-start prefetch: the time a job waits in line warms its model files into the page cache.

A job that will load a model usually waits in line first.  Once its ticket is among the first
``prefetch.ahead`` waiters, a background thread of the waiting process reads the files it named
(``gpulock run --prefetch PATH``, ``acquire(prefetch=[...])``, a router GPU candidate's GGUF)
once, sequentially, so that after the grant its load reads memory, not the disk.

* **Gentle.** The thread runs at idle I/O priority (``ioprio_set`` ``IOPRIO_CLASS_IDLE`` for its
  own task: on Linux a thread has its own I/O priority) and nice 19, hints ``POSIX_FADV_
  SEQUENTIAL`` and reads with ``readinto`` into one reused 8 MiB buffer (no ``WILLNEED``: see
  ``_warm``).  Idle priority is honoured by the ``bfq`` scheduler (and partly by ``mq-deadline``);
  on a disk with scheduler ``none`` (most NVMe) only ``prefetch.max_rate`` caps it.
* **Never into swap.** Before every chunk ``MemAvailable`` (``/proc/meminfo``) must exceed the
  file's size times ``prefetch.margin``; when it does not, the file is skipped (``low memory``)
  or its warming stops there.
* **Free when warm.** Chunks already resident (``mincore``) are not read; a fully resident file
  is skipped at once (``cached``).
* **Stops at once** when the ticket is granted or leaves the line (the thread checks an Event
  between chunks); a killed waiter takes the thread with it, and no process is ever started.

Progress is published in ``<queue>/<seq>.prefetch`` (``gpulock.lock.prefetch_progress``; written
atomically with the state folder's file mode, at most every ``PUBLISH_EVERY_BYTES`` or second)
for ``gpulock status``, and removed when the ticket leaves the line.  Each file ends in one
``prefetch`` event.

**Position without polling.**  A waiter looks at the queue only when the kernel wakes it, and a
grant rings only the next ticket.  So a waiter whose position improves to below ``ahead`` rings
its own successor once: the news travels ``ahead`` tickets down the line, no further.
"""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol

from gpulock.core.config import Config, show_value
from gpulock.core.errors import GpulockError, known_hint
from gpulock.core.pagecache import be_idle, chunk_residency, mem_available_bytes
from gpulock.core.statefile import atomic_write
from gpulock.core.units import parse_size
from gpulock.lock.prefetch_progress import FORMAT, progress_name
from gpulock.lock.ticket import Ticket, TicketFormatError, event_fields

if TYPE_CHECKING:
    from gpulock.core.settings import Settings
    from gpulock.lock.queuedir import QueueDir, TicketFile


class InLine(Protocol):
    """What warming reads of the ticket's place in one line (``gpulock.lock.lines.Line``)."""

    @property
    def qdir(self) -> QueueDir: ...

    @property
    def me(self) -> Ticket: ...

    @property
    def ahead_seqs(self) -> list[int] | None: ...


CHUNK_BYTES: Final = 8 << 20  # read and memory-check unit: stop latency is one chunk's read
PUBLISH_EVERY_BYTES: Final = 64 << 20
PUBLISH_EVERY_S: Final = 1.0

# `prefetch:` keys as they are written in the file, with their defaults.
DEFAULTS: Final[Mapping[str, Any]] = {
    "enabled": True,
    "ahead": 2,
    "margin": 1.5,
    "max_rate": None,
}


@dataclass(frozen=True, slots=True)
class Options:
    """The ``prefetch:`` section, validated."""

    enabled: bool = DEFAULTS["enabled"]
    ahead: int = DEFAULTS["ahead"]  # warm while among the first N waiters
    margin: float = DEFAULTS["margin"]  # MemAvailable must exceed file size x margin
    max_rate_bytes: int | None = None  # bytes per second; None: as fast as idle I/O goes


def options(config: Config) -> Options:
    """The ``prefetch:`` section of ``config``; a bad value is a ConfigError (file:line:key)."""
    raw = config.section("prefetch")
    if raw is None:
        return Options()
    if not isinstance(raw, dict):
        raise config.error(
            "prefetch", f"expected a mapping (ahead, margin...), got {show_value(raw)}"
        )
    for key in raw:
        if key not in DEFAULTS:
            raise config.error(
                f"prefetch.{key}",
                f"unknown key {key!r}",
                hint=known_hint(key, sorted(DEFAULTS)),
            )
    enabled = raw.get("enabled", DEFAULTS["enabled"])
    if not isinstance(enabled, bool):
        raise config.error("prefetch.enabled", f"expected true or false, got {show_value(enabled)}")
    ahead = raw.get("ahead", DEFAULTS["ahead"])
    if not isinstance(ahead, int) or isinstance(ahead, bool) or ahead < 1:
        raise config.error(
            "prefetch.ahead", f"expected a whole number >= 1, got {show_value(ahead)}"
        )
    margin = raw.get("margin", DEFAULTS["margin"])
    if not isinstance(margin, int | float) or isinstance(margin, bool) or not margin >= 1.0:
        raise config.error(
            "prefetch.margin",
            f"expected a number >= 1 (1.5: room for the file and half again), "
            f"got {show_value(margin)}",
        )
    rate = raw.get("max_rate", DEFAULTS["max_rate"])
    rate_bytes = None
    if rate is not None:
        bad = config.error(
            "prefetch.max_rate", f"expected a size per second like 200MiB, got {show_value(rate)}"
        )
        if not isinstance(rate, str | int | float) or isinstance(rate, bool):
            raise bad
        try:
            rate_bytes = parse_size(rate)
        except ValueError as exc:
            raise config.error("prefetch.max_rate", str(exc)) from None
        if rate_bytes <= 0:
            raise bad
    return Options(bool(enabled), int(ahead), float(margin), rate_bytes)


def check_paths(paths: Iterable[str | os.PathLike[str]]) -> tuple[str, ...]:
    """Absolute paths of readable regular files; GpulockError naming the first that is not.

    Checked before queueing, so a typo is an error at once, not a silent cold start later.
    """
    out: list[str] = []
    for p in paths:
        path = os.path.abspath(os.fspath(p))
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            raise GpulockError(
                f"cannot prefetch {path}: {e.strerror}", hint="--prefetch names a model file"
            ) from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise GpulockError(
                    f"cannot prefetch {path}: not a regular file",
                    hint="--prefetch names a model file",
                )
        finally:
            os.close(fd)
        if path not in out:
            out.append(path)
    return tuple(out)


# --- pure decisions ---------------------------------------------------------------------------


def memory_problem(mem_available: int | None, size: int, margin: float) -> str | None:
    """Why a file of ``size`` bytes may not be warmed now, or None when it may."""
    if mem_available is None:
        return "low memory: MemAvailable unknown"
    if mem_available < size * margin:
        return "low memory"
    return None


def should_forward(before: int | None, now: int, ahead: int) -> bool:
    """Whether a waiter that moved from position ``before`` to ``now`` rings its successor:
    the successor moved up too, and now stands within ``ahead`` (position 1 = next in line)."""
    return before is not None and now < before and now < ahead


# --- the waiter's hook ------------------------------------------------------------------------


@dataclass(slots=True)
class _File:
    path: str
    bytes_total: int = 0
    bytes_done: int = 0  # resident now: read by us or found cached
    bytes_read: int = 0  # read from the disk by us
    started_at: float = 0.0
    outcome: str | None = None  # done, skipped, stopped


class Prefetch:
    """A waiter's warming: ``on_rescan`` at each look at the queue, ``stop`` when it leaves.

    Owned by one ``Waiter``; the thread it starts is the only other party, and they meet
    under ``_lock`` (progress counters, the progress file, the one event per file).
    """

    def __init__(self, settings: Settings, paths: Sequence[str], opts: Options) -> None:
        self.settings = settings
        self.opts = opts
        self.files = [_File(p) for p in paths]
        self.position: int | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._current: _File | None = None
        self._qdir: QueueDir | None = None
        self._ticket: Ticket | None = None
        self._state = "waiting"
        self._reason: str | None = None
        self._published_at = 0.0
        self._published_bytes = 0

    def on_rescan(self, waiter: InLine, ahead: Sequence[TicketFile]) -> None:
        """After a look at the queue that did not grant: note the position, pass the news on,
        start warming once within ``ahead``.  Never raises for the queue's sake."""
        if self._stop.is_set():
            return
        try:
            pos = self._position(waiter, ahead)
            if should_forward(self.position, pos, self.opts.ahead):
                waiter.qdir.ring_successor(waiter.me.seq)
            self.position = pos
            if pos <= self.opts.ahead and self.files and self._thread is None:
                self._start(waiter.qdir, waiter.me)
        except OSError:
            pass  # warming is a nicety: the lock goes on without it

    def _position(self, waiter: InLine, ahead: Sequence[TicketFile]) -> int:
        """1 for the next in line; at most ``ahead + 1`` (farther back is all the same)."""
        if all(tf.ticket.holding for tf in ahead):
            return 1
        cap = self.opts.ahead
        if cap == 1:
            return 2
        n = 0
        for seq in waiter.ahead_seqs or ():
            try:
                tf = waiter.qdir.read(seq)
            except TicketFormatError:
                continue
            if tf is None or tf.ticket.holding or not waiter.qdir.alive(seq):
                continue
            n += 1
            if n >= cap:
                return cap + 1
        return n + 1

    def _start(self, qdir: QueueDir, me: Ticket) -> None:
        self._qdir, self._ticket = qdir, me
        self._thread = threading.Thread(target=self._run, name="gpulock-prefetch", daemon=True)
        self._thread.start()

    def stop(self, *, granted: bool) -> None:
        """The ticket was granted or left the line: stop now, account, remove the file."""
        self._stop.set()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            cur = self._current
            if cur is not None and cur.outcome is None:
                cur.outcome = "stopped"
                self._emit(cur, "granted" if granted else "left the line")
            if self._qdir is not None and self._ticket is not None:
                try:
                    os.unlink(self._qdir.path / progress_name(self._ticket.seq))
                except OSError:
                    pass

    # --- the thread ---

    def _run(self) -> None:
        be_idle()
        buf = bytearray(CHUNK_BYTES)
        for f in self.files:
            if self._stop.is_set():
                return
            with self._lock:
                if self._closed:
                    return
                self._current = f
                f.started_at = time.monotonic()
                self._state = "warming"
            try:
                outcome, reason = self._warm(f, buf)
            except OSError as e:
                outcome, reason = "skipped", f"error: {e.strerror or e}"
            with self._lock:
                if self._closed:
                    return
                f.outcome = outcome
                self._emit(f, reason)
                self._current = None
                self._reason = reason if outcome == "skipped" else self._reason
                self._publish(force=True)
        with self._lock:
            if not self._closed:
                warmed = [f for f in self.files if f.outcome == "done"]
                self._state = "done" if warmed else "skipped"
                self._publish(force=True)

    def _warm(self, f: _File, buf: bytearray) -> tuple[str, str | None]:
        """Read one file into the cache; (outcome, reason)."""
        fd = os.open(f.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            size = os.fstat(fd).st_size
            f.bytes_total = size
            cached = chunk_residency(fd, size, CHUNK_BYTES)
            if cached is not None and sum(cached) >= size:
                f.bytes_done = size
                return "skipped", "cached"
            problem = memory_problem(mem_available_bytes(), size, self.opts.margin)
            if problem is not None:
                return "skipped", problem
            with self._lock:
                self._publish(force=True)
            # SEQUENTIAL doubles the kernel's readahead window for these reads.  No WILLNEED:
            # it makes the kernel read with small pages (force_page_cache_ra) where plain reads
            # get large folios (measured on Linux 6.18: 0.33 vs 1.26 GB of FileHugePages for a
            # 1 GB file), and llama.cpp's mmap then faults the model in 4 KiB at a time, which
            # cost more after the grant than the warming saved.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            view = memoryview(buf)
            began = time.monotonic()
            for i, offset in enumerate(range(0, size, CHUNK_BYTES)):
                if self._stop.is_set():
                    return "stopped", None  # stop() has accounted for it
                n = min(CHUNK_BYTES, size - offset)
                had = cached[i] if cached is not None else 0
                if had < n:  # a chunk resident already costs nothing
                    if offset and memory_problem(mem_available_bytes(), size, self.opts.margin):
                        return "stopped", "low memory"
                    if self._read_chunk(fd, view[:n], offset) < n:
                        break  # the file shrank under us
                with self._lock:
                    f.bytes_done = offset + n
                    f.bytes_read += n - had
                    self._publish()
                self._pace(f.bytes_read, began)
            return "done", None
        finally:
            os.close(fd)

    @staticmethod
    def _read_chunk(fd: int, view: memoryview, offset: int) -> int:
        got = 0
        while got < len(view):
            k = os.preadv(fd, [view[got:]], offset + got)
            if k == 0:
                break
            got += k
        return got

    def _pace(self, read: int, began: float) -> None:
        """Sleep off reads ahead of ``max_rate``: on the stop Event, so a grant ends it."""
        rate = self.opts.max_rate_bytes
        if rate is None:
            return
        ahead_s = read / rate - (time.monotonic() - began)
        if ahead_s > 0:
            self._stop.wait(ahead_s)

    # --- accounting (under _lock) ---

    def _emit(self, f: _File, reason: str | None) -> None:
        assert self._ticket is not None
        self.settings.emit(
            "prefetch",
            **event_fields(self._ticket),
            path=f.path,
            outcome=f.outcome,
            reason=reason,
            size_bytes=f.bytes_total,
            read_bytes=f.bytes_read,
            resident_bytes=f.bytes_done,
            elapsed_s=round(time.monotonic() - f.started_at, 6) if f.started_at else 0.0,
            position=self.position,
        )

    def _publish(self, *, force: bool = False) -> None:
        if self._closed or self._qdir is None or self._ticket is None:
            return
        done = sum(f.bytes_done for f in self.files)
        now = time.monotonic()
        if not force and (
            done - self._published_bytes < PUBLISH_EVERY_BYTES
            and now - self._published_at < PUBLISH_EVERY_S
        ):
            return
        self._published_at, self._published_bytes = now, done
        body = {
            "format": FORMAT,
            "ticket": self._ticket.seq,
            "pid": self._ticket.pid,
            "state": self._state,
            "reason": self._reason,
            "updated_wall": time.time(),
            "files": [
                {
                    "path": f.path,
                    "bytes_total": f.bytes_total,
                    "bytes_done": f.bytes_done,
                    "bytes_read": f.bytes_read,
                    "outcome": f.outcome,
                }
                for f in self.files
            ],
        }
        try:
            atomic_write(
                self._qdir.path / progress_name(self._ticket.seq),
                json.dumps(body, separators=(",", ":")).encode(),
                mode=self.settings.file_mode,
            )
        except OSError:
            pass  # status shows less; the warming goes on


def for_waiter(settings: Settings, paths: Sequence[str]) -> Prefetch | None:
    """The hook a waiter gets: None when prefetch is off, or when it has nothing to warm and
    nobody behind it could need the news of its position (``ahead`` 1)."""
    opts = options(settings.config)
    if not opts.enabled:
        return None
    if not paths and opts.ahead <= 1:
        return None
    return Prefetch(settings, paths, opts)
