"""Last use of tenant models, which no server reports: ``<state>/tenants/usage.json``.

Each listing gives a fingerprint per model that changes when the model serves (Ollama's
``expires_at``, llama-server's task ids).  The first sighting knows nothing (last use None:
the watchdog never evicts on unknown idle time); after that, an unchanged fingerprint means
idle at least since it was first seen unchanged, a changed one means used just now.  A call
gpulock itself routes to a tenant (``touch``) is a use too.  The file is a cache: garbage in it
is ignored, and a lost update only makes a model look used more recently (the safe side).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from gpulock.core.errors import GpulockError
from gpulock.core.settings import Settings
from gpulock.core.state import ensure_subdir
from gpulock.core.statefile import atomic_write, read_small

FILE = "usage.json"
FORMAT = "gpulock.tenant-usage/1"


def _load(settings: Settings) -> dict[str, Any]:
    try:
        raw = read_small(settings.state_dir / "tenants" / FILE)
        obj = json.loads(raw) if raw else None
    except (OSError, ValueError, RecursionError, GpulockError):
        return {}
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        return {}
    models = obj.get("models")
    return models if isinstance(models, dict) else {}


def _save(settings: Settings, models: dict[str, Any]) -> None:
    try:
        folder = ensure_subdir(settings.state_dir, "tenants", group=settings.group)
        data = json.dumps({"format": FORMAT, "models": models}, separators=(",", ":")).encode()
        atomic_write(folder / FILE, data, mode=settings.file_mode)
    except (OSError, GpulockError):
        pass  # a cache: status still answers, the next look tries again


@dataclass(frozen=True, slots=True)
class Observed:
    last_used: dict[str, float | None]  # rid -> last use (None: unknown)
    appeared: tuple[str, ...]  # rids not seen before (a residency starts)
    vanished: tuple[str, ...]  # rids of answering tenants no longer listed (it ended)
    # rids whose last use is only "idle since first seen": a lower bound, never a use seen
    bounded: frozenset[str] = frozenset()


def _bounded(entry: Any) -> bool:
    """Whether an entry's last use is only its first sighting (no use was ever seen)."""
    if not isinstance(entry, dict) or entry.get("used_seen"):
        return False
    last = entry.get("last_used_wall")
    return isinstance(last, int | float) and last == entry.get("first_seen_wall")


def observe(
    settings: Settings,
    seen: dict[str, str | None],
    now_wall: float | None = None,
    *,
    asked: frozenset[str] = frozenset(),
) -> Observed:
    """``rid -> fingerprint`` for the models listed now by the tenants ``asked`` (those that
    answered); the models of tenants that did not answer keep their history."""
    now = time.time() if now_wall is None else now_wall
    old = _load(settings)
    new: dict[str, Any] = {
        rid: e for rid, e in old.items() if rid.split("/", 1)[0] not in asked and rid not in seen
    }
    vanished = tuple(rid for rid in old if rid.split("/", 1)[0] in asked and rid not in seen)
    entry: dict[str, Any]
    out: dict[str, float | None] = {}
    for rid, fp in seen.items():
        prev = old.get(rid) if isinstance(old.get(rid), dict) else None
        last = prev.get("last_used_wall") if prev else None
        last = float(last) if isinstance(last, int | float) else None
        if prev is None:
            entry = {"fp": fp, "first_seen_wall": now, "last_used_wall": None}
        elif fp is not None and prev.get("fp") != fp:
            entry = {
                "fp": fp,
                "first_seen_wall": prev.get("first_seen_wall", now),
                "last_used_wall": now,
                "used_seen": True,
            }
        else:
            first = prev.get("first_seen_wall")
            fresh: float | None = last
            # Unchanged since first seen: idle at least since then (a lower bound is evidence).
            if fresh is None and isinstance(first, int | float) and fp is not None:
                fresh = float(first)
            entry = {**prev, "last_used_wall": fresh}
        new[rid] = entry
        out[rid] = entry["last_used_wall"]
    if new != old:
        _save(settings, new)
    bounded = frozenset(rid for rid in seen if _bounded(new[rid]))
    return Observed(out, tuple(r for r in seen if r not in old), vanished, bounded)


def peek(settings: Settings) -> Observed:
    """Last uses as last recorded (``last_used``, ``bounded``), without observing anything."""
    out: dict[str, float | None] = {}
    models = _load(settings)
    for rid, entry in models.items():
        last = entry.get("last_used_wall") if isinstance(entry, dict) else None
        out[rid] = float(last) if isinstance(last, int | float) else None
    return Observed(out, (), (), frozenset(rid for rid, e in models.items() if _bounded(e)))


def touch(settings: Settings, rid: str, now_wall: float | None = None) -> None:
    """Record a use gpulock itself saw (a routed call to ``TENANT/MODEL``)."""
    models = _load(settings)
    got = models.get(rid)
    entry: dict[str, Any] = got if isinstance(got, dict) else {}
    now = time.time() if now_wall is None else now_wall
    models[rid] = {
        **entry,
        "last_used_wall": now,
        "first_seen_wall": entry.get("first_seen_wall", now),
        "used_seen": True,
    }
    _save(settings, models)
