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


def _paragraphs_naming_the_install_path() -> list[tuple[str, str]]:
    """(file, paragraph) for every paragraph of the README, the docs and the shipped files
    (units, crontab, fleet example) that names ``/opt/gpulock``."""
    files = [
        REPO / "README.md",
        *sorted((REPO / "docs").glob("*.md")),
        *sorted((REPO / "gpulock" / "share").rglob("*")),
    ]
    found = []
    for path in files:
        if not path.is_file() or path.suffix not in (".md", ".service", ".example", ".yaml"):
            continue
        for para in re.split(r"\n\s*\n|\n#\s*\n", path.read_text()):
            if "/opt/gpulock" in para:
                found.append((str(path.relative_to(REPO)), para))
    return found


def test_opt_gpulock_means_one_thing_everywhere() -> None:
    """``/opt/gpulock`` is a venv gpulock is pip-installed into, on every page: never "the
    checkout, built with make" on one and "a venv" on another."""
    found = _paragraphs_naming_the_install_path()
    assert {f for f, _ in found} >= {"README.md", "docs/troubleshooting.md"}, found
    for name, para in found:
        words = " ".join(para.split())
        assert not re.search(r"checkout is `?/opt/gpulock", words), (name, words)
        assert "built with `make`" not in words or "not a checkout" in words, (name, words)
        # Prose that says what /opt/gpulock is says "venv"; a bare command line needs not.
        if re.search(r"/opt/gpulock`?[,)]|in /opt/gpulock|is `?/opt/gpulock", words):
            assert "venv" in words, (name, words)
