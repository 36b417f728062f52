"""The fleet file (``gpulock fleet FLEET.yaml``): reading it and validating every key.

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
``@daily`` and friends; read as cron reads it, see ``gpulock.agents.schedules``) or ``every`` (a
duration).  Without ``command`` a run is ``python -m gpulock.agents run NAME ARGS... [--timeout T]
[--module M]``; with it, ``command`` is the whole argv (no shell) and ``args``/``timeout``/
``module`` do not apply.

Everything here is pure but ``read`` (the file) and ``check_schedules`` (imports APScheduler to
let its triggers judge each expression, so that a bad one is reported with its line now, not
when the scheduler starts).  ``plan`` (in ``gpulock.agents.fleetplan``) turns the file into
``JobSpec`` records; it and the schedule names are re-exported here, where callers have always found
them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

from gpulock.agents.fleetplan import (
    AgentEntry,
    FleetFile,
    FleetOptions,
    JobSpec,
    _empty,
    agent_command,
    log_dir,
    plan,
    trigger_spec,
)
from gpulock.agents.schedules import (
    SCHEDULE_HINT,
    CronFields,
    TriggerSpec,
    cron_weekdays,
    parse_schedule,
)
from gpulock.core.config import Config, parse_config, show_value
from gpulock.core.configfile import read_config_bytes
from gpulock.core.errors import ConfigError, known_hint
from gpulock.core.units import parse_duration

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
    "cron_weekdays",
    "log_dir",
    "parse_fleet",
    "parse_schedule",
    "plan",
    "read",
    "trigger_spec",
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
    raw = read_config_bytes(p, "fleet file")  # never blocks on a FIFO named as the file
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError("is not UTF-8 text", file=str(p), line=line) from None
    return parse_fleet(text, str(p))


def parse_fleet(text: str, file: str) -> FleetFile:
    """Validate fleet-file ``text`` (``file`` names it in errors)."""
    try:
        cfg = parse_config(text, file, sections=frozenset(TOP_KEYS))  # line-aware YAML
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
    hint = known_hint(key, known)
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
        raise cfg.error(key, f"expected a duration like 30s or 5m, got {show_value(value)}")
    try:
        seconds = parse_duration(value)
    except ValueError as exc:
        raise cfg.error(key, str(exc)) from None
    if positive and seconds <= 0:
        raise cfg.error(key, f"expected a duration above 0, got {show_value(value)}")
    return seconds


def _env(cfg: Config, key: str, value: Any) -> Mapping[str, str]:
    if value is None:
        return _empty()
    if not isinstance(value, dict):
        raise cfg.error(key, f"expected a mapping of NAME: value, got {show_value(value)}")
    out: dict[str, str] = {}
    for name, v in value.items():
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise cfg.error(f"{key}.{name}", f"{name!r} is not an environment variable name")
        if isinstance(v, bool) or not isinstance(v, str | int | float):
            raise cfg.error(
                f"{key}.{name}",
                f"expected a text or a number, got {show_value(v)}",
                hint="quote it: NAME: 'true'",
            )
        out[name] = str(v)
    return MappingProxyType(out)


def _options(cfg: Config) -> FleetOptions:
    raw = cfg.section("fleet")
    if raw is None:
        return FleetOptions()
    if not isinstance(raw, dict):
        raise cfg.error("fleet", f"expected a mapping of settings, got {show_value(raw)}")
    _check_keys(cfg, "fleet", raw, FLEET_KEYS)
    base = FleetOptions()
    max_parallel = raw.get("max_parallel", base.max_parallel)
    if isinstance(max_parallel, bool) or not isinstance(max_parallel, int) or max_parallel < 1:
        raise cfg.error(
            "fleet.max_parallel", f"expected a whole number >= 1, got {show_value(max_parallel)}"
        )
    log_dir = raw.get("log_dir")
    if log_dir is not None and (not isinstance(log_dir, str) or not log_dir.strip()):
        raise cfg.error("fleet.log_dir", f"expected a folder path, got {show_value(log_dir)}")

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
        raise cfg.error(key, f"expected a list of {what}, got {show_value(value)}")
    out = []
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, str | int | float):
            raise cfg.error(f"{key}[{i}]", f"expected a text or a number, got {show_value(item)}")
        out.append(str(item))
    return tuple(out)


def _agent(cfg: Config, where: str, raw: Any) -> AgentEntry:
    if not isinstance(raw, dict):
        raise cfg.error(
            where, f"expected an agent like {{name: digest, every: 5m}}, got {show_value(raw)}"
        )
    _check_keys(cfg, where, raw, AGENT_KEYS)
    name = raw.get("name")
    if name is None:
        raise cfg.error(where, "missing 'name'", hint="every agent needs a unique name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise cfg.error(
            f"{where}.name",
            f"expected a name of letters, digits, '.', '_' or '-', got {show_value(name)}",
        )
    schedule, every_s = _when(cfg, where, raw, name)
    module = raw.get("module")
    if module is not None and (not isinstance(module, str) or not module.strip()):
        raise cfg.error(f"{where}.module", f"expected a module name, got {show_value(module)}")
    enabled = raw.get("enabled", True)
    if not isinstance(enabled, bool):
        raise cfg.error(f"{where}.enabled", f"expected true or false, got {show_value(enabled)}")

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
            f"expected a crontab expression like '*/5 * * * *', got {show_value(schedule)}",
        )
    try:
        parse_schedule(schedule)
    except ValueError as exc:
        raise cfg.error(f"{where}.schedule", str(exc), hint=SCHEDULE_HINT) from None
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
                f"'{k}' applies to agents run by 'python -m gpulock.agents run', "
                "not to a 'command'",
                hint="put what the command needs in its own argument list",
            )
    return command


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
                    hint=SCHEDULE_HINT,
                ) from None
