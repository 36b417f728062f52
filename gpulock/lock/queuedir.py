"""The files of one GPU's queue, ``<state>/gpu<N>/``: the only code that creates, reads or
removes tickets and their claims.

* ``<seq>.ticket`` -- the ticket record (``gpulock.lock.ticket``), written atomically;
* ``<seq>.fifo`` -- its claim (``gpulock.core.claim``): the owner holds it open for its life;
* ``<state>/.seq`` -- the last number handed out, under a short ``flock``
  (``gpulock.lock.seqfile``).

A ticket for a set of GPUs has a copy (``<seq>.ticket`` and its own ``<seq>.fifo``) in the
folder of every GPU of its set, all made under one hold of the sequence mutex (``enqueue_set``):
a ``Spot`` each.

A ``<seq>.fifo`` without its ticket that no process holds is an orphan: the debris of an owner
killed between removing its ticket and its FIFO (``Lease.release``), or inside ``enqueue``.
Nothing would ever remove it, so ``enqueue`` (already under the sequence mutex) and ``gpulock
break --stale`` do, under that mutex: no ``enqueue`` can then be re-creating the same path.

The queue's rules are in ``gpulock.lock.queue``; the wait in ``gpulock.lock.waiter``; the public
``acquire`` in ``gpulock.lock.lease``; every line of the state folder at once (who holds a GPU,
a process's tickets) in ``gpulock.lock.census``.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from gpulock.core import claim
from gpulock.core.errors import LockTimeout, StateDirError
from gpulock.core.settings import Settings
from gpulock.core.statefile import atomic_write
from gpulock.lock.seqfile import flock_until, last_issued, open_seq, read_last, write_last
from gpulock.lock.ticket import (
    Ticket,
    TicketFormatError,
    encode,
    fifo_name,
    file_name,
    parse,
    seq_of,
)

RING_PROBES = 64  # successors probed by number before the folder is listed

# The test knob that stops a release or a look between its steps (gpulock.lock.steps): loaded
# only when GPULOCK_TEST_PAUSE is set, so that the lock's path loads no module for it.
if os.environ.get("GPULOCK_TEST_PAUSE"):
    from gpulock.lock.steps import pause as pause
else:

    def pause(step: str) -> None:
        """Off: ``GPULOCK_TEST_PAUSE`` is unset (see ``gpulock.lock.steps``)."""


@dataclass(frozen=True, slots=True)
class TicketFile:
    """A ticket as read from disk, with the file's mtime (the holder's last heartbeat)."""

    ticket: Ticket
    mtime_wall: float


@dataclass(slots=True, eq=False)
class Spot:
    """One ticket's copy in one GPU's queue folder, and its owner's claim on it.

    ``fd`` is the claim's read end while this process holds it (None once the copy is gone:
    released, left, or handed to a successor); a ticket pinned to one GPU has one spot.
    """

    qdir: QueueDir
    ticket: Ticket
    fd: int | None

    @property
    def gpu(self) -> int:
        return self.qdir.gpu

    def leave(self) -> None:
        """Remove this copy (ticket, then FIFO), then let go of its claim: its watchers wake."""
        fd, self.fd = self.fd, None
        if fd is None:
            return
        try:
            self.qdir.remove(self.ticket.seq)
        finally:
            owner_fds.discard(fd)
            os.close(fd)


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
        except OSError:  # gone, or garbage in its place (a regular file named gpu1)
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
        if t.uid != st.st_uid:
            # In a shared folder any member can write a ticket: who owns the file is the one
            # thing its writer cannot choose, so a ticket that claims another uid is foreign.
            raise TicketFormatError(
                f"foreign: says uid {t.uid}, but the file belongs to uid {st.st_uid}"
            )
        return TicketFile(t, st.st_mtime)

    def watch(self, seq: int) -> int | None:
        """A write end of the ticket's FIFO (POLLERR once its owner is gone), or None if gone."""
        try:
            return claim.watch(self.fifo_path(seq))
        except claim.NotAClaim as e:
            raise TicketFormatError(str(e)) from None

    def look(self, seq: int) -> tuple[TicketFile, int | None] | None:
        """The ticket and a watch on its claim: None if the ticket is gone (released, left,
        removed); (ticket, fd) while its owner holds it; (ticket, None) once its owner died.
        TicketFormatError for garbage.

        The claim is looked at first, the ticket file after.  A release removes the ticket
        *before* it lets go of the claim (``Lease.release``), so a claim seen gone is a death
        only if the ticket is still there when read after that: read in the other order, a
        release between the two looks (a successor rung at a grant looks just as a brief
        holder releases) was taken for a death and began an exit wait on a live process.
        """
        pause("look-first")
        fd = self.watch(seq)
        pause("look-second")
        try:
            tf = self.read(seq)
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        pause("look-done")
        if tf is None:
            if fd is not None:
                os.close(fd)  # released (or left) just after we saw it held
            return None
        return tf, fd

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
        last = last_issued(self.settings.state_dir)
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
        for extra in (self.fifo_path(seq), self.ticket_path(seq).with_suffix(".prefetch")):
            try:  # the claim, and a waiter's warming progress (gpulock.lock.prefetch)
                os.unlink(extra)
            except FileNotFoundError:
                pass
        return removed

    def orphan_fifos(self, names: list[str] | None = None) -> list[int]:
        """Sequence numbers of FIFOs that have no ticket and that no process holds.

        ``names``: the folder's listing, when the caller has one.
        """
        if names is None:
            try:
                names = os.listdir(self.path)
            except FileNotFoundError:
                return []
        tickets = {s for s in map(seq_of, names) if s is not None}
        out = []
        for name in names:
            stem, _, ext = name.partition(".")
            if ext != "fifo" or not stem.isdigit() or fifo_name(int(stem)) != name:
                continue
            seq = int(stem)
            if seq not in tickets and not claim.held(self.fifo_path(seq)):
                out.append(seq)
        return sorted(out)

    def clean_orphans(self, *, wait_s: float = 2.0) -> list[int]:
        """Remove the orphan FIFOs this user may remove; the numbers removed.

        Under the sequence mutex (given up after ``wait_s``: then nothing is removed).
        """
        try:
            mfd = self._open_mutex()
        except (OSError, StateDirError):
            return []  # no sequence file to lock (a read-only folder): nothing to clean safely
        try:
            try:
                flock_until(mfd, time.monotonic() + wait_s, self.gpu)
            except LockTimeout:
                return []
            return self._clean_orphans_locked(None)
        finally:
            os.close(mfd)

    def _clean_orphans_locked(self, names: list[str] | None) -> list[int]:
        from gpulock.core import identity  # here: rarely needed, and the module's imports stay put

        removed = []
        for seq in self.orphan_fifos(names):
            path = self.fifo_path(seq)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if not stat.S_ISFIFO(st.st_mode) or not identity.may_signal(st.st_uid):
                continue  # another user's: theirs (or root's) to remove
            if claim.held(path):
                continue  # looked again under the mutex: someone holds it after all
            unlink_quietly(path)
            removed.append(seq)
            self.settings.emit(
                "cleanup",
                gpu=self.gpu,
                ticket=seq,
                file=path.name,
                reason="orphan FIFO: no ticket and no process holds it",
                by_pid=os.getpid(),
            )
        return removed

    def _open_mutex(self) -> int:
        """The sequence mutex's file, opened as ``enqueue`` opens it."""
        return open_seq(self.settings.state_dir / ".seq", self.settings.file_mode)

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
        ticket, (spot,) = enqueue_set([self], make, deadline)
        assert spot.fd is not None
        return ticket, spot.fd


