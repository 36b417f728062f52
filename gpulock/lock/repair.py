"""``gpulock break``: remove dead tickets and end hung holders, by their owner or root only.

A ticket for a set of GPUs has a copy in each GPU's folder (``gpulock.lock.ticket``): it is
broken once, through its first copy's claim, and every copy goes with it.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass

from gpulock.core import claim, identity, proof
from gpulock.core.errors import LockError, NotPermitted
from gpulock.core.settings import Settings
from gpulock.lock import queue
from gpulock.lock.census import queue_gpus, remove_dead_copies
from gpulock.lock.hung import signal_holder, ticket_evidence
from gpulock.lock.queuedir import QueueDir, TicketFile
from gpulock.lock.ticket import Ticket, TicketFormatError


@dataclass(frozen=True, slots=True)
class BreakResult:
    ticket: int
    gpu: int
    action: str  # "removed" (owner was gone, or an orphan FIFO), "killed", "skipped"
    detail: str


def find(settings: Settings, seq: int) -> tuple[QueueDir, TicketFile] | None:
    """Ticket ``seq`` (its first copy, for a set ticket), wherever it is."""
    for gpu in queue_gpus(settings):
        qdir = QueueDir(settings, gpu, create=False)
        if seq in qdir.seqs():
            try:
                tf = qdir.read(seq)
            except Exception:
                tf = None
            if tf is not None:
                return qdir, tf
    return None


def find_all(settings: Settings, seq: int) -> list[tuple[QueueDir, TicketFile]]:
    """Every copy of ticket ``seq``: one for a pinned ticket, one per GPU of a set's."""
    out = []
    for gpu in queue_gpus(settings):
        qdir = QueueDir(settings, gpu, create=False)
        try:
            tf = qdir.read(seq)
        except TicketFormatError:
            continue
        if tf is not None:
            out.append((qdir, tf))
    return out


def break_ticket(
    settings: Settings, seq: int, *, force: bool = False, grace_s: float | None = None
) -> BreakResult:
    """Remove ticket ``seq`` if its owner is gone; kill its owner first if hung (or forced)."""
    found = find(settings, seq)
    if found is None:
        why = _unreadable(settings, seq)
        if why is not None:  # garbage, or a forgery: never signalled for
            raise LockError(
                f"ticket {seq} is not a readable ticket ({why}); nothing was signalled",
                hint="gpulock status lists it under 'ignored'",
            )
        raise LockError(f"no ticket {seq} in {settings.state_dir}", hint="gpulock status")
    qdir, tf = found
    return _break(settings, qdir, tf, force=force, grace_s=grace_s)


def _unreadable(settings: Settings, seq: int) -> str | None:
    """Why the file of ticket ``seq`` is not a ticket, if such a file exists."""
    for gpu in queue_gpus(settings):
        try:
            QueueDir(settings, gpu, create=False).read(seq)
        except TicketFormatError as e:
            return str(e)
    return None


def _clean_garbage(settings: Settings, qdir: QueueDir, seq: int, why: str) -> BreakResult | None:
    """Remove a ticket-named file that is no ticket (garbage, or a forgery) when ours or root.

    Garbage never holds the GPU nor is signalled for; this only tidies.  Left alone: another
    user's file (theirs to judge), a folder, and a file we merely could not read.
    """
    path = qdir.ticket_path(seq)
    euid = os.geteuid()
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if stat.S_ISDIR(st.st_mode) or why.startswith("unreadable"):
        return None
    if euid != 0 and st.st_uid != euid:
        return None
    if not qdir.remove(seq):
        return None
    settings.emit(
        "break",
        gpu=qdir.gpu,
        ticket=seq,
        action="removed",
        reason=f"garbage: {why}",
        file_uid=st.st_uid,
        by_pid=os.getpid(),
    )
    return BreakResult(seq, qdir.gpu, "removed", f"garbage: {why}")


