"""The ticket record: one waiter or holder in a GPU's queue (pure: encode and parse).

On disk a ticket is ``<state>/gpu<N>/<seq>.ticket``, a small JSON object written atomically
(temp file + rename), next to ``<seq>.fifo``, the FIFO whose open read end is the owner's
kernel-held claim (see ``gpulock.lock.lease``).  The sequence number is the queue order; it is
unique in a state folder, so ``gpulock break 12`` names one ticket on any GPU.

Format ``gpulock.ticket/1``.  Readers ignore keys they do not know, so later versions may add
fields; a file that is not valid JSON, lacks a required field, or carries another major format
is rejected with ``TicketFormatError`` and skipped by every reader (never a crash).

A ticket for a set of GPUs (``--gpu any``, ``--gpu 0,2``) or for several at once (``--gpus 2``)
is one number with a copy in the folder of every GPU of its set, each with its own FIFO, and
three more keys: ``gpus`` (the set), ``count`` (how many at once) and, once granted,
``granted_gpus`` (all it holds).  A copy's ``gpu`` is its folder.  While it waits, a copy stands
in each line; at its grant the copies of the GPUs it takes are marked granted and the others
removed; its owner holds every copy's claim, so its death frees every GPU it held or waited
for.  The format stays ``/1`` on purpose: a reader that knows nothing of sets reads each copy as
an ordinary ticket of that GPU, which is exactly what it is in that GPU's line (a waiter of an
older gpulock waits behind it, as the rule wants).  A pinned ticket writes none of the three
keys: its file is byte for byte what it was.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields, replace
from typing import Any

from gpulock.core import safejson

FORMAT = "gpulock.ticket/1"
_FORMAT_MAJOR = "gpulock.ticket/1"
SEQ_DIGITS = 12
# 12 digits or more (a number past 10**12 must not vanish from the queue), ASCII only.
TICKET_RE = re.compile(r"^([0-9]{12,})\.ticket$")


class TicketFormatError(ValueError):
    """A file in a queue folder that is not a readable ticket."""


@dataclass(frozen=True, slots=True)
class Ticket:
    """One place in a GPU's queue: who asked, for what, and since when."""

    seq: int
    gpu: int
    pid: int
    uid: int
    user: str
    host: str
    name: str
    created_wall: float
    start_ticks: int | None = None
    boot_id: str | None = None
    pidns: str | None = None
    command: tuple[str, ...] = ()
    need_bytes: int | None = None  # None: exclusive, the whole GPU
    lease_s: float | None = None  # None: may hold for ever
    granted_wall: float | None = None  # None: still waiting
    child_pid: int | None = None  # `gpulock run`: the command that holds the GPU
    child_start_ticks: int | None = None
    # Several GPUs, one line (empty and 1 for a ticket pinned to ``gpu``, the only form before):
    gpus: tuple[int, ...] = ()  # the set it may be granted on; a copy waits in each one's line
    count: int = 1  # how many of them it takes at once, all or nothing
    granted_gpus: tuple[int, ...] = ()  # once granted: every GPU it holds (set tickets only)

    @property
    def exclusive(self) -> bool:
        return self.need_bytes is None

    @property
    def gpu_set(self) -> tuple[int, ...]:
        """The GPUs this ticket may be granted on (its own ``gpu`` for a pinned ticket)."""
        return self.gpus or (self.gpu,)

    @property
    def spans(self) -> bool:
        """Whether it waits in more than one line or takes more than one GPU."""
        return len(self.gpus) > 1 or self.count > 1

    @property
    def held_gpus(self) -> tuple[int, ...]:
        """The GPUs it holds: all it was granted, or its own ``gpu`` for a pinned holder."""
        if not self.holding:
            return ()
        return self.granted_gpus or (self.gpu,)

    @property
    def holding(self) -> bool:
        return self.granted_wall is not None

    def granted(self, now_wall: float) -> Ticket:
        return replace(self, granted_wall=now_wall)


def event_fields(t: Ticket) -> dict[str, Any]:
    """The fields every event about a ticket carries; for a set ticket also ``gpus`` (the set
    asked, or the number of GPUs at once), ``gpu_set`` (with a number: the GPUs it may take)
    and ``granted`` (the GPUs it holds, empty while it waits)."""
    fields: dict[str, Any] = {
        "gpu": t.gpu,
        "ticket": t.seq,
        "pid": t.pid,
        "name": t.name,
        "need_bytes": t.need_bytes,
    }
    if t.spans:
        fields.update(set_fields(t))
    return fields


def set_fields(t: Ticket) -> dict[str, Any]:
    """``gpus``, ``gpu_set`` and ``granted`` of a ticket, as events and status say them."""
    out: dict[str, Any] = {"gpus": t.count if t.count > 1 else list(t.gpu_set)}
    if t.count > 1:
        out["gpu_set"] = list(t.gpu_set)
    out["granted"] = list(t.held_gpus)
    return out


def file_name(seq: int) -> str:
    return f"{seq:0{SEQ_DIGITS}d}.ticket"


def fifo_name(seq: int) -> str:
    # Derived from the sequence number, never read from the ticket: a crafted ticket cannot
    # point a reader at another path.
    return f"{seq:0{SEQ_DIGITS}d}.fifo"


