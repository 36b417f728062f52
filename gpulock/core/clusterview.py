"""What this host last saw of its cluster, for ``gpulock status`` and ``/health`` (no Redis here).

``gpulock serve`` (with a ``cluster:`` section) writes ``<state>/cluster.json`` atomically each
heartbeat: format ``gpulock.cluster.view/1``, ``host``, ``hosts`` (live hosts seen, this one
included; the last count while Redis is down), ``redis`` (``ok`` or ``down``), ``problem`` (why
not, without secrets), ``heartbeat_s``, ``updated_wall`` and ``pid``.  A view counts only while
it is fresh (written within three heartbeats): a stopped server's view is no news.  Reading it
costs one small file read, so the lock's side of gpulock never talks to Redis.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Final

from gpulock.core import safejson
from gpulock.core.errors import StateDirError
from gpulock.core.settings import Settings
from gpulock.core.statefile import atomic_write, read_small

FORMAT: Final = "gpulock.cluster.view/1"
FILE: Final = "cluster.json"
STALE_HEARTBEATS: Final = 3.0


@dataclass(frozen=True, slots=True)
class View:
    host: str
    hosts: int
    redis: str  # "ok" | "down"
    problem: str | None
    heartbeat_s: float
    updated_wall: float
    pid: int

    def fresh(self, now_wall: float) -> bool:
        return now_wall - self.updated_wall <= STALE_HEARTBEATS * max(self.heartbeat_s, 1.0)

    def line(self) -> str:
        """``cluster: 3 hosts, redis ok`` (the line ``gpulock status`` shows)."""
        n = f"{self.hosts} host{'s' if self.hosts != 1 else ''}"
        if self.redis == "ok":
            return f"cluster: {n}, redis ok"
        return f"cluster: {n} last seen, redis down ({self.problem or 'unreachable'}); local only"


def write(settings: Settings, view: View) -> None:
    data = json.dumps({"format": FORMAT, **asdict(view)}, separators=(",", ":"))
    atomic_write(settings.state_dir / FILE, data.encode(), mode=settings.file_mode)


def read(settings: Settings, now_wall: float, *, any_age: bool = False) -> View | None:
    """The fresh view (``any_age``: however old); None when there is none (no cluster, no
    server, stale or unreadable)."""
    try:
        obj = safejson.loads(read_small(settings.state_dir / FILE, 1 << 16) or b"null")
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            return None
        view = View(**{k: obj[k] for k in View.__dataclass_fields__})
    except (OSError, ValueError, TypeError, KeyError, StateDirError):
        return None
    if not isinstance(view.hosts, int) or view.redis not in ("ok", "down"):
        return None
    if not all(isinstance(n, int | float) for n in (view.heartbeat_s, view.updated_wall)):
        return None
    return view if any_age or view.fresh(now_wall) else None
