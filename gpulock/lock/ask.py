"""An ask for GPUs: ``acquire``'s arguments checked, then made into the ticket they describe.

Every argument is checked before a queue folder exists (a GPU this machine does not have is
``NoSuchGpu``, naming the ones there are), so a refused ask leaves nothing behind.  The ticket
itself is made later, under the sequence mutex, once its number is known
(``gpulock.lock.queuedir.enqueue_set``): ``ticket_maker`` returns the function that makes it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpulock.core import devices, identity
from gpulock.core.config import Config
from gpulock.core.units import parse_duration, parse_size
from gpulock.lock import gpuset
from gpulock.lock import prefetch as prefetch_mod
from gpulock.lock.gpuset import GpuArg
from gpulock.lock.ticket import Ticket


@dataclass(frozen=True, slots=True)
class Ask:
    """What a caller asks for, checked: the GPUs it may take (``gset``), how many at once."""

    gset: tuple[int, ...]
    count: int
    timeout_s: float | None
    lease_s: float | None
    need_bytes: int | None  # None: the whole GPU, exclusively
    warm_paths: tuple[str, ...]  # files to prefetch while waiting (absolute, readable)


def check_ask(
    cfg: Config,
    gpu: GpuArg,
    need: int | str | None,
    timeout: float | str | None,
    lease: float | str | None,
    gpus: int | None,
    prefetch: Sequence[str | os.PathLike[str]] | None,
) -> Ask:
    """The ask, or the error of its first bad argument (ValueError, GpulockError, NoSuchGpu)."""
    count = gpuset.count_of(gpus)
    gset = gpuset.gpu_set(cfg, gpu, count)
    timeout_s = None if timeout is None else parse_duration(timeout, key="timeout")
    lease_s = None if lease is None else parse_duration(lease, key="lease")
    need_bytes = None if need is None else parse_size(need, key="need")
    if need_bytes is not None and need_bytes <= 0:
        raise ValueError(f"need must be above 0, got {need!r}")
    warm_paths = prefetch_mod.check_paths(prefetch or ())
    # Before QueueDir() creates gpu<N>/: a refused GPU must leave no queue folder behind.
    for g in gset:
        devices.check_gpu(g, cfg)  # NoSuchGpu, naming the GPUs there are
    return Ask(gset, count, timeout_s, lease_s, need_bytes, warm_paths)


def ticket_maker(
    ask: Ask,
    gset: tuple[int, ...],
    spans: bool,
    name: str | None,
    command: Sequence[str] | None,
    me: identity.Identity,
) -> tuple[str, Callable[[int], Ticket]]:
    """The ticket's name (``name``, else the program's) and the function that makes the ticket
    for ``gset`` (the GPUs left once budgets are known) from its sequence number."""
    argv = tuple(command) if command is not None else own_command()
    label = name or (os.path.basename(argv[0]) if argv else "python")

    def make(seq: int) -> Ticket:
        return Ticket(
            seq=seq,
            gpu=gset[0],
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
            need_bytes=ask.need_bytes,
            lease_s=ask.lease_s,
            gpus=gset if spans else (),
            count=ask.count,
        )

    return label, make


def own_command() -> tuple[str, ...]:
    """This process's command line (its first 32 words), as ``gpulock status`` shows it."""
    try:
        with open("/proc/self/cmdline", "rb") as f:
            parts = f.read().split(b"\0")
        return tuple(p.decode(errors="replace") for p in parts if p)[:32]
    except OSError:
        return ()
