"""A lease passed down the process tree: ``gpulock run`` holds the ticket, its command (and
anything that command starts) uses the GPU under it.

``gpulock run`` names its ticket in the command's environment (``GPULOCK_TICKET``, and every GPU
it holds in ``GPULOCK_GPUS``); an ``acquire()`` of those GPUs inside is then satisfied at once
instead of queueing behind its own parent.  An environment variable is only a claim: the ticket
must still be held, in this pid namespace, by an ancestor of this process (its owner or its
recorded command), so a copied variable grants nothing.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from gpulock.core import identity
from gpulock.core.settings import Settings
from gpulock.lock.queuedir import QueueDir, Spot
from gpulock.lock.ticket import TicketFormatError

ENV_TICKET = "GPULOCK_TICKET"  # set by `gpulock run` for its command: "<gpu>:<seq>"
ENV_GPUS = "GPULOCK_GPUS"  # ...and every GPU it holds: "1,3"


def inherited_spots(settings: Settings, gset: Sequence[int], count: int) -> list[Spot] | None:
    """The copies of the ticket ``gpulock run`` holds for this process tree on these GPUs,
    if any: the lease to inherit.

    ``GPULOCK_TICKET`` names the ticket (``<gpu>:<seq>``), ``GPULOCK_GPUS`` every GPU it holds.
    Accepted only when the ticket still holds ``count`` GPUs of ``gset`` and its owner (or its
    recorded command) is an ancestor of this process, so a copied environment variable grants
    nothing.
    """
    spec = os.environ.get(ENV_TICKET, "")
    gpu_s, _, seq_s = spec.partition(":")
    if not (gpu_s.isdigit() and seq_s.isdigit()):
        return None
    held_s = os.environ.get(ENV_GPUS, "")
    outer = [int(g) for g in held_s.split(",") if g.isdigit()] or [int(gpu_s)]
    if int(gpu_s) not in outer:
        return None
    family: set[int] | None = None
    spots: list[Spot] = []
    for g in outer:
        if g not in gset or len(spots) >= count:
            continue
        qdir = QueueDir(settings, g, create=False)
        try:
            tf = qdir.read(int(seq_s))
        except TicketFormatError:
            return None
        if tf is None or not tf.ticket.holding or not qdir.alive(tf.ticket.seq):
            return None
        t = tf.ticket
        if t.pidns != identity.pid_namespace():
            return None
        if family is None:
            family = set(identity.ancestors()) | {os.getpid()}
        if not ({t.pid, t.child_pid} & family):
            return None
        spots.append(Spot(qdir, t, _open_fd_of(qdir.fifo_path(t.seq))))
    if len(spots) < count or not spots:
        return None
    return spots


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
