"""Foresight's schedules: the next fire of each crontab line and fleet agent that runs gpulock.

``crontab -l`` and ``/etc/cron.d`` lines that call ``gpulock run --name NAME`` or ``gpulock agent
run NAME``, and the agents of the running fleets (``gpulock fleet``: their file read as data,
each ``schedule`` by ``gpulock.core.cronexpr``): NAME's next fire, mapped to the models NAME
called (``foresight_past``).  Both are cached a minute: the crontab changes rarely and ``crontab
-l`` is a process per read.  A line or file that cannot be read adds nothing, never an error.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path
from typing import Final

from gpulock.core import cronexpr, identity
from gpulock.core import foresight as fs

CRON_D: Final = Path("/etc/cron.d")
CRON_CACHE_S: Final = 60.0  # the crontab changes rarely; `crontab -l` is a process per read
_cron_cache: dict[str, tuple[float, list[tuple[str, cronexpr.Cron]]]] = {}
_entries_cache: dict[str, tuple[float, list[tuple[str, cronexpr.Cron, str]]]] = {}


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
        if file is None or not identity.pid_exists(pid):
            continue
        for name, cron in fleet_jobs(file, now_wall):
            at = cron.next_fire(now_wall)
            if at is not None:
                out += [
                    fs.Planned(m, at, "fleet", name, 0.95) for m in sorted(models_of.get(name, ()))
                ]
    return out


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
