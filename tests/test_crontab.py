"""``crontab.example`` holds real cron lines: valid schedules, escaped ``%``, commands that exist
in this checkout's venv and arguments that gpulock's own parsers accept."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import REPO

CRONTAB = REPO / "crontab.example"
PREFIX = "/opt/gpulock/.venv/bin/"  # where the example says gpulock is installed
VENV_BIN = Path(sys.executable).parent  # where it is installed here
EXAMPLE_AGENTS = {"digest", "inbox-triage", "tagger", "report-drafter", "tts-batch"}

_ENV_RE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*=(.*)")


@dataclass(frozen=True)
class Job:
    line: int
    schedule: str  # the five fields
    command: str  # as cron hands it to the shell, before % handling

    def argv(self) -> list[str]:
        """The program and its arguments: \\% unescaped as cron does, redirections dropped."""
        words = shlex.split(self.command.replace("\\%", "%"))
        cut = next((i for i, w in enumerate(words) if w.startswith((">", "2>", "<"))), len(words))
        return words[:cut]


def parse_crontab(text: str) -> tuple[dict[str, str], list[Job]]:
    env: dict[str, str] = {}
    jobs: list[Job] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _ENV_RE.fullmatch(line)  # a job line starts with a digit, '*' or '@': never matches
        if m:
            env[m.group(1)] = m.group(2).strip()
            continue
        fields = line.split(None, 5)
        assert len(fields) == 6, f"line {number}: not 'five fields and a command': {raw!r}"
        jobs.append(Job(number, " ".join(fields[:5]), fields[5]))
    return env, jobs


@pytest.fixture(scope="module")
def crontab() -> tuple[dict[str, str], list[Job]]:
    return parse_crontab(CRONTAB.read_text())


def test_parser_tells_variables_from_jobs() -> None:
    env, jobs = parse_crontab("A=1\n# c\n\n*/5 * * * * x --y=2 >>l 2>&1\nB = two words\n")
    assert env == {"A": "1", "B": "two words"}
    (job,) = jobs
    assert (job.line, job.schedule, job.argv()) == (4, "*/5 * * * *", ["x", "--y=2"])


def test_variables_are_literal_and_set_what_cron_lacks(
    crontab: tuple[dict[str, str], list[Job]],
) -> None:
    env, _ = crontab
    for name, value in env.items():
        # cron expands nothing in these lines, and a trailing comment would be part of the value
        assert "$" not in value and "~" not in value and "#" not in value, (name, value)
    assert Path(env["GPULOCK_STATE_DIR"]).is_absolute()
    assert PREFIX.rstrip("/") in env["PATH"].split(":")
    assert "MAILTO" in env and env.get("SHELL") == "/bin/sh"


def test_every_schedule_is_valid(crontab: tuple[dict[str, str], list[Job]]) -> None:
    from apscheduler.triggers.cron import CronTrigger

    from gpulock.agents.fleetfile import parse_schedule

    _, jobs = crontab
    assert len(jobs) >= 6
    for job in jobs:
        CronTrigger.from_crontab(job.schedule)  # raises ValueError for a bad field
        parse_schedule(job.schedule)  # and as the fleet reads cron (weekdays from Sunday)


def test_no_unescaped_percent(crontab: tuple[dict[str, str], list[Job]]) -> None:
    _, jobs = crontab
    for job in jobs:
        assert not re.search(r"(?<!\\)%", job.command), f"line {job.line}: unescaped %"
    assert any("\\%" in job.command for job in jobs)  # the example shows how to escape it


def _parsers() -> dict[str, Callable[[list[str]], Any]]:
    from gpulock import cli
    from gpulock.agents import cli as agent_cli
    from gpulock.agents import fleet
    from gpulock.metrics import cli as metrics_cli

    return {
        "run": lambda args: cli.build_parser().parse_args(["run", *args]),
        "agent": lambda args: agent_cli.build_parser().parse_args(args),
        "fleet": lambda args: fleet.build_parser().parse_args(args),
        "metrics": lambda args: metrics_cli.build_parser().parse_args(args),
    }


def test_every_command_exists_and_its_arguments_parse(
    crontab: tuple[dict[str, str], list[Job]],
) -> None:
    _, jobs = crontab
    parsers = _parsers()
    seen = set()
    for job in jobs:
        argv = job.argv()
        assert argv[0].startswith(PREFIX), f"line {job.line}: not an absolute gpulock path"
        local = VENV_BIN / argv[0][len(PREFIX) :]
        assert local.is_file() and os.access(local, os.X_OK), f"line {job.line}: {local}"
        sub = argv[1]
        assert sub in parsers, f"line {job.line}: no dry parse for 'gpulock {sub}'"
        args = parsers[sub](argv[2:])  # UsageError (exit 2) for what gpulock would refuse
        seen.add(sub)
        if sub == "run":
            assert args.timeout == 600 and args.need == 6 * 1024**3
            assert args.command[-1] == "/path/to/script"
        if sub == "agent":
            assert args.cmd == "run" and args.timeout is not None, f"line {job.line}"
        if sub == "metrics":
            assert args.textfile.endswith(".prom"), f"line {job.line}"
    assert seen == {"run", "agent", "metrics"}
    names = {a.name for a in _agent_jobs(jobs)}
    assert names == EXAMPLE_AGENTS


def _agent_jobs(jobs: list[Job]) -> list[Any]:
    from gpulock.agents import cli as agent_cli

    parser = agent_cli.build_parser()
    return [parser.parse_args(j.argv()[2:]) for j in jobs if j.argv()[1] == "agent"]


def test_the_agents_named_exist(crontab: tuple[dict[str, str], list[Job]], tmp_path: Path) -> None:
    gpulock = VENV_BIN / "gpulock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULOCK_")}
    env["HOME"] = str(tmp_path)  # no config file from the real home
    r = subprocess.run(
        [str(gpulock), "agent", "list", "--json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    listed = {a["name"] for a in json.loads(r.stdout)["agents"]}
    if not listed & EXAMPLE_AGENTS:
        pytest.skip(
            "'gpulock agent list' shows none of the example agents: gpulock.agents.examples is not "
            f"importable yet (it lists {sorted(listed)})"
        )
    _, jobs = crontab
    missing = {a.name for a in _agent_jobs(jobs)} - listed
    assert not missing, f"crontab.example runs agents that do not exist: {sorted(missing)}"


# --- the systemd units crontab.example points at -------------------------------------------------


def unit(name: str) -> dict[str, list[str]]:
    """``key -> values`` of a unit file (comments dropped; a key may repeat)."""
    out: dict[str, list[str]] = {}
    for raw in (REPO / "gpulock" / "share" / "systemd" / name).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        out.setdefault(key.strip(), []).append(value.strip())
    return out


@pytest.mark.parametrize(
    ("name", "command"),
    [("gpulock-fleet.service", "fleet"), ("gpulock-governor.service", "governor")],
)
def test_the_units_crontab_names_exist_and_use_its_install_path(name: str, command: str) -> None:
    assert name in CRONTAB.read_text()
    [exec_start] = unit(name)["ExecStart"]
    argv = exec_start.split()
    assert argv[0] == PREFIX + "gpulock" and argv[1] == command, exec_start
    assert (VENV_BIN / "gpulock").exists()  # the same program, as installed here


def test_the_fleet_unit_gives_running_agents_their_grace() -> None:
    u = unit("gpulock-fleet.service")
    assert u["KillMode"] == ["mixed"]  # SIGTERM to the fleet only: it stops its agents
    assert u["KillSignal"] == ["SIGTERM"]
    example_grace_s = 30  # examples/fleet.yaml's fleet.grace
    assert int(u["TimeoutStopSec"][0]) > example_grace_s
    assert "grace: 30s" in (REPO / "examples" / "fleet.yaml").read_text()
