"""``get_model`` and ``explain``: read the table, probe the machine, choose, hand out a Model.

The config and its route table are read once per process and again only when the file changes
(its mtime and size), so a second ``get_model`` costs the probe and the choice: well under a
millisecond with no GPU candidates, about one with a GPU's queue to read.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from gpulock.core import settings as settings_mod
from gpulock.core.config import Config
from gpulock.core.settings import Settings
from gpulock.core.units import parse_duration
from gpulock.router import probe
from gpulock.router.choose import Choice, choose, preferred
from gpulock.router.errors import NoModelAvailable, UnknownPreference, UnknownTask
from gpulock.router.model import Model
from gpulock.router.routes import TIERS, Table, load_table

AGENT_ENV = "GPULOCK_AGENT"  # set by the agent runtime: whose calls these are


@dataclass(frozen=True, slots=True)
class _Loaded:
    stamp: tuple[Any, ...]
    settings: Settings
    table: Table


_loaded: dict[tuple[Any, ...], _Loaded] = {}


def _stamp(cfg: Config) -> tuple[Any, ...]:
    if cfg.path is None:
        return (None,)
    try:
        st = os.stat(cfg.path)
    except OSError:
        return (str(cfg.path), None)
    return (str(cfg.path), st.st_mtime_ns, st.st_size)


def context(
    config: Config | str | None = None, state_dir: str | None = None
) -> tuple[Settings, Table]:
    """The settings and route table, cached until the config file changes."""
    if isinstance(config, Config):
        s = settings_mod.load(config, state_dir)
        return s, load_table(config)
    key = (
        config,
        state_dir,
        os.environ.get("GPULOCK_CONFIG"),
        os.environ.get("GPULOCK_STATE_DIR"),
        os.getcwd(),
    )
    hit = _loaded.get(key)
    if (
        hit is not None
        and _stamp(hit.settings.config) == hit.stamp
        and hit.settings.state_dir.is_dir()
    ):
        return hit.settings, hit.table
    s = settings_mod.load(config, state_dir)
    table = load_table(s.config)
    _loaded[key] = _Loaded(_stamp(s.config), s, table)
    return s, table


def _agent_name(agent: str | None) -> str:
    if agent:
        return agent
    return os.environ.get(AGENT_ENV) or os.path.basename(sys.argv[0] or "python") or "python"


def _deadline_s(deadline: float | str | None) -> float | None:
    """Seconds, or a duration as ``gpulock.acquire``'s timeout takes it (``"30s"``, ``"2m"``)."""
    if deadline is None:
        return None
    if isinstance(deadline, str):
        return parse_duration(deadline, key="deadline")
    if isinstance(deadline, bool) or not isinstance(deadline, int | float) or not deadline >= 0:
        raise ValueError(
            f"deadline must be seconds >= 0 (or a duration like '30s'), got {deadline!r}"
        )
    return float(deadline)


def decide(
    task: str,
    *,
    deadline: float | str | None = None,
    prefer: str | None = None,
    config: Config | str | None = None,
    state_dir: str | None = None,
    tools: bool = False,
) -> tuple[Settings, Table, Choice]:
    """``tools``: choose for a request with tools (only candidates that can call them)."""
    deadline = _deadline_s(deadline)
    settings, table = context(config, state_dir)
    cands = table.tasks.get(task)
    if cands is None:
        path = str(settings.config.path) if settings.config.path else None
        raise UnknownTask(task, table.known, path)
    if prefer is not None and prefer not in TIERS and not any(preferred(c, prefer) for c in cands):
        raise UnknownPreference(task, prefer, TIERS, list(dict.fromkeys(c.name for c in cands)))
    host = probe.host(settings, cands, table.settings, warm=probe.warm_models())
    choice = choose(task, cands, host, deadline_s=deadline, prefer=prefer, tools=tools)
    if settings.config.section("cluster") is not None:  # a peer may start it sooner
        from gpulock.router import peers

        choice = peers.relocate(settings, choice, host, deadline)
    return settings, table, choice


def get_model(
    task: str,
    *,
    deadline: float | str | None = None,
    prefer: str | None = None,
    agent: str | None = None,
    config: Config | str | None = None,
    state_dir: str | None = None,
) -> Model:
    """A Model for ``task``, chosen for this machine now; raises NoModelAvailable or UnknownTask.

    ``deadline``: seconds (or ``"2m"``) the caller can wait for an answer to start (GPU queue
    included); candidates whose estimated wait is longer are passed over.  ``prefer``: a tier
    (``cpu``, ``gpu``, ``cloud``) or a candidate's name to try first.  ``agent``: whose calls
    these are in the accounting (default ``$GPULOCK_AGENT``, else the program's name).
    """
    deadline = _deadline_s(deadline)
    settings, table, choice = decide(
        task, deadline=deadline, prefer=prefer, config=config, state_dir=state_dir
    )
    who = _agent_name(agent)
    chosen = choice.chosen
    settings.emit(
        "route",
        task=task,
        agent=who,
        tier=chosen.candidate.tier if chosen else None,
        model=chosen.candidate.name if chosen else None,
        **({"host": chosen.candidate.host} if chosen and chosen.candidate.host else {}),
        reason=chosen.reason if chosen else None,
        rejected=[
            {"model": v.candidate.name, "tier": v.candidate.tier, "reason": v.reason}
            for v in choice.rejected()
        ],
    )
    if chosen is None:
        raise NoModelAvailable(task, choice)
    if chosen.candidate.host is not None:
        from gpulock.router import peers

        peers.count_sent(settings, chosen.candidate.host)
    deadline_at = None if deadline is None else time.monotonic() + deadline
    return Model(task, table, settings, choice, agent=who, deadline_at=deadline_at, prefer=prefer)


def explain(
    task: str,
    *,
    deadline: float | str | None = None,
    prefer: str | None = None,
    config: Config | str | None = None,
    state_dir: str | None = None,
    tools: bool = False,
) -> Choice:
    """What ``get_model`` would choose now, and why; loads nothing and records nothing.
    ``tools``: what ``gpulock serve`` would choose for a request with tools."""
    return decide(
        task, deadline=deadline, prefer=prefer, config=config, state_dir=state_dir, tools=tools
    )[2]
