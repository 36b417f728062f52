"""The fleet's plan: a validated fleet file turned into ``JobSpec`` records, purely.

Every input is an argument (the file, the state folder, the environment, the Python to run
agents with), so table tests read the jobs without a scheduler, a state folder or a process.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Final

from gpulock.agents.schedules import TriggerSpec, parse_schedule
from gpulock.core import children
from gpulock.core.config import Config
from gpulock.core.state import expand_path

__all__ = [
    "AgentEntry",
    "FleetFile",
    "FleetOptions",
    "JobSpec",
    "agent_command",
    "log_dir",
    "plan",
    "trigger_spec",
]

# The fleet file's records (``fleetfile`` reads and checks them; the plan is made of them).


def _empty() -> Mapping[str, str]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class FleetOptions:
    """The ``fleet:`` section.  ``log_dir`` is kept as written; ``plan`` resolves it."""

    jitter_s: float = 0.0
    misfire_grace_s: float = 60.0
    grace_s: float = 30.0
    max_parallel: int = 8
    log_dir: str | None = None
    env: Mapping[str, str] = field(default_factory=_empty)


@dataclass(frozen=True, slots=True)
class AgentEntry:
    """One item of ``agents:``, validated; exactly one of ``schedule`` and ``every_s`` is set."""

    name: str
    schedule: str | None = None
    every_s: float | None = None
    args: tuple[str, ...] = ()
    timeout_s: float | None = None
    module: str | None = None
    command: tuple[str, ...] | None = None
    jitter_s: float | None = None  # None: the fleet's
    env: Mapping[str, str] = field(default_factory=_empty)
    enabled: bool = True
    key: str = ""  # where it is in the file (``agents[2]``), for errors


@dataclass(frozen=True, slots=True)
class FleetFile:
    path: Path
    options: FleetOptions
    agents: tuple[AgentEntry, ...]
    config: Config  # the parsed document: its .error() names this file and a key's line

    def agent(self, name: str) -> AgentEntry | None:
        return next((a for a in self.agents if a.name == name), None)


# Never passed on to a run: a lease the fleet's own parent held is not the agent's.
_DROPPED_ENV: Final = ("GPULOCK_TICKET",)


@dataclass(frozen=True, slots=True)
class JobSpec:
    """Everything needed to schedule and run one agent; ``env`` is the run's whole environment."""

    name: str
    trigger: TriggerSpec
    jitter_s: float
    command: tuple[str, ...]
    # Out of the repr: it holds the API keys the runs need, and a printed job must not show them.
    env: Mapping[str, str] = field(repr=False)
    log_path: Path
    enabled: bool


def _seconds_text(seconds: float) -> str:
    """Seconds as a duration ``parse_duration`` reads back exactly enough (no exponent)."""
    return f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"


def _expand(arg: str, environ: Mapping[str, str]) -> str:
    if arg == "~" or arg.startswith("~/"):
        return str(expand_path(arg, environ))
    return arg


def agent_command(agent: AgentEntry, *, python: str, environ: Mapping[str, str]) -> tuple[str, ...]:
    """The argv of one run: ``command`` as given, else ``python -P -m gpulock.agents run NAME``
    (``-P``: a folder named like the package where the fleet started cannot shadow it)."""
    if agent.command is not None:
        return tuple(_expand(a, environ) for a in agent.command)
    argv = [*children.python("-m", "gpulock.agents", "run", agent.name, executable=python)]
    argv += [_expand(a, environ) for a in agent.args]
    if agent.timeout_s is not None:
        argv += ["--timeout", _seconds_text(agent.timeout_s)]
    if agent.module is not None:
        argv += ["--module", agent.module]
    return tuple(argv)


def trigger_spec(agent: AgentEntry) -> TriggerSpec:
    if agent.every_s is not None:
        return TriggerSpec(text=f"every {_seconds_text(agent.every_s)}", every_s=agent.every_s)
    assert agent.schedule is not None  # parse_fleet checked that one of them is set
    return TriggerSpec(text=f"cron {agent.schedule}", cron=parse_schedule(agent.schedule))


def log_dir(fleet: FleetFile, state_dir: Path, environ: Mapping[str, str]) -> Path:
    """``fleet.log_dir`` (``~`` expanded, relative to the fleet file) or ``<state>/fleet``."""
    if fleet.options.log_dir is None:
        return state_dir / "fleet"
    path = expand_path(fleet.options.log_dir, environ)
    if not path.is_absolute():
        path = fleet.path.parent.absolute() / path
    return path


def plan(
    fleet: FleetFile, *, state_dir: Path, environ: Mapping[str, str], python: str
) -> tuple[JobSpec, ...]:
    """The jobs for ``fleet``: pure, every input an argument.

    A run's environment is ``environ`` less a held ticket, with ``GPULOCK_STATE_DIR`` set to the
    fleet's state folder (so agents queue where the fleet logs, whatever their config says),
    then ``fleet.env``, then the agent's ``env``.
    """
    logs = log_dir(fleet, state_dir, environ)
    base = {k: v for k, v in environ.items() if k not in _DROPPED_ENV}
    base["GPULOCK_STATE_DIR"] = str(state_dir)
    base.update(fleet.options.env)
    jobs = []
    for agent in fleet.agents:
        env = dict(base)
        env.update(agent.env)
        jobs.append(
            JobSpec(
                name=agent.name,
                trigger=trigger_spec(agent),
                jitter_s=fleet.options.jitter_s if agent.jitter_s is None else agent.jitter_s,
                command=agent_command(agent, python=python, environ=environ),
                env=MappingProxyType(env),
                log_path=logs / f"{agent.name}.log",
                enabled=agent.enabled,
            )
        )
    return tuple(jobs)
