"""A host's report (what it publishes each heartbeat) and its reading by the other hosts.

Format ``gpulock.cluster.host/1``, one JSON object::

    {"format": "gpulock.cluster.host/1", "host": "b", "gateway": "http://10.0.0.7:11435",
     "at_wall": 1764110000.0, "heartbeat_s": 2.0, "pid": 4711, "level": "normal",
     "in_flight": 1,
     "gpus": [{"index": 0, "total_bytes": 25769803776, "claimed_bytes": 0,
               "free_bytes": 20000000000,
               "holding": 1, "waiting": 0, "est_wait_s": 3.5, "hold_s": 4.0}],
     "candidates": [{"name": "tiny-gpu", "load_s": 1.0, "gpus": [0], "waits": [3.5]}],
     "warm": ["tiny-gpu"]}

``candidates`` are the route candidates of the gpu tier this host can run (a GPU big enough),
with a newcomer's wait for each on each of those GPUs (``waits``, optional: without it the
GPU's ``est_wait_s`` stands); ``warm`` the ones loaded now.  Readers ignore keys they do not
know and skip a report they cannot read: a newer host's report never breaks an older one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from gpulock.core.foresight import DISK_BYTES_PER_S

FORMAT: Final = "gpulock.cluster.host/1"
# A load's time when none was measured: its size at foresight's cold read from disk (1 GiB/s).
LOAD_BYTES_PER_S: Final = DISK_BYTES_PER_S
LOAD_MIN_S: Final = 1.0


@dataclass(frozen=True, slots=True)
class GpuLine:
    index: int
    total_bytes: int | None
    free_bytes: int | None
    holding: int
    waiting: int
    est_wait_s: float | None  # a newcomer's wait in this GPU's line; None: cannot tell
    hold_s: float  # a typical hold on this GPU: what one more request adds to the wait
    # What the lock's holders claim (an exclusive one: the whole GPU); ``free_bytes`` counts it,
    # as gpulock status does.  None: unknown (a report from an older host).
    claimed_bytes: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "total_bytes": self.total_bytes,
            "claimed_bytes": self.claimed_bytes,
            "free_bytes": self.free_bytes,
            "holding": self.holding,
            "waiting": self.waiting,
            "est_wait_s": None if self.est_wait_s is None else round(self.est_wait_s, 3),
            "hold_s": round(self.hold_s, 3),
        }


@dataclass(frozen=True, slots=True)
class Runs:
    """A gpu candidate a host can run: its name, its load time, the GPUs it fits on, and (when
    the host says) a newcomer's wait for it on each of those GPUs, in order.  Its own wait may
    differ from the GPU's ``est_wait_s`` (an exclusive newcomer's): its need may share the GPU
    with the holders, and a ``kind: command`` tenant's calls take no ticket at all (its server
    holds one for as long as it runs)."""

    name: str
    load_s: float
    gpus: tuple[int, ...]
    waits: tuple[float | None, ...] = ()  # None: the GPU's est_wait_s stands

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "load_s": round(self.load_s, 3),
            "gpus": list(self.gpus),
        }
        if self.waits:
            out["waits"] = [None if w is None else round(w, 3) for w in self.waits]
        return out

    def wait_on(self, gpu: int) -> float | None:
        """This candidate's own wait on ``gpu`` as published; None: the GPU's stands."""
        if len(self.waits) != len(self.gpus):
            return None
        return dict(zip(self.gpus, self.waits, strict=True)).get(gpu)


@dataclass(frozen=True, slots=True)
class HostReport:
    host: str
    gateway: str | None
    at_wall: float
    heartbeat_s: float
    level: str = "normal"
    gpus: tuple[GpuLine, ...] = ()
    candidates: tuple[Runs, ...] = ()
    warm: frozenset[str] = frozenset()
    in_flight: int = 0
    pid: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)  # unknown keys, kept for display

    def as_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "host": self.host,
            "gateway": self.gateway,
            "at_wall": round(self.at_wall, 3),
            "heartbeat_s": self.heartbeat_s,
            "pid": self.pid,
            "level": self.level,
            "in_flight": self.in_flight,
            "gpus": [g.as_dict() for g in self.gpus],
            "candidates": [c.as_dict() for c in self.candidates],
            "warm": sorted(self.warm),
        }

    def runs(self, name: str) -> Runs | None:
        return next((c for c in self.candidates if c.name == name), None)


def load_estimate_s(vram_bytes: int | None) -> float:
    """A model's load time when none was measured: its size read at 1 GiB/s, at least 1 s."""
    if vram_bytes is None:
        return LOAD_MIN_S
    return max(LOAD_MIN_S, vram_bytes / LOAD_BYTES_PER_S)


def parse(obj: Any) -> HostReport | None:
    """A report as read from Redis; None when it is not one (wrong format, bad fields)."""
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        return None
    try:
        host = obj["host"]
        if not isinstance(host, str) or not host:
            return None
        gateway = obj.get("gateway")
        return HostReport(
            host=host,
            gateway=gateway if isinstance(gateway, str) and gateway else None,
            at_wall=_num(obj["at_wall"]),
            heartbeat_s=_num(obj["heartbeat_s"]),
            level=str(obj.get("level") or "normal"),
            gpus=tuple(_gpu(g) for g in _list(obj.get("gpus"))),
            candidates=tuple(_runs(c) for c in _list(obj.get("candidates"))),
            warm=frozenset(str(w) for w in _list(obj.get("warm"))),
            in_flight=int(_num(obj.get("in_flight", 0))),
            pid=obj.get("pid") if isinstance(obj.get("pid"), int) else None,
            extra={k: v for k, v in obj.items() if k not in _KNOWN},
        )
    except (KeyError, TypeError, ValueError):
        return None


_KNOWN = frozenset(HostReport.__dataclass_fields__) | {"format"}


def _num(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise TypeError(f"not a number: {v!r}")
    return float(v)


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(_num(v))


def _list(v: Any) -> Sequence[Any]:
    if v is None:
        return ()
    if not isinstance(v, list):
        raise TypeError("not a list")
    return v


def _gpu(g: Any) -> GpuLine:
    if not isinstance(g, dict):
        raise TypeError("not a GPU")
    est = g.get("est_wait_s")
    return GpuLine(
        index=int(_num(g["index"])),
        total_bytes=_opt_int(g.get("total_bytes")),
        free_bytes=_opt_int(g.get("free_bytes")),
        holding=int(_num(g.get("holding", 0))),
        waiting=int(_num(g.get("waiting", 0))),
        est_wait_s=None if est is None else _num(est),
        hold_s=_num(g.get("hold_s", 30.0)),
        claimed_bytes=_opt_int(g.get("claimed_bytes")),
    )


def _runs(c: Any) -> Runs:
    if not isinstance(c, dict) or not isinstance(c.get("name"), str):
        raise TypeError("not a candidate")
    return Runs(
        name=c["name"],
        load_s=_num(c.get("load_s", LOAD_MIN_S)),
        gpus=tuple(int(_num(i)) for i in _list(c.get("gpus"))),
        waits=tuple(None if w is None else _num(w) for w in _list(c.get("waits"))),
    )
