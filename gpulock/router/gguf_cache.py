"""GGUF header numbers cached in the state folder, so each cron process skips the parse.

``gpulock.core.gguf.read_info`` caches in the process; a cron job is a new process every time,
and the router's VRAM estimate is needed by every ``gpulock route`` and every agent whose route
names a GPU model.  So the numbers are kept in ``<state>/router/gguf.json`` too, by the model's
path, size and modification time (a replaced or rewritten file is parsed again):

    {"version": 1, "models": {"/models/q.gguf": {"size": 4683073248, "mtime_ns": ...,
     "architecture": "qwen2", "block_count": 28, "embedding_length": 3584,
     "head_count": 28, "head_count_kv": 4}}}

Written atomically (temp file + rename; two writers at once lose at most an entry, which costs
one parse), read defensively: a missing, damaged or foreign file, or an entry with the wrong
types, is a cache miss, never an error.  At most ``MAX_MODELS`` entries are kept.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from gpulock.core import state, statefile
from gpulock.core.errors import StateDirError
from gpulock.core.gguf import GGUFInfo, read_info
from gpulock.core.settings import Settings

FOLDER = "router"
FILE = "gguf.json"
FORMAT = 1
MAX_MODELS = 64
_NUMS = ("block_count", "embedding_length", "head_count", "head_count_kv")


def read_info_cached(settings: Settings, path: str) -> GGUFInfo:
    """``gguf_info.read_info(path)``, from the state folder's cache when the file is unchanged.

    Raises what ``read_info`` raises (OSError, GGUFError) on a miss; a cache that cannot be
    read or written is only a miss.
    """
    st = os.stat(path)
    file = settings.state_dir / FOLDER / FILE
    models = _load(file)
    hit = _entry(models.get(path), path, st.st_size, st.st_mtime_ns)
    if hit is not None:
        return hit
    info = read_info(path)
    models[path] = {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "architecture": info.architecture,
        **{k: getattr(info, k) for k in _NUMS},
    }
    while len(models) > MAX_MODELS:
        models.pop(next(iter(models)))  # the oldest entry: dicts keep insertion order
    data = json.dumps({"version": FORMAT, "models": models}, separators=(",", ":")).encode()
    try:
        state.ensure_subdir(settings.state_dir, FOLDER, group=settings.group)
        statefile.atomic_write(file, data, mode=settings.file_mode)
    except (OSError, StateDirError):
        pass  # a cache only: the next process parses the header again
    return info


def _load(file: Path) -> dict[str, Any]:
    try:
        data = statefile.read_small(file)
        doc = json.loads(data) if data else None
    except (OSError, StateDirError, ValueError, RecursionError):
        return {}
    if not isinstance(doc, dict) or doc.get("version") != FORMAT:
        return {}
    models = doc.get("models")
    return dict(models) if isinstance(models, dict) else {}


def _entry(e: object, path: str, size: int, mtime_ns: int) -> GGUFInfo | None:
    if not isinstance(e, dict) or e.get("size") != size or e.get("mtime_ns") != mtime_ns:
        return None
    arch = e.get("architecture")
    if arch is not None and not isinstance(arch, str):
        return None
    nums: list[int | None] = []
    for k in _NUMS:
        v = e.get(k)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
            return None
        nums.append(v)
    return GGUFInfo(path, size, arch, *nums)


__all__ = ["read_info_cached"]
