"""``gpulock fleet FLEET.yaml``: run many agents on their schedules, each run its own process.

Also ``python -m gpulock.agents.fleet``.  The file's format is in ``gpulock.agents.fleetfile``, its
schedules in ``gpulock.agents.schedules``, the jobs it plans in ``gpulock.agents.fleetplan``.
``gpulock.agents.fleetserve`` runs the fleet (APScheduler decides when) until SIGTERM, SIGINT or the
end of ``--for``, and ``gpulock.agents.fleetrun`` starts each run as a subprocess and ends the runs
when the fleet stops; the events they write are described there.

``--once NAME`` runs one agent now, its output on the terminal, and exits with its code;
``--dry-run`` prints the next run times and commands.

APScheduler is imported only inside functions, here and in the modules above, so ``import
agents`` and ``import gpulock.agents.fleet`` stay light.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpulock.agents import fleetfile
from gpulock.agents.fleetfile import FleetFile, JobSpec
from gpulock.agents.fleetrun import (
    EX_ERROR,
    EX_OK,
    Runner,
    RunResult,
    Wakeup,
    exit_code,
    outcome,
    shell_words,
)
from gpulock.agents.fleetrun import EX_NOEXEC as EX_NOEXEC
from gpulock.agents.fleetrun import EX_NOTFOUND as EX_NOTFOUND
from gpulock.agents.fleetrun import EX_TEMPFAIL as EX_TEMPFAIL
from gpulock.agents.fleetrun import EX_USAGE as EX_USAGE
from gpulock.agents.fleetrun import LOG_MAX_BYTES as LOG_MAX_BYTES
from gpulock.agents.fleetrun import REAP_WAIT_S as REAP_WAIT_S
from gpulock.agents.fleetrun import STOP_SIGNALS as STOP_SIGNALS
from gpulock.agents.fleetrun import TERM_WAIT_S as TERM_WAIT_S
from gpulock.agents.fleetserve import serve
from gpulock.agents.schedules import DRY_RUN_FIRES as DRY_RUN_FIRES
from gpulock.agents.schedules import make_trigger, next_fires
from gpulock.cli import (
    Parser,
    UsageError,
    duration_arg,
    print_json,
    run_command,
    stdout_to_stderr,
)
from gpulock.core import children
from gpulock.core.errors import GpulockError, known_hint
from gpulock.core.extras import install_hint

if TYPE_CHECKING:
    from gpulock.core.settings import Settings

# The ``X as X`` imports above re-export names that lived here before the fleet was split into
# modules, so ``gpulock.agents.fleet.TERM_WAIT_S`` and friends keep working.
__all__ = [
    "RunResult",
    "Runner",
    "Wakeup",
    "build_parser",
    "exit_code",
    "main",
    "make_trigger",
    "next_fires",
    "outcome",
]

EPILOG = """\
exit codes: 0 stopped by SIGTERM/SIGINT or at the end of --for, or --dry-run done; with --once,
the agent's own code (0 done, 1 error, 75 skipped, 128+N killed by signal N); 1 error (bad
fleet file, unusable state folder, this file's fleet already running, APScheduler missing);
2 usage.  Each run's output: <log_dir>/<name>.log (default <state>/fleet/).  Each run's end: a
'fleet-run' event (gpulock history --event fleet-run)."""


# --- the modes ---------------------------------------------------------------------------------


def run_once(settings: Settings, fleet: FleetFile, spec: JobSpec, *, as_json: bool = False) -> int:
    """Run one agent now, its output on this terminal; exit with its code.

    ``as_json``: the run's output goes to stderr and stdout gets one object: ``agent``,
    ``pid``, ``exit_code``, ``duration_s``, ``outcome`` (null when the fleet was stopped
    before it started).
    """
    if as_json:
        with stdout_to_stderr():
            done = _run_once(settings, fleet, spec)
        print_json(
            {
                "agent": spec.name,
                "pid": done.pid if done else None,
                "exit_code": done.exit if done else EX_ERROR,
                "duration_s": round(done.duration_s, 6) if done else None,
                "outcome": done.outcome if done else None,
            }
        )
    else:
        done = _run_once(settings, fleet, spec)
    return done.exit if done is not None else EX_ERROR


def _run_once(settings: Settings, fleet: FleetFile, spec: JobSpec) -> RunResult | None:
    wakeup = Wakeup()
    runner = Runner(settings, wakeup, out=sys.stderr)
    result: list[RunResult | None] = []

    def target() -> None:
        try:
            result.append(runner.run(spec, to_terminal=True))
        finally:
            wakeup.poke()  # after the append: the loop below sees it

    thread = threading.Thread(target=target, name="gpulock-fleet-once")
    wakeup.install()
    try:
        thread.start()
        while not result and thread.is_alive():
            if wakeup.wait(None) is not None:
                runner.say(f"stopping {spec.name}: waiting up to {fleet.options.grace_s:g} s")
                runner.drain(fleet.options.grace_s)
                break
        thread.join()
    finally:
        runner.drain(0.0)
        wakeup.close()
    return result[0] if result else None


def unknown_agents(jobs: Sequence[JobSpec]) -> dict[str, list[str]]:
    """Jobs that run ``python -m gpulock.agents run NAME`` for a NAME no agent module defines, each
    with the names that do exist: asked of ``agents list`` in the job's own environment (its
    config, ``GPULOCK_AGENT_MODULES`` and ``--module``), exactly as a run would look."""
    asked: dict[tuple[Any, ...], set[str] | None] = {}
    missing: dict[str, list[str]] = {}
    for spec in jobs:
        argv = spec.command
        head = list(children.python("-m", "gpulock.agents", "run", executable=argv[0]))
        if not spec.enabled or len(argv) <= len(head) or list(argv[: len(head)]) != head:
            continue
        modules = [a for i, a in enumerate(argv) if i and argv[i - 1] == "--module"]
        key = (argv[0], tuple(modules), tuple(sorted(spec.env.items())))
        if key not in asked:
            cmd = [*children.python("-m", "gpulock.agents", "list", "--json", executable=argv[0])]
            cmd += [x for m in modules for x in ("--module", m)]
            r = subprocess.run(cmd, env=dict(spec.env), capture_output=True, text=True, timeout=60)
            try:
                asked[key] = {a["name"] for a in json.loads(r.stdout)["agents"]}
            except (ValueError, KeyError, TypeError):
                asked[key] = None  # the listing itself failed: the run will say why
        known = asked[key]
        if known is not None and argv[len(head)] not in known:
            missing[spec.name] = sorted(known)
    return missing


def missing_inputs(jobs: Sequence[JobSpec]) -> dict[str, list[str]]:
    """The INPUT paths of ``agents run`` jobs that do not exist (``~/notes`` never made): each
    run would fail on them.  Only what looks like a path (``/``, ``~``, ``.``) is checked: an
    agent's INPUT may be a word or a URL too."""
    from gpulock.agents.cli import build_parser as agents_parser

    run_parser = agents_parser()
    found: dict[str, list[str]] = {}
    for spec in jobs:
        argv = spec.command
        head = list(children.python("-m", "gpulock.agents", "run", executable=argv[0]))
        if not spec.enabled or list(argv[: len(head)]) != head:
            continue
        try:
            args = run_parser.parse_args(["run", *argv[len(head) :]])
        except (UsageError, SystemExit):
            continue  # a run says what is wrong with its arguments
        gone = [
            i
            for i in args.inputs
            if i.startswith(("/", "~", ".")) and not Path(i).expanduser().exists()
        ]
        if gone:
            found[spec.name] = gone
    return found


