"""``gpulock governor``: the watchdog and resource governor as a command (or a service).

Found by ``gpulock`` through the ``gpulock.commands`` entry point, and runnable as
``python -m gpulock.governor``.  ``main(argv) -> exit code``; errors become ``error:`` / ``hint:``
lines, never a traceback for a user's mistake.
"""

from __future__ import annotations

import argparse
import io
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from types import FrameType
from typing import TYPE_CHECKING

from gpulock.cli import Parser, UsageError, print_json, run_command

if TYPE_CHECKING:
    from gpulock.core.settings import Settings
    from gpulock.governor.daemon import Governor
    from gpulock.governor.model import GovernorConfig
    from gpulock.metrics.exporter import Exporter

EX_OK = 0

DESCRIPTION = """\
Keep the GPUs' memory healthy for a fleet of agents.  Each pass (every watchdog.interval) it
measures every GPU's used memory, the resident models and who uses them, the host's memory
pressure (PSI), swap traffic and the OOMs residents reported; decides; acts; and publishes its
level in <state>/governor.json, which the lock, the router and the residents read.

Watchdog: when a GPU's used memory passes the threshold in force (watchdog.threshold, or the
watchdog.schedule window for this time of day), it asks the owners of idle, unpinned models
(idle at least watchdog.min_idle) to unload them, cheapest first (cold-start, then longest
idle, then largest), until used < threshold - hysteresis.  Models in use are never touched.

Ladder: a signal over its governor.* threshold for governor.samples passes in a row climbs one
step; every signal clear for governor.cooldown walks one step down:
  normal -> reduce       published: routers and residents shrink contexts and batches
         -> evict-idle   evict idle models, whatever their idle time
         -> force-evict  in-use models too, unless their process holds a GPU ticket;
                         with governor.force_kill, owners that ignore it past governor.grace
                         get SIGTERM, then SIGKILL
         -> freeze       new GPU admissions wait until the level comes down
Every action is an event (gpulock history) carrying the signals and thresholds behind it.
One governor runs per state folder; its level stops counting the moment it exits."""

EPILOG = """\
exit codes: 0 stopped by SIGTERM/SIGINT, or --once done; 1 error (bad config, unusable state
folder, another governor already running); 2 usage.  Run it as a service: see
$(gpulock files governor.service)."""


