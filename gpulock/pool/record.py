"""The pool's record in the state folder, for ``gpulock status``: ``<state>/pools/<pid>.json``.

Format ``gpulock.pool/1``, written atomically by the pool on every change and removed when it
ends::

    {"format": "gpulock.pool/1", "name": "tts", "pid": 4711, "start_ticks": ..., "boot_id": ...,
     "pidns": ..., "gpu": 0, "gpus": [0, 1], "need_bytes": 9556302233, "max": 4, "min": 1,
     "workers": [{"index": 0, "pid": 4712, "ticket": 12, "gpus": [0]}], "waiting_ticket": 14,
     "started_wall": 1764000000.0}

``gpus``: the GPUs its workers may run on (``--gpu any``: all; ``gpu`` is the first), and each
worker's the GPUs it holds.

A reader keeps a record only on proof that its pool still runs (same pid, start time, boot and
pid namespace): a pool killed with SIGKILL leaves a file that nobody shows.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from gpulock.core import identity, safejson
from gpulock.core.errors import StateDirError
from gpulock.core.settings import Settings
from gpulock.core.state import ensure_subdir
from gpulock.core.statefile import atomic_write, read_small

FORMAT = "gpulock.pool/1"
FOLDER = "pools"


def path(settings: Settings, pid: int) -> Path:
    return settings.state_dir / FOLDER / f"{pid}.json"


def write(settings: Settings, body: dict[str, Any]) -> None:
    """Write this process's pool record (``body`` without the format and identity fields)."""
    me = identity.current()
    folder = ensure_subdir(settings.state_dir, FOLDER, group=settings.group)
    doc = {
        "format": FORMAT,
        "pid": me.pid,
        "start_ticks": me.start_ticks,
        "boot_id": me.boot_id,
        "pidns": me.pidns,
        **body,
    }
    data = json.dumps(doc, separators=(",", ":")).encode()
    atomic_write(folder / f"{me.pid}.json", data, mode=settings.file_mode)


def remove(settings: Settings) -> None:
    try:
        os.unlink(path(settings, os.getpid()))
    except FileNotFoundError:
        pass


def live(settings: Settings) -> list[dict[str, Any]]:
    """The records of pools that still run, oldest pid first; unreadable files are skipped."""
    folder = settings.state_dir / FOLDER
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    out = []
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            raw = read_small(folder / name, limit=1 << 16)
            doc = safejson.loads(raw) if raw is not None else None
        except (OSError, StateDirError, ValueError):
            continue
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            continue
        pid, ticks = doc.get("pid"), doc.get("start_ticks")
        if not isinstance(pid, int) or not isinstance(ticks, int):
            continue
        pidns = doc.get("pidns") if isinstance(doc.get("pidns"), str) else None
        boot = doc.get("boot_id") if isinstance(doc.get("boot_id"), str) else None
        if identity.same_process(pid, ticks, boot, pidns):
            out.append(doc)
    return out
