"""``gpulock metrics``: the Prometheus exposition of a state folder, for machines without a daemon.

Found by ``gpulock`` through the ``gpulock.commands`` entry point and imported only when run.
Prints the exposition, or with ``--textfile PATH`` replaces PATH atomically for node_exporter's
textfile collector (a cron line: see ``crontab.example``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from gpulock.cli import Parser, UsageError, run_command

EX_OK = 0

DESCRIPTION = """\
Print the Prometheus metrics of this state folder (the queue of each GPU, VRAM, resident
models, the governor's level and signals, the router's calls and spend, counters from the
event log), or write them for node_exporter's textfile collector.  Counters are kept in
<state>/metrics/, so they only go up, however the metrics are read.  A daemon serves the same
over HTTP: gpulock governor --metrics-listen HOST:PORT (or metrics.listen in the config)."""


def build_parser(prog: str = "gpulock metrics") -> argparse.ArgumentParser:
    p = Parser(
        prog=prog,
        description=DESCRIPTION,
        epilog="exit codes: 0 ok; 1 error (unusable state folder, textfile not writable); 2 usage.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--textfile",
        metavar="PATH",
        help="write PATH (a .prom file in node_exporter's --collector.textfile.directory) "
        "atomically instead of printing",
    )
    p.add_argument("--config", metavar="FILE", help="config file (default: the usual lookup)")
    p.add_argument(
        "--state-dir", metavar="DIR", help="state folder (default: $GPULOCK_STATE_DIR, config)"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(_main, argv)


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from gpulock.core.config import load_config
    from gpulock.core.settings import load
    from gpulock.metrics import config as mconfig
    from gpulock.metrics import require_client

    textfile = None
    if args.textfile is not None:
        try:
            textfile = mconfig.check_textfile(Path(args.textfile).expanduser())
        except ValueError as e:
            raise UsageError(
                f"--textfile: {e}",
                hint="e.g. --textfile /var/lib/node_exporter/textfile_collector/gpulock.prom",
            ) from None
    cfg = load_config(args.config)
    mconfig.load(cfg)  # a bad metrics: section is reported here too, before a missing folder
    settings = load(cfg, args.state_dir, create=False)
    require_client()
    from gpulock.metrics.collector import exposition, write_textfile

    data = exposition(settings)
    if textfile is None:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    else:
        write_textfile(textfile, data)
    return EX_OK
