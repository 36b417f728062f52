"""A holder past its lease (no heartbeat for its ``lease_s``): what the waiter behind it does.

By ``on_hung``: report it, once per heartbeat (a ``stale`` event), or stop it: SIGTERM, then
SIGKILL after ``hung_grace_s``, each only on proof that the process holds the ticket's claim
(``signal_holder``), never on the word of the pids a ticket names.  ``gpulock break``
(``gpulock.lock.repair``) and the command tenants' stop use the same evidence and signal.
"""

from __future__ import annotations

import math
import signal
from pathlib import Path
from typing import Any

from gpulock.core import identity, proof
from gpulock.core.settings import Settings
from gpulock.lock import queue
from gpulock.lock.queuedir import QueueDir, TicketFile
from gpulock.lock.ticket import Ticket, event_fields


class HungHolders:
    """The holders past their lease that one waiter watches: those reported, those signalled."""

    def __init__(self, settings: Settings, recheck_s: float) -> None:
        self.settings = settings
        self.recheck_s = recheck_s  # after a SIGKILL: look again this much later
        self.reported: set[tuple[int, float]] = set()  # (seq, heartbeat) reported stale
        self.kills: dict[int, tuple[float, bool]] = {}  # seq -> (SIGTERM sent at, SIGKILL sent)

    @property
    def killing(self) -> bool:
        """Whether a holder was signalled (its end, or the SIGKILL, is still to be seen)."""
        return bool(self.kills)

    def overdue(self, tf: TicketFile, now_w: float) -> bool:
        """Past its lease and not reported yet: a timed wake must look at it."""
        expiry = queue.lease_expiry_wall(tf.ticket, tf.mtime_wall)
        reported = (tf.ticket.seq, tf.mtime_wall) in self.reported
        return expiry is not None and now_w >= expiry and not reported

    def wake_at(self, qdir: QueueDir, tf: TicketFile, now: float, now_w: float) -> float:
        """Handle a watched holder if it is past its lease; the monotonic time to look again."""
        expiry = queue.lease_expiry_wall(tf.ticket, tf.mtime_wall)
        if expiry is None:
            return math.inf
        if now_w <= expiry:
            return now + (expiry - now_w)
        return self._on_hung(qdir, tf, now, now_w)

    def _on_hung(self, qdir: QueueDir, tf: TicketFile, now: float, now_w: float) -> float:
        """Past its lease: report it once, or stop it by ``on_hung``; when to look again."""
        t = tf.ticket
        cfg = self.settings.config
        evidence = ticket_evidence(tf, now_w)
        why_not = None
        if cfg.on_hung == "kill":
            if not identity.may_signal(t.uid):
                why_not = f"not permitted: owner uid {t.uid}"
            elif t.pidns != identity.pid_namespace():
                why_not = "owner is in another pid namespace"
        fifo = qdir.fifo_path(t.seq)
        sent = self.kills.get(t.seq)
        if (
            cfg.on_hung == "kill"
            and not why_not
            and sent is None
            and not signal_holder(t, signal.SIGTERM, fifo)
        ):
            why_not = f"unproven: pid {t.pid} does not hold the ticket's claim"
        if cfg.on_hung != "kill" or why_not:
            key = (t.seq, tf.mtime_wall)
            if key not in self.reported:
                self.reported.add(key)
                self.settings.emit(
                    "stale", **evidence, action="report", policy=cfg.on_hung, why_not=why_not
                )
            return math.inf
        grace = cfg.hung_grace_s
        if sent is None:
            self.kills[t.seq] = (now, False)
            self.settings.emit("kill", **evidence, signal="SIGTERM", grace_s=grace)
            return now + grace
        at, hard = sent
        if now < at + grace:
            return at + grace
        if not hard:
            signal_holder(t, signal.SIGKILL, fifo)
            self.kills[t.seq] = (at, True)
            self.settings.emit("kill", **evidence, signal="SIGKILL")
        return now + self.recheck_s


def ticket_evidence(tf: TicketFile, now_w: float) -> dict[str, Any]:
    """What a ``stale`` or ``kill`` event says of a holder: its ticket, age and last beat."""
    t = tf.ticket
    beat = queue.heartbeat_wall(t, tf.mtime_wall)
    return {
        **event_fields(t),
        "user": t.user,
        "child_pid": t.child_pid,
        "held_s": round(now_w - (t.granted_wall or now_w), 3),
        "lease_s": t.lease_s,
        "heartbeat_age_s": round(now_w - beat, 3),
    }


def signal_holder(t: Ticket, sig: int, fifo: Path) -> bool:
    """Signal the command first (it holds the GPU), then the owner; True if either was sent.

    Each only on proof that it holds the ticket's claim ``fifo`` (``gpulock.core.proof``): the
    pids in a ticket are what its writer says, and anyone in a shared folder can write one.
    """
    sent = False
    if t.child_pid is not None:
        sent = proof.send(
            t.child_pid,
            t.child_start_ticks,
            t.uid,
            t.pidns,
            fifo,
            sig,
            via=(t.pid, t.start_ticks),
        )
    return proof.send(t.pid, t.start_ticks, t.uid, t.pidns, fifo, sig) or sent
