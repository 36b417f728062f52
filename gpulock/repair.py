"""``gpulock break``: remove dead tickets and end hung holders, by their owner or root only."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from gpulock import claim, identity, queue
from gpulock.errors import LockError, NotPermitted
from gpulock.queuedir import QueueDir, TicketFile, queue_gpus
from gpulock.settings import Settings
from gpulock.ticket import TicketFormatError
from gpulock.waiter import signal_holder, ticket_evidence


@dataclass(frozen=True, slots=True)
class BreakResult:
    ticket: int
    gpu: int
    action: str  # "removed" (owner was gone, or an orphan FIFO), "killed", "skipped"
    detail: str


def find(settings: Settings, seq: int) -> tuple[QueueDir, TicketFile] | None:

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


def break_ticket(
    settings: Settings, seq: int, *, force: bool = False, grace_s: float | None = None
) -> BreakResult:
    """Remove ticket ``seq`` if its owner is gone; kill its owner first if hung (or forced)."""
    found = find(settings, seq)
    if found is None:
        raise LockError(f"no ticket {seq} in {settings.state_dir}", hint="gpulock status")
    qdir, tf = found
    return _break(settings, qdir, tf, force=force, grace_s=grace_s)


def break_stale(settings: Settings, *, grace_s: float | None = None) -> list[BreakResult]:
    """Break every dead or hung ticket this user may break; others are reported as skipped."""

    results = []
    now_w = time.time()
    for gpu in queue_gpus(settings):
        qdir = QueueDir(settings, gpu, create=False)
        for _seq, tf, _why in qdir.scan():
            if tf is None:
                continue
            alive = qdir.alive(tf.ticket.seq)
            if alive and not queue.is_hung(tf.ticket, tf.mtime_wall, now_w):
                continue
            try:
                results.append(_break(settings, qdir, tf, force=False, grace_s=grace_s))
            except NotPermitted as e:
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

        def send(sig: int) -> bool:
            signal_holder(t, sig)
            return True  # the wait tells: a holder that no longer matches is not signalled

        def announce(sig_name: str) -> None:
            settings.emit("kill", **evidence, signal=sig_name, reason=why, by_pid=os.getpid())

        if claim.end_owner(fd, send, grace, announce) == "survived":
            raise LockError(
                f"ticket {t.seq}: pid {t.pid} still holds it after SIGKILL",
                hint="another process may have inherited its descriptor; see 'lsof'",
            )
    finally:
        os.close(fd)
    qdir.remove(t.seq)
    settings.emit("break", **evidence, action="killed", reason=why, by_pid=os.getpid())
    return BreakResult(t.seq, t.gpu, "killed", f"pid {t.pid} ({t.name}): {why}")
