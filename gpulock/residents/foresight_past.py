"""Foresight's past on this machine: what the event log says, kept in a digest.

Read from the tail of the event log (``HISTORY_BYTES``): ``call`` events (model, agent),
``resident`` and ``model-load`` events (a use, and for ``model-load`` its ``load_s``: the reload
cost), ``fleet-start`` / ``fleet-stop`` (the fleets running), and where each model comes from
(``Where``: its file, tenant, GPU and size).  An agent's (or ticket's) models come from the
``call`` events naming both: the route table's choice on this machine as it was actually made.
The digest (``foresight-past.json``) keeps what the log said up to an offset, so each reader
parses only what was written since.  A log or digest that cannot be read adds nothing, never an
error.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from gpulock.core import foresight as fs
from gpulock.core import safejson, statefile
from gpulock.core.errors import StateDirError
from gpulock.core.events import LOG_NAME

HISTORY_BYTES: Final = 4 * 1024**2  # the most of the log read at once: bounded cost
DIGEST_NAME: Final = "foresight-past.json"
DIGEST_FORMAT: Final = "gpulock.foresight-past/2"  # /2: where each model comes from
DIGEST_MAX_BYTES: Final = 8 * 1024**2
KEEP_PER_USER: Final = 64  # uses kept per (model, agent): enough for a rhythm and a day's
KEEP_LOADS: Final = 16  # load times kept per model


@dataclass(frozen=True, slots=True)
class Where:
    """Where a model came from the last time it was loaded or called: its file (a
    ``model-load`` event's ``path``), the tenant that serves it (a tenant's ``resident`` event,
    a ``call`` through a tenant), its GPU and size.  What pre-warming needs to warm it."""

    path: str | None = None
    tenant: str | None = None
    gpu: int | None = None
    bytes: int | None = None

    def merged(self, newer: Where) -> Where:
        """This, with what ``newer`` knows written over it."""
        return Where(
            newer.path if newer.path is not None else self.path,
            newer.tenant if newer.tenant is not None else self.tenant,
            newer.gpu if newer.gpu is not None else self.gpu,
            newer.bytes if newer.bytes is not None else self.bytes,
        )


@dataclass(frozen=True, slots=True)
class Past:
    uses: list[fs.Use]
    loads: list[fs.Load]
    models_of: dict[str, set[str]]  # agent or ticket name -> models it called
    # running fleets (``fleet-start`` events): pid -> fleet file; None once it stopped
    fleets: dict[int, str | None] = field(default_factory=dict)
    where: dict[str, Where] = field(default_factory=dict)  # model -> where it comes from


def read_past(state_dir: Path, *, mode: int = 0o600) -> Past:
    """Uses, loads and who-calls-what from the event log, kept in a digest.

    The digest (``foresight-past.json`` in the state folder) holds what the log said up to a
    byte offset, trimmed to the recent past (``KEEP_PER_USER`` uses per model and agent);
    each reader parses only the lines written since and writes the digest back.  So a
    decision costs the same after a month as after an hour.  A digest that does not match
    the log (rotated past it, truncated, unreadable) is rebuilt from the log's last
    ``HISTORY_BYTES``.
    """
    log = state_dir / LOG_NAME
    digest = _load_digest(state_dir / DIGEST_NAME)
    try:
        st = os.stat(log, follow_symlinks=False)
    except OSError:
        return digest[0] if digest is not None else Past([], [], {})
    chunks: list[bytes] | None = None
    past = Past([], [], {})
    if digest is not None:
        past, inode, offset = digest
        if inode == st.st_ino and 0 <= st.st_size - offset <= HISTORY_BYTES:
            chunks = [_read_range(log, offset, st.st_size)]
        else:
            rotated = log.with_name(LOG_NAME + ".1")
            try:
                old = os.stat(rotated, follow_symlinks=False)
            except OSError:
                old = None
            fits = old is not None and old.st_size - offset + st.st_size <= HISTORY_BYTES
            if old is not None and old.st_ino == inode and fits:
                chunks = [
                    _read_range(rotated, offset, old.st_size),
                    _read_range(log, 0, st.st_size),
                ]
    if chunks is None:  # no digest, or one that does not match: the log's tail
        past = Past([], [], {})
        tail = b""
        try:
            tail = statefile.read_tail(log, HISTORY_BYTES) or b""
        except (OSError, StateDirError):
            pass
        chunks = [tail]
        start = st.st_size - len(tail)
    else:
        start = st.st_size - len(chunks[-1])
    data = chunks[-1]
    done = data.rfind(b"\n") + 1  # a line still being written is read next time
    text = b"".join(chunks[:-1]) + data[:done]
    new = past_of(_events(text))
    both = {
        a: past.models_of.get(a, set()) | new.models_of.get(a, set())
        for a in {*past.models_of, *new.models_of}
    }
    where = dict(past.where)
    for m, w in new.where.items():
        where[m] = where[m].merged(w) if m in where else w
    merged = _trim(
        Past(
            past.uses + new.uses, past.loads + new.loads, both, {**past.fleets, **new.fleets},
            where,
        )
    )  # fmt: skip
    if text or digest is None:
        _save_digest(state_dir / DIGEST_NAME, merged, st.st_ino, start + done, mode)
    return merged


def past_of(events: Iterable[dict[str, Any]]) -> Past:
    """``read_past``'s reading of events (pure: the tests feed it lists)."""
    uses: list[fs.Use] = []
    loads: list[fs.Load] = []
    models_of: dict[str, set[str]] = {}
    fleets: dict[int, str | None] = {}
    where: dict[str, Where] = {}

    def at(model: str, w: Where) -> None:
        where[model] = where[model].merged(w) if model in where else w

    for e in events:
        kind, ts = e.get("event"), e.get("ts")
        if not isinstance(ts, int | float):
            continue
        gpu = e.get("gpu") if isinstance(e.get("gpu"), int) else None
        tenant = e.get("tenant") if isinstance(e.get("tenant"), str) else None
        if kind in ("fleet-start", "fleet-stop") and isinstance(e.get("pid"), int):
            file = e.get("file") if kind == "fleet-start" else None
            fleets[e["pid"]] = file if isinstance(file, str) else None
        if kind == "call" and isinstance(e.get("model"), str) and e.get("tier") != "cloud":
            by = e["agent"] if isinstance(e.get("agent"), str) else ""
            uses.append(fs.Use(e["model"], float(ts), by))
            if by:
                models_of.setdefault(e["agent"], set()).add(e["model"])
            if tenant is not None:
                at(e["model"], Where(tenant=tenant))
        elif kind == "resident" and isinstance(e.get("name"), str):
            uses.append(fs.Use(e["name"], float(ts)))
            if tenant is not None:
                size = e.get("declared_bytes")
                b = size if isinstance(size, int) and size > 0 else None
                path = e.get("path") if isinstance(e.get("path"), str) else None
                at(e["name"], Where(path=path, tenant=tenant, gpu=gpu, bytes=b))
        elif kind == "model-load" and isinstance(e.get("model"), str):
            uses.append(fs.Use(e["model"], float(ts)))
            load_s, size = e.get("load_s"), e.get("need_bytes")
            b = size if isinstance(size, int) and size > 0 else None
            if isinstance(load_s, int | float) and load_s > 0:
                loads.append(fs.Load(e["model"], float(load_s), b))
            path = e.get("path") if isinstance(e.get("path"), str) else None
            at(e["model"], Where(path=path, gpu=gpu, bytes=b))
    return Past(uses, loads, models_of, fleets, where)


