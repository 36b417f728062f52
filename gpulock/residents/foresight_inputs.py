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

import os
import shlex
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from gpulock.core import cronexpr, safejson
from gpulock.core import foresight as fs
from gpulock.core.events import LOG_NAME
from gpulock.core.settings import Settings
from gpulock.residents.registry import Record

HISTORY_BYTES: Final = 4 * 1024**2  # the log's tail read per decision: bounded cost
CRON_D: Final = Path("/etc/cron.d")
CRON_CACHE_S: Final = 60.0  # the crontab changes rarely; `crontab -l` is a process per read
_cron_cache: dict[str, tuple[float, list[tuple[str, cronexpr.Cron]]]] = {}


@dataclass(frozen=True, slots=True)
class Past:
    uses: list[fs.Use]
    loads: list[fs.Load]
    models_of: dict[str, set[str]]  # agent or ticket name -> models it called


def model_key(r: Record) -> str:
    """The name foresight knows a resident by: its model name (what the events call it)."""
    return r.name


def gather(
    settings: Settings,
    records: Sequence[Record],
    gpus: Iterable[int],
    *,
    now_wall: float | None = None,
    cron: bool = True,
) -> fs.Forecast:
    """The forecast for ``records`` (residents and tenant models) at ``now_wall``; the
    tickets waiting on ``gpus`` count as uses now."""
    now = time.time() if now_wall is None else now_wall
    past = read_past(settings.state_dir)
    uses = past.uses + [fs.Use(model_key(r), r.last_used_wall) for r in records if r.idle_known]
    planned = [p for gpu in gpus for p in waiters(settings, gpu, past.models_of, now)]
    if cron:
        planned += cron_plans(past.models_of, now)
    models = {model_key(r): r.bytes for r in records}
    return fs.forecast(
        models, planned, uses, past.loads, now, utc_offset_s=float(local_offset_s(now))
    )


def local_offset_s(now_wall: float) -> int:
    return time.localtime(now_wall).tm_gmtoff


def read_past(state_dir: Path) -> Past:
    """Uses, loads and who-calls-what from the tail of the event log."""
    return past_of(_tail_events(state_dir / LOG_NAME, HISTORY_BYTES))


def past_of(events: Iterable[dict[str, Any]]) -> Past:
    """``read_past``'s reading of events (pure: the tests feed it lists)."""
    uses: list[fs.Use] = []
    loads: list[fs.Load] = []
    models_of: dict[str, set[str]] = {}
    for e in events:
        kind, ts = e.get("event"), e.get("ts")
        if not isinstance(ts, int | float):
            continue
        if kind == "call" and isinstance(e.get("model"), str) and e.get("tier") != "cloud":
            by = e["agent"] if isinstance(e.get("agent"), str) else ""
            uses.append(fs.Use(e["model"], float(ts), by))
            if by:
                models_of.setdefault(e["agent"], set()).add(e["model"])
        elif kind == "resident" and isinstance(e.get("name"), str):
            uses.append(fs.Use(e["name"], float(ts)))
        elif kind == "model-load" and isinstance(e.get("model"), str):
            uses.append(fs.Use(e["model"], float(ts)))
            load_s, size = e.get("load_s"), e.get("need_bytes")
            if isinstance(load_s, int | float) and load_s > 0:
                b = size if isinstance(size, int) and size > 0 else None
                loads.append(fs.Load(e["model"], float(load_s), b))
    return Past(uses, loads, models_of)


def _tail_events(path: Path, limit: int) -> list[dict[str, Any]]:
    """The events in the last ``limit`` bytes of the log (and of its rotated generation)."""
    out: list[dict[str, Any]] = []
    left = limit
    chunks: list[bytes] = []
    for p in (path, path.with_name(path.name + ".1")):
        if left <= 0:
            break
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            size = os.fstat(fd).st_size
            start = max(size - left, 0)
            os.lseek(fd, start, os.SEEK_SET)
            data = os.read(fd, size - start)
        finally:
            os.close(fd)
        if start > 0:
            data = data.split(b"\n", 1)[1] if b"\n" in data else b""
        chunks.insert(0, data)
        left -= len(data)
    for raw in b"".join(chunks).splitlines():
        try:
            rec = safejson.loads(raw)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def waiters(
    settings: Settings, gpu: int, models_of: dict[str, set[str]], now_wall: float
) -> list[fs.Planned]:
    """The models of the tickets waiting on ``gpu``: needed now."""
    from gpulock.lock.queuedir import QueueDir

    try:
        qdir = QueueDir(settings, gpu, create=False)
        found = [tf.ticket for _seq, tf, _why in qdir.scan() if tf is not None]
    except OSError:
        return []
    return [
        fs.Planned(m, now_wall, "waiter", t.name)
        for t in found
        if not t.holding
        for m in sorted(models_of.get(t.name, ()))
    ]


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


def cron_jobs(now_wall: float) -> list[tuple[str, cronexpr.Cron]]:
    """(agent name, schedule) of the readable crontab lines that call gpulock; cached a minute."""
    hit = _cron_cache.get("jobs")
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
    jobs = [job for text, system in texts for job in crontab_jobs(text, system=system)]
    _cron_cache["jobs"] = (now_wall, jobs)
    return jobs


def crontab_jobs(text: str, *, system: bool = False) -> list[tuple[str, cronexpr.Cron]]:
    """Lines of a crontab (``system``: /etc/cron.d, with a user field) that call gpulock."""
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
            out.append((name, cronexpr.parse(sched)))
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
