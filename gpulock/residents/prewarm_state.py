"""Pre-warm's published state, ``<state>/prewarm.json``, and its readers.

Written by the governor's ``gpulock.residents.prewarm.Prewarmer`` (format ``gpulock.prewarm/1``,
atomically, with the state folder's file mode): what it is warming, what it warmed or loaded
ahead, each with the prediction that caused it, and what is due but not warmed, with why.
Read by ``gpulock status`` (``published``) and by eviction (``loaded_ahead``: a model loaded
ahead and not used since is the first victim).  What is under way counts while its writer
lives; what was done, until its predicted use has passed by a lead (a ``--once`` pass from
cron exits, its loads ahead stay).
"""

from __future__ import annotations

import time
from typing import Any, Final

from gpulock.core import identity, safejson, statefile
from gpulock.core.errors import GpulockError
from gpulock.core.settings import Settings

PUBLISHED: Final = "prewarm.json"
FORMAT: Final = "gpulock.prewarm/1"
DONE: Final = ("warm", "loaded", "stopped", "failed")


def used_since(past: Any, model: str, since_wall: float | None) -> bool:
    """Whether an agent called ``model`` after ``since_wall`` (a load ahead's own appearance
    is no use: only calls name an agent)."""
    if since_wall is None:
        return False
    return any(u.model == model and u.by and u.at_wall > since_wall for u in past.uses)


def published(settings: Settings, now_wall: float | None = None) -> dict[str, Any] | None:
    """The governor's last word on pre-warming: what is under way (while its writer lives) and
    what was done (until its predicted use has passed by a lead: a pass from cron exits, its
    loads ahead stay)."""
    try:
        raw = statefile.read_small(settings.state_dir / PUBLISHED)
        doc = safejson.loads(raw) if raw is not None else None
    except (OSError, ValueError, GpulockError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        return None
    now = time.time() if now_wall is None else now_wall
    pid = doc.get("pid")
    live = isinstance(pid, int) and identity.pid_exists(pid)
    entries = doc.get("entries")
    waiting = doc.get("waiting")
    keep = []
    for e in entries if isinstance(entries, list) else ():
        if not isinstance(e, dict):
            continue
        until = e.get("until_wall")
        if e.get("state") in DONE:
            if isinstance(until, int | float) and now <= until:
                keep.append(e)
        elif live:
            keep.append(e)
    # What waits is news while its writer lives, or (a pass from cron) for a lead after it
    updated, lead = doc.get("updated_wall"), doc.get("lead_s")
    recent = (
        isinstance(updated, int | float) and isinstance(lead, int | float) and now - updated <= lead
    )
    news = waiting if (live or recent) and isinstance(waiting, list) else []
    return {
        "updated_wall": updated,
        "entries": keep,
        "waiting": [e for e in news if isinstance(e, dict)],
    }


def loaded_ahead(settings: Settings) -> dict[str, float]:
    """Tenant models loaded ahead and not used since: resident id -> when the load ended.
    ``gpulock.residents.eviction`` evicts these first (a pre-warm is undone first)."""
    doc = published(settings)
    if doc is None:
        return {}
    out: dict[str, float] = {}
    for e in doc["entries"]:
        if e.get("how") != "load" or e.get("state") != "loaded":
            continue
        model, tenant, done = e.get("model"), e.get("tenant"), e.get("done_wall")
        if isinstance(model, str) and isinstance(tenant, str) and isinstance(done, int | float):
            out[f"{tenant}/{model}"] = float(done)
    if not out:
        return {}
    from gpulock.residents.foresight_past import read_past

    past = read_past(settings.state_dir, mode=settings.file_mode)
    return {
        rid: done for rid, done in out.items()
        if not used_since(past, rid.split("/", 1)[1], done)
    }  # fmt: skip