def _read_range(path: Path, start: int, end: int) -> bytes:
    """Bytes ``start:end`` of a log (b"" when it cannot be read: a symlink, a FIFO, gone)."""
    try:
        fd = statefile.open_regular(path, os.O_RDONLY)
    except (OSError, StateDirError):
        return b""
    try:
        chunks = []
        while start < end:
            chunk = os.pread(fd, min(end - start, 1 << 20), start)
            if not chunk:
                break
            chunks.append(chunk)
            start += len(chunk)
        return b"".join(chunks)
    except OSError:
        return b""
    finally:
        os.close(fd)


_KINDS: Final = (b'"call"', b'"model-load"', b'"resident"', b'"fleet-st')


def _events(data: bytes) -> list[dict[str, Any]]:
    """The events foresight reads among ``data``'s lines (the others are not even parsed)."""
    out = []
    for raw in data.splitlines():
        if not any(k in raw for k in _KINDS):
            continue
        try:
            rec = safejson.loads(raw)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def _trim(past: Past) -> Past:
    """The recent past only: ``KEEP_PER_USER`` uses per (model, agent), ``KEEP_LOADS`` loads
    per model."""
    by_user: dict[tuple[str, str], list[fs.Use]] = {}
    for u in past.uses:
        by_user.setdefault((u.model, u.by), []).append(u)
    uses = [
        u for group in by_user.values()
        for u in sorted(group, key=lambda u: u.at_wall)[-KEEP_PER_USER:]
    ]  # fmt: skip
    by_model: dict[str, list[fs.Load]] = {}
    for ld in past.loads:
        by_model.setdefault(ld.model, []).append(ld)
    loads = [ld for group in by_model.values() for ld in group[-KEEP_LOADS:]]
    fleets: dict[int, str | None] = {p: f for p, f in past.fleets.items() if f is not None}
    return Past(uses, loads, past.models_of, fleets, past.where)