def dry_run(fleet: FleetFile, jobs: Sequence[JobSpec], state_dir: Path, *, as_json: bool) -> int:
    """Print each agent's next run times (before jitter) and command; start nothing.

    Exit 1 when a job names an agent that does not exist (every fire would exit 2); an INPUT
    folder that does not exist (yet) is a warning.
    """
    missing = unknown_agents(jobs)
    absent = {k: v for k, v in missing_inputs(jobs).items() if k not in missing}
    now = datetime.now().astimezone()  # aware, local: triggers convert it to their zone
    fires = {
        spec.name: next_fires(make_trigger(spec, jitter=False), now) if spec.enabled else []
        for spec in jobs
    }
    if as_json:
        rows = [
            {
                "name": spec.name,
                "enabled": spec.enabled,
                "trigger": spec.trigger.text,
                "jitter_s": spec.jitter_s,
                "next_runs": [f.isoformat() for f in fires[spec.name]],
                "command": list(spec.command),
                "log": str(spec.log_path),
            }
            for spec in jobs
        ]
        for row in rows:
            row["unknown_agent"] = row["name"] in missing
            row["missing_inputs"] = absent.get(str(row["name"]), [])
        doc = {"file": str(fleet.path), "state_dir": str(state_dir), "agents": rows}
        print(json.dumps(doc, indent=2))
        return EX_ERROR if missing else EX_OK
    print(f"{fleet.path}: {len(jobs)} agent(s), state {state_dir} (dry run: nothing runs)")
    for spec in jobs:
        print(f"\n{spec.name}  {spec.trigger.text}" + ("" if spec.enabled else "  (disabled)"))
        if spec.enabled:
            stamps = ", ".join(f.strftime("%a %Y-%m-%d %H:%M:%S") for f in fires[spec.name])
            jitter = f", each + up to {spec.jitter_s:g} s jitter" if spec.jitter_s else ""
            print(f"  next:    {stamps}{jitter}")
        print(f"  command: {shell_words(spec.command)}")
        print(f"  log:     {spec.log_path}")
    for name, gone in absent.items():
        for path in gone:
            print(
                f"warning: {fleet.path}: agent {name!r}: input {path} does not exist: "
                "its runs fail until it does",
                file=sys.stderr,
            )
    for name, known in missing.items():
        print(f"error: {fleet.path}: agent {name!r} is not defined", file=sys.stderr)
        print(f"hint: known agents: {', '.join(known) or 'none'}", file=sys.stderr)
    return EX_ERROR if missing else EX_OK


