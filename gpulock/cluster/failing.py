"""Peers that failed a call from this host: skipped by every caller here until they beat again.

A frozen peer (SIGSTOP, a hung kernel, a partition one way) still accepts connections, and its
last report stays fresh in Redis for up to three heartbeats; a cooldown that ends after a fixed
time sends the next caller to it again while it is still frozen, to wait out another
``peer_timeout``.  So a peer that sent no answer in time, refused, or broke off is *failing*
for every process of this host (``get_model`` in each agent, ``gpulock route``, ``gpulock
serve``) until its heartbeat moves: until the report it publishes is newer than the one in force
when it failed.  A peer that comes back is used again at its first beat; one that stays frozen
stops beating and drops out of the fleet by itself.

``<state>/cluster-failing.json`` (format ``gpulock.cluster.failing/1``)::

    {"format": "gpulock.cluster.failing/1",
     "peers": {"b": {"beat_wall": 1764110000.0, "at_wall": 1764110003.2, "reason": "timeout"}}}

``beat_wall`` is the ``at_wall`` of the peer's report read when the call failed.  Changes are
made under an ``flock`` (read, change, atomic replace); readers ignore what they cannot read
(a damaged file marks no peer failing: a frozen peer then costs one more ``peer_timeout``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from gpulock.core import safejson, state, statefile
from gpulock.core.errors import StateDirError
from gpulock.core.settings import Settings

FORMAT: Final = "gpulock.cluster.failing/1"
FILE: Final = "cluster-failing.json"
LOCK_FILE: Final = "cluster-failing.lock"
KEEP_S: Final = 3600.0  # a mark whose peer was not seen for an hour is forgotten
_HINT: Final = "move it away, or check the state folder's owner and mode (ls -la)"


@dataclass(frozen=True, slots=True)
class Mark:
    beat_wall: float  # the at_wall of the peer's report in force when it failed
    at_wall: float  # when it failed
    reason: str


def path(settings: Settings) -> Path:
    return settings.state_dir / FILE


def parse(data: bytes | None) -> dict[str, Mark]:
    """The marks in ``data``; nothing for a missing, damaged or foreign file."""
    if not data:
        return {}
    try:
        obj: Any = safejson.loads(data)
    except ValueError:
        return {}
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        return {}
    peers = obj.get("peers")
    if not isinstance(peers, dict):
        return {}
    out: dict[str, Mark] = {}
    for host, m in peers.items():
        try:
            out[str(host)] = Mark(float(m["beat_wall"]), float(m["at_wall"]), str(m["reason"]))
        except (KeyError, TypeError, ValueError):
            continue
    return out


_READ: dict[str, tuple[tuple[int, int, int], dict[str, Mark]]] = {}


def read(settings: Settings) -> dict[str, Mark]:
    """This host's marks, parsed again only when the file changed (a ``stat`` a call)."""
    p = path(settings)
    try:
        st = os.stat(p)
    except OSError:
        return {}
    key = (st.st_ino, st.st_mtime_ns, st.st_size)
    hit = _READ.get(str(p))
    if hit is not None and hit[0] == key:
        return hit[1]
    try:
        marks = parse(statefile.read_small(p, 1 << 20))
    except (OSError, StateDirError):
        marks = {}
    _READ[str(p)] = (key, marks)
    return marks


def failing(marks: dict[str, Mark], beats: Iterable[tuple[str, float]]) -> frozenset[str]:
    """The hosts among ``beats`` (host, at_wall of its live report) still failing: marked,
    and no report newer than the one in force when they failed (pure)."""
    return frozenset(
        host for host, at in beats if (m := marks.get(host)) is not None and at <= m.beat_wall
    )


def failing_now(settings: Settings, beats: Iterable[tuple[str, float]]) -> frozenset[str]:
    """``failing`` over this host's marks as they are on disk now."""
    marks = read(settings)
    return failing(marks, beats) if marks else frozenset()


def mark(
    settings: Settings,
    host: str,
    beat_wall: float,
    reason: str,
    *,
    now_wall: float | None = None,
) -> None:
    """``host`` failed a call now; its report in force was made at ``beat_wall``."""
    now = time.time() if now_wall is None else now_wall
    with _change(settings) as marks:
        prev = marks.get(host)
        if prev is None or beat_wall >= prev.beat_wall:
            marks[host] = Mark(beat_wall, now, reason[:200])
        for h in [h for h, m in marks.items() if now - m.at_wall > KEEP_S]:
            del marks[h]


@contextlib.contextmanager
def _change(settings: Settings) -> Iterator[dict[str, Mark]]:
    folder = state.ensure_state_dir(settings.state_dir, group=settings.group)
    lock = folder / LOCK_FILE
    try:
        fd = statefile.open_regular(lock, os.O_RDWR | os.O_CREAT, settings.file_mode)
    except OSError as e:
        raise StateDirError(str(lock), f"cannot open: {e.strerror or e}", hint=_HINT) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            marks = parse(statefile.read_small(folder / FILE, 1 << 20))
        except (OSError, StateDirError):
            marks = {}
        yield marks
        data = {
            "format": FORMAT,
            "peers": {
                h: {"beat_wall": m.beat_wall, "at_wall": m.at_wall, "reason": m.reason}
                for h, m in sorted(marks.items())
            },
        }
        statefile.atomic_write(
            folder / FILE, json.dumps(data, separators=(",", ":")).encode(), mode=settings.file_mode
        )
    finally:
        os.close(fd)