def _load_digest(path: Path) -> tuple[Past, int, int] | None:
    """(the past, the log's inode, the offset it covers), or None when missing or malformed."""
    try:
        raw = statefile.read_small(path, DIGEST_MAX_BYTES)
        doc = safejson.loads(raw) if raw is not None else None
    except (OSError, StateDirError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != DIGEST_FORMAT:
        return None
    inode, offset = doc.get("inode"), doc.get("offset")
    if not isinstance(inode, int) or not isinstance(offset, int) or offset < 0:
        return None
    try:
        uses = [
            fs.Use(str(m), float(t), str(b))
            for m, users in doc["uses"].items()
            for b, times in users.items()
            for t in times
        ]
        loads = [
            fs.Load(str(m), float(s), int(b) if b is not None else None) for m, s, b in doc["loads"]
        ]
        models_of = {str(a): {str(m) for m in ms} for a, ms in doc["models_of"].items()}
        fleets: dict[int, str | None] = {int(p): str(f) for p, f in doc["fleets"].items()}
        where = {
            str(m): Where(
                None if p is None else str(p), None if t is None else str(t),
                None if g is None else int(g), None if b is None else int(b),
            )
            for m, (p, t, g, b) in doc["where"].items()
        }  # fmt: skip
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return Past(uses, loads, models_of, fleets, where), inode, offset


def _save_digest(path: Path, past: Past, inode: int, offset: int, mode: int) -> None:
    # Grouped, times in whole seconds: the digest is read before every decision, and a
    # list of bare numbers is the cheapest JSON to check and parse.
    uses: dict[str, dict[str, list[int]]] = {}
    for u in past.uses:
        uses.setdefault(u.model, {}).setdefault(u.by, []).append(round(u.at_wall))
    doc = {
        "format": DIGEST_FORMAT,
        "inode": inode,
        "offset": offset,
        "uses": uses,
        "loads": [[ld.model, ld.load_s, ld.bytes] for ld in past.loads],
        "models_of": {a: sorted(ms) for a, ms in past.models_of.items()},
        "fleets": {str(p): f for p, f in past.fleets.items() if f is not None},
        "where": {m: [w.path, w.tenant, w.gpu, w.bytes] for m, w in past.where.items()},
    }
    try:
        statefile.atomic_write(path, json.dumps(doc, separators=(",", ":")).encode(), mode=mode)
    except (OSError, StateDirError):
        pass  # a reader that may not write (another user's folder) still decides
