"""``gpulock files``: the files that come with gpulock (systemd units, the Grafana dashboard,
crontab.example, the example configs and agents), and where this install keeps them.

They ship inside the package (``gpulock/share/``), so a ``pip install`` has them as a checkout
does: ``gpulock files`` lists them, ``gpulock files NAME`` prints one path, for
``cp "$(gpulock files grafana)" /var/lib/grafana/dashboards/``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from gpulock.cli import EX_OK, Parser, UsageError, print_json, run_command
from gpulock.core.errors import GpulockError, known_hint
from gpulock.core.shared import SHARE

PACKAGE: Final = SHARE.parent


@dataclass(frozen=True, slots=True)
class Shipped:
    name: str  # what `gpulock files NAME` takes
    relpath: str  # under the package folder
    what: str

    @property
    def path(self) -> Path:
        return PACKAGE / self.relpath


FILES: Final = (
    Shipped("crontab", "share/crontab.example", "cron lines for gpulock jobs and agents"),
    Shipped(
        "governor.service", "share/systemd/gpulock-governor.service", "systemd unit: the governor"
    ),
    Shipped("fleet.service", "share/systemd/gpulock-fleet.service", "systemd unit: an agent fleet"),
    Shipped("serve.service", "share/systemd/gpulock-serve.service", "systemd unit: gpulock serve"),
    Shipped("grafana", "share/grafana-dashboard.json", "Grafana dashboard of gpulock's metrics"),
    Shipped(
        "config", "share/examples/gpulock.yaml", "a sample config: routes for the example agents"
    ),
    Shipped("tiny.yaml", "share/examples/tiny.yaml", "the config of the tour: the tiny model"),
    Shipped("fleet.yaml", "share/examples/fleet.yaml", "a sample fleet file (gpulock fleet)"),
    Shipped("examples", "share/examples", "the tour's folder: scripts, data and configs"),
    Shipped("agents", "agents/examples", "the example agents' source (gpulock agent list)"),
)


def find(name: str) -> Shipped:
    """The shipped file called ``name`` (its short name, or its file name)."""
    for f in FILES:
        if name in (f.name, f.path.name):
            return f
    raise UsageError(
        f"no file named {name!r} comes with gpulock",
        hint=known_hint(name, [f.name for f in FILES], "files"),
    )


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(_files, argv)


DESCRIPTION = """\
List the files that come with gpulock (systemd units, the Grafana dashboard, crontab.example,
the example configs and agents) with their paths in this install; with NAME, print that one
path, for cp "$(gpulock files grafana)" DEST.  They ship inside the package, so a pip install
has them as a checkout does."""

EPILOG = """\
exit codes: 0 listed or printed; 1 the file is missing from this install; 2 usage (an unknown
NAME: the known ones are listed)."""


def build_parser(prog: str = "gpulock files") -> argparse.ArgumentParser:
    p = Parser(
        prog=prog,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    names = ", ".join(f.name for f in FILES)
    p.add_argument("name", nargs="?", metavar="NAME", help=f"one file: {names}")
    p.add_argument("--json", action="store_true", help='print {"files": [...]}, or one of them')
    return p


def _files(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.name is not None:
        f = find(args.name)
        if not f.path.exists():
            raise GpulockError(
                f"{f.name} is not where this install should have it: {f.path}",
                hint="reinstall gpulock (pip install --force-reinstall ...)",
            )
        print_json(_entry(f)) if args.json else print(f.path)
        return EX_OK
    if args.json:
        print_json({"files": [_entry(f) for f in FILES]})
        return EX_OK
    width = max(len(f.name) for f in FILES)
    for f in FILES:
        gone = "" if f.path.exists() else "  (missing)"
        print(f"{f.name:<{width}}  {f.path}{gone}\n{'':<{width}}  {f.what}")
    return EX_OK


def _entry(f: Shipped) -> dict[str, object]:
    return {"name": f.name, "path": str(f.path), "what": f.what, "exists": f.path.exists()}
