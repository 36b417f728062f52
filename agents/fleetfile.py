"""The fleet file (``gpulock fleet FLEET.yaml``): reading, validating, and planning the jobs.

::

    fleet:
      jitter: 0s           # random 0..jitter delay added to every run (per agent: jitter:)
      misfire_grace: 60s   # a run that could not start within this of its time is dropped
      grace: 30s           # on SIGTERM: how long running agents get before SIGTERM, SIGKILL
      max_parallel: 8      # runs at the same time, at most
      log_dir: null        # each run's output is appended to <log_dir>/<name>.log
                           # (default <state>/fleet/; relative to this file's folder)
      env: {}              # extra environment for every run
    agents:
      - {name: digest, schedule: "*/5 * * * *", args: [~/notes], timeout: 10m}
      - {name: backup, schedule: "0 3 * * *", command: [/usr/local/bin/backup, --all]}
      - {name: fast, every: 2s, enabled: false}

An agent has a ``name`` and one of ``schedule`` (crontab: 5 fields, or 6 with seconds first, or
``@daily`` and friends) or ``every`` (a duration).  Without ``command`` a run is
``python -m agents run NAME ARGS... [--timeout T] [--module M]``; with it, ``command`` is the
whole argv (no shell) and ``args``/``timeout``/``module`` do not apply.

Schedules mean what they mean to cron, not what APScheduler 3 would make of them: day-of-week
0 and 7 are Sunday (APScheduler 3 counts from Monday), and a day-of-month and a day-of-week that
are both restricted match either one (cron's rule; APScheduler would want both).

Everything here is pure but ``read`` (the file) and ``check_schedules`` (imports APScheduler to
let its triggers judge each expression, so that a bad one is reported with its line now, not
when the scheduler starts).  ``plan`` turns the file into ``JobSpec`` records that table tests
read without a scheduler.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

from gpulock.config import Config, parse_config
from gpulock.errors import ConfigError
from gpulock.state import expand_path
from gpulock.units import parse_duration

__all__ = [
    "AGENT_KEYS",
    "FLEET_KEYS",
    "AgentEntry",
    "CronFields",
    "FleetFile",
    "FleetOptions",
    "JobSpec",
    "TriggerSpec",
    "agent_command",
    "check_schedules",
    "parse_fleet",
    "parse_schedule",
    "plan",
    "read",
]

FLEET_KEYS: Final = ("jitter", "misfire_grace", "grace", "max_parallel", "log_dir", "env")
AGENT_KEYS: Final = (
    "name",
    "schedule",
    "every",
    "args",
    "timeout",
    "module",
    "command",
    "jitter",
    "env",
    "enabled",
)
TOP_KEYS: Final = ("fleet", "agents")
# Used as a file name (<log_dir>/<name>.log) and an APScheduler job id.
_NAME_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")
_ALIASES: Final = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
_WEEKDAYS: Final = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")  # cron's numbering: 0..6


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


@dataclass(frozen=True, slots=True)
class CronFields:
    """Keyword arguments of one APScheduler ``CronTrigger``, already in APScheduler's terms."""

    second: str
    minute: str
    hour: str
    day: str
    month: str
    day_of_week: str

    def kwargs(self) -> dict[str, str]:
        return {
            "second": self.second,
            "minute": self.minute,
            "hour": self.hour,
            "day": self.day,
            "month": self.month,
            "day_of_week": self.day_of_week,
        }


@dataclass(frozen=True, slots=True)
class TriggerSpec:
    """When a job fires: every ``every_s`` seconds, or when any of ``cron`` matches."""

    text: str  # for people: "cron */5 * * * *", "every 2s"
    every_s: float | None = None
    cron: tuple[CronFields, ...] = ()  # two: cron's day-of-month OR day-of-week rule


@dataclass(frozen=True, slots=True)
class JobSpec:
    """Everything needed to schedule and run one agent; ``env`` is the run's whole environment."""

    name: str
    trigger: TriggerSpec
    jitter_s: float
    command: tuple[str, ...]
    env: Mapping[str, str]
    log_path: Path
    enabled: bool


# --- reading -----------------------------------------------------------------------------------