def build_parser(prog: str = "gpulock governor") -> argparse.ArgumentParser:
    p = Parser(
        prog=prog,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config", metavar="FILE", help="config file with watchdog: and governor: sections"
    )
    p.add_argument(
        "--state-dir",
        metavar="DIR",
        help="state folder (default: $GPULOCK_STATE_DIR, then the config); must be the "
        "agents' folder",
    )
    p.add_argument("--once", action="store_true", help="one pass, then exit (cron, tests)")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the decision (signals, level) and what would be done, one line per "
        "action; evict, signal, publish and log nothing (may run beside the real governor)",
    )
    p.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (default: metrics.listen "
        "in the config; none). ':PORT' binds 127.0.0.1",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help='with --once: print the pass as one JSON object {"dry_run", "level", '
        '"level_before", "signals", "thresholds", "actions", "lines"} instead of lines',
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(_main, argv)


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from gpulock.core.settings import load
    from gpulock.governor import config as gconfig
    from gpulock.governor.daemon import Governor
    from gpulock.governor.effects import Effects
    from gpulock.governor.probes import Probe

    if args.json and not args.once:
        raise UsageError("--json goes with --once", hint="gpulock governor --once --json")
    settings = load(args.config, args.state_dir)
    config = gconfig.load(settings.config)  # ConfigError names file:line:key
    exporter = _metrics(settings, args.metrics_listen, dry_run=args.dry_run)
    # --json: the lines go into the object; a dry pass prints them under its decision.
    text = io.StringIO() if args.json or (args.once and args.dry_run) else sys.stdout
    governor = Governor(
        settings,
        config,
        probe=Probe(settings, clean=not args.dry_run),
        effects=Effects(settings, dry_run=args.dry_run, out=text),
        after_pass=exporter.after_pass if exporter is not None else None,
    )
    stop = threading.Event()

    def work() -> None:
        if args.once:
            governor.once()
        else:
            governor.run(stop)

    signals: list[int] = []
    with governor:
        try:
            if exporter is not None:
                exporter.start()
            if not args.once:  # a service says when it starts and stops (for its journal)
                _say(f"started for {settings.state_dir} (pid {os.getpid()}, a pass every "
                     f"{config.interval_s:g} s{', dry run' if args.dry_run else ''})")  # fmt: skip
            _in_worker(work, stop, signals)
        finally:
            if exporter is not None:
                exporter.close()
    if not args.once:
        _say("stopped" + (f" by {signal.Signals(signals[0]).name}" if signals else ""))
    if args.once and isinstance(text, io.StringIO):
        _print_pass(governor, config, text.getvalue().splitlines(), args.json, args.dry_run)
    return EX_OK


def _say(text: str) -> None:
    print(f"gpulock governor: {text}", file=sys.stderr, flush=True)


def _print_pass(
    governor: Governor, config: GovernorConfig, lines: list[str], as_json: bool, dry_run: bool
) -> None:
    """One pass's decision: signals, level and actions, as lines or one JSON object."""
    from gpulock.governor import explain

    if governor.last_snapshot is None:  # the pass failed before measuring: nothing to say
        return
    d = explain.decision(
        governor.last_snapshot,
        config,
        governor.last_level_before,
        governor.state.level,
        governor.last_results,
    )
    if as_json:
        print_json({"dry_run": dry_run, **d, "lines": lines})
        return
    for line in explain.lines(d):
        print(line)
    for line in lines:  # what it would do, one line per action
        print(line, flush=True)


def _metrics(settings: Settings, listen_arg: str | None, *, dry_run: bool) -> Exporter | None:
    """The metrics exporter the config or --metrics-listen asks for, else None.

    A dry run leaves the config's listener and textfile to the real governor it may run
    beside (the same port would be taken, the same file written twice); --metrics-listen
    still applies.
    """
    from gpulock.metrics import config as mconfig

    mcfg = mconfig.load(settings.config)
    if dry_run:
        mcfg = mconfig.MetricsConfig(api_keys_env=mcfg.api_keys_env)
    listen = mcfg.listen
    if listen_arg is not None:
        try:
            listen = mconfig.parse_listen(listen_arg)
        except ValueError as e:
            raise UsageError(
                f"--metrics-listen: {e}", hint="e.g. --metrics-listen 127.0.0.1:9464"
            ) from None
    if listen is None and mcfg.textfile is None:
        return None
    # Off loopback only with keys (exit 2 otherwise), checked before anything is opened.
    keys = () if listen is None else mconfig.listen_keys(listen, mcfg.api_keys_env)
    from gpulock.metrics import require_client

    require_client()
    from gpulock.metrics.exporter import Exporter

    return Exporter(settings, listen=listen, textfile=mcfg.textfile, err=sys.stderr, keys=keys)


def _in_worker(work: Callable[[], None], stop: threading.Event, signals: list[int]) -> None:
    """Run ``work`` in a thread while the main thread takes SIGTERM/SIGINT and sets ``stop``.

    The handler runs in the main thread; were the loop waiting on ``stop`` there too, a signal
    landing while that thread holds the Event's internal lock would deadlock ``stop.set()``.
    Here the main thread only joins, so the handler never waits on a lock it holds itself.
    A failure in ``work`` is raised again here, for ``main`` to report.
    """
    failure: list[BaseException] = []

    def target() -> None:
        try:
            work()
        except BaseException as e:
            failure.append(e)
            stop.set()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        signals.append(signum)  # which one stopped it, for the "stopped" line
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        worker = threading.Thread(target=target, name="gpulock-governor")
        worker.start()
        worker.join()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if failure:
        raise failure[0]
