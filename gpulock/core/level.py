"""The governor's published level, read by every process with one small file read.

The governor (``governor`` package) writes ``<state>/governor.json`` atomically each pass:
format ``gpulock.governor/1``, ``level`` (``normal``, ``reduce``, ``evict-idle``,
``force-evict``, ``freeze``), ``since_wall``, ``updated_wall``, ``interval_s``, ``pid`` and
the last ``signals`` and ``thresholds``.  It also holds ``<state>/governor.fifo`` open (a
``gpulock.core.claim``) for as long as it runs.

A level counts only while its governor lives (the claim is held) and has written within
three intervals: a governor that died in ``freeze`` never freezes the queue for ever.
Readers (the lock, the router, residents) live here so that gpulock imports nothing above it.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpulock.core import claim, safejson
from gpulock.core.errors import StateDirError
from gpulock.core.settings import Settings
from gpulock.core.statefile import atomic_write, read_small

FORMAT = "gpulock.governor/1"
FILE = "governor.json"
CLAIM = "governor.fifo"
LEVELS = ("normal", "reduce", "evict-idle", "force-evict", "freeze")
STALE_INTERVALS = 3.0


@dataclass(frozen=True, slots=True)
class Published:
    level: str
    since_wall: float
    updated_wall: float
    interval_s: float
    pid: int
    signals: dict[str, Any] = field(default_factory=dict)
    thresholds: dict[str, Any] = field(default_factory=dict)
    memory: dict[str, Any] = field(default_factory=dict)  # the governor's own, between passes

    def fresh(self, now_wall: float) -> bool:
        return now_wall - self.updated_wall <= STALE_INTERVALS * max(self.interval_s, 1.0)


def claim_path(settings: Settings) -> Path:
    return settings.state_dir / CLAIM


def write(settings: Settings, published: Published) -> None:
    data = json.dumps({"format": FORMAT, **asdict(published)}, separators=(",", ":"), default=str)
    atomic_write(settings.state_dir / FILE, data.encode(), mode=settings.file_mode)


def read_raw(settings: Settings) -> Published | None:
    """The file as written, alive governor or not; None when missing or unreadable."""
    try:
        # Non-blocking, regular files only, bounded: a FIFO put in its place must not hang
        # every `gpulock run` (statefile.read_small), nor deep nesting crash it (safejson).
        obj = safejson.loads(read_small(settings.state_dir / FILE, 1 << 16) or b"null")
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            return None
        pub = Published(**{k: obj[k] for k in Published.__dataclass_fields__ if k in obj})
    except (OSError, ValueError, TypeError, StateDirError):
        return None
    numbers = (pub.since_wall, pub.updated_wall, pub.interval_s)
    if not all(isinstance(n, int | float) and not isinstance(n, bool) for n in numbers):
        return None
    if not isinstance(pub.pid, int) or not all(
        isinstance(d, dict) for d in (pub.signals, pub.thresholds, pub.memory)
    ):
        return None
    if not isinstance(pub.level, str) or pub.level not in LEVELS:
        return None
    return pub


def read(settings: Settings, *, now_wall: float | None = None) -> Published | None:
    """The level in force: None when no governor runs or its word is stale."""
    pub = read_raw(settings)
    if pub is None:
        return None
    if not pub.fresh(time.time() if now_wall is None else now_wall):
        return None
    if not claim.held(claim_path(settings)):
        return None
    return pub


def current(settings: Settings) -> str:
    """``normal`` unless a live governor says otherwise."""
    pub = read(settings)
    return pub.level if pub is not None else "normal"


def freeze(settings: Settings, *, now_wall: float | None = None) -> Published | None:
    """The live governor's word when it is ``freeze`` (new GPU admissions wait), else None.

    Cheap on the lock's path: one small read, and the claim is probed only when frozen.
    """
    pub = read_raw(settings)
    if pub is None or pub.level != "freeze":
        return None
    if not pub.fresh(time.time() if now_wall is None else now_wall):
        return None
    return pub if claim.held(claim_path(settings)) else None


def stale_at_wall(pub: Published) -> float:
    """When this word stops counting if the governor writes nothing new."""
    return pub.updated_wall + STALE_INTERVALS * max(pub.interval_s, 1.0)


def governor_level(config: Any = None, state_dir: str | None = None) -> str:
    """The level in force for this state folder: ``normal`` unless a live governor says otherwise.

    At ``reduce`` and above, load models with smaller contexts and run smaller batches.
    """
    from gpulock.core.settings import load

    return current(load(config, state_dir))