def read(path: str | os.PathLike[str]) -> FleetFile:
    """Read and validate a fleet file; ConfigError names the file, the line and the key."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(
            "no such fleet file", file=str(p), hint="gpulock fleet PATH/TO/FLEET.yaml"
        )
    if p.is_dir():
        raise ConfigError("is a folder, not a fleet file", file=str(p))
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"cannot read it: {exc.strerror or exc}", file=str(p), hint="check its permissions"
        ) from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError("is not UTF-8 text", file=str(p), line=line) from None
    return parse_fleet(text, str(p))


def parse_fleet(text: str, file: str) -> FleetFile:
    """Validate fleet-file ``text`` (``file`` names it in errors)."""
    try:
        cfg = parse_config(text, file)  # line-aware YAML; fleet and agents are known sections
    except ConfigError as exc:
        if exc.key and "." not in exc.key and "[" not in exc.key and "unknown key" in exc.problem:
            raise _unknown(exc.key, TOP_KEYS, exc.file, exc.line) from None
        raise
    for key in cfg.lines:
        if "." not in key and "[" not in key and key not in TOP_KEYS:
            # A key of the main config: valid YAML for parse_config, meaningless here.
            error = _unknown(key, TOP_KEYS, file, cfg.lines[key])
            error.hint = f"{key!r} belongs in the gpulock config file (--config); " + str(
                error.hint
            )
            raise error
    options = _options(cfg)
    raw = cfg.section("agents")
    if raw is None:
        raise cfg.error(
            "agents",
            "no agents: the file needs an 'agents:' list",
            hint='agents:\n  - {name: digest, schedule: "*/5 * * * *"}',
        )
    if not isinstance(raw, list) or not raw:
        raise cfg.error(
            "agents",
            "expected a list of agents, one '- {name: ..., schedule: ...}' per line",
        )
    agents: list[AgentEntry] = []
    seen: dict[str, str] = {}
    for index, item in enumerate(raw):
        entry = _agent(cfg, f"agents[{index}]", item)
        if entry.name in seen:
            raise cfg.error(
                f"agents[{index}].name",
                f"duplicate agent name {entry.name!r} (first on line "
                f"{cfg.line_of(seen[entry.name])})",
                hint="names must be unique: they name the log file and the job",
            )
        seen[entry.name] = f"agents[{index}].name"
        agents.append(entry)
    return FleetFile(Path(file), options, tuple(agents), cfg)


def _unknown(
    key: str, known: tuple[str, ...], file: str | None, line: int | None, where: str = ""
) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = (f"did you mean {close[0]!r}? " if close else "") + "known keys: " + ", ".join(known)
    path = f"{where}.{key}" if where else key
    return ConfigError(f"unknown key {key!r}", file=file, line=line, key=path, hint=hint)


def _check_keys(cfg: Config, where: str, raw: Mapping[Any, Any], known: tuple[str, ...]) -> None:
    for k in raw:
        if k not in known:
            key = f"{where}.{k}"
            file = str(cfg.path) if cfg.path is not None else None
            raise _unknown(str(k), known, file, cfg.line_of(key), where)


def _duration(cfg: Config, key: str, value: Any, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise cfg.error(key, f"expected a duration like 30s or 5m, got {_show(value)}")
    try:
        seconds = parse_duration(value)
    except ValueError as exc:
        raise cfg.error(key, str(exc)) from None
    if positive and seconds <= 0:
        raise cfg.error(key, f"expected a duration above 0, got {_show(value)}")
    return seconds


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return repr(value)


def _env(cfg: Config, key: str, value: Any) -> Mapping[str, str]:
    if value is None:
        return _empty()
    if not isinstance(value, dict):
        raise cfg.error(key, f"expected a mapping of NAME: value, got {_show(value)}")
    out: dict[str, str] = {}
    for name, v in value.items():
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise cfg.error(f"{key}.{name}", f"{name!r} is not an environment variable name")
        if isinstance(v, bool) or not isinstance(v, str | int | float):
            raise cfg.error(
                f"{key}.{name}",
                f"expected a text or a number, got {_show(v)}",
                hint="quote it: NAME: 'true'",
            )
        out[name] = str(v)
    return MappingProxyType(out)


def _options(cfg: Config) -> FleetOptions:
    raw = cfg.section("fleet")
    if raw is None:
        return FleetOptions()
    if not isinstance(raw, dict):
        raise cfg.error("fleet", f"expected a mapping of settings, got {_show(raw)}")
    _check_keys(cfg, "fleet", raw, FLEET_KEYS)
    base = FleetOptions()
    max_parallel = raw.get("max_parallel", base.max_parallel)
    if isinstance(max_parallel, bool) or not isinstance(max_parallel, int) or max_parallel < 1:
        raise cfg.error(
            "fleet.max_parallel", f"expected a whole number >= 1, got {_show(max_parallel)}"
        )
    log_dir = raw.get("log_dir")
    if log_dir is not None and (not isinstance(log_dir, str) or not log_dir.strip()):
        raise cfg.error("fleet.log_dir", f"expected a folder path, got {_show(log_dir)}")

    def dur(key: str, default: float, positive: bool = False) -> float:
        value = raw.get(key)
        if value is None:
            return default
        return _duration(cfg, f"fleet.{key}", value, positive=positive)

    return FleetOptions(
        jitter_s=dur("jitter", base.jitter_s),
        misfire_grace_s=dur("misfire_grace", base.misfire_grace_s, positive=True),
        grace_s=dur("grace", base.grace_s),
        max_parallel=max_parallel,
        log_dir=log_dir,
        env=_env(cfg, "fleet.env", raw.get("env")),
    )


def _strings(cfg: Config, key: str, value: Any, what: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise cfg.error(key, f"expected a list of {what}, got {_show(value)}")
    out = []
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, str | int | float):
            raise cfg.error(f"{key}[{i}]", f"expected a text or a number, got {_show(item)}")
        out.append(str(item))
    return tuple(out)


def _agent(cfg: Config, where: str, raw: Any) -> AgentEntry:
    if not isinstance(raw, dict):
        raise cfg.error(
            where, f"expected an agent like {{name: digest, every: 5m}}, got {_show(raw)}"
        )
    _check_keys(cfg, where, raw, AGENT_KEYS)
    name = raw.get("name")
    if name is None:
        raise cfg.error(where, "missing 'name'", hint="every agent needs a unique name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise cfg.error(
            f"{where}.name",
            f"expected a name of letters, digits, '.', '_' or '-', got {_show(name)}",
        )
    schedule, every_s = _when(cfg, where, raw, name)
    module = raw.get("module")
    if module is not None and (not isinstance(module, str) or not module.strip()):
        raise cfg.error(f"{where}.module", f"expected a module name, got {_show(module)}")
    enabled = raw.get("enabled", True)
    if not isinstance(enabled, bool):
        raise cfg.error(f"{where}.enabled", f"expected true or false, got {_show(enabled)}")

    def duration(key: str, positive: bool) -> float | None:
        value = raw.get(key)
        return None if value is None else _duration(cfg, f"{where}.{key}", value, positive=positive)

    args = raw.get("args")
    return AgentEntry(
        name=name,
        schedule=schedule,
        every_s=every_s,
        args=() if args is None else _strings(cfg, f"{where}.args", args, "arguments"),
        timeout_s=duration("timeout", positive=True),
        module=module,
        command=_command(cfg, where, raw),
        jitter_s=duration("jitter", positive=False),
        env=_env(cfg, f"{where}.env", raw.get("env")),
        enabled=enabled,
        key=where,
    )


def _when(
    cfg: Config, where: str, raw: dict[Any, Any], name: str
) -> tuple[str | None, float | None]:
    """(schedule, every_s): exactly one of them."""
    schedule, every = raw.get("schedule"), raw.get("every")
    if schedule is None and every is None:
        raise cfg.error(
            where,
            f"agent {name!r} has no 'schedule' or 'every'",
            hint="schedule: '*/5 * * * *' (crontab), or every: 10m",
        )
    if schedule is not None and every is not None:
        raise cfg.error(f"{where}.every", "give 'schedule' or 'every', not both")
    if every is not None:
        return None, _duration(cfg, f"{where}.every", every, positive=True)
    if not isinstance(schedule, str):
        raise cfg.error(
            f"{where}.schedule",
            f"expected a crontab expression like '*/5 * * * *', got {_show(schedule)}",
        )
    try:
        parse_schedule(schedule)
    except ValueError as exc:
        raise cfg.error(f"{where}.schedule", str(exc), hint=_SCHEDULE_HINT) from None
    return schedule, None


def _command(cfg: Config, where: str, raw: dict[Any, Any]) -> tuple[str, ...] | None:
    if raw.get("command") is None:
        return None
    command = _strings(cfg, f"{where}.command", raw["command"], "program and arguments")
    if not command:
        raise cfg.error(f"{where}.command", "expected a program and its arguments, got []")
    for k in ("args", "timeout", "module"):
        if raw.get(k) is not None:
            raise cfg.error(
                f"{where}.{k}",
                f"'{k}' applies to agents run by 'python -m agents run', not to a 'command'",
                hint="put what the command needs in its own argument list",
            )
    return command


_SCHEDULE_HINT: Final = (
    "crontab: minute hour day month weekday, e.g. '*/5 * * * *' or '0 3 * * 1-5' "
    "(a sixth field in front is seconds); or use every: 10m"
)


# --- schedules ---------------------------------------------------------------------------------


def parse_schedule(text: str) -> tuple[CronFields, ...]:
    """A crontab expression -> the CronTrigger arguments that fire exactly when cron would.

    Raises ValueError for what cron would refuse here; APScheduler judges the values of the
    fields (``check_schedules``).
    """
    expr = text.strip()
    if expr.startswith("@"):
        if expr == "@reboot":
            raise ValueError(
                "'@reboot' is not a clock time; run 'gpulock fleet FILE --once NAME' at boot"
            )
        if expr not in _ALIASES:
            raise ValueError(f"unknown schedule {expr!r}; known: {', '.join(_ALIASES)}")
        expr = _ALIASES[expr]
    fields = expr.split()
    if len(fields) == 5:
        fields = ["0", *fields]
    elif len(fields) != 6:
        raise ValueError(f"expected 5 crontab fields (or 6 with seconds), got {len(fields)}")
    second, minute, hour, day, month, weekday = fields
    day_of_week = cron_weekdays(weekday)
    if day.startswith("*") or weekday.startswith("*"):
        return (CronFields(second, minute, hour, day, month, day_of_week),)
    # cron: when both are restricted, a day matching either one fires.
    return (
        CronFields(second, minute, hour, day, month, "*"),
        CronFields(second, minute, hour, "*", month, day_of_week),
    )


def cron_weekdays(field: str) -> str:
    """Cron's day-of-week field (0 or 7 = Sunday, names, ranges, steps) -> APScheduler's.

    APScheduler 3 numbers Monday 0, so numbers are turned into the names both agree on.
    """
    if field in ("*", "?"):
        return "*"
    days: set[int] = set()
    for item in field.lower().split(","):
        base, _, step_text = item.partition("/")
        step = 1
        if step_text:
            if not step_text.isdigit() or int(step_text) == 0:
                raise ValueError(f"day of week: bad step in {item!r}")
            step = int(step_text)
        if base == "*":
            first, last = 0, 6
        elif "-" in base:
            a, _, b = base.partition("-")
            first, last = _weekday(a), _weekday(b)
            if last == 0 and first > 0:
                last = 7  # "5-7" and "fri-sun" end on Sunday
            if first > last:
                raise ValueError(f"day of week: range {item!r} runs backwards")
        else:
            first = _weekday(base)
            last = 6 if step_text else first
        days.update(d % 7 for d in range(first, last + 1, step))
    if len(days) == 7:
        return "*"
    return ",".join(_WEEKDAYS[d] for d in sorted(days))


def _weekday(text: str) -> int:
    t = text.strip()
    if t.isdigit() and int(t) <= 7:
        return int(t) % 7
    if t[:3] in _WEEKDAYS and len(t) == 3:
        return _WEEKDAYS.index(t)
    raise ValueError(f"day of week: {text!r} is not 0-7 or sun..sat")


def check_schedules(fleet: FleetFile) -> None:
    """Let APScheduler's CronTrigger judge every schedule now, naming the line of a bad one."""
    from apscheduler.triggers.cron import CronTrigger

    for agent in fleet.agents:
        if agent.schedule is None:
            continue
        for fields in parse_schedule(agent.schedule):
            try:
                CronTrigger(**fields.kwargs())
            except ValueError as exc:
                raise fleet.config.error(
                    f"{agent.key}.schedule",
                    f"bad schedule {agent.schedule!r}: {exc}",
                    hint=_SCHEDULE_HINT,
                ) from None


# --- planning ----------------------------------------------------------------------------------


def _seconds_text(seconds: float) -> str:
    """Seconds as a duration ``parse_duration`` reads back exactly enough (no exponent)."""
    return f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"


def _expand(arg: str, environ: Mapping[str, str]) -> str:
    if arg == "~" or arg.startswith("~/"):
        return str(expand_path(arg, environ))
    return arg


def agent_command(agent: AgentEntry, *, python: str, environ: Mapping[str, str]) -> tuple[str, ...]:
    """The argv of one run: ``command`` as given, else ``python -m agents run NAME ...``."""
    if agent.command is not None:
        return tuple(_expand(a, environ) for a in agent.command)
    argv = [python, "-m", "agents", "run", agent.name, *(_expand(a, environ) for a in agent.args)]
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


# Never passed on to a run: a lease the fleet's own parent held is not the agent's.
_DROPPED_ENV: Final = ("GPULOCK_TICKET",)


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