def seq_of(name: str) -> int | None:
    m = TICKET_RE.match(name)
    return int(m.group(1)) if m else None


def encode(t: Ticket) -> bytes:
    """The file's bytes: the format, then every field in order (the record is flat: a walk
    over its fields, not ``asdict``'s deep copy, which costs more than the rest of a grant)."""
    body: dict[str, Any] = {"format": FORMAT}
    for key in _FIELDS:
        value = getattr(t, key)
        if key in _SET_KEYS:
            if value == () or (key == "count" and value == 1):
                continue  # a pinned ticket's file stays what it was before sets
            value = list(value) if isinstance(value, tuple) else value
        elif key == "command":
            value = list(value)
        body[key] = value
    return json.dumps(body, separators=(",", ":")).encode()


_SET_KEYS = frozenset({"gpus", "count", "granted_gpus"})
_FIELDS = tuple(f.name for f in fields(Ticket))
MAX_GPUS = 1024  # more GPUs than any machine has: a longer list is garbage


_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "seq": int,
    "gpu": int,
    "pid": int,
    "uid": int,
    "user": str,
    "host": str,
    "name": str,
    "created_wall": (int, float),
}
_OPTIONAL: dict[str, type | tuple[type, ...]] = {
    "start_ticks": int,
    "boot_id": str,
    "pidns": str,
    "need_bytes": int,
    "lease_s": (int, float),
    "granted_wall": (int, float),
    "child_pid": int,
    "child_start_ticks": int,
}


def parse(data: bytes) -> Ticket:
    """Parse a ticket file's bytes; raise TicketFormatError saying what is wrong."""
    try:
        obj = safejson.loads(data)
    except safejson.TooDeep as e:
        raise TicketFormatError(f"not JSON ({e})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise TicketFormatError(f"not JSON ({e.__class__.__name__})") from None
    if not isinstance(obj, dict):
        raise TicketFormatError("not a JSON object")
    fmt = obj.get("format")
    if not isinstance(fmt, str) or not fmt.startswith(_FORMAT_MAJOR):
        raise TicketFormatError(f"unknown format {fmt!r}")
    fields: dict[str, Any] = {}
    for key, typ in _REQUIRED.items():
        val = obj.get(key)
        if not isinstance(val, typ) or isinstance(val, bool):
            raise TicketFormatError(f"missing or bad {key!r}")
        fields[key] = val
    for key, typ in _OPTIONAL.items():
        val = obj.get(key)
        if val is None:
            continue
        if not isinstance(val, typ) or isinstance(val, bool):
            raise TicketFormatError(f"bad {key!r}")
        fields[key] = val
    if fields["seq"] <= 0 or fields["gpu"] < 0:
        raise TicketFormatError("bad 'seq' or 'gpu'")
    for key in ("pid", "child_pid"):  # a pid the kernel could hand out (pid_max <= 2**22)
        if key in fields and not 0 < fields[key] < 2**31:
            raise TicketFormatError(f"bad {key!r}")
    if not 0 <= fields["uid"] < 2**32:
        raise TicketFormatError("bad 'uid'")
    need = fields.get("need_bytes")
    if need is not None and need <= 0:
        raise TicketFormatError("bad 'need_bytes'")
    cmd = obj.get("command", [])
    if not isinstance(cmd, list) or not all(isinstance(a, str) for a in cmd):
        raise TicketFormatError("bad 'command'")
    fields["command"] = tuple(cmd)
    if "gpus" in obj or "count" in obj or "granted_gpus" in obj:  # not a pinned ticket's
        fields.update(_parse_set(obj, fields))
    return Ticket(**fields)


def _gpu_list(obj: dict[str, Any], key: str) -> tuple[int, ...]:
    val = obj.get(key)
    if val is None:
        return ()
    if (
        not isinstance(val, list)
        or not 0 < len(val) <= MAX_GPUS
        or not all(type(g) is int and 0 <= g < 2**31 for g in val)
        or len(set(val)) != len(val)
    ):
        raise TicketFormatError(f"bad {key!r}")
    return tuple(sorted(val))


def _parse_set(obj: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """``gpus``, ``count``, ``granted_gpus``: absent on a pinned ticket; consistent otherwise."""
    gpus = _gpu_list(obj, "gpus")
    granted = _gpu_list(obj, "granted_gpus")
    count = obj.get("count", 1)
    if type(count) is not int or count < 1:
        raise TicketFormatError("bad 'count'")
    everyone = gpus or (fields["gpu"],)
    if fields["gpu"] not in everyone or count > len(everyone):
        raise TicketFormatError("bad 'gpus': its own GPU is not in it, or fewer than 'count'")
    if granted and (
        len(granted) != count
        or not set(granted) <= set(everyone)
        or fields["gpu"] not in granted
        or "granted_wall" not in fields
    ):
        raise TicketFormatError("bad 'granted_gpus'")
    out: dict[str, Any] = {}
    if gpus:
        out["gpus"] = gpus
    if count != 1:
        out["count"] = count
    if granted:
        out["granted_gpus"] = granted
    return out
