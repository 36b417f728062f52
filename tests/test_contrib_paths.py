"""The systemd units that ship with gpulock (``gpulock/share/systemd/``) and ``crontab.example``
call gpulock at one install path, so a user who installs it where one file says finds every
other file agreeing."""

from __future__ import annotations

import re
from pathlib import Path

from cli_helpers import REPO

INSTALLED = "/opt/gpulock/.venv/bin/gpulock"  # the one path every example names
# A path to a gpulock program: '/.../bin/gpulock' as a word (not 'gpulock-serve.service').
PROGRAM_RE = re.compile(r"(?<![\w.-])(/[\w./-]*/bin/gpulock)(?![\w.-])")


def example_files() -> list[Path]:
    units = sorted((REPO / "gpulock" / "share" / "systemd").glob("*.service"))
    assert units, "no systemd units in gpulock/share/systemd/"
    return [*units, REPO / "crontab.example"]


def test_every_unit_runs_gpulock_from_the_crontab_install_path() -> None:
    for path in example_files():
        if path.suffix != ".service":
            continue
        starts = [
            line.partition("=")[2].split()[0]
            for line in path.read_text().splitlines()
            if line.startswith("ExecStart=")
        ]
        assert starts == [INSTALLED], f"{path.name}: ExecStart runs {starts}"


def test_contrib_and_crontab_name_one_gpulock_path() -> None:
    found: dict[str, set[str]] = {}
    for path in example_files():
        for line in path.read_text().splitlines():
            for program in PROGRAM_RE.findall(line):
                found.setdefault(program, set()).add(path.name)
    assert set(found) == {INSTALLED}, f"gpulock programs named, and where: {found}"
