"""Taking and releasing a GPU: ZooKeeper's lock recipe on local files and FIFOs.

Each GPU has a queue folder, ``<state>/gpu<N>/``.  A process that wants the GPU takes a ticket:

* **Sequence** -- under a short ``flock`` on ``<state>/.seq`` it takes the next number and makes
  its ticket visible (``<seq>.ticket``, JSON, written atomically).  The number is the queue
  order, fixed at arrival: FIFO is a property of the data, not of the kernel scheduler's luck.
* **Ephemeral** -- before the ticket becomes visible, the owner creates ``<seq>.fifo`` and opens
  it read-write.  That open read end is the owner's claim, held by the kernel: when the owner
  exits, however it exits (SIGKILL included), the kernel closes it.  "Is the owner alive?" is
  then ``open(fifo, O_WRONLY | O_NONBLOCK)``: ``ENXIO`` is the kernel's proof that no process
  holds the read end any more.  No pid is trusted for this, so a reused pid cannot keep a dead
  ticket alive.  (The FIFO plays the part of the ``flock`` in DESIGN.md: an ``flock`` proves
  death just as well, but a waiter cannot block on one with a timeout from any thread, whereas
  a FIFO can be ``poll``-ed with a timeout, together with others, and is woken by the kernel.)
* **Watch** -- a waiter opens the write end of the FIFO it depends on (see ``gpulock.queue``):
  the kernel reports ``POLLERR`` on it the moment the last read end closes, i.e. when that
  owner releases, leaves or dies.  One release wakes only the waiter that watches it.
* **Doorbell** -- when a waiter is granted it writes a byte into its successor's FIFO, which
  the successor (polling its own read end) takes as "re-check": that is how a queue of VRAM
  sharers advances without anyone polling.
* **Leave** -- on release, timeout or Ctrl-C the owner removes its ticket and FIFO, then closes
  its read end, which wakes its watcher.

A waiter wakes on the kernel's word, on its own timeout, at the lease expiry of a holder it
watches (to handle a hung holder), and, as a guard against the unforeseen, re-checks that the
tickets it watches still exist every ``SAFETY_RECHECK_S`` seconds: nothing polls faster.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import math
import os
import select
import signal
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

from gpulock import claim, devices, identity, level, queue
from gpulock.config import Config
from gpulock.errors import LockError, LockTimeout, NeedTooLarge
from gpulock.settings import Settings, load
from gpulock.state import atomic_write
from gpulock.ticket import Ticket, TicketFormatError, encode, fifo_name, file_name, parse, seq_of
from gpulock.units import parse_duration, parse_size

SAFETY_RECHECK_S = 2.0  # first guard re-check; doubles while nothing happens...
SAFETY_RECHECK_MAX_S = 30.0  # ...up to this, so hundreds of idle waiters cost ~nothing
RING_PROBES = 64  # successors probed by number before the folder is listed
ENV_TICKET = "GPULOCK_TICKET"  # set by `gpulock run` for its command: "<gpu>:<seq>"
GOVERNOR_WATCH = 0  # the key of the governor's claim among watched FIFOs (tickets start at 1)

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class TicketFile:
    """A ticket as read from disk, with the file's mtime (the holder's last heartbeat)."""

    ticket: Ticket
    mtime_wall: float


class QueueDir:
    """The files of one GPU's queue.  The only code that creates, reads or removes them."""

    def __init__(self, settings: Settings, gpu: int, *, create: bool = True) -> None:
        self.settings = settings
        self.gpu = gpu
        self.path = settings.gpu_dir(gpu, create=create)

    def ticket_path(self, seq: int) -> Path:
        return self.path / file_name(seq)

    def fifo_path(self, seq: int) -> Path:
        return self.path / fifo_name(seq)

    def seqs(self) -> list[int]:
        """Sequence numbers present, in queue order (files that are not tickets are ignored)."""
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return []
        return sorted(s for s in map(seq_of, names) if s is not None)

    def read(self, seq: int) -> TicketFile | None:
        """The ticket, None if it vanished; TicketFormatError for anything not a ticket."""
        try:
            fd = os.open(self.ticket_path(seq), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise TicketFormatError("a symlink, not a ticket") from None
            raise TicketFormatError(f"unreadable ({e.strerror})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise TicketFormatError("not a regular file")
            data = os.read(fd, 1 << 16)
        finally:
            os.close(fd)
        t = parse(data)
        if t.seq != seq or t.gpu != self.gpu:
            raise TicketFormatError(f"says ticket {t.seq} on gpu{t.gpu}")
        return TicketFile(t, st.st_mtime)

    def watch(self, seq: int) -> int | None:
        """A write end of the ticket's FIFO (POLLERR once its owner is gone), or None if gone."""
        try:
            return claim.watch(self.fifo_path(seq))
        except claim.NotAClaim as e:
            raise TicketFormatError(str(e)) from None

    def alive(self, seq: int) -> bool:
        return claim.held(self.fifo_path(seq))

    def ring(self, seq: int) -> bool:
        """Wake the owner of ``seq`` (it re-checks the queue); False if it is gone."""
        return claim.ring(self.fifo_path(seq))

    def ring_successor(self, seq: int) -> bool:
        """Ring the nearest live ticket after ``seq``; False if there is none.

        Usually that is ``seq + 1``: the numbers are probed one by one (up to the last one
        issued, read from ``.seq`` without its lock: a ticket published after this read
        scans the queue itself, after my grant was written), and the folder is listed only
        past RING_PROBES numbers without a live ticket (many left, or other GPUs' numbers).
        """
        try:
            fd = os.open(self.settings.state_dir / ".seq", os.O_RDONLY | os.O_NOFOLLOW)
            try:
                raw = os.pread(fd, 32, 0).strip()
            finally:
                os.close(fd)
            last = int(raw) if raw.isdigit() else None
        except OSError:
            last = None
        probe_to = seq + RING_PROBES if last is None else min(last, seq + RING_PROBES)
        for s in range(seq + 1, probe_to + 1):
            if self.ring(s):
                return True
        if last is not None and last <= probe_to:
            return False
        return any(self.ring(s) for s in self.seqs() if s > probe_to)

    def remove(self, seq: int) -> bool:
        """Remove a ticket's files; True if this call removed the ticket."""
        try:
            os.unlink(self.ticket_path(seq))
            removed = True
        except FileNotFoundError:
            removed = False
        try:
            os.unlink(self.fifo_path(seq))
        except FileNotFoundError:
            pass
        return removed

    def holders(self) -> list[Ticket]:
        """The live tickets that hold this GPU, in queue order."""
        return [
            tf.ticket
            for seq, tf, _why in self.scan()
            if tf is not None and tf.ticket.holding and self.alive(seq)
        ]

    def ring_head(self) -> int | None:
        """Ring the first live waiter (it looks at the queue again); its number, or None."""
        for seq, tf, _why in self.scan():
            if tf is not None and not tf.ticket.holding and self.ring(seq):
                return seq
        return None

    def scan(self) -> Iterator[tuple[int, TicketFile | None, str | None]]:
        """Every ticket file: (seq, ticket or None, why it is unreadable or None)."""
        for seq in self.seqs():
            try:
                tf = self.read(seq)
            except TicketFormatError as e:
                yield seq, None, str(e)
                continue
            if tf is not None:
                yield seq, tf, None

    # --- taking a ticket ---------------------------------------------------------------

    def enqueue(self, make: Callable[[int], Ticket], deadline: float | None) -> tuple[Ticket, int]:
        """Take the next number, create the FIFO (read end held), then publish the ticket."""
        mode = self.settings.file_mode
        mpath = self.settings.state_dir / ".seq"
        mfd = os.open(mpath, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, mode)
        try:
            _flock_until(mfd, deadline, self.gpu)
            raw = os.pread(mfd, 32, 0).strip()
            counter = int(raw) if raw.isdigit() else 0
            present = self.seqs()
            # Never below a ticket still present, even if the counter file was lost: a smaller
            # number would jump the queue.
            seq = max(counter, present[-1] if present else 0) + 1
            fifo = self.fifo_path(seq)
            fd = claim.create(fifo, mode)
            try:
                ticket = make(seq)
                atomic_write(self.ticket_path(seq), encode(ticket), mode=mode)
            except BaseException:
                os.close(fd)
                _unlink_quietly(fifo)
                raise
            os.ftruncate(mfd, 0)
            os.pwrite(mfd, f"{seq}\n".encode(), 0)
        finally:
            os.close(mfd)  # drops the flock
        _owner_fds.add(fd)
        return ticket, fd


def queue_gpus(settings: Settings) -> list[int]:
    """GPUs that have a queue folder in this state folder."""
    try:
        names = os.listdir(settings.state_dir)
    except OSError:
        return []
    return sorted(int(n[3:]) for n in names if n.startswith("gpu") and n[3:].isdigit())


def holder_pids(settings: Settings) -> set[int]:
    """Pids that hold a GPU now: the owner and the command (``gpulock run``) of live holders."""
    pids: set[int] = set()
    for gpu in queue_gpus(settings):
        for t in QueueDir(settings, gpu, create=False).holders():
            pids.add(t.pid)
            if t.child_pid is not None:
                pids.add(t.child_pid)
    return pids


def _flock_until(fd: int, deadline: float | None, gpu: int) -> None:
    """The sequence mutex is held for microseconds; only a stopped process can stall it."""
    if deadline is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return
    start = time.monotonic()
    pause = 0.0005
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            now = time.monotonic()
            if now >= deadline:
                raise LockTimeout(gpu, now - start) from None
            time.sleep(min(pause, deadline - now))
            pause = min(pause * 2, 0.05)


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


# Read ends of our own tickets: a child made by fork() (multiprocessing, not exec) must not
# keep the GPU claimed after we release, so it closes them at once.
_owner_fds: set[int] = set()


def _close_owner_fds_in_child() -> None:
    for fd in list(_owner_fds):
        try:
            os.close(fd)
        except OSError:
            pass
    _owner_fds.clear()
    _held.__dict__.clear()


_held = threading.local()  # gpu -> Lease held by this thread, for re-entrancy
os.register_at_fork(after_in_child=_close_owner_fds_in_child)


class Lease:
    """A granted claim on one GPU.  Release it (or leave the ``with`` block) to pass it on.

    ``acquire()`` in a thread that already holds the same GPU returns the same Lease with a
    deeper nesting count instead of queueing behind itself; only the outermost release frees
    the GPU.  A process started by ``gpulock run`` inherits its parent's lease (see
    ``ENV_TICKET``): its own ``acquire()`` on that GPU is satisfied at once.
    """

    def __init__(
        self,
        settings: Settings,
        qdir: QueueDir,
        ticket: Ticket,
        fd: int | None,
        waited_s: float,
        *,
        inherited: bool = False,
    ) -> None:
        self.settings = settings
        self._qdir = qdir
        self._ticket = ticket
        self._fd = fd
        self._owner_pid = os.getpid()
        self._depth = 1
        self.waited_s = waited_s
        self.inherited = inherited

    gpu = property(lambda self: self._ticket.gpu, doc="The GPU index granted.")
    ticket = property(lambda self: self._ticket.seq, doc="The ticket number (unique per folder).")
    name = property(lambda self: self._ticket.name)
    need_bytes = property(lambda self: self._ticket.need_bytes, doc="None: exclusive.")
    lease_s = property(lambda self: self._ticket.lease_s)
    granted_wall = property(lambda self: self._ticket.granted_wall)

    @property
    def path(self) -> Path:
        return self._qdir.ticket_path(self._ticket.seq)

    @property
    def held(self) -> bool:
        return self._depth > 0 and (self._fd is not None or self.inherited)

    @property
    def cuda_visible_devices(self) -> str:
        return str(self._ticket.gpu)

    @property
    def claim_fd(self) -> int | None:
        """The claim's descriptor, if this process has one (an inherited lease may not)."""
        return self._fd if self.held else None

    def fileno(self) -> int:
        """The claim's descriptor; a child that inherits it keeps the GPU claimed until it exits."""
        if self.claim_fd is None:
            raise ValueError("this lease holds no descriptor (released, or inherited without one)")
        return self.claim_fd

    def heartbeat(self) -> None:
        """Show that the holder is alive and working: renews the lease (touches the ticket)."""
        if self.held:
            os.utime(self.path)

    def set_child(self, pid: int) -> None:
        """Record the process that really uses the GPU (``gpulock run``'s command)."""
        self._ticket = replace(
            self._ticket, child_pid=pid, child_start_ticks=identity.start_ticks(pid)
        )
        atomic_write(self.path, encode(self._ticket), mode=self.settings.file_mode)

    def release(self) -> None:
        """Give the GPU back.  Safe to call twice; a no-op in a forked child."""
        if self._depth <= 0:
            return
        self._depth -= 1
        if self._depth > 0 or self.inherited:
            return
        fd, self._fd = self._fd, None
        held = getattr(_held, "leases", {})
        if held.get(self._ticket.gpu) is self:
            del held[self._ticket.gpu]
        if fd is None or os.getpid() != self._owner_pid:
            return
        seq = self._ticket.seq
        try:
            _unlink_quietly(self._qdir.ticket_path(seq))  # new scans no longer see it...
            now_w = time.time()
        finally:
            _owner_fds.discard(fd)
            os.close(fd)  # ...and this wakes whoever watches it: the handoff happens here
        _unlink_quietly(self._qdir.fifo_path(seq))  # tidying, off the handoff's path
        granted = self._ticket.granted_wall
        self.settings.emit(
            "release",
            **_who(self._ticket),
            held_s=round(now_w - granted, 6) if granted else None,
            now_wall=now_w,
        )

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "held" if self.held else "released"
        return f"<Lease gpu{self.gpu} ticket {self.ticket} {self.name!r} {state}>"


def _who(t: Ticket) -> dict[str, Any]:
    return {"gpu": t.gpu, "ticket": t.seq, "pid": t.pid, "name": t.name, "need_bytes": t.need_bytes}


def acquire(
    gpu: int | None = None,
    need: int | str | None = None,
    timeout: float | str | None = None,
    name: str | None = None,
    lease: float | str | None = None,
    *,
    config: Config | str | None = None,
    state_dir: str | os.PathLike[str] | None = None,
    command: Sequence[str] | None = None,
) -> Lease:
    """Wait in line for a GPU and return the granted Lease (also a context manager).

    gpu: index (default: the config's ``default_gpu``, else 0).  need: VRAM this holder will
    use, e.g. ``"6GiB"``; None means the whole GPU, exclusively.  timeout: seconds (or
    ``"5m"``) to wait before giving up with LockTimeout, having left the queue; None waits for
    ever, 0 tries once.  name: shown in ``gpulock status`` (default: the program's name).
    lease: the longest the holder may go without ``heartbeat()`` before it counts as hung.
    """
    settings = load(config, state_dir)
    cfg = settings.config
    gpu_i = cfg.default_gpu if gpu is None else gpu
    if isinstance(gpu_i, bool) or not isinstance(gpu_i, int) or gpu_i < 0:
        raise ValueError(f"gpu must be a GPU index >= 0, got {gpu!r}")
    timeout_s = None if timeout is None else parse_duration(timeout, key="timeout")
    lease_s = None if lease is None else parse_duration(lease, key="lease")
    need_bytes = None if need is None else parse_size(need, key="need")
    if need_bytes is not None and need_bytes <= 0:
        raise ValueError(f"need must be above 0, got {need!r}")

    # Before QueueDir() creates gpu<N>/: a refused GPU must leave no queue folder behind.
    simulated = devices.simulated_sizes(cfg)
    if simulated is not None and gpu_i >= len(simulated):
        raise LockError(
            f"gpu{gpu_i} does not exist: {len(simulated)} simulated GPU(s), "
            f"gpu0..gpu{len(simulated) - 1}",
            hint="check --gpu, default_gpu and GPULOCK_SIMULATE",
        )
    held: dict[int, Lease] = _held.__dict__.setdefault("leases", {})
    mine = held.get(gpu_i)
    if mine is not None and mine.held:
        mine._depth += 1
        return mine
    qdir = QueueDir(settings, gpu_i)
    inherited = _inherited_lease(settings, qdir)
    if inherited is not None:
        held[gpu_i] = inherited
        return inherited

    budget = None
    if need_bytes is not None:
        total = devices.total_bytes(gpu_i, cfg)
        if total is not None:
            budget = total - cfg.reserve_bytes(total)
            if need_bytes > budget:
                raise NeedTooLarge(gpu_i, need_bytes, budget)

    start = time.monotonic()
    deadline = None if timeout_s is None else start + timeout_s
    me = identity.current()
    argv = tuple(command) if command is not None else _own_command()
    label = name or (os.path.basename(argv[0]) if argv else "python")

    def make(seq: int) -> Ticket:
        return Ticket(
            seq=seq,
            gpu=gpu_i,
            pid=me.pid,
            uid=me.uid,
            user=me.user,
            host=me.host,
            name=label,
            created_wall=time.time(),
            start_ticks=me.start_ticks,
            boot_id=me.boot_id,
            pidns=me.pidns,
            command=argv,
            need_bytes=need_bytes,
            lease_s=lease_s,
        )

    ticket, fd = qdir.enqueue(make, deadline)
    try:
        granted = _Waiter(settings, qdir, ticket, fd, budget, deadline, start).wait()
    except BaseException:
        qdir.remove(ticket.seq)
        _owner_fds.discard(fd)
        os.close(fd)
        raise
    result = Lease(settings, qdir, granted, fd, time.monotonic() - start)
    held[gpu_i] = result
    return result


def locked(
    gpu: int | None = None,
    need: int | str | None = None,
    timeout: float | str | None = None,
    name: str | None = None,
    lease: float | str | None = None,
    **kwargs: Any,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorator form of ``acquire``: the function runs holding the GPU.

    ::

        @gpulock.locked(gpu=0, need="6GiB", timeout=600)
        def render(batch): ...
    """

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def wrapper(*args: P.args, **kw: P.kwargs) -> R:
            label = name or getattr(fn, "__qualname__", None) or "function"
            with acquire(gpu, need, timeout, label, lease, **kwargs):
                return fn(*args, **kw)

        return wrapper

    return decorate


def _own_command() -> tuple[str, ...]:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            parts = f.read().split(b"\0")
        return tuple(p.decode(errors="replace") for p in parts if p)[:32]
    except OSError:
        return ()


def _inherited_lease(settings: Settings, qdir: QueueDir) -> Lease | None:
    """The lease ``gpulock run`` holds for this process tree on this GPU, if any.

    Accepted only when the ticket still holds and its owner (or its recorded command) is an
    ancestor of this process, so a copied environment variable grants nothing.
    """
    spec = os.environ.get(ENV_TICKET, "")
    gpu_s, _, seq_s = spec.partition(":")
    if not (gpu_s.isdigit() and seq_s.isdigit()) or int(gpu_s) != qdir.gpu:
        return None
    try:
        tf = qdir.read(int(seq_s))
    except TicketFormatError:
        return None
    if tf is None or not tf.ticket.holding or not qdir.alive(tf.ticket.seq):
        return None
    t = tf.ticket
    if t.pidns != identity.pid_namespace():
        return None
    family = set(identity.ancestors()) | {os.getpid()}
    if not ({t.pid, t.child_pid} & family):
        return None
    return Lease(settings, qdir, t, _open_fd_of(qdir.fifo_path(t.seq)), 0.0, inherited=True)


def _open_fd_of(path: Path) -> int | None:
    """Our descriptor of ``path`` if we inherited one (``gpulock run`` passes its claim on)."""
    target = str(path)
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return None
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}") == target:
                return int(name)
        except (OSError, ValueError):
            continue
    return None


class _Waiter:
    """One ticket's wait for its grant: scan, decide, watch, sleep until the kernel says."""

    def __init__(
        self,
        settings: Settings,
        qdir: QueueDir,
        me: Ticket,
        fd: int,
        budget: int | None,
        deadline: float | None,
        start: float,
    ) -> None:
        self.settings = settings
        self.qdir = qdir
        self.me = me
        self.fd = fd
        self.budget = budget
        self.deadline = deadline
        self.start = start
        self.watched: dict[int, int] = {}
        self.poller = select.poll()
        self.poller.register(fd, select.POLLIN)
        self.reported: set[tuple[int, float]] = set()
        self.kills: dict[int, tuple[float, bool]] = {}  # seq -> (SIGTERM sent at, SIGKILL sent)
        self.announced = False
        self.safety_s = SAFETY_RECHECK_S
        self.freeze_ends: float | None = None  # monotonic time the governor's freeze goes stale
        self.ahead_seqs: list[int] | None = None

    def wait(self) -> Ticket:
        try:
            return self._loop()
        finally:
            self._unwatch_all()

    def _loop(self) -> Ticket:
        rescan = True
        ahead: list[TicketFile] = []
        while True:
            if rescan:
                ahead, fds = self._scan_ahead()
                d = queue.decide(self.me, [tf.ticket for tf in ahead], self.budget)
                frozen = level.freeze(self.settings) if d.grant else None
                if d.grant and frozen is None:
                    for fd in fds.values():
                        os.close(fd)
                    self._make_room()
                    return self._grant()
                self._rewatch(d.watch, fds)
                self.freeze_ends = None
                if frozen is not None:
                    d = queue.Decision(False, (), "the governor froze new GPU admissions")
                    self._watch_governor(frozen)
                if not self.announced:
                    self.announced = True
                    n_ahead = sum(1 for q in self.qdir.seqs() if q < self.me.seq)
                    self.settings.emit("wait", **_who(self.me), ahead=n_ahead, reason=d.reason)
            now = time.monotonic()
            if self.deadline is not None and now >= self.deadline:
                raise self._timeout(ahead)
            wake = now + self.safety_s
            if self.deadline is not None:
                wake = min(wake, self.deadline)
            wake = min(wake, self._hung_holders(ahead, now))
            if self.freeze_ends is not None:
                wake = min(wake, self.freeze_ends)
            ready = self.poller.poll(max(0, math.ceil((wake - time.monotonic()) * 1000)))
            rescan = bool(ready) or self._due(ahead)
            self.safety_s = (
                SAFETY_RECHECK_S if rescan else min(self.safety_s * 2, SAFETY_RECHECK_MAX_S)
            )
            for fd, _ in ready:
                if fd == self.fd:
                    claim.drain(self.fd)

    def _watch_governor(self, word: level.Published) -> None:
        """While frozen: wake when the governor dies (its claim), rings, or its word goes stale."""
        self.freeze_ends = time.monotonic() + max(0.0, level.stale_at_wall(word) - time.time())
        try:
            fd = claim.watch(level.claim_path(self.settings))
        except claim.NotAClaim:
            fd = None
        if fd is not None:
            self.watched[GOVERNOR_WATCH] = fd
            self.poller.register(fd, 0)

    def _due(self, ahead: list[TicketFile]) -> bool:
        """After a timed wake: does anything need a fresh look?"""
        if self.freeze_ends is not None and time.monotonic() >= self.freeze_ends:
            return True
        now_w = time.time()
        for tf in ahead:
            if tf.ticket.seq not in self.watched:
                continue
            if not self.qdir.ticket_path(tf.ticket.seq).exists():
                return True  # the guard: released while a stray fork kept its FIFO open
            expiry = queue.lease_expiry_wall(tf.ticket, tf.mtime_wall)
            reported = (tf.ticket.seq, tf.mtime_wall) in self.reported
            if expiry is not None and now_w >= expiry and not reported:
                return True
        return bool(self.kills)

    def _scan_ahead(self) -> tuple[list[TicketFile], dict[int, int]]:
        """Live tickets ahead of me, nearest waiter only if one is ahead; with watch fds."""
        live: list[TicketFile] = []
        fds: dict[int, int] = {}
        if self.ahead_seqs is None:
            # Listed once per wait: nobody is ever inserted ahead of a ticket, so later scans
            # only drop the ones that left (O(1) per handoff instead of O(queue length)).
            self.ahead_seqs = [s for s in self.qdir.seqs() if s < self.me.seq]
        gone: set[int] = set()
        for seq in reversed(self.ahead_seqs):
            try:
                tf = self.qdir.read(seq)
                if tf is None:
                    gone.add(seq)
                    continue
                fd = self.qdir.watch(seq)
            except TicketFormatError:
                continue  # garbage is skipped: it never holds the GPU
            if fd is None:
                self._clean_dead(tf)
                gone.add(seq)
                continue
            live.append(tf)
            fds[seq] = fd
            if not tf.ticket.holding and len(live) == 1:
                break  # a waiter ahead: it is all that can change my answer
        live.reverse()
        if gone:
            self.ahead_seqs = [s for s in self.ahead_seqs if s not in gone]
        return live, fds

    def _clean_dead(self, tf: TicketFile) -> None:
        t = tf.ticket
        if not identity.may_signal(t.uid):
            return  # not ours to remove; it is skipped all the same
        if self.qdir.remove(t.seq):
            self.settings.emit(
                "cleanup",
                **_who(t),
                holding=t.holding,
                reason="owner gone: no process holds its FIFO open",
                by_pid=os.getpid(),
            )

    def _rewatch(self, want: Sequence[int], fds: dict[int, int]) -> None:
        self._unwatch_all()
        for seq, fd in fds.items():
            if seq in want:
                self.watched[seq] = fd
                self.poller.register(fd, 0)  # POLLERR/POLLHUP are always reported
            else:
                os.close(fd)

    def _unwatch_all(self) -> None:
        for fd in self.watched.values():
            self.poller.unregister(fd)
            os.close(fd)
        self.watched.clear()

    def _make_room(self) -> None:
        """A holder with a ``need`` asks idle models of other processes to leave first.

        Models kept in VRAM between calls (by processes that do not hold the lock) would
        otherwise make a granted load fail with a CUDA OOM.
        """
        if self.me.need_bytes is None:
            return
        if not (self.settings.state_dir / "residents").is_dir():
            return  # nobody ever registered a model: nothing to ask
        from gpulock import residents

        left = None if self.deadline is None else self.deadline - time.monotonic()
        residents.make_room(
            self.settings,
            self.me.gpu,
            self.me.need_bytes,
            exclude_pid=self.me.pid,
            timeout_s=10.0 if left is None else max(min(left, 10.0), 0.5),
            reason=f"room for ticket {self.me.seq} ({self.me.name})",
        )

    def _grant(self) -> Ticket:
        granted = self.me.granted(time.time())
        atomic_write(
            self.qdir.ticket_path(granted.seq), encode(granted), mode=self.settings.file_mode
        )
        self.settings.emit(
            "acquire", **_who(granted), waited_s=round(time.monotonic() - self.start, 6)
        )
        # The one behind me may share the GPU with me, or now watches a holder with a lease:
        # ring it so it looks again.  Only the nearest live one: no herd.  (Its look also
        # prunes the tickets that left ahead of it now, while I hold, not at my release.)
        self.qdir.ring_successor(granted.seq)
        return granted

    def _timeout(self, ahead: list[TicketFile]) -> LockTimeout:
        waited = time.monotonic() - self.start
        holder = next((tf.ticket for tf in ahead if tf.ticket.holding), None)
        if holder is None:
            holder = next(iter(self.qdir.holders()), None)
        n_ahead = sum(1 for s in self.qdir.seqs() if s < self.me.seq)
        self.settings.emit(
            "timeout",
            **_who(self.me),
            waited_s=round(waited, 6),
            holder_pid=holder.pid if holder else None,
            holder_name=holder.name if holder else None,
        )
        return LockTimeout(
            self.me.gpu,
            waited,
            holder.pid if holder else None,
            holder.name if holder else None,
            queue_ahead=n_ahead,
        )

    def _hung_holders(self, ahead: list[TicketFile], now: float) -> float:
        """Handle watched holders past their lease; return when to look at them next."""
        wake = math.inf
        now_w = time.time()
        for tf in ahead:
            t = tf.ticket
            if t.seq not in self.watched:
                continue
            expiry = queue.lease_expiry_wall(t, tf.mtime_wall)
            if expiry is None:
                continue
            if now_w <= expiry:
                wake = min(wake, now + (expiry - now_w))
                continue
            wake = min(wake, self._on_hung(tf, now, now_w))
        return wake

    def _on_hung(self, tf: TicketFile, now: float, now_w: float) -> float:
        t = tf.ticket
        cfg = self.settings.config
        evidence = _evidence(tf, now_w)
        why_not = None
        if cfg.on_hung == "kill":
            if not identity.may_signal(t.uid):
                why_not = f"not permitted: owner uid {t.uid}"
            elif t.pidns != identity.pid_namespace():
                why_not = "owner is in another pid namespace"
        if cfg.on_hung != "kill" or why_not:
            key = (t.seq, tf.mtime_wall)
            if key not in self.reported:
                self.reported.add(key)
                self.settings.emit(
                    "stale", **evidence, action="report", policy=cfg.on_hung, why_not=why_not
                )
            return math.inf
        grace = cfg.hung_grace_s
        sent = self.kills.get(t.seq)
        if sent is None:
            _signal_holder(t, signal.SIGTERM)
            self.kills[t.seq] = (now, False)
            self.settings.emit("kill", **evidence, signal="SIGTERM", grace_s=grace)
            return now + grace
        at, hard = sent
        if now < at + grace:
            return at + grace
        if not hard:
            _signal_holder(t, signal.SIGKILL)
            self.kills[t.seq] = (at, True)
            self.settings.emit("kill", **evidence, signal="SIGKILL")
        return now + SAFETY_RECHECK_S


def _evidence(tf: TicketFile, now_w: float) -> dict[str, Any]:
    t = tf.ticket
    beat = queue.heartbeat_wall(t, tf.mtime_wall)
    return {
        **_who(t),
        "user": t.user,
        "child_pid": t.child_pid,
        "held_s": round(now_w - (t.granted_wall or now_w), 3),
        "lease_s": t.lease_s,
        "heartbeat_age_s": round(now_w - beat, 3),
    }


def _signal_holder(t: Ticket, sig: int) -> None:
    """Signal the command first (it holds the GPU), then the owner; never a reused pid."""
    if t.child_pid is not None:
        identity.signal_exact(t.child_pid, t.child_start_ticks, t.pidns, sig)
    identity.signal_exact(t.pid, t.start_ticks, t.pidns, sig)
