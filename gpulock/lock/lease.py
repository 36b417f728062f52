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
* **Watch** -- a waiter opens the write end of the FIFO it depends on (see ``gpulock.lock.queue``):
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

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import TracebackType

from gpulock.core import identity
from gpulock.core.config import Config
from gpulock.core.errors import LockTimeout
from gpulock.core.settings import Settings, load
from gpulock.core.statefile import atomic_write
from gpulock.core.units import format_gpus
from gpulock.lock import gpuset, inherit
from gpulock.lock import prefetch as prefetch_mod
from gpulock.lock.ask import check_ask, ticket_maker
from gpulock.lock.gpuset import GpuArg, Prefer
from gpulock.lock.queued import Queued
from gpulock.lock.queuedir import QueueDir, Spot, enqueue_set, owner_fds, pause, unlink_quietly
from gpulock.lock.room import Room, require
from gpulock.lock.ticket import Ticket, TicketFormatError, encode, event_fields

_held = threading.local()  # gpu -> Lease held by this thread, for re-entrancy


def _forget_leases_in_child() -> None:
    _held.__dict__.clear()  # a forked child holds none of its parent's leases


os.register_at_fork(after_in_child=_forget_leases_in_child)


class Lease:
    """A granted claim on one GPU (or on several, for a set ticket).  Release it (or leave the
    ``with`` block) to pass it on.

    ``acquire()`` in a thread that already holds the same GPU returns the same Lease with a
    deeper nesting count instead of queueing behind itself; only the outermost release frees
    the GPU.  A process started by ``gpulock run`` inherits its parent's lease (see
    ``gpulock.lock.inherit``): its own ``acquire()`` on that GPU is satisfied at once.
    """

    def __init__(
        self,
        settings: Settings,
        spots: Sequence[Spot],
        waited_s: float,
        *,
        inherited: bool = False,
    ) -> None:
        self.settings = settings
        self._spots = list(spots)  # one per GPU held, in GPU order
        self._owner_pid = os.getpid()
        self._depth = 1
        self._released = False
        self.waited_s = waited_s
        self.inherited = inherited

    @property
    def _ticket(self) -> Ticket:
        return self._spots[0].ticket

    gpu = property(lambda self: self._spots[0].gpu, doc="The GPU granted (the first of gpus).")
    ticket = property(lambda self: self._ticket.seq, doc="The ticket number (unique per folder).")
    name = property(lambda self: self._ticket.name)
    need_bytes = property(lambda self: self._ticket.need_bytes, doc="None: exclusive.")
    lease_s = property(lambda self: self._ticket.lease_s)
    granted_wall = property(lambda self: self._ticket.granted_wall)

    @property
    def gpus(self) -> tuple[int, ...]:
        """Every GPU granted, in order (one for a ticket pinned or granted one of a set)."""
        return tuple(spot.gpu for spot in self._spots)

    @property
    def path(self) -> Path:
        return self._spots[0].qdir.ticket_path(self._ticket.seq)

    @property
    def held(self) -> bool:
        return self._depth > 0 and not self._released

    @property
    def cuda_visible_devices(self) -> str:
        return ",".join(map(str, self.gpus))

    @property
    def claim_fd(self) -> int | None:
        """The claim's descriptor, if this process has one (an inherited lease may not)."""
        return self._spots[0].fd if self.held else None

    @property
    def claim_fds(self) -> tuple[int, ...]:
        """Every claim's descriptor this process has (one per GPU held)."""
        if not self.held:
            return ()
        return tuple(spot.fd for spot in self._spots if spot.fd is not None)

    def fileno(self) -> int:
        """The claim's descriptor; a child that inherits it keeps the GPU claimed until it exits."""
        if self.claim_fd is None:
            raise ValueError("this lease holds no descriptor (released, or inherited without one)")
        return self.claim_fd

    def waiting_behind(self) -> bool:
        """Whether a live ticket waits behind this one in the line of a GPU it holds.

        A holder that shares its grant between requests (``gpulock serve``) asks this before
        taking another one in: fairness says it must not once someone waits.
        """
        for spot in self._spots:
            qdir = spot.qdir
            for seq in qdir.seqs():
                if seq <= self._ticket.seq:
                    continue
                try:
                    tf = qdir.read(seq)
                except TicketFormatError:
                    continue  # garbage in the folder waits for nobody
                if tf is not None and not tf.ticket.holding and qdir.alive(seq):
                    return True
        return False

    def heartbeat(self) -> None:
        """Show that the holder is alive and working: renews the lease (touches the ticket)."""
        if self.held:
            for spot in self._spots:
                os.utime(spot.qdir.ticket_path(spot.ticket.seq))

    def set_child(self, pid: int) -> None:
        """Record the process that really uses the GPU (``gpulock run``'s command)."""
        ticks = identity.start_ticks(pid)
        for spot in self._spots:
            spot.ticket = replace(spot.ticket, child_pid=pid, child_start_ticks=ticks)
            atomic_write(
                spot.qdir.ticket_path(spot.ticket.seq),
                encode(spot.ticket),
                mode=self.settings.file_mode,
            )

    def release(self) -> None:
        """Give the GPU back.  Safe to call twice; a no-op in a forked child."""
        if self._depth <= 0:
            return
        self._depth -= 1
        if self._depth > 0 or self.inherited:
            return
        self._released = True
        held = getattr(_held, "leases", {})
        for gpu in self.gpus:
            if held.get(gpu) is self:
                del held[gpu]
        if os.getpid() != self._owner_pid:
            return
        now_w = None
        for spot in self._spots:
            fd, spot.fd = spot.fd, None
            if fd is None:
                continue
            seq = spot.ticket.seq
            try:
                pause("release-ticket")  # (test hooks: gpulock.lock.steps)
                unlink_quietly(spot.qdir.ticket_path(seq))  # new scans no longer see it...
                now_w = time.time() if now_w is None else now_w
                # ...the FIFO goes while we still hold it, so a FIFO without a ticket that nobody
                # holds is always debris (see gpulock.lock.queuedir), never a release in
                # progress...
                pause("release-fifo")
                unlink_quietly(spot.qdir.fifo_path(seq))
            finally:
                owner_fds.discard(fd)
                pause("release-close")
                os.close(fd)  # ...and this wakes whoever watches it: the handoff happens here
                pause("release-done")
        if now_w is None:
            return
        granted = self._ticket.granted_wall
        self.settings.emit(
            "release",
            **event_fields(self._ticket),
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
        where = format_gpus(self.gpus)
        return f"<Lease {where} ticket {self.ticket} {self.name!r} {state}>"


def acquire(
    gpu: GpuArg = None,
    need: int | str | None = None,
    timeout: float | str | None = None,
    name: str | None = None,
    lease: float | str | None = None,
    *,
    gpus: int | None = None,
    config: Config | str | None = None,
    state_dir: str | os.PathLike[str] | None = None,
    command: Sequence[str] | None = None,
    prefetch: Sequence[str | os.PathLike[str]] | None = None,
    prefer: Prefer = None,
    room: Room,
) -> Lease:
    """Wait in line for a GPU and return the granted Lease (also a context manager).

    The lock's own entry point: ``room`` makes room before the grant (``gpulock.lock.room``);
    users call ``gpulock.acquire``, which passes the residents' room.

    gpu: an index, a set of indices (``[0, 2]``, ``"0,2"``) or ``"any"`` (every GPU of this
    machine); a set is granted whichever of its GPUs can take the ticket first (default: the
    config's ``default_gpu``, else 0).  gpus: how many GPUs at once, all or nothing (default
    1; with no set given, from every GPU).  need: VRAM this holder will use on each, e.g.
    ``"6GiB"``; None means the whole GPU, exclusively.  timeout: seconds (or ``"5m"``) to wait
    before giving up with LockTimeout, having left the queue; None waits for ever, 0 tries
    once.  name: shown in ``gpulock status`` (default: the program's name).  lease: the
    longest the holder may go without ``heartbeat()`` before it counts as hung.  prefetch:
    files the holder will load (a model's GGUF...): read into the page cache while the ticket
    waits among the first ``prefetch.ahead`` (see ``gpulock.lock.prefetch``).  prefer: GPUs
    (or GPU -> why) where the job is warm already, taken first among those free at once.
    """
    got = enqueue(
        gpu,
        need,
        timeout,
        name,
        lease,
        gpus=gpus,
        config=config,
        state_dir=state_dir,
        command=command,
        prefetch=prefetch,
        prefer=prefer,
        room=room,
    )
    if isinstance(got, Lease):
        return got
    held: dict[int, Lease] = _held.__dict__.setdefault("leases", {})
    result: Lease | None = None
    try:
        waiter = got.waiter()
        waiter.wait()
        # Inside the try: an exception (a signal handler's) between the grant and the
        # Lease must still give the GPU back, not leave a granted ticket behind.
        result = Lease(got.settings, waiter.granted_spots(), time.monotonic() - got.start)
        for g in result.gpus:
            held[g] = result
    except BaseException as e:
        if result is not None:
            for g in result.gpus:
                if held.get(g) is result:
                    del held[g]
        got.leave(e)
        raise
    return result


def enqueue(
    gpu: GpuArg = None,
    need: int | str | None = None,
    timeout: float | str | None = None,
    name: str | None = None,
    lease: float | str | None = None,
    *,
    gpus: int | None = None,
    config: Config | str | None = None,
    state_dir: str | os.PathLike[str] | None = None,
    command: Sequence[str] | None = None,
    prefetch: Sequence[str | os.PathLike[str]] | None = None,
    prefer: Prefer = None,
    nested: bool = True,
    room: Room,
) -> Lease | Queued:
    """Check the arguments and take a ticket; a Lease when this process already holds the GPU.

    ``nested``: a thread that holds the GPU gets its own Lease again (re-entrancy); the event
    loop's tasks share one thread, so ``acquire_async`` passes False.
    """
    room = require(room)
    settings = load(config, state_dir)
    cfg = settings.config
    ask = check_ask(cfg, gpu, need, timeout, lease, gpus, prefetch)
    already = _held_already(settings, ask.gset, ask.count, nested)
    if already is not None:
        return already

    budgets, gset = gpuset.budgets(cfg, ask.gset, ask.count, ask.need_bytes)
    qdirs = [QueueDir(settings, g) for g in gset]
    spans = len(gset) > 1 or ask.count > 1
    start = time.monotonic()
    deadline = None if ask.timeout_s is None else start + ask.timeout_s
    me = identity.current()
    label, make = ticket_maker(ask, gset, spans, name, command, me)
    warm = prefetch_mod.for_waiter(settings, ask.warm_paths)
    try:
        _ticket, spots = enqueue_set(qdirs, make, deadline)
    except LockTimeout:
        # Out of time before a ticket could be taken (the sequence mutex stayed busy): a
        # timeout all the same, and the event log says so like any other.
        settings.emit(
            "timeout",
            gpu=gset[0],
            ticket=None,
            pid=me.pid,
            name=label,
            need_bytes=ask.need_bytes,
            **({"gpus": gpuset.asked_of(gset, ask.count), "granted": []} if spans else {}),
            waited_s=round(time.monotonic() - start, 6),
            reason="no ticket yet: the sequence mutex stayed busy",
        )
        raise
    return Queued(
        settings,
        tuple(spots),
        budgets,
        deadline,
        start,
        room,
        warm,
        gpuset.prefer_of(prefer, gset),
        ask.warm_paths if spans else (),
    )


def _held_already(
    settings: Settings, gset: Sequence[int], count: int, nested: bool
) -> Lease | None:
    """A lease on these GPUs held already, by this thread (one nesting deeper) or, through
    ``gpulock run``, by this process tree; None: take a ticket."""
    held: dict[int, Lease] = _held.__dict__.setdefault("leases", {})
    mine = _mine(held, gset, count) if nested else None
    if mine is not None:
        mine._depth += 1
        return mine
    inherited = _inherited_lease(settings, gset, count)
    if inherited is not None and nested:
        for g in inherited.gpus:
            held[g] = inherited
    return inherited


def _mine(held: dict[int, Lease], gset: Sequence[int], count: int) -> Lease | None:
    """A lease this thread holds that covers the ask: ``count`` of its GPUs in ``gset``."""
    if len(gset) == 1 and count == 1:
        mine = held.get(gset[0])
        return mine if mine is not None and mine.held else None
    for lease in dict.fromkeys(held.values()):
        if lease.held and len(set(lease.gpus) & set(gset)) >= count:
            return lease
    return None


def leases_held() -> list[Lease]:
    """The leases this thread holds now (``gpulock run`` releases them if a signal cuts in
    just as ``acquire`` returns)."""
    return [lease for lease in getattr(_held, "leases", {}).values() if lease.held]


def _inherited_lease(settings: Settings, gset: Sequence[int], count: int) -> Lease | None:
    """The lease ``gpulock run`` holds for this process tree on these GPUs, if any
    (``gpulock.lock.inherit``)."""
    spots = inherit.inherited_spots(settings, gset, count)
    return None if spots is None else Lease(settings, spots, 0.0, inherited=True)
