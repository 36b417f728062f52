"""Gathering foresight's inputs on this machine: the event log's past, the line, the crontab.

The decision is ``gpulock.core.foresight`` (pure); this module does the reading around it:

* **history** -- the tail of the event log (``HISTORY_BYTES``): ``call`` events (model, agent),
  ``resident`` and ``model-load`` events (a use, and for ``model-load`` its ``load_s``: the
  reload cost), plus each resident's own last use;
* **who uses what** -- an agent's (or ticket's) models, from the ``call`` events naming both:
  the route table's choice on this machine as it was actually made;
* **the line** -- tickets waiting on the GPU: their agents' models are needed now;
* **cron** -- ``crontab -l`` and ``/etc/cron.d`` lines that call ``gpulock run --name NAME`` or
  ``gpulock agent run NAME``: NAME's next fire, mapped to its models.

The fleet's own schedules (APScheduler, in ``agents``) are above gpulock, which never imports
them; a fleet's runs reach foresight as history (its agents' ``call`` events keep a rhythm).
Every source is optional: a part that cannot be read adds nothing, never an error.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from gpulock.core import cronexpr, safejson, statefile
from gpulock.core import foresight as fs
from gpulock.core.errors import StateDirError
from gpulock.core.events import LOG_NAME
from gpulock.core.settings import Settings
from gpulock.residents.registry import Record

HISTORY_BYTES: Final = 4 * 1024**2  # the most of the log read at once: bounded cost
DIGEST_NAME: Final = "foresight-past.json"
DIGEST_FORMAT: Final = "gpulock.foresight-past/2"  # /2: where each model comes from
DIGEST_MAX_BYTES: Final = 8 * 1024**2
KEEP_PER_USER: Final = 64  # uses kept per (model, agent): enough for a rhythm and a day's
KEEP_LOADS: Final = 16  # load times kept per model
CRON_D: Final = Path("/etc/cron.d")
CRON_CACHE_S: Final = 60.0  # the crontab changes rarely; `crontab -l` is a process per read
_cron_cache: dict[str, tuple[float, list[tuple[str, cronexpr.Cron]]]] = {}
_entries_cache: dict[str, tuple[float, list[tuple[str, cronexpr.Cron, str]]]] = {}


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


def model_key(r: Record) -> str:
    """The name foresight knows a resident by: its model name (what the events call it)."""
    return r.name


def gather(
    settings: Settings,
    records: Sequence[Record],
    gpus: Iterable[int],
    *,
    now_wall: float | None = None,
) -> fs.Forecast:
    """The forecast for ``records`` (residents and tenant models) at ``now_wall``; the
    tickets waiting on ``gpus`` count as uses now."""
    now = time.time() if now_wall is None else now_wall
    past = read_past(settings.state_dir, mode=settings.file_mode)
    uses = past.uses + [fs.Use(model_key(r), r.last_used_wall) for r in records if r.idle_known]
    planned = [p for gpu in gpus for p in waiters(settings, gpu, past.models_of, now)]
    planned += cron_plans(past.models_of, now)
    planned += fleet_plans(past.fleets, past.models_of, now)
    models = {model_key(r): r.bytes for r in records}
    return fs.forecast(
        models, planned, uses, past.loads, now, utc_offset_s=float(local_offset_s(now))
    )


def local_offset_s(now_wall: float) -> int:
    return time.localtime(now_wall).tm_gmtoff


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


def waiters(
    settings: Settings, gpu: int, models_of: dict[str, set[str]], now_wall: float
) -> list[fs.Planned]:
    """The models of the tickets waiting on ``gpu``: needed soon, in line order."""
    from gpulock.lock.queuedir import QueueDir

    try:
        qdir = QueueDir(settings, gpu, create=False)
        found = [tf.ticket for _seq, tf, _why in qdir.scan() if tf is not None]
    except OSError:
        return []
    line = sorted((t for t in found if not t.holding), key=lambda t: t.seq)
    return fs.line_plans(
        [(t.name, sorted(models_of.get(t.name, ()))) for t in line if t.name in models_of],
        now_wall,
    )


def cron_plans(models_of: dict[str, set[str]], now_wall: float) -> list[fs.Planned]:
    """The next fire of each crontab line that runs a gpulock agent, as its models."""
    out = []
    for name, cron in cron_jobs(now_wall):
        models = models_of.get(name)
        if not models:
            continue
        at = cron.next_fire(now_wall)
        if at is not None:
            out += [fs.Planned(m, at, "cron", name, 0.95) for m in sorted(models)]
    return out


def fleet_plans(
    fleets: dict[int, str | None], models_of: dict[str, set[str]], now_wall: float
) -> list[fs.Planned]:
    """The next fire of each agent of the running fleets (``gpulock fleet``), as its models.

    The fleet's scheduler is APScheduler, in ``agents``, above gpulock: its file is read here
    as data, each agent's crontab ``schedule`` by ``gpulock.core.cronexpr`` (a seconds field in
    front is dropped: a minute is close enough to choose a victim).  ``every:`` agents keep a
    rhythm in the history instead.  A fleet whose process is gone counts no more.
    """
    out = []
    for pid, file in sorted(fleets.items()):
        if file is None or not _alive(pid):
            continue
        for name, cron in fleet_jobs(file, now_wall):
            at = cron.next_fire(now_wall)
            if at is not None:
                out += [
                    fs.Planned(m, at, "fleet", name, 0.95) for m in sorted(models_of.get(name, ()))
                ]
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's: alive
    return True


FLEET_MAX_BYTES: Final = 1024**2


def fleet_jobs(file: str, now_wall: float) -> list[tuple[str, cronexpr.Cron]]:
    """(agent name, schedule) of a fleet file's enabled crontab agents; cached a minute."""
    hit = _cron_cache.get("fleet:" + file)
    if hit is not None and now_wall - hit[0] < CRON_CACHE_S:
        return hit[1]
    jobs: list[tuple[str, cronexpr.Cron]] = []
    import yaml  # gpulock's own dependency; only a machine with a fleet pays for it

    try:
        with open(file, "rb") as f:
            text = f.read(FLEET_MAX_BYTES + 1)
        doc = yaml.safe_load(text) if len(text) <= FLEET_MAX_BYTES else None
    except (OSError, ValueError, yaml.YAMLError):
        doc = None
    agents = doc.get("agents") if isinstance(doc, dict) else None
    for a in agents if isinstance(agents, list) else ():
        if not isinstance(a, dict) or a.get("enabled", True) is False:
            continue
        name, sched = a.get("name"), a.get("schedule")
        if not isinstance(name, str) or not isinstance(sched, str):
            continue
        fields = sched.split()
        try:
            jobs.append((name, cronexpr.parse(" ".join(fields[1:]) if len(fields) == 6 else sched)))
        except ValueError:
            continue
    _cron_cache["fleet:" + file] = (now_wall, jobs)
    return jobs