def break_stale(settings: Settings, *, grace_s: float | None = None) -> list[BreakResult]:
    """Break every dead or hung ticket this user may break; others are reported as skipped."""

    results = []
    now_w = time.time()
    done: set[int] = set()  # a set ticket is met in each of its GPUs' folders: broken once
    for gpu in queue_gpus(settings):
        qdir = QueueDir(settings, gpu, create=False)
        for seq, tf, why in qdir.scan():
            if tf is None:
                cleaned = _clean_garbage(settings, qdir, seq, why or "")
                if cleaned is not None:
                    results.append(cleaned)
                continue
            if seq in done:
                continue
            alive = qdir.alive(tf.ticket.seq)
            if alive and not queue.is_hung(tf.ticket, tf.mtime_wall, now_w):
                continue
            done.add(seq)
            try:
                results.append(_break(settings, qdir, tf, force=False, grace_s=grace_s))
            except LockError as e:  # NotPermitted, unproven, another namespace
                results.append(BreakResult(tf.ticket.seq, gpu, "skipped", str(e)))
        for seq in qdir.clean_orphans():
            why = "orphan FIFO (no ticket, no process held it)"
            results.append(BreakResult(seq, gpu, "removed", why))
    return results


def _break(
    settings: Settings, qdir: QueueDir, tf: TicketFile, *, force: bool, grace_s: float | None
) -> BreakResult:
    t = tf.ticket
    if not identity.may_signal(t.uid):
        raise NotPermitted(t.seq, t.uid)
    now_w = time.time()
    evidence = ticket_evidence(tf, now_w)
    try:
        fd = qdir.watch(t.seq)
    except TicketFormatError:
        fd = None  # its .fifo is not a FIFO: no process can be holding it
    if fd is None:
        qdir.remove(t.seq)
        _other_copies(settings, t)
        settings.emit(
            "break", **evidence, action="removed", reason="owner gone", by_pid=os.getpid()
        )
        return BreakResult(t.seq, t.gpu, "removed", f"owner pid {t.pid} ({t.name}) was gone")
    try:
        hung = queue.is_hung(t, tf.mtime_wall, now_w)
        if not (hung or force):
            raise LockError(
                f"ticket {t.seq} is alive and within its lease (pid {t.pid}, {t.name!r})",
                hint=f"gpulock break --force {t.seq} kills it",
            )
        if t.pidns != identity.pid_namespace():
            raise LockError(f"ticket {t.seq}: its owner is in another pid namespace")
        grace = settings.config.hung_grace_s if grace_s is None else grace_s
        why = "hung: past its lease without a heartbeat" if hung else "forced"

        fifo = qdir.fifo_path(t.seq)
        child = t.child_pid
        if not proof.proven(t.pid, t.start_ticks, t.uid, fifo) and not (
            child is not None and proof.proven(child, t.child_start_ticks, t.uid, fifo)
        ):
            # A ticket says who holds it; only the kernel's open files prove it.  Nothing is
            # signalled for a ticket whose pid does not hold its claim (a forgery, or debris).
            raise LockError(
                f"ticket {t.seq}: pid {t.pid} does not hold the ticket's claim; not signalled",
                hint=f"ls -l /proc/{t.pid}/fd shows what it holds; the ticket may be forged",
            )

        def send(sig: int) -> bool:
            return signal_holder(t, sig, fifo)

        def announce(sig_name: str) -> None:
            settings.emit("kill", **evidence, signal=sig_name, reason=why, by_pid=os.getpid())

        outcome = claim.end_owner(fd, send, grace, announce)
        if outcome == "survived":
            raise LockError(
                f"ticket {t.seq}: pid {t.pid} still holds it after SIGKILL",
                hint="another process may have inherited its descriptor; see 'lsof'",
            )
        if outcome == "not-sent":
            raise LockError(f"ticket {t.seq}: pid {t.pid} is gone or changed; not signalled")
    finally:
        os.close(fd)
    qdir.remove(t.seq)
    _other_copies(settings, t)
    settings.emit("break", **evidence, action="killed", reason=why, by_pid=os.getpid())
    return BreakResult(t.seq, t.gpu, "killed", f"pid {t.pid} ({t.name}): {why}")


def _other_copies(settings: Settings, t: Ticket) -> None:
    """A set ticket's copies in its other GPUs' folders: their owner is gone (its first copy's
    claim closed), and the kernel closes all of a process's claims together; a moment's grace
    for the last of them."""
    if not t.spans:
        return
    deadline = time.monotonic() + claim.KILL_WAIT_S
    for g in t.gpu_set:
        if g == t.gpu:
            continue
        try:
            fd = QueueDir(settings, g, create=False).watch(t.seq)
        except TicketFormatError:
            continue  # not a FIFO: nobody holds it
        if fd is not None:  # still held: the kernel says when it closes (no polling)
            try:
                claim.wait_released(fd, max(0.0, deadline - time.monotonic()))
            finally:
                os.close(fd)
    remove_dead_copies(settings, t)