def enqueue_set(
    qdirs: Sequence[QueueDir], make: Callable[[int], Ticket], deadline: float | None
) -> tuple[Ticket, list[Spot]]:
    """Take the next number and publish the ticket in every folder of ``qdirs`` (its set), each
    copy's FIFO made (read end held) before the copy appears, all under one hold of the
    sequence mutex: a later ticket can only be numbered once every copy is in place.

    ``make(seq)`` gives the ticket of the first folder; each other copy differs in ``gpu``.
    """
    first = qdirs[0]
    mode = first.settings.file_mode
    mfd = open_seq(first.settings.state_dir / ".seq", mode)
    spots: list[Spot] = []
    try:
        flock_until(mfd, deadline, first.gpu)
        counter = read_last(mfd)
        top = 0
        for q in qdirs:
            names = os.listdir(q.path)
            present = [s for s in map(seq_of, names) if s is not None]
            if len(names) > 2 * len(present):  # a FIFO without a ticket is here: an orphan?
                q._clean_orphans_locked(names)
            top = max(top, max(present, default=0))
        # Never below a ticket still present, even if the counter file was lost: a smaller
        # number would jump the queue.
        seq = max(counter, top) + 1
        ticket = make(seq)
        try:
            for q in qdirs:
                copy = ticket if q.gpu == ticket.gpu else replace(ticket, gpu=q.gpu)
                spots.append(Spot(q, copy, claim.create(q.fifo_path(seq), mode)))
                atomic_write(q.ticket_path(seq), encode(copy), mode=mode)
        except BaseException:
            for spot in spots:
                fd, spot.fd = spot.fd, None
                if fd is not None:
                    os.close(fd)
                unlink_quietly(spot.qdir.ticket_path(seq))
                unlink_quietly(spot.qdir.fifo_path(seq))
            raise
        write_last(mfd, seq)
    finally:
        os.close(mfd)  # drops the flock
    for spot in spots:
        assert spot.fd is not None
        owner_fds.add(spot.fd)
    return ticket, spots


def unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


# Read ends of our own tickets: a child made by fork() (multiprocessing, not exec) must not
# keep the GPU claimed after we release, so it closes them at once.
owner_fds: set[int] = set()


def _close_owner_fds_in_child() -> None:
    for fd in list(owner_fds):
        try:
            os.close(fd)
        except OSError:
            pass
    owner_fds.clear()


os.register_at_fork(after_in_child=_close_owner_fds_in_child)