def cron_jobs(now_wall: float) -> list[tuple[str, cronexpr.Cron]]:
    """(agent name, schedule) of the readable crontab lines that call gpulock; cached a minute."""
    return [(name, cron) for name, cron, _line in cron_entries(now_wall)]


def cron_lines(now_wall: float) -> dict[str, list[str]]:
    """The readable crontab lines that run each gpulock agent, as written: what ``gpulock
    replay --target-wait`` shows beside two agents that stand in each other's way."""
    out: dict[str, list[str]] = {}
    for name, _cron, line in cron_entries(now_wall):
        out.setdefault(name, []).append(line)
    return out


def cron_entries(now_wall: float) -> list[tuple[str, cronexpr.Cron, str]]:
    """(agent name, schedule, the line) of ``crontab -l`` and /etc/cron.d; cached a minute."""
    hit = _entries_cache.get("jobs")
    if hit is not None and now_wall - hit[0] < CRON_CACHE_S:
        return hit[1]
    texts: list[tuple[str, bool]] = []  # (text, has a user field)
    try:
        done = subprocess.run(
            ["crontab", "-l"], capture_output=True, timeout=2.0, check=False, text=True
        )
        if done.returncode == 0:
            texts.append((done.stdout, False))
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        for p in sorted(CRON_D.iterdir()):
            try:
                texts.append((p.read_text(errors="replace"), True))
            except OSError:
                continue
    except OSError:
        pass
    jobs = [job for text, system in texts for job in crontab_entries(text, system=system)]
    _entries_cache["jobs"] = (now_wall, jobs)
    return jobs


def crontab_jobs(text: str, *, system: bool = False) -> list[tuple[str, cronexpr.Cron]]:
    """Lines of a crontab (``system``: /etc/cron.d, with a user field) that call gpulock."""
    return [(name, cron) for name, cron, _line in crontab_entries(text, system=system)]


def crontab_entries(text: str, *, system: bool = False) -> list[tuple[str, cronexpr.Cron, str]]:
    """``crontab_jobs`` with each line as written."""
    out = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or "gpulock" not in line:
            continue
        if line.startswith("@"):
            sched, _, rest = line.partition(" ")
        else:
            parts = line.split(None, 5)
            if len(parts) < 6:
                continue
            sched, rest = " ".join(parts[:5]), parts[5]
        if system:
            rest = rest.split(None, 1)[1] if len(rest.split(None, 1)) == 2 else ""
        name = agent_of(rest)
        if name is None:
            continue
        try:
            out.append((name, cronexpr.parse(sched), line))
        except ValueError:
            continue
    return out


def agent_of(command: str) -> str | None:
    """NAME in ``gpulock run --name NAME ...`` or ``gpulock agent run NAME``; else None."""
    try:
        words = shlex.split(command.replace("\\%", "%"))
    except ValueError:
        return None
    for i, w in enumerate(words):
        if not (w == "gpulock" or w.endswith("/gpulock")):
            continue
        rest = words[i + 1 :]
        if rest[:2] == ["agent", "run"] and len(rest) > 2:
            return rest[2]
        if rest[:1] == ["run"]:
            for j, a in enumerate(rest):
                if a == "--":
                    # no --name: the ticket is named after the command (gpulock run's default)
                    return os.path.basename(rest[j + 1]) if j + 1 < len(rest) else None
                if a == "--name" and j + 1 < len(rest):
                    return rest[j + 1]
                if a.startswith("--name="):
                    return a.split("=", 1)[1]
    return None