# --- the command -------------------------------------------------------------------------------


def _duration_arg(text: str) -> float:
    seconds = duration_arg(text)
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"expected a duration above 0, got {text!r}")
    return seconds


def build_parser(prog: str = "gpulock fleet") -> argparse.ArgumentParser:
    p = Parser(
        prog=prog,
        description=(
            "Run the agents of FLEET.yaml on their schedules (APScheduler), each run its own "
            "process: one at a time per agent, at most fleet.max_parallel at once, late fires "
            "coalesced.  On SIGTERM/SIGINT it starts nothing more, gives running agents "
            "fleet.grace, then SIGTERM, then SIGKILL."
        ),
        epilog=EPILOG,
    )
    p.add_argument("fleet_file", metavar="FLEET.yaml", help="the fleet file")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--dry-run",
        action="store_true",
        help="print each agent's next 3 run times and command; run nothing",
    )
    mode.add_argument("--once", metavar="NAME", help="run agent NAME now, exit with its code")
    mode.add_argument(
        "--for",
        dest="for_s",
        type=_duration_arg,
        metavar="DURATION",
        help="run for this long (30s, 2h), then stop as on SIGTERM",
    )
    p.add_argument("--json", action="store_true", help="with --dry-run or --once: print JSON")
    p.add_argument("--config", metavar="FILE", help="gpulock config file (default: the usual)")
    p.add_argument(
        "--state-dir", metavar="DIR", help="state folder (default: $GPULOCK_STATE_DIR, config)"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(_main, argv)


def _environ(config: str | None) -> dict[str, str]:
    """The environment runs start from: ``--config`` goes to them as ``GPULOCK_CONFIG``, so an
    agent reads the same routes as the fleet that started it."""
    environ = dict(os.environ)
    if config is not None:
        environ["GPULOCK_CONFIG"] = str(Path(config).expanduser().absolute())
    return environ


def _require_apscheduler() -> None:
    try:
        import apscheduler
    except ImportError:
        raise GpulockError(
            "the fleet runner needs APScheduler 3, which is not installed",
            hint=install_hint("scheduler"),
        ) from None
    version = str(getattr(apscheduler, "__version__", "3"))
    if not version.startswith("3."):
        raise GpulockError(
            f"the fleet runner needs APScheduler 3.x, found {version}",
            hint="pip install 'apscheduler>=3.10,<4'",
        )


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.json and not (args.dry_run or args.once is not None):
        raise UsageError(
            "--json goes with --dry-run or --once", hint="gpulock fleet FILE --dry-run --json"
        )
    _require_apscheduler()
    fleet = fleetfile.read(args.fleet_file)
    fleetfile.check_schedules(fleet)
    if args.dry_run:
        from gpulock.core import state
        from gpulock.core.config import load_config

        if args.state_dir:
            state_dir = Path(args.state_dir).expanduser().absolute()
        else:
            state_dir = state.resolve_state_dir(load_config(args.config).state_dir)
        jobs = fleetfile.plan(
            fleet, state_dir=state_dir, environ=_environ(args.config), python=sys.executable
        )
        return dry_run(fleet, jobs, state_dir, as_json=args.json)
    if args.once is not None and fleet.agent(args.once) is None:
        raise UsageError(
            f"no agent {args.once!r} in {fleet.path}",
            hint=known_hint(args.once, [a.name for a in fleet.agents], "agents"),
        )
    from gpulock.core.settings import load

    settings = load(args.config, args.state_dir)
    jobs = fleetfile.plan(
        fleet, state_dir=settings.state_dir, environ=_environ(args.config), python=sys.executable
    )
    if args.once is not None:
        spec = next(j for j in jobs if j.name == args.once)
        return run_once(settings, fleet, spec, as_json=args.json)
    return serve(settings, fleet, jobs, for_s=args.for_s)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
